"""Prototype (not shipped): a chunk may not end (no </async>, no end of sequence) before it has
sampled PASTA_MIN_CHUNK tokens; everything else as the engine does. Usage: python minchunk_screen.py <screen args>"""
import os, sys
from pasta_engine.core.interpreter import Interpreter
from pasta_engine.lang.grammar import GrammarState

MIN = int(os.environ["PASTA_MIN_CHUNK"])
orig = Interpreter._grammar_state

def _grammar_state(self, t):
    state = orig(self, t)
    if state == GrammarState.CHUNK and not t.is_main and not t.inline and t.n_sampled < MIN:
        return GrammarState.CHUNK_OPEN
    return state
Interpreter._grammar_state = _grammar_state
print("min chunk tokens", MIN, flush=True)
sys.argv[0] = "bench/screen_adapter.py"
import runpy
runpy.run_path("bench/screen_adapter.py", run_name="__main__")
