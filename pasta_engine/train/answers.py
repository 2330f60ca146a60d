"""The model's own answers to the training prompts: the SFT data source that does not drift.

The paper annotates responses and finetunes on them (Jin et al., ICML 2025, arXiv 2502.11517,
section 4.1). Reference answers written by a much larger model make a 135M model imitate text it
cannot write, and its chunks drift (repeated headings, loops). Here the base model answers each
training prompt itself, sequentially and without PASTA-LANG; the annotators then mark those
answers (:func:`pasta_engine.train.data.build_examples`), so SFT teaches only *where to fork*,
on text the model already writes.

Sampling: the SmolLM2-135M-Instruct model card's example (``temperature=0.2``, ``top_p=0.9``) is
the default, but at that temperature the 135M model loops (on 32 training prompts 12 answers
repeated whole lines); ``temperature=0`` with ``repetition_penalty=1.1`` (greedy, CTRL's penalty)
gave no repeated line on the 8 prompts tried, and is what the shipped data used. Every request is
seeded by its row, so a rerun gives the same answers. Requests
run through the engine in batches (continuous batching, ``max_running_requests`` at a time) and
each finished batch is appended to ``answers.jsonl``: an interrupted run resumes where it
stopped. ``answers.json`` (AlpacaEval's format: ``dataset``, ``instruction``, ``output``,
``generator``) is what ``pasta-engine train sft --prompts`` reads.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .common import check_resume_record, read_row_log
from ..config import SamplingParams
from ..errors import ParameterError
from ..tools.traces import PromptRow

__all__ = ["MODEL_CARD_SAMPLING", "check_answers_resume", "generate_answers"]

#: SmolLM2-135M-Instruct's model-card sampling (its ``generate`` example): temperature, top-p.
MODEL_CARD_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def _read_log(path: Path) -> tuple[dict[str, dict[str, Any]], list[str] | None]:
    """The rows of ``answers.jsonl`` by instruction, and the lines to write back when the file
    does not end with a whole row (None when it does; :func:`~pasta_engine.train.common.read_row_log`:
    a row an interrupted run cut off is left out and answered again). Raises ValueError naming
    the file and the line when a line other than the last is not a JSON row."""
    if not path.exists():
        return {}, None
    kept, rewrite = read_row_log(
        path, path.read_text(encoding="utf-8"),
        lambda r: isinstance(r, dict) and isinstance(r.get("instruction"), str),
        "an answer row (an object with an 'instruction')",
        f"delete that line to resume (its prompt is answered again), or remove {path} (or answer into a new --out) "
        "to start over")
    return {r["instruction"]: r for r, _ in kept}, ([line for _, line in kept] if rewrite else None)


def _sampling(generator: str, max_new_tokens: int, temperature: float, top_p: float, repetition_penalty: float,
              seed: int) -> dict[str, Any]:
    return {"model": generator, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "repetition_penalty": repetition_penalty, "seed": seed}


def check_answers_resume(out: Path, *, max_new_tokens: int = 320,
                         temperature: float = MODEL_CARD_SAMPLING["temperature"],
                         top_p: float = MODEL_CARD_SAMPLING["top_p"], repetition_penalty: float = 1.0, seed: int = 0,
                         generator: str = "SmolLM2-135M-Instruct") -> None:
    """What :func:`generate_answers` checks first, before any model loads (the CLI calls it early):
    raises ParameterError when ``out`` holds answers sampled under another model (``generator``) or
    other sampling flags (``out/sampling.json``), and ValueError when a line of ``out/answers.jsonl``
    other than the last is not a JSON row (a last line cut off by an interrupted run is fine:
    :func:`generate_answers` drops it and answers that prompt again)."""
    _check_sampling(out, _sampling(generator, max_new_tokens, temperature, top_p, repetition_penalty, seed))
    _read_log(out / "answers.jsonl")


def _check_sampling(out: Path, sampling: dict[str, Any]) -> None:
    """:func:`~pasta_engine.train.common.check_resume_record` for this command's rows."""
    check_resume_record(out, sampling, "answers sampled", "answer into a new --out")


