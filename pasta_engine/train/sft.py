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

Scale (:mod:`pasta_engine.train.scale`): ``device``/``dtype`` put the frozen base weights on a GPU
in bfloat16 (the LoRA and tag rows stay float32), ``gradient_checkpointing`` recomputes each
layer's activations in the backward, a memory estimate is printed (and checked) before the
weights load, and under ``torchrun`` (``data_parallel``) each rank runs its share of every
optimizer step's ``grad_accum`` examples and the ranks sum their gradients, so the global batch
and the loss curve are those of one process; rank 0 alone logs, checkpoints and exports.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config import Limits
from ..errors import ParameterError
from ..models.adapter import read_manifest
from ..lang.grammar import tag_tokens_of
from ..lang.prompts import LEARNED_PASTA_PROMPT, PastaPrompt
from .common import LoraSettings, LossCurve, checkpoint_state, export_adapter, git_commit, load_base, load_checkpoint, \
    load_config, load_tokenizer, lr_lambda, machine, save_checkpoint, wrap_lora
from .data import TrainExample
from .forward import forward_log_softmax, forward_logprobs, layout_for
from .distill import distill_loss, teacher_rows
from .losses import sft_loss, tag_decision_ids, tag_decision_weights, without_end_target
from .scale import DataParallel, MemoryEstimate, ModelShape, check_memory, estimate_training_memory, longest_layout, \
    resolve_device, resolve_dtype
from ..lang.tokenization import eos_token_ids

__all__ = ["SFTSettings", "train_sft", "sft_memory_estimate", "sft_worker"]


@dataclass
class SFTSettings:
    """SFT hyperparameters (learning rate per optimizer step of ``grad_accum`` examples, the
    global batch however many ranks share it; ``warmup`` and ``save_every`` in optimizer steps;
    ``max_steps`` stops early, for tests).

    ``device`` (``cpu``, ``cuda``, ``cuda:N``, ``auto``) and ``dtype`` (``float32``, ``bfloat16``,
    ``float16``; None: float32 on a CPU, bfloat16 on CUDA) place the base weights;
    ``gradient_checkpointing`` keeps one tensor per layer and recomputes the rest in the backward;
    ``example_seeds`` seeds torch's RNG per example (from ``seed``, the step and the example's
    place in the global batch), so LoRA dropout draws the same masks whichever rank runs the
    example: on by itself with more than one rank, off by default so that one process draws as
    it always did."""

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
    tag_tokens: bool = False  # add the PASTA-LANG pieces as tokens (lang.grammar): a fresh adapter, or an init_adapter without them
    content_loss: str = "nll"  # "distill": the base model's distribution at content tokens (train.distill)
    end_target: str = "always"  # "ended": no end-of-sequence target where the answer was cut (TrainExample.ended)
    distill_hard_open: int = 0  # with content_loss="distill": a chunk's first this many content tokens stay one-hot
    tokens_only: bool = False  # train the tag tokens' rows only: the LoRA stays zero, so the weights stay the base's
    device: str = "cpu"
    dtype: str | None = None
    gradient_checkpointing: bool = False
    example_seeds: bool = False


#: SFTSettings fields a resume may change: how often it saves and where it runs, and how long it
#: goes on (more epochs or steps extend the same order of steps; the learning-rate schedule is
#: stretched to the new total).
_RESUME_FREE = ("save_every", "device", "dtype", "gradient_checkpointing", "epochs", "max_steps")


def _run_fingerprint(examples: Sequence[TrainExample], settings: SFTSettings,
                     base: str | os.PathLike | None = None) -> dict[str, Any]:
    """What a run's optimizer steps depend on: the base checkpoint (``--model``'s absolute path,
    or the embedded model's name for None), the examples in order (count and a SHA-256 of their
    prompts, annotations and ends) and every setting but :data:`_RESUME_FREE`."""
    from ..models.loader import EMBEDDED_MODEL

    digest = hashlib.sha256()
    for e in examples:
        digest.update(json.dumps([e.prompt, e.annotated, e.ended]).encode())
    cfg = {k: v for k, v in asdict(settings).items() if k not in _RESUME_FREE}
    return {"base": EMBEDDED_MODEL if base is None else str(Path(base).expanduser().resolve()),
            "examples": len(examples), "examples_sha256": digest.hexdigest(),
            "settings": json.loads(json.dumps(cfg, default=str))}


