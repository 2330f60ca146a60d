"""PASTA-LANG as a dialect: a promise forks a chunk, ``<sync/>`` joins (no torch).

PASTA-LANG (Jin et al., ICML 2025, arXiv 2502.11517, section 3; docs/DESIGN.md section 2) is the
engine's default dialect and one like the others (:mod:`.apar`, :mod:`.multiverse`): its syntax
and parser are :mod:`.tags`, its grammar masks :mod:`.grammar`; this module says what its tags
mean to the engine.

* ``<promise topic="T" tokens="N"/>`` (a :class:`~.dialect.Promise`) on the main thread forks one
  chunk; ``<async>`` is inserted into it, and it ends at ``</async>``
  (:class:`~.dialect.AsyncClose`);
* ``<sync/>`` (:class:`~.dialect.Sync`) joins: the main thread waits for its outstanding chunks;
* positions follow the request's position policy (``predicted`` reserves ``N`` plus the tags,
  clamped to ``limits.max_promise_tokens``), a chunk may sample ``limits.chunk_cap(N)`` tokens;
* the sampler's grammar masks (when the tokenizer has the tag pieces as tokens) are
  :func:`~.grammar.grammar_state`'s;
* a string prompt is taught PASTA-LANG by the engine's configured prompt (an adapter's
  manifest's when it has one).
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

from . import grammar, tags
from .dialect import BaseDialect, Chunk, Parsed, Promise, Threads, policy_reserve, register_dialect
from .prompts import PastaPrompt

__all__ = ["PastaDialect", "PASTA"]


class PastaDialect(BaseDialect):
    """PASTA-LANG (module docstring): ``<promise topic="T" tokens="N"/>`` forks, ``<async>``
    (inserted) ... ``</async>`` is the chunk, ``<sync/>`` joins; positions follow the position
    policy (``predicted`` reserves ``N`` plus the tags). Every member of
    :class:`~.dialect.BaseDialect` but :meth:`prompt` keeps its default."""

    name = "pasta"
    open_tag = tags.ASYNC_OPEN
    close_tag = tags.ASYNC_CLOSE
    nesting = False

    def parser(self) -> tags.TagParser:
        """A fresh incremental parser for one thread (:class:`~.tags.TagParser`)."""
        return tags.TagParser()

    def parse(self, text: str) -> list[Parsed]:
        """A whole text's items, text runs merged (:func:`~.tags.parse`)."""
        return tags.parse(text)

    def grammar_state(self, is_main: bool, pending: str, can_fork: bool, taken: Collection[str] = (),
                      tail: str | None = None) -> int:
        """The sampler's grammar state (:func:`~.grammar.grammar_state`)."""
        return grammar.grammar_state(is_main, pending, can_fork, taken, tail)

    def child_cap(self, limits: Any, fork: Promise) -> int:
        """Tokens a chunk may sample: ``limits.chunk_cap(N)`` for a promise of ``N`` tokens."""
        return limits.chunk_cap(fork.tokens)

    def reserved_positions(self, fork: Promise, policy: Any, limits: Any, open_len: int,
                           close_len: int, chunk_len: int | None) -> tuple[int, str | None]:
        """Positions the main thread skips after a promise: under ``predicted`` the tags plus
        ``N`` clamped to ``limits.max_promise_tokens`` (with a diagnostic when clamped), else
        :func:`~.dialect.policy_reserve`'s."""
        if policy.kind != "predicted":
            return policy_reserve(policy, open_len, close_len, chunk_len, 0), None
        note = None
        if fork.tokens > limits.max_promise_tokens:
            note = f"promise tokens={fork.tokens} clamped to {limits.max_promise_tokens}"
        return open_len + close_len + min(fork.tokens, limits.max_promise_tokens), note

    def split_threads(self, annotated: str, lead_whitespace: str = "main") -> Threads:
        """The main thread's text and each promise's chunk (:func:`~.tags.split_threads`)."""
        return tags.split_threads(annotated, lead_whitespace)

    def splice(self, main: str, chunks: Sequence[Chunk | str | None]) -> str:
        """Each chunk after its promise (:func:`~.tags.splice`)."""
        return tags.splice(main, chunks)

    def clean_text(self, annotated: str) -> str:
        """What a reader sees (:func:`~.tags.clean_text`)."""
        return tags.clean_text(annotated)

    def prompt(self, pasta_prompt: PastaPrompt) -> PastaPrompt:
        """``pasta_prompt``: the engine's configured PASTA-LANG prompt teaches PASTA-LANG."""
        return pasta_prompt

    def __repr__(self) -> str:
        return "PastaDialect()"


#: PASTA-LANG, the engine's default dialect (``get_dialect("pasta")``).
PASTA = register_dialect(PastaDialect())
