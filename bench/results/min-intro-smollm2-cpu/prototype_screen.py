"""Prototype (not shipped): the main thread may not promise before it has sampled
PASTA_MIN_INTRO tokens (its intro is a full paragraph that every chunk then sees); everything else
as the engine does. Usage: PASTA_MIN_INTRO=N python intro_screen.py <screen args>"""
import os, sys
from pasta_engine.core.interpreter import Interpreter
from pasta_engine.lang.grammar import GrammarState

MIN = int(os.environ["PASTA_MIN_INTRO"])
orig = Interpreter._grammar_state

def _grammar_state(self, t):
    state = orig(self, t)
    if state == GrammarState.MAIN and t.is_main and not t.inline and t.n_sampled < MIN:
        return GrammarState.MAIN_NO_FORK
    return state
Interpreter._grammar_state = _grammar_state
print("min intro tokens", MIN, flush=True)
sys.argv[0] = "bench/screen_adapter.py"
import runpy
runpy.run_path("bench/screen_adapter.py", run_name="__main__")
