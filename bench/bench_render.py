"""Microbenchmark of the clean-text walk (pasta_engine.core.render): clean_text and reading_order_prefix on a
finished 6-chunk flat PASTA-LANG replay, no model (interpreter, scheduler and block manager over forced tokens).
Run from the repository root: python bench/bench_render.py (prints microseconds per call)."""
import sys, timeit, tempfile
sys.path.insert(0, "tests/lang"); sys.path.insert(0, "tests")
from pathlib import Path
from transformers import AutoTokenizer
from pasta_engine.tools.presets import build_checkpoint
from pasta_engine.config import Limits, PositionPolicy, SamplingParams
from pasta_engine.core.request import Request, interpreter_factory
from pasta_engine.core.block_manager import BlockManager
from pasta_engine.lang.tokenization import eos_token_ids
from pasta_engine.core import render
from test_tokenization import run_forced
ck = build_checkpoint("tiny-llama", Path(tempfile.mkdtemp()))
tok = AutoTokenizer.from_pretrained(ck)
ann = "Tips:\n" + "".join(f'{i}. <promise topic="t{i}" tokens="30"/><async>Chunk {i} says a few words here and more words.</async>\n' for i in range(1, 7)) + "<sync/>Done."
make, n = interpreter_factory(tok, [1, 2, 3], mode="pasta", max_new_tokens=1, limits=Limits(max_threads=None), policy=PositionPolicy(),
                              max_positions=None, eos_ids=eos_token_ids(tok), annotated_response=ann)
req = Request("r", 0, "pasta", SamplingParams(max_new_tokens=n), make)
run_forced(req, BlockManager(4096, 4))
it = req.interp if hasattr(req, "interp") else req.interpreter
for name, f in [("clean_text", lambda: render.clean_text(it, False)), ("reading_order_prefix", lambda: render.reading_order_prefix(it))]:
    k = 20000
    print(name, f"{min(timeit.repeat(f, number=k, repeat=5)) / k * 1e6:.2f} us/call", len(f()))
