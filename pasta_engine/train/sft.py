"""Stage 1: supervised finetuning on annotated responses, with LoRA (Jin et al. 2025, section 4.1).

Each example is laid out exactly as the engine's pasta-mode replay decodes it
(:mod:`pasta_engine.train.layout`) and trained with the chat template and one short system line
(:data:`~pasta_engine.lang.prompts.LEARNED_PASTA_PROMPT`), the form the model is used in. The
loss is the mean negative log-likelihood of the sampled tokens (the inserted ``<async>`` tags
are context, not targets), or with ``content_loss="distill"`` the cross-entropy of each content
token against the frozen base model's distribution (:mod:`pasta_engine.train.distill`). With
``end_target="ended"`` an answer that was cut (:attr:`TrainExample.ended` False) trains no
end-of-sequence token (:func:`~pasta_engine.train.losses.without_end_target`). Progress shows on stderr; a checkpoint every ``save_every`` optimizer
steps makes the run resumable; ``loss.json``/``loss.png`` hold the curve; the adapter is
exported in float16 with a manifest.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config import Limits
from ..models.adapter import read_manifest
from ..lang.grammar import tag_tokens_of
from ..lang.prompts import LEARNED_PASTA_PROMPT, PastaPrompt
from .common import LoraSettings, LossCurve, export_adapter, git_commit, load_base, load_checkpoint, lr_lambda, \
    machine, save_checkpoint, wrap_lora
from .data import TrainExample
from .forward import forward_log_softmax, forward_logprobs, layout_for
from .distill import distill_loss, teacher_rows
from .losses import sft_loss, tag_decision_ids, tag_decision_weights, without_end_target
from ..lang.tokenization import eos_token_ids

__all__ = ["SFTSettings", "train_sft"]


@dataclass
class SFTSettings:
    """SFT hyperparameters (learning rate per optimizer step of ``grad_accum`` examples;
    ``warmup`` and ``save_every`` in optimizer steps; ``max_steps`` stops early, for tests)."""

    epochs: int = 2
    lr: float = 2e-4
    grad_accum: int = 8
    warmup: int = 10
    weight_decay: float = 0.0
    save_every: int = 20
    seed: int = 0
    position_policy: str = "predicted"
    max_steps: int | None = None
    lora: LoraSettings = field(default_factory=LoraSettings)
    pasta_prompt: PastaPrompt = LEARNED_PASTA_PROMPT
    tag_weight: float = 1.0
    init_adapter: str | None = None
    tag_tokens: bool = False  # a fresh adapter adds the PASTA-LANG pieces as tokens (lang.grammar)
    content_loss: str = "nll"  # "distill": the base model's distribution at content tokens (train.distill)
    end_target: str = "always"  # "ended": no end-of-sequence target where the answer was cut (TrainExample.ended)
    distill_hard_open: int = 0  # with content_loss="distill": a chunk's first this many content tokens stay one-hot
    tokens_only: bool = False  # train the tag tokens' rows only: the LoRA stays zero, so the weights stay the base's


def train_sft(
    examples: Sequence[TrainExample],
    out: Path,
    settings: SFTSettings = SFTSettings(),
    *,
    base: str | None = None,
    resume: bool = False,
    progress: bool = True,
    manifest: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Finetune a LoRA adapter on ``examples``; write ``out/adapter`` (the result),
    ``out/checkpoint`` (resumable), ``out/loss.json``/``loss.png`` and ``out/summary.json``.

    Args:
        examples: annotated training responses (:func:`pasta_engine.train.data.build_examples`).
        out: output folder (created).
        settings: :class:`SFTSettings`.
        base: the checkpoint (None: the embedded SmolLM2-135M-Instruct).
        resume: continue from ``out/checkpoint`` when there is one.
        progress: a tqdm bar on stderr.
        manifest: extra fields for the adapter's manifest (data, commands).

    Returns the summary (also in ``out/summary.json``)."""
    from tqdm import tqdm

    if settings.content_loss not in ("nll", "distill"):
        raise ValueError(f"content_loss must be 'nll' or 'distill', got {settings.content_loss!r}")
    if settings.end_target not in ("always", "ended"):
        raise ValueError(f"end_target must be 'always' or 'ended', got {settings.end_target!r}")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    model, tok, path = load_base(base)
    eos_ids = eos_token_ids(tok, model.config)
    model = wrap_lora(model, settings.lora, adapter=settings.init_adapter, tokenizer=tok,
                      tag_tokens=settings.tag_tokens and settings.init_adapter is None)
    if settings.tokens_only:
        # the LoRA matrices stay at their start (B = 0: no change to any weight); only the added
        # tag-token rows learn, so the model writes the base model's content wherever no tag is in
        # its context, and its fork decisions are the tag rows read against the base model's states
        frozen = [p for n, p in model.named_parameters() if "lora_" in n]
        if settings.init_adapter is not None or not frozen or not settings.tag_tokens:
            raise ValueError("tokens_only trains a fresh adapter's tag-token rows: it needs tag_tokens=True and no "
                             "init_adapter")
        for p in frozen:
            p.requires_grad_(False)
    tags = tag_tokens_of(tok)  # the pieces as tokens (added now, or by the adapter continued from)
    decision_ids = tag_decision_ids(tok)
    teacher = None
    if settings.content_loss == "distill":
        if tags is None:
            raise ValueError("content_loss='distill' needs the tag pieces as tokens (--tag-tokens, or an adapter that "
                             "added them): it tells tag tokens from content by id")
        teacher, _, _ = load_base(base)  # the frozen base model, its own weights (LoRA never touches them)
        teacher.eval().requires_grad_(False)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    per_epoch = len(examples) // settings.grad_accum
    total = per_epoch * settings.epochs
    if settings.max_steps is not None:
        total = min(total, settings.max_steps)
    if total < 1:
        raise ValueError(f"{len(examples)} examples make no optimizer step of {settings.grad_accum}")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, settings.warmup, total))
    state = {"step": 0, "elapsed_s": 0.0}
    curve = LossCurve()
    if resume:
        got = load_checkpoint(out, model, opt, sched)
        if got is not None:
            state = got
            if (out / "loss.json").exists():
                curve.points = [p for p in json.loads((out / "loss.json").read_text()) if p["step"] <= state["step"]]
    order = [list(range(len(examples))) for _ in range(settings.epochs)]
    for e, o in enumerate(order):
        random.Random(settings.seed * 1000 + e).shuffle(o)
    flat = [i for o in order for i in o][: total * settings.grad_accum]
    limits = Limits(max_threads=None)
    bar = tqdm(total=total, initial=state["step"], unit="step", desc="sft", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    t0 = time.perf_counter() - state["elapsed_s"]
    try:
        while state["step"] < total:
            batch = flat[state["step"] * settings.grad_accum : (state["step"] + 1) * settings.grad_accum]
            losses, tokens = [], 0
            extra: dict[str, float] = {}
            for i in batch:
                ex = examples[i]
                layout = layout_for(model, tok, ex.prompt, ex.annotated, settings.position_policy,
                                    pasta_prompt=settings.pasta_prompt, limits=limits)
                weights = None
                sampled = layout.sampled()[1]
                if settings.tag_weight != 1.0:
                    weights = tag_decision_weights(sampled, decision_ids, settings.tag_weight)
                if settings.end_target == "ended" and not ex.ended:
                    weights = without_end_target(sampled, eos_ids, weights)
                if teacher is None:
                    lps = forward_logprobs(model, layout)
                    loss = sft_loss(lps, weights)
                else:
                    targets, soft, rows = teacher_rows(teacher, tok, ex.prompt, layout, tags, eos_ids,
                                                       hard_open=settings.distill_hard_open)
                    lps = forward_log_softmax(model, layout)
                    loss, parts = distill_loss(lps, torch.tensor(targets), torch.tensor(soft), rows, weights)
                    for k, v in parts.items():
                        extra[k] = extra.get(k, 0.0) + v / len(batch)
                (loss / len(batch)).backward()
                losses.append(loss.item())
                tokens += lps.shape[0]
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            state["step"] += 1
            state["elapsed_s"] = time.perf_counter() - t0
            curve.add(step=state["step"], examples=state["step"] * settings.grad_accum,
                      loss=sum(losses) / len(losses), lr=sched.get_last_lr()[0], tokens=tokens,
                      elapsed_s=round(state["elapsed_s"], 1), ended=sum(examples[i].ended for i in batch),
                      **{k: round(v, 4) for k, v in extra.items()})
            bar.update(1)
            bar.set_postfix(loss=f"{curve.points[-1]['loss']:.3f}")
            if state["step"] % settings.save_every == 0 or state["step"] == total:
                save_checkpoint(out, model, opt, sched, state)
                curve.save(out, "SFT loss (mean NLL per sampled token)" if teacher is None else
                           "SFT loss (content: cross-entropy against the base model; tags: NLL)")
    finally:
        bar.close()
    summary = {
        "stage": "sft",
        "examples": len(examples),
        "optimizer_steps": state["step"],
        "epochs": settings.epochs,
        "train_seconds": round(state["elapsed_s"], 1),
        "first_loss": curve.points[0]["loss"] if curve.points else None,
        "last_loss": sum(p["loss"] for p in curve.points[-10:]) / len(curve.points[-10:]) if curve.points else None,
        "settings": {**asdict(settings), "pasta_prompt": settings.pasta_prompt.to_dict()},
        "machine": machine(),
        "commit": git_commit(),
    }
    model.eval()
    earlier = (read_manifest(settings.init_adapter) or {}).get("stages", []) if settings.init_adapter else []
    export_adapter(model, out / "adapter", {
        **(manifest or {}), "base_model": str(base or "embedded SmolLM2-135M-Instruct"), "base_path": str(path),
        "pasta_prompt": settings.pasta_prompt.to_dict(), "stages": [*earlier, summary],
        **({"added_tokens": tags.as_dict()} if tags is not None else {}),
    })
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
