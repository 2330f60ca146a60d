"""A pairwise judge behind any OpenAI-compatible endpoint: which of two answers to a question is
better, in the MT-bench / AlpacaEval pairwise style (Zheng et al. 2023, "Judging LLM-as-a-Judge
with MT-Bench and Chatbot Arena", arXiv 2306.05685, section 3: pairwise comparison, both orders
against position bias).

The brief (:data:`JUDGE_PROMPT`) is the project's blind reading brief (docs/reader_briefs.md) for
one pair at a time, asking for one JSON object. :class:`JudgeQuality` turns it into the quality
term of ``train bonbon --judge-url``: a sample's preference against a reference answer to the same
prompt (the base model's), judged in both orders.

Example (a judge served by vLLM, SGLang or OpenAI)::

    from pasta_engine.tools.endpoint import ChatEndpoint
    from pasta_engine.tools.judge import judge_pair
    v = judge_pair(ChatEndpoint("http://127.0.0.1:8000/v1", "Qwen/Qwen3-8B"), "Name a colour.", "Blue.", "Banana.")
    v.verdict  # "A"
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .endpoint import ChatEndpoint, EndpointError

__all__ = ["JUDGE_PROMPT", "Verdict", "JudgeReplyError", "parse_verdict", "judge_pair", "JudgeQuality",
           "write_blind_pairs", "read_blind_sides", "win_value"]

JUDGE_PROMPT = """\
You are an impartial judge, in the MT-bench / AlpacaEval pairwise style. You see a question and two
answers, A and B. Judge which is more helpful, correct, relevant, coherent and complete for the
user. Both answers come from small language models. Stray markup (tags, stray symbols), empty
bullets or list items, repeated lines or repeated content, and cut-off answers are defects. Avoid
length bias (longer is not better by itself) and position bias (the order of A and B is random).
Reply with exactly one JSON object and nothing else:
{"verdict": "A" or "B" or "tie", "confidence": "low" or "medium" or "high", "score_a": 1-10,
"score_b": 1-10, "reason": "one sentence"}
"""


class JudgeReplyError(EndpointError):
    """The judge replied with something that is not a verdict; the message names the endpoint
    and quotes the start of the reply."""


@dataclass(frozen=True)
class Verdict:
    """One pairwise verdict: ``verdict`` ``"A"``, ``"B"`` or ``"tie"``; ``confidence`` as the
    judge gave it (None when absent); ``score_a``/``score_b`` 1-10 (None when absent); ``reason``."""

    verdict: str
    confidence: str | None = None
    score_a: float | None = None
    score_b: float | None = None
    reason: str = field(default="", compare=False)


def parse_verdict(reply: str, where: str = "the judge") -> Verdict:
    """The :class:`Verdict` in a judge's ``reply``: the first ``{...}`` span parsed as JSON (a
    code fence or words around it are ignored), ``verdict`` case-insensitive (``"a"``, ``"Tie"``).

    Raises :class:`JudgeReplyError` naming ``where`` when there is no JSON object, the verdict is
    missing or not A/B/tie, or a score is not a number from 1 to 10."""
    start = reply.find("{")
    head = " ".join(reply.split())[:200]
    if start < 0:
        raise JudgeReplyError(f"{where}: the reply holds no JSON object: {head!r}")
    try:
        # the first object only: a "}" in words after it is not part of it
        obj, _ = json.JSONDecoder().raw_decode(reply, start)
    except json.JSONDecodeError as e:
        raise JudgeReplyError(f"{where}: the reply's JSON does not parse ({e.msg}): {head!r}") from None
    if not isinstance(obj, dict):
        raise JudgeReplyError(f"{where}: the reply's JSON is not an object: {head!r}")
    v = obj.get("verdict")
    v = {"a": "A", "b": "B", "tie": "tie"}.get(v.strip().lower()) if isinstance(v, str) else None
    if v is None:
        raise JudgeReplyError(f"{where}: 'verdict' must be \"A\", \"B\" or \"tie\", got {obj.get('verdict')!r}: {head!r}")
    scores = []
    for k in ("score_a", "score_b"):
        s = obj.get(k)
        if s is None:
            scores.append(None)
            continue
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 1 <= s <= 10:
            raise JudgeReplyError(f"{where}: {k!r} must be a number from 1 to 10, got {s!r}: {head!r}")
        scores.append(float(s))
    conf = obj.get("confidence")
    return Verdict(v, conf if isinstance(conf, str) else None, scores[0], scores[1], str(obj.get("reason", "")))


def judge_pair(endpoint: ChatEndpoint, question: str, answer_a: str, answer_b: str, max_tokens: int = 256) -> Verdict:
    """The judge's verdict on one pair, in the order given (call twice with the order swapped to
    cancel position bias, as :class:`JudgeQuality` does).

    Raises :class:`~pasta_engine.tools.endpoint.EndpointError` when the endpoint fails and
    :class:`JudgeReplyError` when its reply is not a verdict (both name the endpoint)."""
    user = (f"Question:\n{question}\n\n[Answer A]\n{answer_a}\n[End of answer A]\n\n"
            f"[Answer B]\n{answer_b}\n[End of answer B]")
    reply = endpoint.complete([{"role": "system", "content": JUDGE_PROMPT}, {"role": "user", "content": user}],
                              max_tokens=max_tokens)
    return parse_verdict(reply, endpoint.name)


@dataclass
class JudgeQuality:
    """A BoNBoN quality term (:data:`pasta_engine.train.quality.Scorer`): a sample's win value
    against the reference answer to its prompt, judged by ``endpoint`` in both orders (the
    sample as A, then as B): 1 per win, 0.5 per tie, 0 per loss, averaged, so 0 to 1.

    Args:
        endpoint: the judge.
        references: prompt -> the reference answer (e.g. the base model's own answers,
            ``train answers``' ``answers.json``).

    Calling it with a prompt that has no reference raises KeyError naming the prompt's start;
    the endpoint's failures raise as :func:`judge_pair`'s. ``verdicts`` keeps every call's
    verdicts, for the round's record."""

    endpoint: ChatEndpoint
    references: Mapping[str, str]
    verdicts: list[dict] = field(default_factory=list)

    def __call__(self, prompt: str, text: str) -> float:
        if prompt not in self.references:
            raise KeyError(f"no reference answer for the prompt {prompt[:60]!r}: give --judge-reference a file "
                           "with an answer to every prompt sampled")
        ref = self.references[prompt]
        first = judge_pair(self.endpoint, prompt, text, ref)
        second = judge_pair(self.endpoint, prompt, ref, text)
        win = ({"A": 1.0, "tie": 0.5, "B": 0.0}[first.verdict] + {"B": 1.0, "tie": 0.5, "A": 0.0}[second.verdict]) / 2
        self.verdicts.append({"prompt": prompt, "as_a": first.verdict, "as_b": second.verdict, "win": win})
        return win


def write_blind_pairs(questions: Sequence[str], candidates: Sequence[str], baselines: Sequence[str], out: Path,
                      seed: int, meta: Mapping[str, Any] | None = None) -> None:
    """The files of a blind pairwise reading by a reader who sees nothing else (docs/reader_briefs.md):
    ``out/pairs.jsonl`` (``id``, ``question``, ``answer_a``, ``answer_b``: row ``id``'s candidate and
    baseline in a seeded random order), ``out/pairs_reversed.jsonl`` (every order swapped) and
    ``out/key.json`` (``meta``'s fields, ``seed``, and per row which side the candidate is in each
    file), which stays away from the reader. Raises ValueError when the three lists differ in length."""
    if not len(questions) == len(candidates) == len(baselines):
        raise ValueError(f"{len(questions)} questions, {len(candidates)} candidates and {len(baselines)} baselines: "
                         "one of each per row")
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    key, fwd, rev = [], [], []
    for i, (q, c, b) in enumerate(zip(questions, candidates, baselines)):
        cand_is_a = rng.random() < 0.5
        a, bb = (c, b) if cand_is_a else (b, c)
        fwd.append({"id": i, "question": q, "answer_a": a, "answer_b": bb})
        rev.append({"id": i, "question": q, "answer_a": bb, "answer_b": a})
        key.append({"id": i, "candidate_in_pairs": "A" if cand_is_a else "B",
                    "candidate_in_pairs_reversed": "B" if cand_is_a else "A"})
    (out / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fwd))
    (out / "pairs_reversed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rev))
    (out / "key.json").write_text(json.dumps({**(meta or {}), "seed": seed, "rows": key}, indent=1) + "\n")


def _verdict_file(path: Path, ids: set[int]) -> dict[int, str]:
    """``id -> "A" | "B" | "tie"`` of a reader's verdict file. Raises ValueError naming the file
    and line of a line that is not a verdict, holds an id not among ``ids`` (the key's rows),
    or repeats an id."""
    out: dict[int, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            v = json.loads(line)
            rid, verdict = v["id"], str(v["verdict"]).strip()
            if type(rid) is not int:  # not 1.9, not true
                raise TypeError(f"id {rid!r} is not an integer")
            choice = {"A": "A", "B": "B", "TIE": "tie"}[verdict.upper()]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} line {n} is not a verdict (a JSON object with an int 'id' and a 'verdict' of "
                             f"A, B or tie): {line[:80]!r}") from e
        if rid not in ids:
            raise ValueError(f"{path} line {n}: id {rid} is not a row of the key ({len(ids)} rows)")
        if rid in out:
            raise ValueError(f"{path} line {n}: id {rid} was judged on an earlier line already")
        out[rid] = choice
    return out


def _read_key(path: Path) -> dict[str, Any]:
    """The key of :func:`write_blind_pairs` at ``path``, checked (see :func:`read_blind_sides`)."""
    try:
        key = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg} at line {e.lineno}): it must be the key write_blind_pairs "
                         "wrote") from None
    if not isinstance(key, dict) or not isinstance(key.get("rows"), list):
        what = "has no 'rows' list" if isinstance(key, dict) else f"is a JSON {type(key).__name__}, not an object"
        raise ValueError(f"{path} {what}: a key is an object whose 'rows' list says per row which side the "
                         "candidate is in each pairs file")
    seen: set[int] = set()
    for n, k in enumerate(key["rows"]):
        if not isinstance(k, dict) or type(k.get("id")) is not int:
            raise ValueError(f"{path} row {n} has no int 'id': {json.dumps(k)[:80]}")
        for side in ("candidate_in_pairs", "candidate_in_pairs_reversed"):
            if k.get(side) not in ("A", "B"):
                raise ValueError(f"{path} row {n} (id {k['id']}): {side!r} must be \"A\" or \"B\", got "
                                 f"{k.get(side)!r}")
        if k["id"] in seen:
            raise ValueError(f"{path} row {n}: id {k['id']} is on an earlier row already")
        seen.add(k["id"])
    return key


