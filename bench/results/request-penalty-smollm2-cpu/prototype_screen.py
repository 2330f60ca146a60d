"""Prototype (not shipped): the penalties count what the whole request wrote (every thread's
tokens so far, as a sequential answer counts every earlier paragraph), except a chunk's own
promise (the shipped rule). Usage: python prototype_screen.py <bench/screen_adapter.py args>"""
import sys
from pasta_engine.core import scheduler
from pasta_engine.core.interpreter import Interpreter


def seen_tokens(self, tid):
    t = self.threads[tid]
    seen = []
    for u in self.threads:
        if t.parent is not None and u is t.parent:
            seen += u.tokens[: t.promise_from] + u.tokens[t.fork_at:]
        else:
            seen += u.tokens
    return self.prompt_ids + seen


class _Never:
    def __eq__(self, other):
        return False


class _AlwaysRecount(dict):
    def __getitem__(self, k):  # the scheduler recounts a thread whose count is stale: every step
        return _Never()


Interpreter.seen_tokens = seen_tokens
_orig_init = scheduler._RequestSampling.__init__


def _init(self, *a, **kw):
    _orig_init(self, *a, **kw)
    self.uncounted = _AlwaysRecount()


scheduler._RequestSampling.__init__ = _init
print("prototype: penalties over the whole request's tokens (a chunk's own promise left out)", flush=True)
sys.argv[0] = "bench/screen_adapter.py"
import runpy
runpy.run_path("bench/screen_adapter.py", run_name="__main__")
