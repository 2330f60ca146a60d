"""Prototype (not shipped): the shipped adapter keeps a list's first item on its main thread.
Where the main thread's text ends with a list intro (a line ending with ':', then a line break)
and it has not finished the first line after it, the promise token is masked (the first item is
written in sequence); at the start of the next line after that first item the main thread forks
where the promise token has p >= FIRST_ITEM_THR (env, default 0.05). The live counterpart of
`FIRST_ITEM=sequential` in ../base-plan-smollm2-cpu/prototype_base_plan.py. Usage:
python prototype_first_item.py <bench/screen_adapter.py args>"""
import os
import re
import sys

import pasta_engine.core.scheduler as sch
from pasta_engine.engine.llm_engine import Engine

S = {}
Orig = sch.SamplingRow
# the main thread's tail: an intro line ending with ':', then the first item's line, unfinished
IN_FIRST = re.compile(r":[ \t]*\n+[ \t]*[^\n<]*$")
# ... and the first item finished: at the start of the line after it
AFTER_FIRST = re.compile(r":[ \t]*\n+[ \t]*[^\n<]+\n+[ \t]*$")
THR = float(os.environ.get("FIRST_ITEM_THR", "0.05"))


def row(rid, tid, params, forced, grammar, seen, ends, thr, rng):
    req = sys._getframe(1).f_locals.get("req")
    if forced is None and req is not None and S:
        t = req.interp.threads[tid]
        if t.parent is None and t.tokens:
            tail = S["tok"].decode(list(t.tokens[-160:]), skip_special_tokens=False)
            if AFTER_FIRST.search(tail):
                thr = THR if thr is None else min(thr, THR)
                S["thr"] = S.get("thr", 0) + 1
            elif IN_FIRST.search(tail):
                ends = tuple(sorted(set(ends) | {S["open"]}))
                S["mask"] = S.get("mask", 0) + 1
    return Orig(rid, tid, params, forced, grammar, seen, ends, thr, rng)


sch.SamplingRow = row
orig_fp = Engine.from_pretrained.__func__


def from_pretrained(cls, *a, **kw):
    eng = orig_fp(cls, *a, **kw)
    S["open"] = eng.tag_tokens.promise_open
    S["tok"] = eng.tokenizer
    print("first-item rule on; promise id", S["open"], "threshold after the first item", THR, flush=True)
    return eng


Engine.from_pretrained = classmethod(from_pretrained)
sys.argv[0] = "bench/screen_adapter.py"
import runpy  # noqa: E402

runpy.run_path("bench/screen_adapter.py", run_name="__main__")
print("first-item masks applied:", S.get("mask", 0), "thresholds:", S.get("thr", 0), flush=True)
