"""Prototype (not shipped): the main thread does not end with chunks it has not joined; where
its greedy choice is end-of-sequence while it has unjoined chunks, it writes <sync/> instead
(end of sequence is an implicit sync anyway, DESIGN.md section 2 rule 6), then goes on seeing
every chunk: a conclusion, or its end. Usage: python prototype_screen.py <screen_adapter.py args>"""
import sys
import torch
from pasta_engine.core import scheduler
from pasta_engine.engine.llm_engine import Engine
from pasta_engine.layers import sampler

STATE = {"flag": set()}
_orig_alloc = scheduler.Scheduler._allocate


def _allocate(self, req, picks, out):
    STATE["req"] = req
    return _orig_alloc(self, req, picks, out)


scheduler.Scheduler._allocate = _allocate
_Row = scheduler.SamplingRow


def SamplingRow(rid, tid, params, forced, grammar, seen, ends, thr, rng):
    row = _Row(rid, tid, params, forced, grammar, seen, ends, thr, rng)
    req = STATE.get("req")
    if forced is None and tid == 0 and req is not None and req.interp.mode == "pasta":
        main = req.interp.threads[0]
        if main.outstanding:
            STATE["flag"].add(id(row))
    return row


scheduler.SamplingRow = SamplingRow
_orig_process = sampler.SamplingBatch.process


def process(self, logits):
    logits = _orig_process(self, logits)
    flagged = [k for k, r in enumerate(self.rows) if id(r) in STATE["flag"]]
    STATE["flag"].clear()
    if flagged and "sync" in STATE:
        top = logits[flagged].argmax(-1).tolist()
        for k, t in zip(flagged, top):
            if t in STATE["eos"]:
                logits[k, STATE["sync"]] = logits[k, t] + 1.0
                STATE["swapped"] = STATE.get("swapped", 0) + 1
    return logits


sampler.SamplingBatch.process = process
_orig_fp = Engine.from_pretrained.__func__


def from_pretrained(cls, *a, **kw):
    eng = _orig_fp(cls, *a, **kw)
    STATE["sync"] = eng.tag_tokens.sync
    STATE["eos"] = set(eng.eos_ids)
    print("prototype: <sync/> instead of an end with unjoined chunks; sync", STATE["sync"], "eos", STATE["eos"],
          flush=True)
    return eng


Engine.from_pretrained = classmethod(from_pretrained)
sys.argv[0] = "bench/screen_adapter.py"
import runpy
runpy.run_path("bench/screen_adapter.py", run_name="__main__")
print("ends swapped for a sync:", STATE.get("swapped", 0))
