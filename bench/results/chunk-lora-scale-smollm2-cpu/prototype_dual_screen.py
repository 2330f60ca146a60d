"""Prototype (not shipped): the main thread at one LoRA scale, chunk threads at another.
Usage: python dual_screen.py CHUNK_SCALE  <screen_adapter args incl. --lora-scale MAIN_SCALE>"""
import sys
import torch
from pasta_engine.engine.llm_engine import Engine
from pasta_engine.lang.grammar import GrammarState
from pasta_engine.worker import model_runner as mr

chunk_scale = float(sys.argv.pop(1))
CHUNK = {int(GrammarState.CHUNK), int(GrammarState.CHUNK_OPEN)}
state = {"mask": None}
orig_prepare = mr.ModelRunner.prepare

def prepare(self, batch):
    inputs = orig_prepare(self, batch)
    m = []
    for st in batch.threads:
        m += [st.step.grammar in CHUNK] * len(st.step.tokens)
    state["mask"] = torch.tensor(m, dtype=torch.bool) if any(m) else None
    return inputs
mr.ModelRunner.prepare = prepare

orig_fp = Engine.from_pretrained.__func__

def from_pretrained(cls, *a, **kw):
    eng = orig_fp(cls, *a, **kw)
    kw2 = dict(kw); kw2["lora_scale"] = chunk_scale
    other = orig_fp(cls, *a, **kw2)
    model = eng.model
    counterpart = {}
    for la, lb in zip(model.weights.layers, other.model.weights.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            wa, wb = getattr(la, name), getattr(lb, name)
            if not torch.equal(wa, wb):
                counterpart[id(wa)] = wb
    print(f"dual LoRA: chunk rows at scale {chunk_scale}, main at {eng.lora_scale}; {len(counterpart)} weights differ", flush=True)
    del other
    lin = model._linear

    def dual(x, w, b=None):
        out = lin(x, w, b)
        wc = counterpart.get(id(w))
        mask = state["mask"]
        if wc is None or mask is None or x.shape[0] != mask.shape[0]:
            return out
        out[mask] = lin(x[mask], wc, b)
        return out
    model._linear = dual
    return eng
Engine.from_pretrained = classmethod(from_pretrained)

sys.argv[0] = "bench/screen_adapter.py"
import runpy
runpy.run_path("bench/screen_adapter.py", run_name="__main__")
