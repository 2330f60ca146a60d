"""Stage 2: rounds of BoNBoN preference optimization (Jin et al. 2025, section 4.2).

Each round: the engine itself samples ``n`` annotated responses per training prompt in pasta mode
(temperature > 0, the current adapter merged); each sample is scored by its content speedup
(content tokens / critical path, :mod:`pasta_engine.metrics`: tag tokens are overhead) +
lambda x quality (:mod:`pasta_engine.train.quality`, a proxy); the best and the worst sample of
a prompt form a pair (only a sample that ended by itself can be the best: one cut at the token
limit would teach stopping there); the adapter is trained on the pairs with the BoNBoN loss
(:func:`~pasta_engine.train.losses.bonbon_loss`, arXiv 2406.00832) against the round's starting
adapter as the reference model. Samples, scores, pairs and the loss curve are written out.

``device``/``dtype`` put the engine that samples, the scorer's base model and the policy on a
GPU in bfloat16 (LoRA in float32), ``gradient_checkpointing`` recomputes activations in the
backward, and a memory estimate (the larger of sampling and training,
:mod:`pasta_engine.train.scale`) is printed and checked before anything loads. BoNBoN runs in one
process.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..config import Limits, SamplingParams
from ..lang.prompts import LEARNED_PASTA_PROMPT, PastaPrompt
from ..models.adapter import manifest_pasta_prompt, read_manifest
from .common import LossCurve, differing_keys, export_adapter, git_commit, load_base, load_config, load_tokenizer, \
    lr_lambda, machine, wrap_lora
from .forward import forward_logprobs, layout_for
from .losses import bonbon_loss
from .quality import LikelihoodQuality, Scorer, speedup_plus_quality

__all__ = ["BonbonSettings", "ReaderVerdictsPending", "adapter_pasta_prompt", "reader_scores",
           "proxy_pair_agreement", "reader_picks", "read_round_picks", "sample_and_rank", "best_and_worst",
           "bonbon_memory_estimate", "train_bonbon"]


@dataclass
class BonbonSettings:
    """One BoNBoN setup: ``n`` samples per prompt at ``temperature``/``top_p`` up to
    ``max_new_tokens`` with ``repetition_penalty`` (CTRL's, per thread; 1 = none);
    ``quality_weight`` is the lambda of the score; ``alpha`` weighs the SFT
    term of the loss; ``lr`` and ``grad_accum`` (pairs per optimizer step) train the adapter for
    ``epochs`` over the pairs; ``rounds`` repeats sample-and-train; ``best_must_finish``: only a
    sample that ended by itself (not at the token limit) can be a pair's best. ``device``,
    ``dtype`` (None: float32 on a CPU, bfloat16 on CUDA) and ``gradient_checkpointing`` as
    :class:`~pasta_engine.train.sft.SFTSettings`'s. ``pasta_prompt``: the context samples are drawn
    and trained in (None: the starting adapter's own, from its manifest; an adapter without one,
    the learned system line), as ``train sft`` keeps a continued adapter's."""

    n: int = 4
    rounds: int = 1
    temperature: float = 0.8
    top_p: float = 0.95
    repetition_penalty: float = 1.0
    max_new_tokens: int = 320
    quality_weight: float = 1.0
    alpha: float = 0.5
    lr: float = 5e-5
    grad_accum: int = 4
    epochs: int = 1
    warmup: int = 2
    seed: int = 0
    max_running_requests: int = 8
    kv_cache_mb: int = 1024
    best_must_finish: bool = True
    pasta_prompt: PastaPrompt | None = None
    device: str = "cpu"
    dtype: str | None = None
    gradient_checkpointing: bool = False


class ReaderVerdictsPending(RuntimeError):
    """A round's samples wait for a reader's verdicts (``train bonbon --reader``): ``folder`` holds
    the pair files to give a reader; the message says which files to write and that the same
    command run again goes on from there."""

    def __init__(self, folder: Path, samples: int, missing: int):
        self.folder = folder
        super().__init__(
            f"{missing} of {samples} samples wait for a reader: give {folder / 'pairs.jsonl'} (and, for the second "
            f"order, {folder / 'pairs_reversed.jsonl'}) to a blind reader with the brief in docs/reader_briefs.md, "
            f"write the verdicts to {folder / 'verdicts.jsonl'} (and {folder / 'verdicts_reversed.jsonl'}), then run "
            "the same command again: the samples are kept and the round goes on from them")


def reader_scores(rows: list[dict[str, Any]], references: Mapping[str, str], folder: Path, seed: int,
                  quality_weight: float) -> list[dict[str, Any]]:
    """Score a round's samples (:func:`sample_and_rank`'s rows) by a blind reader's pairwise
    preference against the reference answer to the same prompt (``references``: prompt -> answer,
    e.g. the base model's own): the first call writes the pair files to ``folder``
    (:func:`~pasta_engine.tools.judge.write_blind_pairs`, one row per sample, its clean text
    against the reference) and raises :class:`ReaderVerdictsPending`; once the reader's
    verdicts are there, every row's ``quality`` becomes its win value (1 win, 0.5 tie, 0 loss,
    averaged over the orders judged) and its ``score`` content speedup + ``quality_weight`` x
    that; the proxy's quality stays as ``proxy_quality``. Raises KeyError naming a prompt with
    no reference, ReaderVerdictsPending while a sample has no verdict in either order, and
    ValueError for a verdict line that is not one."""
    from ..tools.judge import read_blind_sides, win_value, write_blind_pairs

    if not (folder / "key.json").exists():
        missing = [r["prompt"] for r in rows if r["prompt"] not in references]
        if missing:
            raise KeyError(f"no reference answer for {len(missing)} sampled prompts (first: {missing[0][:60]!r}): give "
                           "--judge-reference a file with an answer to every prompt sampled")
        write_blind_pairs([r["prompt"] for r in rows], [r["text"] for r in rows],
                          [references[r["prompt"]] for r in rows], folder, seed,
                          {"candidate": "this round's samples (samples.jsonl, in order)",
                           "baseline": "the reference answer (--judge-reference)"})
    _check_pairs_match(rows, folder)
    wins = [win_value(side) for side in read_blind_sides(folder)]
    missing = sum(1 for w in wins if w is None)
    if missing:
        raise ReaderVerdictsPending(folder, len(rows), missing)
    return [{**r, "proxy_quality": r.get("proxy_quality", r["quality"]), "quality": w,
             "score": speedup_plus_quality(r["content_speedup"], w, quality_weight)} for r, w in zip(rows, wins)]


def _check_pairs_match(rows: Sequence[Mapping[str, Any]], folder: Path) -> None:
    """Raise ValueError naming ``folder`` unless its pair files were written for exactly these
    samples, in order (question and candidate text per row): a round sampled again (another
    ``--n``, ``--limit``) would otherwise join the old verdicts to other samples by position."""
    pairs = [json.loads(x) for x in (folder / "pairs.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    key = json.loads((folder / "key.json").read_text(encoding="utf-8"))["rows"]
    fix = f"remove {folder} to write pairs for this round's samples (its verdicts are for other samples)"
    if len(pairs) != len(rows) or len(key) != len(rows):
        raise ValueError(f"{folder}: {len(pairs)} pairs for {len(rows)} samples: {fix}")
    for i, (r, p, k) in enumerate(zip(rows, pairs, key)):
        text = p["answer_a"] if k["candidate_in_pairs"] == "A" else p["answer_b"]
        if p["question"] != r["prompt"] or text != r["text"]:
            raise ValueError(f"{folder}: pair {i} is not sample {i} of this round (another prompt or answer): {fix}")


def proxy_pair_agreement(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How often the proxy orders two samples of one prompt as the reader does: over every pair of
    samples of the same prompt whose reader win values (``quality``) differ, the fraction where
    ``proxy_quality`` is higher for the one the reader preferred (0.5 = chance); pairs whose proxy
    values tie are left out (neither order). Returns ``{"pairs": n, "agreement": fraction or
    None}``, ``n`` the pairs counted."""
    by: dict[int, list[Mapping[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["prompt_index"], []).append(r)
    agree = total = 0
    for group in by.values():
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                if a["quality"] == b["quality"] or a["proxy_quality"] == b["proxy_quality"]:
                    continue
                total += 1
                agree += (a["quality"] > b["quality"]) == (a["proxy_quality"] > b["proxy_quality"])
    return {"pairs": total, "agreement": agree / total if total else None}


#: The ``annotator`` of a :func:`reader_picks` example (the tags are the sampling adapter's own).
PICK_ANNOTATOR = "reader-pick"


def reader_picks(rows: Sequence[Mapping[str, Any]], min_win: float = 0.75) -> list[Any]:
    """The samples a blind reader preferred to the reference, as SFT examples (rejection sampling
    on the reader's verdicts; the paper's stage 2 distils best-of-n samples the same way, Jin et
    al. 2025 section 4.2): every row of :func:`reader_scores` whose win value (``quality``, 0 to
    1) is at least ``min_win`` and that ended by itself (``finish_reason`` ``stop``; an answer cut
    at the token limit would teach stopping there), in row order, as
    :class:`~pasta_engine.train.data.TrainExample` (``annotator`` :data:`PICK_ANNOTATOR`,
    ``promises`` the sample's forks, ``response_tokens`` its decoded tokens). Raises ValueError for
    ``min_win`` outside (0, 1] and KeyError for a row without those fields."""
    from .data import TrainExample

    if not 0.0 < min_win <= 1.0:
        raise ValueError(f"min_win must be in (0, 1] (a win value: 1 win, 0.5 tie, 0 loss), got {min_win!r}")
    return [TrainExample(prompt=r["prompt"], annotated=r["annotated"], dataset=None, annotator=PICK_ANNOTATOR,
                         promises=int(r["forks"]), response_tokens=int(r["tokens"]), ended=True)
            for r in rows if r["quality"] >= min_win and r["finish_reason"] == "stop"]


def read_round_picks(round_dir: Path, min_win: float = 0.75) -> list[Any]:
    """:func:`reader_picks` of a ``train bonbon --reader`` round folder (``round_dir``: its
    ``samples.jsonl`` and the reader's verdicts in ``round_dir/reader/``). Raises
    FileNotFoundError naming a missing samples file or key, ReaderVerdictsPending while a sample
    has no verdict, and ValueError as :func:`reader_picks` or when the pair files were written for
    other samples than ``samples.jsonl``'s (the round was sampled again)."""
    from ..tools.judge import read_blind_sides, win_value

    samples, folder = round_dir / "samples.jsonl", round_dir / "reader"
    for need in (samples, folder / "key.json"):
        if not need.exists():
            raise FileNotFoundError(f"{need} is missing: {round_dir} is not a sampled `train bonbon --reader` round")
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    _check_pairs_match(rows, folder)
    wins = [win_value(side) for side in read_blind_sides(folder)]
    missing = sum(1 for w in wins if w is None)
    if missing or len(wins) != len(rows):
        raise ReaderVerdictsPending(folder, len(rows), missing or abs(len(rows) - len(wins)))
    return reader_picks([{**r, "quality": w} for r, w in zip(rows, wins)], min_win)


def adapter_pasta_prompt(adapter: Path, given: PastaPrompt | None = None) -> PastaPrompt:
    """The context an adapter samples and trains in: ``given`` when set, else the ``pasta_prompt`` its
    manifest records (``train sft --system-prompt``; read as the engine reads it,
    :func:`~pasta_engine.models.adapter.manifest_pasta_prompt`, so an empty object sets none), else
    :data:`LEARNED_PASTA_PROMPT` (adapters trained before the manifest kept one, with that line).
    Raises CheckpointError naming the adapter for a ``pasta_prompt`` the engine would refuse."""
    if given is not None:
        return given
    recorded = manifest_pasta_prompt(read_manifest(adapter), adapter)
    return recorded if recorded is not None else LEARNED_PASTA_PROMPT


def bonbon_memory_estimate(prompts: Sequence[str], adapter: Path, settings: BonbonSettings,
                           base: str | None = None) -> tuple[Any, Any]:
    """``(sampling, training)`` memory estimates (:class:`~pasta_engine.train.scale.MemoryEstimate`,
    bytes) of a round: the engine's weights and KV cache (``kv_cache_mb``) beside the scorer's base
    model; then the scorer's and the policy's weights, the adapter (its LoRA rank and added rows
    from ``adapter``'s ``adapter_config.json`` and manifest) and the activations of a best and a
    worst sample alive together, each at most the longest prompt (chat template and system line)
    plus ``max_new_tokens``. Raises FileNotFoundError for a bad ``base``."""
    from types import SimpleNamespace

    from ..lang.dialect import PASTA, dialect_prompt
    from ..lang.tokenization import encode_prompt
    from ..models.adapter import added_tokens
    from .scale import ModelShape, estimate_inference_memory, estimate_training_memory, resolve_device, \
        resolve_dtype

    shape = ModelShape.from_config(load_config(base))
    tok = load_tokenizer(base)
    dtype = resolve_dtype(settings.dtype, resolve_device(settings.device))
    context = dialect_prompt(PASTA, adapter_pasta_prompt(adapter, settings.pasta_prompt))
    longest = max((len(encode_prompt(tok, context.messages(p), "text")) for p in prompts),
                  default=0) + settings.max_new_tokens
    cfg = {}
    try:
        cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        pass
    added = len(added_tokens(read_manifest(adapter)) or {})
    targets = cfg.get("target_modules")  # a list of names (a regex string: every projection, as the default)
    lora = SimpleNamespace(r=int(cfg.get("r", 16)), targets=tuple(targets) if isinstance(targets, list) and targets else None,
                           dropout=float(cfg.get("lora_dropout", 0.05)))
    sampling = estimate_inference_memory(shape, dtype, settings.kv_cache_mb * 2**20, frozen_copies=1)
    kwargs = {} if lora.targets is None else {"lora_targets": lora.targets}
    training = estimate_training_memory(shape, dtype, tokens=longest, lora_r=lora.r, lora_dropout=lora.dropout,
                                        trainable_rows=added * (1 if shape.tied else 2), added_rows=added,
                                        gradient_checkpointing=settings.gradient_checkpointing, sequences=2,
                                        frozen_copies=1, **kwargs)
    return sampling, training


def sample_and_rank(engine: Any, prompts: Sequence[str], settings: BonbonSettings,
                    scorer: Scorer, seed: int) -> list[dict[str, Any]]:
    """Sample ``settings.n`` pasta-mode responses per prompt with ``engine`` and score them.

    ``scorer(prompt, clean text) -> float`` (:data:`~pasta_engine.train.quality.Scorer`, the quality term)
    ranks them; ``seed + i`` seeds the i-th sample. Returns one row per sample (JSON-ready):
    prompt index, prompt, sample index, annotated and clean (``text``) text, finish reason, content
    speedup (content tokens / critical path), forks, quality (the scorer's: nats per token for the likelihood proxy, a win value from 0 to 1 for a judge) and score. Raises what
    the engine and the scorer raise."""
    rows = _sample_rows(engine, prompts, settings, seed)
    for i in range(len(rows)):
        _score_row(rows, i, scorer, settings.quality_weight)
    return rows


def _sample_rows(engine: Any, prompts: Sequence[str], settings: BonbonSettings, seed: int) -> list[dict[str, Any]]:
    """:func:`sample_and_rank`'s rows before scoring (``quality`` and ``score`` None)."""
    plist = [p for p in prompts for _ in range(settings.n)]
    params = [SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                             top_p=settings.top_p, repetition_penalty=settings.repetition_penalty, seed=seed + i)
              for i in range(len(plist))]
    results = engine.generate(plist, params, mode="pasta", progress=True)
    return [{"prompt_index": i // settings.n, "prompt": p, "sample": i % settings.n,
             "annotated": r.annotated_text, "text": r.text, "finish_reason": r.stats.finish_reason,
             "content_speedup": r.stats.content_speedup, "forks": r.stats.forks,
             "tokens": r.stats.tokens_decoded, "quality": None, "score": None}
            for i, (p, r) in enumerate(zip(plist, results))]


def _score_row(rows: list[dict[str, Any]], i: int, scorer: Scorer, quality_weight: float) -> dict[str, Any]:
    """Score row ``i`` in place; returns the record of it (``row``, ``quality`` and, from a scorer
    that keeps ``verdicts`` (:class:`~pasta_engine.tools.judge.JudgeQuality`), its ``verdict``)."""
    before = len(getattr(scorer, "verdicts", None) or [])
    q = scorer(rows[i]["prompt"], rows[i]["text"])
    rows[i]["quality"] = q
    rows[i]["score"] = speedup_plus_quality(rows[i]["content_speedup"], q, quality_weight)
    record: dict[str, Any] = {"row": i, "quality": q}
    verdicts = getattr(scorer, "verdicts", None)
    if isinstance(verdicts, list) and len(verdicts) > before:
        record["verdict"] = verdicts[-1]
    return record


#: What a round's quality term was, for ``summary.json`` (the likelihood proxy's line).
PROXY_QUALITY = ("base model mean log-likelihood per token of the clean text, minus 2.0 x the fraction of repeated "
                 "lines (a proxy, not a judge)")
READER_QUALITY = ("a blind pairwise reading against the reference answer (win 1, tie 0.5, loss 0, averaged over the "
                  "orders judged); the proxy's value kept as proxy_quality")


def _scorer_quality(scorer: Scorer | None) -> str:
    """The line describing the samples' ``quality`` from ``scorer`` (None: the likelihood proxy)."""
    if scorer is None or isinstance(scorer, LikelihoodQuality):
        return PROXY_QUALITY
    name = getattr(getattr(scorer, "endpoint", None), "name", None)
    if name is not None:
        return (f"the judge endpoint {name}: a sample's win value against the reference answer to its prompt, "
                "judged in both orders (win 1, tie 0.5, loss 0, averaged)")
    return f"the scorer given to train_bonbon ({type(scorer).__name__})"


#: The LoRA scale BoNBoN samples at: the policy as trained (its reference and policy, ``wrap_lora``,
#: run at 1.0), not a starting adapter's serving ``lora_scale``, so that the pairs are on-policy.
SAMPLING_LORA_SCALE = 1.0


def _round_inputs(prompts: Sequence[str], settings: BonbonSettings, seed: int, start: Path,
                  pasta_prompt: PastaPrompt, quality: str) -> dict[str, Any]:
    """What a round's samples and their scores depend on (kept as ``sampling.json`` beside them;
    ``lora_scale``: the scale the adapter was sampled at, the policy's own 1.0 whatever its
    manifest serves at)."""
    return {"prompts": list(prompts), "n": settings.n, "temperature": settings.temperature, "top_p": settings.top_p,
            "lora_scale": SAMPLING_LORA_SCALE,
            "repetition_penalty": settings.repetition_penalty, "max_new_tokens": settings.max_new_tokens,
            "seed": seed, "quality_weight": settings.quality_weight, "quality": quality,
            "pasta_prompt": pasta_prompt.to_dict(), "start_adapter": str(Path(start).resolve())}


def _check_round_inputs(rdir: Path, rows: Sequence[Mapping[str, Any]], inputs: Mapping[str, Any]) -> None:
    """Raise ValueError naming what differs when ``rdir``'s kept samples were drawn under other
    prompts or settings than ``inputs`` (a round from before ``sampling.json``: its rows' prompts)."""
    fix = (f"run with the same prompts and flags to go on from them, or remove {rdir} to sample this round again")
    kept_path = rdir / "sampling.json"
    if kept_path.exists():
        kept = json.loads(kept_path.read_text(encoding="utf-8"))
    else:
        kept = {"prompts": [r["prompt"] for r in rows][:: max(1, inputs["n"])]}
    differ = _differences(kept, inputs)
    if differ:
        raise ValueError(f"{rdir}: its samples were drawn or scored under other settings: "
                         f"{'; '.join(text for _, text in differ)}: {fix}")


def _differences(kept: Mapping[str, Any], now: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Each key of ``now`` that ``kept`` (a round's record) holds with another value, in
    ``now``'s order, with a few words naming its flag and both values (the prompts as a count of
    those that differ; a pasta prompt or quality term cut to 80 characters). A key ``kept`` lacks
    (a record from an older version) is not compared."""
    out = []
    for k in differing_keys(kept, now):
        was, is_, flag = kept[k], now[k], _round_flag(k)
        if k == "prompts":
            other = sum(1 for a, b in zip(was, is_) if a != b) + abs(len(was) - len(is_))
            out.append((k, f"{flag}: {other} of {len(is_)} prompts differ (another --prompts, --limit, "
                           "--sample-prompts or --seed?)"))
        elif k in ("pasta_prompt", "quality"):
            out.append((k, f"{flag}: {k} {str(was)[:80]!r} then, {str(is_)[:80]!r} now"))
        else:
            out.append((k, f"{flag} {was!r} then, {is_!r} now"))
    return out


def _training_inputs(settings: BonbonSettings, reader: bool) -> dict[str, Any]:
    """What a round's training depends on beyond its samples (:func:`_round_inputs`): the loss, the
    optimizer, which samples pair up and whether a reader scored them (kept as ``training`` in
    ``round.json``)."""
    return {"alpha": settings.alpha, "lr": settings.lr, "grad_accum": settings.grad_accum, "epochs": settings.epochs,
            "warmup": settings.warmup, "best_must_finish": settings.best_must_finish, "reader": reader}


#: The ``train bonbon`` flag that sets a recorded round input, where it is not the input's own name.
_ROUND_FLAGS = {"prompts": "--prompts", "start_adapter": "--adapter", "pasta_prompt": "--adapter",
                "quality": "--judge-url"}


def _round_flag(key: str) -> str:
    """The ``train bonbon`` flag that sets the recorded round input ``key``."""
    return _ROUND_FLAGS.get(key, "--" + key.replace("_", "-"))


def _check_done_round(rdir: Path, inputs: Mapping[str, Any], training: Mapping[str, Any], seed_offset: int) -> None:
    """Refuse to reuse the finished round ``rdir`` unless it was sampled, scored and trained under
    ``inputs`` (:func:`_round_inputs`, against its ``sampling.json``) and ``training``
    (:func:`_training_inputs`, against the ``training`` record of its ``round.json``): its adapter
    would stand for flags that trained nothing. A key a record lacks is not compared (a round
    written before either record resumes as before). ``seed_offset``: the round's, taken off the
    seeds shown. Raises ParameterError naming the first flag that differs (every one, with both
    values, in the message)."""
    from ..errors import ParameterError

    kept = json.loads((rdir / "sampling.json").read_text(encoding="utf-8")) if (rdir / "sampling.json").exists() else {}
    kept.update(json.loads((rdir / "round.json").read_text(encoding="utf-8")).get("training", {}))
    now = {**inputs, **training}
    for record in (kept, now):  # the --seed given, not the round's
        if isinstance(record.get("seed"), int):
            record["seed"] -= seed_offset
    differ = _differences(kept, now)
    if not differ:
        return
    first = differ[0][0]
    raise ParameterError(_round_flag(first), now[first], message=(
        f"{rdir} is a finished round sampled and trained under other flags ({'; '.join(t for _, t in differ)}): "
        "rerun with the same flags to go on from it, or train into a new --out"))


def _score_pending(rows: list[dict[str, Any]], rdir: Path, scorer: Scorer, quality_weight: float) -> None:
    """Score every row of ``rdir``'s samples that has no score yet, in place: scores kept in
    ``rdir/scores.jsonl`` by an earlier, interrupted run are taken from there, each new one is
    appended to it as it arrives (a judge's reply that fails keeps the ones before), and
    ``samples.jsonl`` is rewritten with the scores once every row has one."""
    record = rdir / "scores.jsonl"
    if record.exists():
        for line in record.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                i = r["row"]
                if 0 <= i < len(rows) and rows[i].get("score") is None:
                    rows[i]["quality"] = r["quality"]
                    rows[i]["score"] = speedup_plus_quality(rows[i]["content_speedup"], r["quality"], quality_weight)
    pending = [i for i, r in enumerate(rows) if r.get("score") is None]
    if not pending and not record.exists():
        return
    with record.open("a", encoding="utf-8") as f:
        for i in pending:
            f.write(json.dumps(_score_row(rows, i, scorer, quality_weight)) + "\n")
            f.flush()
    _write_samples(rdir / "samples.jsonl", rows)


def _write_samples(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(dict(r)) + "\n" for r in rows)
    tmp.replace(path)


def best_and_worst(rows: list[dict[str, Any]], best_must_finish: bool = True) -> list[tuple[dict, dict]]:
    """Per prompt, the best-scored sample (one that ended by itself, with ``best_must_finish``)
    and the worst, as ``(best row, worst row)`` of :func:`sample_and_rank`'s rows; prompts whose
    best and worst tie or read the same, or with no eligible best, are left out. Raises
    KeyError for rows without ``prompt_index``, ``score``, ``finish_reason`` or ``annotated``."""
    by: dict[int, list[dict]] = {}
    for r in rows:
        by.setdefault(r["prompt_index"], []).append(r)
    out = []
    for group in by.values():
        eligible = [r for r in group if r["finish_reason"] == "stop" or not best_must_finish]
        if not eligible:
            continue
        best = max(eligible, key=lambda r: r["score"])
        worst = min(group, key=lambda r: r["score"])
        if worst is best or worst["annotated"] == best["annotated"] or best["score"] <= worst["score"]:
            continue
        out.append((best, worst))
    return out


def _read_samples(path: Path, expected: int) -> list[dict[str, Any]] | None:
    """The rows of a round's ``samples.jsonl`` (None when absent or short of ``expected``; rows
    not scored yet have ``score`` None)."""
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows if len(rows) == expected else None


def train_bonbon(
    prompts: Sequence[str],
    adapter: Path,
    out: Path,
    settings: BonbonSettings = BonbonSettings(),
    *,
    base: str | None = None,
    scorer: Scorer | None = None,
    reader_references: Mapping[str, str] | None = None,
    manifest: dict[str, Any] | None = None,
    progress: bool = True,
    max_memory_gib: float | None = None,
) -> dict[str, Any]:
    """Run ``settings.rounds`` BoNBoN rounds from ``adapter`` (the SFT result) on ``prompts``;
    write ``out/round{k}/`` (samples.jsonl, pairs.jsonl, loss.json/png, adapter/, round.json; with a reader,
    picks.jsonl: :func:`reader_picks`) and
    ``out/adapter`` (the last round's), and return the summary (``out/summary.json``).

    Resumes: a round whose ``round.json`` exists is not run again (its adapter starts the next
    round), and a round whose ``samples.jsonl`` holds every sample reuses them instead of sampling,
    scoring only the ones not scored yet (each score is kept in ``scores.jsonl`` as it arrives):
    when they were drawn or scored under other prompts or settings (``sampling.json``: prompts,
    ``n``, temperature, ``top_p``, repetition penalty, ``max_new_tokens``, seed, quality weight and
    term, pasta prompt, starting adapter, LoRA scale) it raises ValueError naming what differs. A finished
    round is reused only when it was sampled, scored and trained under the same inputs: its
    ``sampling.json`` and the ``training`` record of its ``round.json`` (alpha, lr, grad_accum, epochs,
    warmup, best_must_finish, reader) are compared before anything loads, and a difference raises
    ParameterError naming the first flag that differs and both values (rerun with the same flags,
    or a new ``out``); a round written before those records resumes as before. A round sampled
    again (another sample count) moves a reader's folder written for the old samples to
    ``reader.stale``.

    Each round samples its adapter at LoRA scale 1.0 (:data:`SAMPLING_LORA_SCALE`: the policy and
    reference as trained), not at a serving ``lora_scale`` in its manifest, and the adapters it
    writes carry no ``lora_scale`` / ``lora_scale_note`` (measured on the starting adapter, not on them).

    ``scorer``: quality of ``(prompt, clean text)``; default :class:`LikelihoodQuality` with the
    base model. ``reader_references`` (prompt -> reference answer): a blind reader's preference
    replaces the scorer's quality (:func:`reader_scores`; the scorer's stays as ``proxy_quality``):
    a round stops after sampling with :class:`ReaderVerdictsPending` until the verdicts are in
    ``out/round{k}/reader/``, and a run again goes on from the kept samples. ``max_memory_gib``: the memory the estimate (:func:`bonbon_memory_estimate`, the
    larger of sampling and training) must fit in (None: the device's). ``summary.json`` says what
    the quality term was (``quality_term``: ``likelihood proxy``, ``judge``, ``reader`` or
    ``scorer``; ``quality``: its description) and the resolved ``device`` and ``dtype`` it ran
    under (``float32``, ``bfloat16``, ...). Raises ValueError when a
    round yields no pair; ParameterError (naming the flag to change) when the estimate does not
    fit, before anything loads."""
    from tqdm import tqdm

    from ..engine.llm_engine import Engine
    from .scale import check_memory, resolve_device, resolve_dtype

    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    sampling, training = bonbon_memory_estimate(prompts, adapter, settings, base)
    flags = (["--dtype bfloat16"] if dtype == torch.float32 else [])
    for what, est, more in (("train bonbon (sampling)", sampling, ["--max-running-requests"]),
                            ("train bonbon (training)", training,
                             ([] if settings.gradient_checkpointing else ["--gradient-checkpointing"])
                             + ["--max-new-tokens"])):
        line = check_memory(est, device, what, max_memory_gib=max_memory_gib, flags=flags + more)
        if progress:
            print(line, file=sys.stderr, flush=True)
    on_gpu = device if device.type == "cuda" else None
    pasta_prompt = adapter_pasta_prompt(adapter, settings.pasta_prompt)
    quality = _scorer_quality(scorer)
    training_inputs = _training_inputs(settings, reader_references is not None)
    start = Path(adapter)
    for k in range(settings.rounds):  # the finished rounds to reuse, checked before anything loads
        rdir = out / f"round{k + 1}"
        if not ((rdir / "round.json").exists() and (rdir / "adapter" / "adapter_config.json").exists()):
            break
        _check_done_round(rdir, _round_inputs(prompts, settings, settings.seed + 10_000 * k, start, pasta_prompt,
                                              quality), training_inputs, 10_000 * k)
        start = rdir / "adapter"
    out.mkdir(parents=True, exist_ok=True)
    base_model, tok, path = load_base(base, dtype, device=on_gpu)
    base_model.eval()
    scorer = scorer or LikelihoodQuality(base_model, tok)
    current = Path(adapter)
    rounds = []
    t_start = time.perf_counter()
    for k in range(settings.rounds):
        rdir = out / f"round{k + 1}"
        rdir.mkdir(exist_ok=True)
        if (rdir / "round.json").exists() and (rdir / "adapter" / "adapter_config.json").exists():
            rounds.append(json.loads((rdir / "round.json").read_text()))
            current = rdir / "adapter"
            print(f"bonbon round {k + 1}: done before, resumed from {current}", file=sys.stderr)
            continue
        inputs = _round_inputs(prompts, settings, settings.seed + 10_000 * k, current, pasta_prompt, quality)
        rows = _read_samples(rdir / "samples.jsonl", len(prompts) * settings.n)
        sample_s = 0.0
        if rows is not None:
            _check_round_inputs(rdir, rows, inputs)
        if rows is None:
            if (rdir / "reader").exists():  # its pairs and verdicts are for the samples about to be replaced
                stale = rdir / "reader.stale"
                if stale.exists():
                    shutil.rmtree(stale)
                (rdir / "reader").rename(stale)
                print(f"bonbon round {k + 1}: sampled again; the reader's folder for the old samples moved to {stale}",
                      file=sys.stderr)
            engine = Engine.from_pretrained(base, device=device, dtype=dtype, adapter=current,
                                            max_running_requests=settings.max_running_requests,
                                            kv_cache_bytes=settings.kv_cache_mb * 2**20,
                                            pasta_prompt=pasta_prompt,
                                            lora_scale=SAMPLING_LORA_SCALE)
            t0 = time.perf_counter()
            rows = _sample_rows(engine, prompts, settings, seed=settings.seed + 10_000 * k)
            sample_s = time.perf_counter() - t0
            del engine
            rows = [{**r, "sample_seconds": round(sample_s, 1)} for r in rows]
            (rdir / "scores.jsonl").unlink(missing_ok=True)
            _write_samples(rdir / "samples.jsonl", rows)  # unscored: a scorer that fails keeps the samples
            (rdir / "sampling.json").write_text(json.dumps(inputs, indent=2) + "\n")
        else:
            sample_s = rows[0].get("sample_seconds", 0.0)
        _score_pending(rows, rdir, scorer, settings.quality_weight)
        if reader_references is not None:
            rows = reader_scores(rows, reader_references, rdir / "reader", settings.seed + k, settings.quality_weight)
            with (rdir / "picks.jsonl").open("w") as f:
                f.writelines(json.dumps(e.to_dict()) + "\n" for e in reader_picks(rows))
        pairs = best_and_worst(rows, settings.best_must_finish)
        with (rdir / "pairs.jsonl").open("w") as f:
            f.writelines(json.dumps({"prompt": b["prompt"], "best": b["sample"], "worst": w["sample"],
                                     "best_score": b["score"], "worst_score": w["score"]}) + "\n" for b, w in pairs)
        if not pairs:
            raise ValueError(f"round {k + 1}: no best/worst pair among {len(rows)} samples (all equal or none ended)")
        # the reference model is this round's starting adapter: its log-probabilities first
        policy_base, _, _ = load_base(base, dtype, device=on_gpu)
        policy = wrap_lora(policy_base, adapter=current, tokenizer=tok)
        if on_gpu is not None:
            policy.to(device)
        if settings.gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        limits = Limits(max_threads=None)

        def lay(text: str, prompt: str):
            return layout_for(policy, tok, prompt, text, pasta_prompt=pasta_prompt, limits=limits)

        layouts = [(lay(b["annotated"], b["prompt"]), lay(w["annotated"], w["prompt"])) for b, w in pairs]
        policy.eval()
        with torch.no_grad():
            refs = [(forward_logprobs(policy, lb), forward_logprobs(policy, lw)) for lb, lw in layouts]
        policy.train()
        params = [p for p in policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=settings.lr)
        # each epoch's shuffle in steps of grad_accum pairs, the last one short: every pair trains
        # once per epoch and no step spans two epochs (a floor over all epochs left pairs out)
        chunks = []
        for e in range(settings.epochs):
            perm = random.Random(settings.seed + e).sample(range(len(pairs)), len(pairs))
            chunks += [perm[j : j + settings.grad_accum] for j in range(0, len(perm), settings.grad_accum)]
        steps = len(chunks)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, settings.warmup, steps))
        curve = LossCurve()
        t_train = time.perf_counter()
        bar = tqdm(total=steps, desc=f"bonbon round {k + 1}", unit="step", file=sys.stderr, disable=not progress)
        for s in range(steps):
            parts_acc: dict[str, float] = {"loss": 0.0, "sft": 0.0, "ipo": 0.0, "margin": 0.0}
            chunk = chunks[s]
            for i in chunk:
                lb, lw = layouts[i]
                loss, parts = bonbon_loss(forward_logprobs(policy, lb), forward_logprobs(policy, lw), refs[i][0],
                                          refs[i][1], n=settings.n, alpha=settings.alpha)
                (loss / len(chunk)).backward()
                parts_acc["loss"] += loss.item() / len(chunk)
                for key in ("sft", "ipo", "margin"):
                    parts_acc[key] += parts[key] / len(chunk)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            lr_used = opt.param_groups[0]["lr"]  # this step's (the scheduler's step below sets the next)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            curve.add(step=s + 1, lr=lr_used, **parts_acc)
            bar.update(1)
            bar.set_postfix(loss=f"{parts_acc['loss']:.2f}", margin=f"{parts_acc['margin']:.2f}")
        bar.close()
        curve_seconds = time.perf_counter() - t_train
        curve.save(rdir, f"BoNBoN round {k + 1} (alpha {settings.alpha}, n {settings.n})")
        policy.eval()
        summary_k = {
            "round": k + 1, "prompts": len(prompts), "samples": len(rows), "pairs": len(pairs),
            "pairs_trained": sum(len(c) for c in chunks), "epochs": settings.epochs,
            "sample_seconds": round(sample_s, 1), "optimizer_steps": steps,
            "mean_score": sum(r["score"] for r in rows) / len(rows),
            "mean_content_speedup": sum(r["content_speedup"] for r in rows) / len(rows),
            "forked_samples": sum(1 for r in rows if r["forks"] > 0),
            "mean_quality": sum(r["quality"] for r in rows) / len(rows),
            "mean_tokens": sum(r["tokens"] for r in rows) / len(rows),
            "length_cut_samples": sum(1 for r in rows if r["finish_reason"] == "length"),
            "first_margin": curve.points[0]["margin"], "last_margin": curve.points[-1]["margin"],
            "train_seconds": round(curve_seconds, 1), "training": training_inputs,
        }
        if reader_references is not None:
            summary_k["proxy_pair_agreement"] = proxy_pair_agreement(rows)
        rounds.append(summary_k)
        # a scale merged at serving was measured on the starting adapter, not on this one
        prior = {k: v for k, v in (read_manifest(current) or {}).items() if k not in ("lora_scale", "lora_scale_note")}
        current = export_adapter(policy, rdir / "adapter", {
            **prior, **(manifest or {}), "pasta_prompt": pasta_prompt.to_dict(),
            "stages": [*prior.get("stages", []), {"stage": "bonbon", **summary_k}],
        })
        (rdir / "round.json").write_text(json.dumps(summary_k, indent=2) + "\n")
        del policy, policy_base
    summary = {"stage": "bonbon", "rounds": rounds, "settings": {**asdict(settings),
                                                                  "pasta_prompt": pasta_prompt.to_dict()},
               "device": str(device), "dtype": str(dtype).replace("torch.", ""),
               "train_seconds": round(time.perf_counter() - t_start, 1), "machine": machine(device), "commit": git_commit()}
    if reader_references is not None:
        summary.update(quality_term="reader", quality=READER_QUALITY, quality_proxy=quality)
    elif quality == PROXY_QUALITY:
        summary.update(quality_term="likelihood proxy", quality=quality, quality_proxy=quality)
    else:
        summary.update(quality_term="judge" if quality.startswith("the judge endpoint") else "scorer", quality=quality)
    final = out / "adapter"
    if final.exists():
        shutil.rmtree(final)
    shutil.copytree(current, final)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