def read_blind_sides(out: Path, complete: bool = False) -> list[dict[str, Any]]:
    """The readers' verdicts of :func:`write_blind_pairs`' files joined with its key, from the
    candidate's side: per row ``{"id", "first_order", "reversed_order"}``, each ``"win"``,
    ``"loss"``, ``"tie"`` or None (not judged), from ``out/verdicts.jsonl`` (the reader of
    ``pairs.jsonl``) and ``out/verdicts_reversed.jsonl`` (a second reader, every order reversed);
    a missing verdict file counts as nothing judged. Raises ValueError naming the file and line
    of a line that is not a verdict, names a row the key does not have, or repeats an id.

    ``complete``: a verdict file that is there must judge every row of the key, else ValueError
    naming the file and the ids it misses (a reader who stopped early; ``bench/judge_pairs.py
    join`` asks for this, since a win rate over fewer rows in one order than in the other is not
    the figure it says). Off by default: BoNBoN's readings judge slices of their keys.

    A ``key.json`` that is not :func:`write_blind_pairs`' key (not JSON, not an object with a
    ``rows`` list, a row without an int ``id`` or whose ``candidate_in_pairs`` /
    ``candidate_in_pairs_reversed`` is not A or B, an id twice) is a ValueError naming the file
    and what is wrong; a missing one, FileNotFoundError."""
    key = _read_key(out / "key.json")
    files = [out / "verdicts.jsonl", out / "verdicts_reversed.jsonl"]
    ids = {k["id"] for k in key["rows"]}
    fwd, rev = (_verdict_file(f, ids) if f.exists() else {} for f in files)
    if complete:
        for f, got in zip(files, (fwd, rev)):
            missing = sorted(ids - set(got))
            if f.exists() and missing:
                shown = ", ".join(map(str, missing[:20]))
                if len(missing) > 20:
                    shown += f", ... ({len(missing)} in all)"
                raise ValueError(f"{f} judges {len(got)} of the key's {len(ids)} rows: ids {shown} have no verdict")

    def side(verdict: str | None, cand: str) -> str | None:
        return None if verdict is None else "tie" if verdict == "tie" else "win" if verdict == cand else "loss"

    return [{"id": k["id"], "first_order": side(fwd.get(k["id"]), k["candidate_in_pairs"]),
             "reversed_order": side(rev.get(k["id"]), k["candidate_in_pairs_reversed"])} for k in key["rows"]]


def win_value(row: Mapping[str, Any]) -> float | None:
    """A row of :func:`read_blind_sides` as the candidate's win value: 1 per win, 0.5 per tie, 0 per
    loss, averaged over the orders judged (0 to 1; None when neither was judged)."""
    sides = [row[k] for k in ("first_order", "reversed_order") if row.get(k) is not None]
    return sum({"win": 1.0, "tie": 0.5, "loss": 0.0}[s] for s in sides) / len(sides) if sides else None