def _check_resume(saved: dict[str, Any] | None, now: dict[str, Any], out: Path) -> None:
    """Refuse to resume ``out``'s checkpoint under another base model, other examples or
    settings (its step would be applied to other weights or another order: examples trained
    twice or never). A checkpoint from before fingerprints (None) resumes as before, and one
    from before the base was recorded is not checked for it. Raises ParameterError naming what
    changed."""
    if saved is None:
        return
    if "base" not in saved:
        now = {k: v for k, v in now.items() if k != "base"}
    if saved == now:
        return
    changed = [f"{k} ({str(saved['settings'].get(k))[:60]} then, {str(now['settings'].get(k))[:60]} now)"
               for k in sorted(set(saved["settings"]) | set(now["settings"]))
               if saved["settings"].get(k) != now["settings"].get(k)]
    if saved.get("examples") != now["examples"] or saved.get("examples_sha256") != now["examples_sha256"]:
        changed.insert(0, f"the examples ({saved.get('examples')} then, {now['examples']} now)")
    if saved.get("base", now.get("base")) != now.get("base"):
        changed.insert(0, f"the base model --model ({saved['base']} then, {now['base']} now)")
    raise ParameterError("--resume", str(out), message=(
        f"the checkpoint in {out} was written under other training inputs: {', '.join(changed)} changed; "
        "resume with the same data and flags, or train into a new --out"))


def sft_memory_estimate(examples: Sequence[TrainExample], settings: SFTSettings, base: str | None = None,
                        tokenizer: Any = None) -> MemoryEstimate:
    """The memory estimate of :func:`train_sft` with ``settings`` on ``examples`` (bytes by part,
    :func:`~pasta_engine.train.scale.estimate_training_memory`), from the checkpoint's config and
    the longest example's layout (:func:`~pasta_engine.train.scale.longest_layout`), without
    loading the weights. ``tokenizer``: the base model's (default: loaded). Raises
    FileNotFoundError for a bad ``base``, ValueError for no examples."""
    from ..models.adapter import added_tokens

    cfg = load_config(base)
    shape = ModelShape.from_config(cfg)
    tok = tokenizer if tokenizer is not None else load_tokenizer(base)
    t, s = longest_layout(examples, tok, cfg, settings.position_policy, pasta_prompt=settings.pasta_prompt)
    added = 0
    if settings.init_adapter is not None:
        added = len(added_tokens(read_manifest(settings.init_adapter)) or {})
    if not added and settings.tag_tokens:
        added = 6  # at most the six PASTA-LANG pieces (lang.grammar.TAG_PIECES)
    dtype = resolve_dtype(settings.dtype, resolve_device(settings.device))
    return estimate_training_memory(
        shape, dtype, tokens=t, targets=s, lora_r=settings.lora.r, lora_targets=settings.lora.targets,
        lora_dropout=settings.lora.dropout, trainable_rows=added * (1 if shape.tied else 2), added_rows=added,
        gradient_checkpointing=settings.gradient_checkpointing,
        frozen_copies=1 if settings.content_loss == "distill" else 0)


def _memory_flags(settings: SFTSettings, dtype: torch.dtype) -> list[str]:
    """What to change, in order, when the estimate does not fit."""
    flags = []
    if dtype == torch.float32:
        flags.append("--dtype bfloat16")
    if not settings.gradient_checkpointing:
        flags.append("--gradient-checkpointing")
    flags.append("--max-response-tokens (shorter examples)")
    return flags


