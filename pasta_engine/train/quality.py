"""An offline quality proxy for responses, and the score BoNBoN ranks samples by.

**A proxy, named as one**: with no judge model on this machine, a response's quality is taken
as the base model's mean log-likelihood per token of its clean text (tags stripped), given the
plain user prompt, minus a penalty for repeated lines (small models loop). It rewards fluent,
on-topic text the base model finds likely and punishes degenerate repetition; it does not judge
helpfulness the way AlpacaEval's length-controlled win rate does (for that, the evaluation
exports ``model_outputs`` in AlpacaEval's format). The scorer is pluggable: anything with
``__call__(prompt, result) -> float`` works, e.g. a judge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..lang.tokenization import encode_prompt, encode_text
from ..metrics import repeated_line_fraction  # the text-only proxies live with the other measures

__all__ = ["repeated_line_fraction", "LikelihoodQuality", "Scorer", "speedup_plus_quality"]

#: A quality scorer: ``(prompt, clean response text) -> float`` (higher is better).
Scorer = Callable[[str, str], float]


@dataclass
class LikelihoodQuality:
    """The quality proxy (see the module docstring): ``mean log p_base(token | prompt, text
    before it)`` over the clean text's tokens, minus ``repeat_penalty`` x
    :func:`repeated_line_fraction`. Natural-log units (nats per token); an empty text scores
    ``empty_score``.

    Args:
        model: the base ``transformers`` causal LM (no adapter), in eval mode.
        tokenizer: its tokenizer (the chat template formats the plain prompt)."""

    model: Any
    tokenizer: Any
    repeat_penalty: float = 2.0
    empty_score: float = -10.0
    max_tokens: int = 1024

    @torch.no_grad()
    def mean_loglik(self, prompt: str, text: str) -> float:
        """Mean log-likelihood per token (nats) of ``text`` after the chat-formatted ``prompt``."""
        p = encode_prompt(self.tokenizer, [{"role": "user", "content": prompt}])
        t = encode_text(self.tokenizer, text)[: self.max_tokens]
        if not t:
            return self.empty_score
        dev = next(self.model.parameters()).device
        ids = torch.tensor([p + t], device=dev)
        logits = self.model(input_ids=ids, use_cache=False).logits[0, len(p) - 1 : -1].float()
        return float(torch.log_softmax(logits, -1).gather(1, ids[0, len(p):, None]).mean())

    def __call__(self, prompt: str, text: str) -> float:
        return self.mean_loglik(prompt, text) - self.repeat_penalty * repeated_line_fraction(text)


def speedup_plus_quality(content_speedup: float, quality: float, weight: float) -> float:
    """The BoNBoN ranking score (Jin et al. 2025, section 4.2): the content speedup (content
    tokens / critical path, :func:`pasta_engine.metrics.content_speedup`) plus ``weight``
    (lambda) times quality."""
    return content_speedup + weight * quality
