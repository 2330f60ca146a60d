"""Sibling dependence measured with a causal LM: the measurement behind the ``independent`` annotator.

A forked chunk is decoded without the sibling chunks that run beside it (docs/DESIGN.md
section 2). How much it needs them is measured as the change in a reference model's mean
log-likelihood of the chunk when they are cut from its context:

    dependence = mean_t log p(x_t | prompt, seen, x_<t) - mean_t log p(x_t | prompt, alone, x_<t)

in nats per token, where ``seen`` is the whole answer before the chunk and ``alone`` the same text
without the outstanding chunks (what the chunk's thread sees). A chunk that refers to a sibling
("as mentioned above"), continues it, or repeats it is predicted much better with the sibling in
view and scores high; an unrelated list item scores near zero. This is the "context-removal"
probe of the independence question in issue 30 (the same quantity as the pointwise mutual
information between the chunk and its siblings given the rest, per token).

The chunk's tokens are the same in both conditions: the answer is tokenized once and the chunk's
token ids are reused after the shortened context, so the difference measures the context alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..lang.tokenization import decode, encode_prompt, encode_text

__all__ = ["SiblingDependence", "score_answers"]


@dataclass
class SiblingDependence:
    """``dependence(seen, alone, piece)`` in nats per token for one prompt's answer.

    Args:
        model: a ``transformers`` causal LM (the base model, no adapter), in eval mode.
        tokenizer: its tokenizer (the chat template formats ``prompt``).
        prompt: the user's instruction the answer responds to.
        max_context_tokens: the context (prompt + text before the piece) is cut from the left to
            this many tokens, keeping the piece whole.

    Call it as the annotator does: ``seen`` is the answer's text before the piece, ``alone`` that
    text without the outstanding chunks, ``piece`` the piece's text. Returns 0.0 for an empty
    piece. Raises nothing on content."""

    model: Any
    tokenizer: Any
    prompt: str
    max_context_tokens: int = 1024

    def __post_init__(self) -> None:
        self._prompt_ids = encode_prompt(self.tokenizer, [{"role": "user", "content": self.prompt}])

    @torch.inference_mode()
    def token_logliks(self, context: str, piece_ids: list[int]) -> list[float]:
        """Log-likelihood (nats) of each of ``piece_ids`` after the prompt and ``context``
        (``context + piece`` tokenized whole, so a space the piece's first token carries is not
        doubled; ``context``'s own tokens then ``piece_ids`` when that tokenization does not end
        with them)."""
        text = decode(self.tokenizer, piece_ids)
        whole = encode_text(self.tokenizer, context + text)
        n = len(piece_ids)
        ctx_ids = whole[:-n] if len(whole) > n and whole[-n:] == piece_ids else encode_text(self.tokenizer, context)
        ctx = (self._prompt_ids + ctx_ids)[-self.max_context_tokens:]
        dev = next(self.model.parameters()).device
        ids = torch.tensor([ctx + piece_ids], device=dev)
        logits = self.model(input_ids=ids, use_cache=False).logits[0, len(ctx) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, len(ctx):, None])[:, 0].tolist()

    def piece_ids(self, seen: str, piece: str) -> list[int]:
        """The piece's token ids as they are in the answer: ``seen + piece`` tokenized whole, from
        the first token that differs from ``seen``'s own tokenization (a leading-space token
        counts as the piece's)."""
        whole = encode_text(self.tokenizer, seen + piece)
        before = encode_text(self.tokenizer, seen)
        k = 0
        while k < min(len(whole), len(before)) and whole[k] == before[k]:
            k += 1
        return whole[k:]

    def token_gains(self, seen: str, alone: str, piece: str) -> list[float]:
        """Per token of ``piece``: log p(token | seen) - log p(token | alone), in nats (empty for
        an empty piece)."""
        ids = self.piece_ids(seen, piece)
        if not ids:
            return []
        # the piece's first token may carry the end of the context (a space): cut it from both
        extra = decode(self.tokenizer, ids)
        extra = extra[: len(extra) - len(piece)] if extra.endswith(piece) else ""
        if extra and seen.endswith(extra) and alone.endswith(extra):
            seen, alone = seen[: -len(extra)], alone[: -len(extra)]
        return [a - b for a, b in zip(self.token_logliks(seen, ids), self.token_logliks(alone, ids))]

    def __call__(self, seen: str, alone: str, piece: str) -> float:
        gains = self.token_gains(seen, alone, piece)
        return sum(gains) / len(gains) if gains else 0.0


def score_answers(rows: Sequence[Any], model: Any, tokenizer: Any, out: Path, *, max_response_tokens: int = 256,
                  progress: bool = True) -> Path:
    """Measure every piece of every training answer once, for
    :func:`~pasta_engine.tools.annotate_independent.table_dependence`.

    Each answer (cut as :func:`pasta_engine.train.data.cut_response` cuts it) is walked by
    :func:`~pasta_engine.tools.annotate_independent.annotate_independent` with an infinite
    threshold, so each piece after the first fork is measured against every earlier forked
    chunk: an upper bound of its dependence under any finite threshold (a sync only shows a
    piece more of the answer), which lets a threshold be chosen afterwards without measuring again.

    Args:
        rows: :class:`~pasta_engine.tools.traces.PromptRow` with ``output`` (the training split).
        model, tokenizer: the base model (eval mode) and its tokenizer.
        out: a JSONL file, one row per answer: ``instruction``, ``dataset``, ``response`` (the
            cut answer), ``pieces`` (``start``, ``end`` in characters, ``candidate``,
            ``dependence`` in nats per token, ``token_gains`` per token). Appended to; rows already there are skipped
            (resumable).
        max_response_tokens: the answer cut, in tokens.

    Returns ``out``."""
    from tqdm import tqdm

    from ..tools.annotate_independent import annotate_independent
    from ..tools.bench import count_tokens_fn
    from .data import cut_response

    count = count_tokens_fn(tokenizer)
    done: set[str] = set()
    if out.exists():
        done = {json.loads(line)["instruction"] for line in out.read_text().splitlines() if line.strip()}
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = [r for r in rows if r.instruction not in done and r.output and r.output.strip()]
    with out.open("a") as f:
        for r in tqdm(todo, desc="dependence", disable=not progress):
            cut = cut_response(r.output, count, max_response_tokens)
            if cut is None:
                continue
            probe = SiblingDependence(model, tokenizer, r.instruction)
            gains: dict[int, list[float]] = {}

            def dependence(seen: str, alone: str, piece: str) -> float:
                g = gains[len(seen)] = probe.token_gains(seen, alone, piece)
                return sum(g) / len(g) if g else 0.0

            _, scores = annotate_independent(cut, dependence, count, threshold=math.inf)
            f.write(json.dumps({"instruction": r.instruction, "dataset": r.dataset, "response": cut,
                                "pieces": [{"start": s.start, "end": s.end, "candidate": s.candidate,
                                            "dependence": round(s.dependence, 4),
                                            "token_gains": [round(x, 2) for x in gains.get(s.start, [])]}
                                           for s in scores]}) + "\n")
            f.flush()
    return out