def train_sft(
    examples: Sequence[TrainExample],
    out: Path,
    settings: SFTSettings = SFTSettings(),
    *,
    base: str | None = None,
    resume: bool = False,
    progress: bool = True,
    manifest: dict[str, Any] | None = None,
    data_parallel: DataParallel | None = None,
    max_memory_gib: float | None = None,
) -> dict[str, Any]:
    """Finetune a LoRA adapter on ``examples``; write ``out/adapter`` (the result),
    ``out/checkpoint`` (resumable), ``out/loss.json``/``loss.png`` and ``out/summary.json``.

    Args:
        examples: annotated training responses (:func:`pasta_engine.train.data.build_examples`);
            every rank gets the same list.
        out: output folder (created).
        settings: :class:`SFTSettings`.
        base: the checkpoint (None: the embedded SmolLM2-135M-Instruct).
        resume: continue from ``out/checkpoint`` when there is one (written by any number of
            ranks: the checkpoint holds the global step, the replicas' common adapter and AdamW
            state, so it resumes on another number of ranks).
        progress: a tqdm bar on stderr (rank 0 only) with the loss, tokens/s (forwarded tokens,
            all ranks) and the ETA.
        manifest: extra fields for the adapter's manifest (data, commands).
        data_parallel: this rank of a data-parallel run (:func:`~pasta_engine.train.scale.init_data_parallel`;
            None: one process on ``settings.device``). Rank r runs ``batch[r::world_size]`` of
            each optimizer step's global batch; each loss is divided by the global batch size and
            the gradients are summed over the ranks (one ``all_reduce``) before clipping and the
            AdamW step; rank 0 alone writes files.
        max_memory_gib: the memory the estimate must fit in, GiB (None: the device's,
            :func:`~pasta_engine.train.scale.device_memory`).

    Returns the summary (also in ``out/summary.json``). Raises ValueError (ParameterError naming
    the flag) for a bad setting, when the memory estimate does not fit (before the weights load),
    or when the world is larger than ``grad_accum``; ParameterError naming ``--resume``, before
    the weights load, when ``out``'s checkpoint was written from another base model or under
    other examples or settings (:func:`_check_resume`)."""
    from tqdm import tqdm

    if settings.content_loss not in ("nll", "distill"):
        raise ValueError(f"content_loss must be 'nll' or 'distill', got {settings.content_loss!r}")
    if settings.end_target not in ("always", "ended"):
        raise ValueError(f"end_target must be 'always' or 'ended', got {settings.end_target!r}")
    if settings.tokens_only and (settings.init_adapter is not None or not settings.tag_tokens):
        raise ValueError("tokens_only trains a fresh adapter's tag-token rows: it needs tag_tokens=True and no "
                         "init_adapter")
    if min(settings.max_steps or 1, (len(examples) // settings.grad_accum) * settings.epochs) < 1:
        raise ValueError(f"{len(examples)} examples make no optimizer step of {settings.grad_accum}")
    dp = data_parallel if data_parallel is not None else DataParallel(device=resolve_device(settings.device))
    device = dp.device
    dtype = resolve_dtype(settings.dtype, device)
    if dp.world_size > settings.grad_accum:
        raise ParameterError("--grad-accum", settings.grad_accum, message=f"--grad-accum {settings.grad_accum} is the "
                             f"global batch of an optimizer step: it must be at least the world size {dp.world_size} "
                             "(each rank runs one example or more per step)")
    fingerprint = _run_fingerprint(examples, settings, base)
    if resume:  # another model, data or settings: refused before the weights load
        _check_resume((checkpoint_state(out) or {}).get("fingerprint"), fingerprint, out)
    estimate = sft_memory_estimate(examples, settings, base)
    line = check_memory(estimate, device, f"train sft (rank {dp.rank} of {dp.world_size})" if dp.world_size > 1
                        else "train sft", max_memory_gib=max_memory_gib, flags=_memory_flags(settings, dtype))
    if dp.is_main and progress:
        print(line, file=sys.stderr, flush=True)
    if dp.is_main:
        out.mkdir(parents=True, exist_ok=True)
    dp.barrier()
    torch.manual_seed(settings.seed)
    model, tok, path = load_base(base, dtype, device=device if device.type == "cuda" else None)
    eos_ids = eos_token_ids(tok, model.config)
    model = wrap_lora(model, settings.lora, adapter=settings.init_adapter, tokenizer=tok,
                      tag_tokens=settings.tag_tokens)
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
    if device.type == "cuda":
        model.to(device)  # the rows and adapter peft added on the host
    if settings.gradient_checkpointing:
        # non-reentrant: the inputs need no gradient, and the saved RNG state replays LoRA dropout exactly
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tags = tag_tokens_of(tok)  # the pieces as tokens (added now, or by the adapter continued from)
    decision_ids = tag_decision_ids(tok)
    teacher = None
    if settings.content_loss == "distill":
        if tags is None:
            raise ValueError("content_loss='distill' needs the tag pieces as tokens (--tag-tokens, or an adapter that "
                             "added them): it tells tag tokens from content by id")
        teacher, _, _ = load_base(base, dtype, device=device if device.type == "cuda" else None)
        teacher.eval().requires_grad_(False)  # the frozen base model, its own weights (LoRA never touches them)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    dp.broadcast_parameters(params)
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    # float16 weights: their activation gradients underflow without loss scaling (bfloat16 has float32's range)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    per_epoch = len(examples) // settings.grad_accum
    total = per_epoch * settings.epochs
    if settings.max_steps is not None:
        total = min(total, settings.max_steps)
    if total < 1:
        raise ValueError(f"{len(examples)} examples make no optimizer step of {settings.grad_accum}")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, settings.warmup, total))
    state: dict[str, Any] = {"step": 0, "elapsed_s": 0.0}
    curve = LossCurve()
    state["fingerprint"] = fingerprint
    if resume:
        got = load_checkpoint(out, model, opt, sched)
        if got is not None:
            state = {**got, "fingerprint": fingerprint}
            # the optimizer state brought back the old schedule's last rate: a longer run
            # (epochs, max_steps) stretches the schedule, so its next step takes the new one's
            for group, base_lr in zip(opt.param_groups, sched.base_lrs):
                group["lr"] = base_lr * lr_lambda(sched.last_epoch, settings.warmup, total)
            if scaler is not None and "grad_scaler" in state:
                scaler.load_state_dict(state["grad_scaler"])
            if (out / "loss.json").exists():
                curve.points = [p for p in json.loads((out / "loss.json").read_text()) if p["step"] <= state["step"]]
    seeded = settings.example_seeds or dp.world_size > 1 or bool(state.get("example_seeds"))
    if seeded:
        state["example_seeds"] = True
    order = [list(range(len(examples))) for _ in range(settings.epochs)]
    for e, o in enumerate(order):
        random.Random(settings.seed * 1000 + e).shuffle(o)
    # each epoch cut to whole optimizer steps before the next begins: a step never spans two
    # epochs (which could hold one example twice) and no epoch is skipped
    flat = [i for o in order for i in o[: per_epoch * settings.grad_accum]][: total * settings.grad_accum]
    limits = Limits(max_threads=None)
    bar = tqdm(total=total, initial=state["step"], unit="step", desc="sft", file=sys.stderr,
               disable=not (progress and dp.is_main), dynamic_ncols=True)
    t0 = time.perf_counter() - state["elapsed_s"]
    t_run, run_tokens = time.perf_counter(), 0.0
    try:
        while state["step"] < total:
            batch = flat[state["step"] * settings.grad_accum : (state["step"] + 1) * settings.grad_accum]
            losses, tokens, forwarded = [], 0, 0
            extra: dict[str, float] = {}
            for place, i in dp.shard(list(enumerate(batch))):
                if seeded:  # the same dropout masks for this example on any rank, in any world size
                    torch.manual_seed(settings.seed * 1_000_003 + state["step"] * settings.grad_accum + place)
                ex = examples[i]
                layout = layout_for(model, tok, ex.prompt, ex.annotated, settings.position_policy,
                                    pasta_prompt=settings.pasta_prompt, limits=limits)
                weights = None
                sampled = layout.sampled()[1]
                if settings.tag_weight != 1.0:
                    weights = tag_decision_weights(sampled, decision_ids, settings.tag_weight)
                if settings.end_target == "ended" and not ex.ended:
                    weights = without_end_target(sampled, eos_ids, weights)
                if weights is not None and device.type != "cpu":
                    weights = weights.to(device)
                if teacher is None:
                    lps = forward_logprobs(model, layout)
                    loss = sft_loss(lps, weights)
                else:
                    targets, soft, rows = teacher_rows(teacher, tok, ex.prompt, layout, tags, eos_ids,
                                                       hard_open=settings.distill_hard_open)
                    lps = forward_log_softmax(model, layout)
                    loss, parts = distill_loss(lps, torch.tensor(targets, device=lps.device),
                                               torch.tensor(soft, device=lps.device), rows, weights)
                    for k, v in parts.items():
                        extra[k] = extra.get(k, 0.0) + v / len(batch)
                if scaler is None:
                    (loss / len(batch)).backward()
                else:
                    scaler.scale(loss / len(batch)).backward()
                losses.append(loss.item())
                tokens += lps.shape[0]
                forwarded += len(layout)
            keys = sorted(extra)
            if dp.world_size > 1:
                dp.all_reduce_gradients(params)
                summed = dp.all_reduce_sum([sum(losses), len(losses), tokens, forwarded, *(extra[k] for k in keys)])
                loss_mean = summed[0] / summed[1]
                tokens, forwarded = int(summed[2]), int(summed[3])
                extra = dict(zip(keys, summed[4:]))
            else:
                loss_mean = sum(losses) / len(losses)
            if scaler is not None:
                scaler.unscale_(opt)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))  # of the global batch's gradient
            lr_used = opt.param_groups[0]["lr"]  # this step's (the scheduler's step below sets the next)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
                state["grad_scaler"] = scaler.state_dict()
            sched.step()
            opt.zero_grad(set_to_none=True)
            state["step"] += 1
            state["elapsed_s"] = time.perf_counter() - t0
            state["world_size"] = dp.world_size
            run_tokens += forwarded
            curve.add(step=state["step"], examples=state["step"] * settings.grad_accum,
                      loss=loss_mean, lr=lr_used, tokens=tokens, grad_norm=grad_norm,
                      elapsed_s=round(state["elapsed_s"], 1), ended=sum(examples[i].ended for i in batch),
                      **{k: round(v, 4) for k, v in extra.items()})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_mean:.3f}",
                            tok_s=f"{run_tokens / max(time.perf_counter() - t_run, 1e-9):.0f}")
            if state["step"] % settings.save_every == 0 or state["step"] == total:
                if dp.is_main:  # the curve first: a run killed between the two resumes from the older
                    # checkpoint and drops the curve's later points (a resume keeps points <= its step);
                    # the other order lost the points between the two checkpoints
                    curve.save(out, "SFT loss (mean NLL per sampled token)" if teacher is None else
                               "SFT loss (content: cross-entropy against the base model; tags: NLL)")
                    save_checkpoint(out, model, opt, sched, state)
                dp.barrier()
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
        "machine": machine(device),
        "commit": git_commit(),
    }
    if dp.world_size > 1 or device.type != "cpu" or dtype != torch.float32:
        summary["scale"] = {"world_size": dp.world_size, "backend": dp.backend, "device": str(device),
                            "dtype": str(dtype).replace("torch.", ""), "memory_estimate_bytes": estimate.total}
    model.eval()
    if dp.is_main:
        earlier = (read_manifest(settings.init_adapter) or {}).get("stages", []) if settings.init_adapter else []
        export_adapter(model, out / "adapter", {
            **(manifest or {}), "base_model": str(base or "embedded SmolLM2-135M-Instruct"), "base_path": str(path),
            "pasta_prompt": settings.pasta_prompt.to_dict(), "stages": [*earlier, summary],
            **({"added_tokens": tags.as_dict()} if tags is not None else {}),
        })
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    dp.barrier()
    return summary


def sft_worker(rank: int, world_size: int, port: int, examples: Sequence[TrainExample], out: Path,
               settings: SFTSettings, base: str | None, resume: bool = False, threads: int = 1) -> None:
    """One rank of :func:`train_sft` started by ``torch.multiprocessing.spawn(sft_worker, args=(world_size,
    port, examples, out, settings, base), nprocs=world_size)``: sets the variables torchrun would
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` 127.0.0.1, ``MASTER_PORT`` ``port``),
    joins the group (:func:`~pasta_engine.train.scale.init_data_parallel`), trains, and leaves it.
    ``threads``: torch CPU threads per rank. A module-level function, so that spawn's children
    import it by name. Raises what :func:`train_sft` raises."""
    import os

    from .scale import init_data_parallel

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dp = init_data_parallel(resolve_device(settings.device))
    try:
        train_sft(examples, out, settings, base=base, resume=resume, progress=False, data_parallel=dp)
    finally:
        dp.close()
