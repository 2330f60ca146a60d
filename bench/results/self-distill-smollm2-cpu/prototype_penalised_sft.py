"""Prototype (issue 30, not shipped): `pasta-engine train sft` with the loss taken on penalised
logits, as the engine samples them, for examples without tags (one thread, sequential).

The base model's training answers were chosen by greedy decoding under CTRL's repetition penalty
(Keskar et al. 2019, section 4.1): a token the penalty picked is the argmax only after the
penalty. Plain SFT raises it without the penalty, and the engine applies the penalty again when
it decodes. Here each query row's logits get the penalty over the tokens that row has seen (the
prompt and the answer so far, :func:`pasta_engine.layers.sampler.apply_repetition_penalty`'s
rule) before the log-softmax. (Measured: the penalty explains about 0.05 of 1.0 nats per token; README.)

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
from pasta_engine.layers.sampler import apply_repetition_penalty
from pasta_engine.train.forward import forward_logits

PENALTY = float(os.environ.get("PENALTY", "1.1"))


def penalised(model, layout) -> torch.Tensor:
    """``[S]`` float32 log-probabilities of the sampled tokens of a one-thread layout under the
    engine's repetition penalty: the training forward's logits (``forward_logits``) penalised by
    the sampler's own rule (``apply_repetition_penalty``) over what each row has seen."""
    qs, toks = layout.sampled()
    if any(b - a != 1 for a, b in zip(qs, qs[1:])):
        raise ValueError("penalised SFT prototype: examples must be one thread (no promise)")
    logits = forward_logits(model, layout)
    ids = layout.input_ids
    seen = [ids[: q + 1] for q in qs]  # row i predicts the token after position qs[i], having seen it
    pen = apply_repetition_penalty(logits, list(range(len(qs))), seen, [PENALTY] * len(qs))
    return torch.log_softmax(pen, dim=-1).gather(1, torch.tensor(toks, device=pen.device)[:, None]).squeeze(1)


if __name__ == "__main__":
    sft.forward_logprobs = penalised
    sys.exit(main(sys.argv[1:]))
