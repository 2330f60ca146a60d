"""Files: prompts (and reference answers) in, annotated traces in and out.

One reader per kind of file:

* :func:`read_prompts`: a prompts file, either AlpacaEval JSON (a list of objects with a string
  ``instruction``, optionally ``output`` and ``dataset``; a list of strings also works) or a
  text file with one prompt per line (blank lines skipped). Used by ``generate``, ``bench
  pareto``, ``bench annotate`` and training alike.
* :func:`read_traces` / :func:`write_traces`: trace files, JSONL, one object per line:
  ``prompt``, ``annotated_response``, ``annotator``, plus ``response`` (the original),
  ``promises``, ``index`` (row in the source file), ``dataset`` and ``note`` when known. They
  are outputs of ``pasta-engine bench annotate``, regenerated on demand.

Every error is a :class:`TraceFileError` naming the file and the row or line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

__all__ = ["TraceFileError", "PromptRow", "TraceRow", "read_prompts", "read_traces", "write_traces"]


class TraceFileError(ValueError):
    """A prompts, responses or trace file cannot be used; the message names the file (and row)."""


@dataclass
class PromptRow:
    """One prompt of a prompts file: the ``instruction``, and when the file has them the
    reference answer ``output``, the source ``dataset`` (AlpacaEval's subsets) and the
    ``finish_reason`` of a generated answer (``train answers`` writes ``stop`` or ``length``)."""

    instruction: str
    output: str | None = None
    dataset: str | None = None
    finish_reason: str | None = None


def read_prompts(path: str | Path, need_output: bool = False) -> list[PromptRow]:
    """The prompts of a file (see the module docstring).

    Args:
        path: a ``.json`` file (AlpacaEval format, or a list of strings) or a text file.
        need_output: every row must carry a string ``output`` (for the text annotators).

    Raises TraceFileError naming the file (and row): unreadable, not JSON, not a list (a JSON
    object is not a prompts file), a row without a string ``instruction``, an empty or
    whitespace-only prompt (a text file's blank lines are skipped instead), a non-string
    ``output``, no prompt at all."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFileError(f"cannot read prompts file {p}: {getattr(e, 'strerror', None) or e}") from None
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFileError(f"{p} is not JSON (expected a list of objects with 'instruction'): {e}") from None
        if not isinstance(data, list):
            raise TraceFileError(f"{p} holds a JSON {type(data).__name__}, not a list of prompts (AlpacaEval format: "
                                 f"a list of objects with 'instruction')")
        rows = []
        for i, row in enumerate(data):
            if isinstance(row, str):
                if not row.strip():
                    raise TraceFileError(f"{p}: row {i} is an empty prompt: give it a prompt or remove the row")
                rows.append(PromptRow(row))
                continue
            if not isinstance(row, dict) or not isinstance(row.get("instruction"), str):
                raise TraceFileError(f"{p}: row {i} is not a string or an object with a string 'instruction'")
            if not row["instruction"].strip():
                raise TraceFileError(f"{p}: row {i} has an empty 'instruction': give it a prompt or remove the row")
            out = row.get("output")
            if out is not None and not isinstance(out, str):
                raise TraceFileError(f"{p}: row {i} has a non-string 'output'")
            ds = row.get("dataset")
            fr = row.get("finish_reason")
            rows.append(PromptRow(row["instruction"], out, ds if isinstance(ds, str) else None,
                                  fr if isinstance(fr, str) else None))
    else:
        rows = [PromptRow(line) for line in text.splitlines() if line.strip()]
    if not rows:
        raise TraceFileError(f"{p} holds no prompt")
    if need_output:
        for i, r in enumerate(rows):
            if r.output is None:
                raise TraceFileError(f"{p}: row {i} has no string 'output' to annotate")
    return rows


@dataclass
class TraceRow:
    """One line of a trace file (see the module docstring)."""

    prompt: str
    annotated_response: str
    annotator: str
    response: str | None = None
    promises: int | None = None
    index: int | None = None
    dataset: str | None = None
    note: str | None = None

    def to_json(self) -> str:
        """The row as one JSON line (fields that are None left out)."""
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})


def read_traces(path: str | Path) -> list[TraceRow]:
    """Rows of a JSONL trace file: ``prompt`` and ``annotated_response`` (or ``annotated`` /
    ``response``) strings per line; blank lines skipped.

    Raises TraceFileError naming the file and the 1-based line number of a bad line."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFileError(f"cannot read trace file {p}: {getattr(e, 'strerror', None) or e}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFileError(f"{p}:{n}: not a JSON object ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TraceFileError(f"{p}:{n}: not a JSON object")
        key = next((k for k in ("annotated_response", "annotated", "response") if k in obj), None)
        if not isinstance(obj.get("prompt"), str) or key is None or not isinstance(obj[key], str):
            raise TraceFileError(f"{p}:{n}: needs string fields 'prompt' and 'annotated_response'")
        rows.append(
            TraceRow(
                prompt=obj["prompt"],
                annotated_response=obj[key],
                annotator=str(obj.get("annotator", "unknown")),
                response=obj.get("response") if key != "response" else None,
                promises=obj.get("promises"),
                index=obj.get("index"),
                dataset=obj.get("dataset"),
                note=obj.get("note"),
            )
        )
    if not rows:
        raise TraceFileError(f"{p} holds no trace")
    return rows


def write_traces(path: str | Path, rows: Iterable[TraceRow]) -> int:
    """Write ``rows`` as JSONL (UTF-8, parent folders created). Returns the number written."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with p.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(row.to_json() + "\n")
            n += 1
    return n
