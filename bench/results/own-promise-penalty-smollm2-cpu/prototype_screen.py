"""Prototype (not shipped): a chunk's penalty does not count its own promise (the topic it was
promised, its length); everything else as the engine counts it. Usage: python owntopic_screen.py <screen args>"""
import sys
from pasta_engine.core.interpreter import Interpreter
from pasta_engine.engine.llm_engine import Engine

TAGS = {}
orig = Interpreter.seen_tokens

def seen_tokens(self, tid):
    t = self.threads[tid]
    if t.parent is None or not TAGS:
        return orig(self, tid)
    prefix = t.parent.tokens[: t.fork_at]
    op = TAGS["open"]
    last = max((i for i, x in enumerate(prefix) if x == op), default=None)
    if last is not None:
        prefix = prefix[:last]
    seen = prefix + t.tokens
    p = t.parent
    while p.parent is not None:
        seen = p.parent.tokens[: p.fork_at] + seen
        p = p.parent
    return self.prompt_ids + seen
Interpreter.seen_tokens = seen_tokens

orig_fp = Engine.from_pretrained.__func__
def from_pretrained(cls, *a, **kw):
    eng = orig_fp(cls, *a, **kw)
    TAGS["open"] = eng.tag_tokens.promise_open
    print("own promise left out of a chunk's penalty; open id", TAGS["open"], flush=True)
    return eng
Engine.from_pretrained = classmethod(from_pretrained)
sys.argv[0] = "bench/screen_adapter.py"
import runpy
runpy.run_path("bench/screen_adapter.py", run_name="__main__")
