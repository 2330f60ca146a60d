"""Prototype (not shipped): the first chunk of each fork group is written in place on the main
thread (inline mode's machinery, in pasta mode), and the promises after it fork as usual, so
every forked sibling sees its group's first chunk whole. The live counterpart, with the adapter's
own plan, of `FIRST_ITEM=sequential` in ../base-plan-smollm2-cpu/prototype_base_plan.py (a
list's first item in sequence, the rest forked: 47.2% against 43.8% read blind). A group starts
at the main thread's first promise after the start or a <sync/>. The critical path counts the
inline chunk (the interpreter's structure puts its sampled tokens on the main thread).
Usage: python prototype_first_chunk_inline.py <bench/screen_adapter.py args>"""
import sys

import pasta_engine.core.interpreter as it

S = {"inlined": 0, "forked_after": 0}
orig_init = it.Interpreter.__init__
orig_on_fork = it.Interpreter._on_fork


def init(self, *a, **kw):
    orig_init(self, *a, **kw)
    if self.mode == "pasta" and not self.replay:  # the closing tag the interpreter inserts at a cap
        self.close_ids = list(self._inserted_ids(self.dialect.close_tag))
    self._group_at = None  # len(main.syncs) when this group's first chunk was inlined


def on_fork(self, parent, fork):
    if (self.mode == "pasta" and not self.replay and parent.is_main and not parent.inline
            and not parent.outstanding and self._group_at != len(parent.syncs)):
        branches = self.dialect.branches(fork)
        if len(branches) == 1 and self.n_forks < self.limits.max_forks:
            bp, text = branches[0]
            ids = self._inserted_ids(text)
            if self.max_positions is None or parent.next_pos + len(ids) <= self.max_positions:
                self.topics_taken.update(it.topic_key(b.topic) for b, _ in branches if b.topic)
                parent.n_branches += 1
                self._group_at = len(parent.syncs)
                parent.inline_open = (ids, bp, None)
                parent.inline_promise = (it._tokens_before_tag(parent, fork.raw), len(parent.tokens))
                S["inlined"] += 1
                return True
    if parent.is_main and not parent.outstanding and self._group_at == len(parent.syncs):
        S["forked_after"] += 1
    return orig_on_fork(self, parent, fork)


it.Interpreter.__init__ = init
it.Interpreter._on_fork = on_fork
sys.argv[0] = "bench/screen_adapter.py"
import runpy  # noqa: E402

runpy.run_path("bench/screen_adapter.py", run_name="__main__")
print("first chunks inlined:", S["inlined"], "groups forked after one:", S["forked_after"], flush=True)
