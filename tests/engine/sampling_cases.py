"""Every sampling option through the whole engine, for the sampling-row tests (issue 32 item 1).

:func:`run_cases` drives the tiny random-weight Llama (and the same model with an adapter that
adds the PASTA-LANG pieces as tokens, so grammar masks and ``fork_threshold`` apply) through
mixed batches: requests with different sampling options decode in the same steps, forked
threads included (a logits hook makes the main thread promise). It returns per case and request
the tokens, their threads, the logprobs and the finish reason.

``tests/engine/data/sampling_golden.json`` holds what the code before the sampling rows gave
(recorded with ``python tests/engine/sampling_cases.py record``, run from the repository root at
commit 0f627af); ``test_sampling_rows.py`` checks that today's code gives the same. Recorded
again when each thread got its own random stream (``core.batch.thread_seed``): only the two
seeded forking requests of ``grammar_forks`` changed (their chunks' tokens), every other case
is byte for byte the 0f627af record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GOLDEN = Path(__file__).with_name("data") / "sampling_golden.json"
KV = dict(kv_cache_bytes=8 * 2**20, page_size=4)
PROMPTS = [[1, 40, 41, 42, 43], [5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23]]


def make_tagged_adapter(ckpt: Path, out: Path) -> Path:
    """A LoRA adapter on ``ckpt`` that adds the PASTA-LANG pieces as tokens (fixed seeded
    weights, as ``tests/models/test_adapter_tokens.py`` builds it); returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pasta_engine.lang.grammar import tag_tokens_of
    from pasta_engine.train.common import LoraSettings, export_adapter, wrap_lora

    torch.manual_seed(0)  # the new token rows and LoRA's own initialization draw from the global generator
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = wrap_lora(hf, LoraSettings(r=4, alpha=8, dropout=0.0), tokenizer=tok, tag_tokens=True)
    tags = tag_tokens_of(tok)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    export_adapter(model.eval(), out, {"added_tokens": tags.as_dict()})
    return out


def _drive(engine, requests) -> list[dict]:
    """Add ``requests`` (``(prompt, params, mode, limits)``) at once, step until all finish,
    and return each one's result as plain data, in order."""
    ids = [engine.add_request(p, prm, mode=mode, limits=lim, output_kind="final") for p, prm, mode, lim in requests]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.result
    rows = []
    for rid in ids:
        r = done[rid]
        rows.append({"token_ids": r.token_ids, "threads": r.threads, "finish": r.stats.finish_reason,
                     "logprobs": r.logprobs, "error": r.error})
    return rows


def _eos_first(eos: int):
    def hook(req, tid, row):
        row[eos] = row.max() + 50.0
    return hook


def _promise_first(tags):
    """The main thread wants to open a promise at every sample (the grammar then leads it
    through the promise to its close, so it forks); chunks want to promise and sync (masked)."""
    def hook(req, tid, row):
        if tid == 0:
            row[tags.promise_open] += 8.0
        else:
            row[[tags.promise_open, tags.sync]] += 1e4
    return hook


def run_cases(ckpt: Path, tagged_adapter: Path) -> dict[str, list[dict]]:
    """Run every case (see the module docstring) and return ``{case: [result, ...]}``."""
    from pasta_engine import Engine, Limits, SamplingParams
    from pasta_engine.lang.grammar import tag_tokens_of

    S = SamplingParams
    out: dict[str, list[dict]] = {}
    engine = Engine.from_pretrained(ckpt, **KV)
    mixed = [
        S(max_new_tokens=10, temperature=0.0, return_logprobs=True),
        S(max_new_tokens=10, temperature=0.9, seed=3, return_logprobs=True),
        S(max_new_tokens=10, temperature=1.1, top_k=5, top_p=0.8, seed=7),
        S(max_new_tokens=10, temperature=1.0, min_p=0.1, seed=11, return_logprobs=True),
    ]
    out["mixed_options"] = _drive(engine, [(p, prm, "sequential", None) for p, prm in zip(PROMPTS, mixed)])
    penalised = [
        S(max_new_tokens=12, temperature=0.0, repetition_penalty=1.5),
        S(max_new_tokens=12, temperature=0.0, presence_penalty=0.8, frequency_penalty=0.6, return_logprobs=True),
        S(max_new_tokens=12, temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
          seed=5),
        S(max_new_tokens=12, temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=0.8, seed=9),
    ]
    out["penalties"] = _drive(engine, [(p, prm, "pasta", None) for p, prm in zip(PROMPTS, penalised)])
    eos = engine.eos_ids[0]
    engine.logits_hook = _eos_first(eos)
    ends = [
        S(max_new_tokens=6, ignore_eos=True),
        S(max_new_tokens=8, min_tokens=3),
        S(max_new_tokens=8, min_tokens=3, stop_token_ids=[41, 42], temperature=0.9, seed=2),
        S(max_new_tokens=6, temperature=0.0),
    ]
    out["end_masks"] = _drive(engine, [(p, prm, "sequential", None) for p, prm in zip(PROMPTS, ends)])
    engine.logits_hook = None
    from sample_traces import ANNOTATED  # tests/sample_traces.py

    [rep] = engine.replay(["Give me sleep tips."], [ANNOTATED], params=S(return_logprobs=True))
    out["replay"] = [{"token_ids": rep.token_ids, "threads": rep.threads, "finish": rep.stats.finish_reason,
                      "logprobs": rep.logprobs, "error": rep.error}]

    tagged = Engine.from_pretrained(ckpt, adapter=tagged_adapter, position_policy="constant:8", **KV)
    tags = tag_tokens_of(tagged.tokenizer)
    tagged.logits_hook = _promise_first(tags)
    forking = [
        S(max_new_tokens=40, temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3, return_logprobs=True),
        S(max_new_tokens=40, temperature=0.8, top_k=20, seed=13, frequency_penalty=0.5),
        S(max_new_tokens=40, temperature=1.0, seed=17, min_p=0.02, min_tokens=30),
    ]
    # the golden tokens predate the sentence-end rule (a chunk's end masked until its sentence ends),
    # which changes what the grammar masks and so the logprobs: record and compare with it off
    lim = Limits(max_threads=3, chunk_clean_end=False)
    out["grammar_forks"] = _drive(tagged, [(p, prm, "pasta", lim) for p, prm in zip(PROMPTS, forking)])
    knob = [
        S(max_new_tokens=30, temperature=0.0),
        S(max_new_tokens=30, temperature=0.9, seed=23, repetition_penalty=1.1),
    ]
    lims = [Limits(fork_threshold=0.3), Limits(fork_threshold=0.9)]
    tagged.logits_hook = None
    out["fork_threshold"] = _drive(tagged, [(p, prm, "pasta", lm) for p, prm, lm in zip(PROMPTS, knob, lims)])
    return out


def _build(tmp: Path) -> tuple[Path, Path]:
    from pasta_engine.tools.presets import build_checkpoint

    ckpt = build_checkpoint("tiny-llama", tmp / "tiny-llama")
    return ckpt, make_tagged_adapter(ckpt, tmp / "adapter")


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["record"]:
        sys.exit("usage: python tests/engine/sampling_cases.py record")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for sample_traces
    with tempfile.TemporaryDirectory() as d:
        results = run_cases(*_build(Path(d)))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {GOLDEN}: " + ", ".join(f"{k} ({len(v)})" for k, v in results.items()))
