"""Prototype (not shipped): after a list intro (the main thread's last line ends with ':'), the
main thread may not open a promise before it has written something on the new line (its item
marker, as the base model does: '1. '); right after a list marker at a line start, the main
thread forks where the promise token has p >= MARKER_THR (env; unset: the model decides). Usage: python prototype_listintro.py <screen args>"""
import re, sys
import pasta_engine.core.scheduler as sch
from pasta_engine.engine.llm_engine import Engine

S = {}
Orig = sch.SamplingRow
INTRO = re.compile(r":[ \t]*\n\s*$")
MARKER = re.compile(r"(^|\n)[ \t]*(\d+\.|[-*])[ \t]*$")
THR = float(__import__("os").environ.get("MARKER_THR", "0")) or None  # unset: no marker threshold

def row(rid, tid, params, forced, grammar, seen, ends, thr, rng):
    req = sys._getframe(1).f_locals.get("req")
    if forced is None and req is not None and S:
        t = req.interp.threads[tid]
        if t.parent is None and t.tokens:
            tail = S["tok"].decode(list(t.tokens[-6:]), skip_special_tokens=False)
            if INTRO.search(tail):
                ends = tuple(sorted(set(ends) | {S["open"]}))
                S["n"] = S.get("n", 0) + 1
            elif THR is not None and MARKER.search(tail) and thr is None:
                thr = THR
                S["m"] = S.get("m", 0) + 1
    return Orig(rid, tid, params, forced, grammar, seen, ends, thr, rng)
sch.SamplingRow = row

orig_fp = Engine.from_pretrained.__func__
def from_pretrained(cls, *a, **kw):
    eng = orig_fp(cls, *a, **kw)
    S["open"] = eng.tag_tokens.promise_open
    S["tok"] = eng.tokenizer
    print("list-intro rule on; promise id", S["open"], flush=True)
    return eng
Engine.from_pretrained = classmethod(from_pretrained)
sys.argv[0] = "bench/screen_adapter.py"
import runpy
runpy.run_path("bench/screen_adapter.py", run_name="__main__")
print("list-intro masks applied:", S.get("n", 0), "marker thresholds:", S.get("m", 0), flush=True)
