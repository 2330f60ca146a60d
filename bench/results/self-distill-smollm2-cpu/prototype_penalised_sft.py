"""Prototype (issue 30, not shipped): `pasta-engine train sft` with the loss taken on penalised
logits, as the engine samples them, for examples without tags (one thread, sequential).

The base model's training answers were chosen by greedy decoding under CTRL's repetition penalty
(Keskar et al. 2019, section 4.1): a token the penalty picked is the argmax only after the
penalty. Plain SFT raises it without the penalty, and the engine applies the penalty again when
it decodes. Here each query row's logits get the penalty over the tokens that row has seen (the
prompt and the answer so far, :func:`pasta_engine.layers.sampler.apply_repetition_penalty`'s
rule) before the log-softmax, so the base model's own choices leave little to learn.

    python bench/results/self-distill-smollm2-cpu/prototype_penalised_sft.py train sft --prompts ... \\
        --examples ... --out ... (the flags of `pasta-engine train sft`)

PENALTY (environment, default 1.1) sets the penalty. Refuses an example with a promise: a
forked layout's rows see other tokens (`Interpreter.seen_tokens`), which this does not model.
"""
from __future__ import annotations

import os
import sys

import torch

import pasta_engine.train.sft as sft
from pasta_engine.entrypoints.cli import main

PENALTY = float(os.environ.get("PENALTY", "1.1"))


def penalised(model, layout) -> torch.Tensor:
    """``[S]`` float32 log-probabilities of the sampled tokens of a one-thread layout under
    penalised logits (the training forward's one dense pass, as ``forward_log_softmax``)."""
    qs, toks = layout.sampled()
    if any(b - a != 1 for a, b in zip(qs, qs[1:])):
        raise ValueError("penalised SFT prototype: examples must be one thread (no promise)")
    param = next(model.parameters())
    dev = param.device
    ids = torch.tensor([layout.input_ids], dtype=torch.long, device=dev)
    pos = torch.tensor([layout.position_ids], dtype=torch.long, device=dev)
    keep = layout.mask().to(dev)[None, None]
    mask = torch.zeros(keep.shape, dtype=param.dtype, device=dev).masked_fill(~keep, torch.finfo(param.dtype).min)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    logits = out.logits[0, torch.tensor(qs, device=dev)].float()
    seen = torch.zeros(logits.shape, dtype=torch.bool)
    seen[:, torch.tensor(sorted(set(layout.input_ids[: qs[0] + 1])), dtype=torch.long)] = True
    for i, q in enumerate(qs[1:], start=1):
        seen[i:, layout.input_ids[q]] = True  # row i predicts the token after position q, having seen it
    seen = seen.to(dev)
    pen = torch.where(seen, torch.where(logits > 0, logits / PENALTY, logits * PENALTY), logits)
    return torch.log_softmax(pen, dim=-1).gather(1, torch.tensor(toks, device=dev)[:, None]).squeeze(1)


if __name__ == "__main__":
    sft.forward_logprobs = penalised
    sys.exit(main(sys.argv[1:]))
