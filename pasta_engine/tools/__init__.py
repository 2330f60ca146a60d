"""Tools on top of the engine: annotators, trace files, random-weight presets, speedup
benchmarks. The engine never imports them."""