def generate_answers(engine: Any, rows: Sequence[PromptRow], out: Path, *, max_new_tokens: int = 320,
                     temperature: float = MODEL_CARD_SAMPLING["temperature"],
                     top_p: float = MODEL_CARD_SAMPLING["top_p"], repetition_penalty: float = 1.0,
                     batch: int = 32, seed: int = 0,
                     generator: str = "SmolLM2-135M-Instruct", progress: bool = True) -> dict[str, Any]:
    """Answer every row's instruction with ``engine`` in sequential mode and write them.

    Args:
        engine: an :class:`~pasta_engine.engine.llm_engine.Engine` (the base model: no adapter).
        rows: the prompts (training split only: the caller filters).
        out: folder for ``answers.jsonl`` (appended per batch; resumed), ``answers.json`` and
            ``summary.json``.
        max_new_tokens: the answer budget in tokens; temperature, top_p, repetition_penalty:
            sampling (temperature 0 with a penalty of 1.1: greedy answers that do not loop); batch: prompts
            handed to the engine per ``generate`` call (the unit of resumption); seed: request
            ``i`` is seeded ``seed + i``.
        generator: the name written into each row's ``generator`` field.
        progress: one line per batch on stderr.

    A rerun into the same ``out`` resumes: rows answered already are kept, except those whose
    ``finish_reason`` is ``"error"`` (answered again) and a last line cut off part-way by an
    interrupted run (dropped; its prompt is answered again). Each row is flushed as it is written.
    ``sampling.json`` keeps the model (``generator``) and the sampling flags.

    Returns the summary: rows, answers, how many ended at the budget (``length``), tokens per
    second of the whole run, the settings.

    Raises:
        ParameterError: ``out`` holds answers sampled under another model, max_new_tokens,
            temperature, top_p, repetition_penalty or seed (named; the fix: the same flags, or a new
            ``--out``).
        ValueError: a line of ``answers.jsonl`` other than the last is not a JSON row (named, with
            the fix)."""
    sampling = _sampling(generator, max_new_tokens, temperature, top_p, repetition_penalty, seed)
    _check_sampling(out, sampling)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling.json").write_text(json.dumps(sampling, indent=2) + "\n")
    log = out / "answers.jsonl"
    done, whole = _read_log(log)
    if whole is not None:  # the row an interrupted run was writing: left out (answered again), so a row appends cleanly
        log.write_text("".join(x + "\n" for x in whole), encoding="utf-8")
    todo = [(i, r) for i, r in enumerate(rows)
            if r.instruction not in done or done[r.instruction].get("finish_reason") == "error"]
    t0 = time.perf_counter()
    tokens = 0
    for at in range(0, len(todo), batch):
        part = todo[at: at + batch]
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + i,
                                 repetition_penalty=repetition_penalty)
                  for i, _ in part]
        results = engine.generate([r.instruction for _, r in part], params, mode="sequential")
        with log.open("a", encoding="utf-8") as f:
            for (i, r), res in zip(part, results):
                row = {"dataset": r.dataset, "instruction": r.instruction, "output": res.text, "generator": generator,
                       "finish_reason": res.stats.finish_reason, "tokens": res.stats.tokens_decoded, "index": i}
                done[r.instruction] = row
                tokens += res.stats.tokens_decoded
                f.write(json.dumps(row) + "\n")
                f.flush()  # on disk row by row: a kill loses at most the row being written
        if progress:
            el = time.perf_counter() - t0
            print(f"answers: {len(done)}/{len(rows)} ({tokens / max(el, 1e-9):.1f} tokens/s this run)", file=sys.stderr,
                  flush=True)
    ordered = [done[r.instruction] for r in rows if r.instruction in done]
    (out / "answers.json").write_text(json.dumps(ordered, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    summary = {"rows": len(rows), "answers": len(ordered),
               "length_cut": sum(1 for r in ordered if r["finish_reason"] == "length"),
               "errors": sum(1 for r in ordered if r["finish_reason"] == "error"),
               "settings": {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                            "repetition_penalty": repetition_penalty, "seed": seed, "mode": "sequential",
                            "source": "SmolLM2-135M-Instruct model card" if (temperature, top_p, repetition_penalty) == (
                                MODEL_CARD_SAMPLING["temperature"], MODEL_CARD_SAMPLING["top_p"], 1.0) else "given"},
               "this_run_seconds": round(time.perf_counter() - t0, 1), "this_run_tokens": tokens}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
