"""Replay (forced decoding): the token streams an annotated response forces (no torch).

Every forward pass, KV write, fork and join of a replayed request is real; only the sampler is
replaced by the response's tokens (docs/DESIGN.md section 3). Both modes force the same content,
tokenized once by :func:`pasta_engine.lang.tokenization.tokenize_annotated`:

* pasta mode: the main thread is forced with the response without its chunks (end-of-sequence
  last), and each child with its chunk (content then ``</async>``);
* sequential mode: one thread is forced with the same tokens in reading order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..config import GREEDY_TEMPERATURE, Limits
from ..lang.detokenizer import IncrementalDetokenizer, token_bytes_for
from ..lang.dialect import BaseDialect, Dialect, Sync, as_dialect
from ..lang.pasta import PASTA
from ..lang.tokenization import (AnnotatedTokens, ForcedChunk, ThreadTokens, decode, encode_text,
                                  tokenize_annotated)
from ..errors import ParameterError
from ..metrics import ResponseStructure, critical_path

__all__ = ["REPLAY_UNUSED_FIELDS", "ReplayScript", "check_replay_sampling", "replay_script", "trace_content_figures"]

#: The sampling fields a replay cannot honour (they act only where a token is sampled, and a
#: replay forces every token), as :class:`~pasta_engine.config.SamplingParams` and the server's
#: request both name them: per field, the test of a value that asks for nothing a forced token
#: could differ by (greedy, no filter, no penalty, no minimum length, no stop token; a seed only
#: draws samples, so none asks for nothing), and that value as an error shows it. The one rule
#: of :func:`check_replay_sampling`, which the Python API and the server both call.
REPLAY_UNUSED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: v < GREEDY_TEMPERATURE, "0"), "top_p": (lambda v: v == 1, "1"),
    "top_k": (lambda v: v in (0, -1), "0"), "min_p": (lambda v: v == 0, "0"),
    "presence_penalty": (lambda v: v == 0, "0"), "frequency_penalty": (lambda v: v == 0, "0"),
    "repetition_penalty": (lambda v: v == 1, "1"), "min_tokens": (lambda v: v == 0, "0"),
    "ignore_eos": (lambda v: not v, "False"), "stop_token_ids": (lambda v: not v, "empty"),
    "seed": (lambda v: False, "None"),
}


def check_replay_sampling(source: Any, where: str = "") -> None:
    """Refuse a sampling field a replay would ignore: raise ParameterError naming the first field
    of :data:`REPLAY_UNUSED_FIELDS` that ``source`` sets to a value that asks for something
    (its value shown, and how to fix it). A field ``source`` lacks, or holds as None, is not
    set. Honoured in a replay, so never refused here: ``max_new_tokens`` (raised to the tokens
    the replay samples when smaller), ``return_logprobs`` / ``logprobs`` (the forced tokens'
    log-probabilities) and ``stop`` (the replay ends as ``stop`` at one).

    Args:
        source: a :class:`~pasta_engine.config.SamplingParams`, or any object with the fields as
            attributes (the server's request).
        where: what made it a replay, named in the message (``"pasta.annotated_response"``,
            ``"Engine.replay"``).

    ``n`` other than 1 is refused too: a replay forces one response, so its completions would
    be the same tokens.

    Raises ParameterError (``param`` the field); its callers call it before a request is queued
    or takes a KV page: the server on the request's own fields, the Python API
    (:meth:`~pasta_engine.engine.llm_engine.Engine.replay`, and the input processor for the step
    API and :class:`~pasta_engine.engine.async_engine.AsyncEngine`) on the caller's
    :class:`~pasta_engine.config.SamplingParams`."""
    for name, (neutral, shown) in REPLAY_UNUSED_FIELDS.items():
        value = getattr(source, name, None)
        if value is not None and not neutral(value):
            if isinstance(value, tuple):
                value = list(value)
            raise ParameterError(name, value, message=(
                f"{name}={value!r} cannot apply to a replay ({where + ': ' if where else ''}its tokens are forced, "
                f"none is sampled); leave {name} out (or {shown})"))
    n = getattr(source, "n", None)
    if n is not None and n != 1:
        raise ParameterError("n", n, message=(
            f"n={n} cannot apply to a replay ({where + ': ' if where else ''}it forces one response, so its "
            "completions would be the same tokens); leave n at 1 (list the prompt and its response n times for n runs)"))


@dataclass
class ReplayScript:
    """Forced token streams for replaying one annotated response.

    Attributes:
        tokens: the canonical tokenization (:class:`~pasta_engine.lang.tokenization.AnnotatedTokens`).
        forced_main: the main thread's tokens, end-of-sequence last.
        forced_chunks: per promise, the child's tokens (content then ``</async>``), or None.
        sequential_ids: what sequential replay forces: the same content in reading order,
            the ``<async>`` tags included, end-of-sequence last.
        structure: the response's token counts when every promise forks
            (:func:`pasta_engine.metrics.critical_path` of it is the decode steps of a pasta
            replay at unlimited width)."""

    tokens: AnnotatedTokens
    forced_main: list[int]
    forced_chunks: list[list[int] | None]
    sequential_ids: list[int]
    structure: ResponseStructure

    def sampled_tokens(self, mode: str, limits: Limits | None = None) -> int:
        """Tokens a replay of this script samples in ``mode``, all threads together: what its
        ``stats.tokens_decoded`` (the server's ``usage.completion_tokens``) counts and
        ``max_new_tokens`` budgets, so the smallest budget that replays it whole (the EOS and tag
        tokens included, the tags the interpreter inserts not: they are not sampled).

        Args:
            mode: ``sequential`` (the reading-order stream, every tag forced), ``pasta`` or
                ``inline`` (the main thread's stream and every chunk's, nested ones included).
            limits: the request's limits (default :class:`~pasta_engine.config.Limits`): a fork
                that ``max_forks`` or ``max_fork_depth`` refuses is decoded inline by its parent,
                which is then forced with the inserted tag too. One thread forks in a dialect that
                does not nest (one branch per marker, in reading order), so the chunks past
                ``max_forks`` are refused; in a nesting one, where the forks' order depends on the
                schedule, the count is exact when no fork can be refused and otherwise the
                sequential stream's (every fork refused: the most a replay samples).

        Never raises (an unknown mode counts as pasta)."""
        if mode == "sequential":
            return len(self.sequential_ids)
        limits = limits if limits is not None else Limits()
        forked = len(self.forced_main) + _chunk_tokens(self.forced_chunks)
        chunks, depth = _chunk_shape(self.forced_chunks)
        if chunks <= limits.max_forks and depth <= limits.max_fork_depth:
            return forked
        if self.tokens.tree is None:  # main forks alone (max_fork_depth >= 1): the chunks past the cap go inline
            return forked + (chunks - limits.max_forks) * len(self.tokens.open_ids)
        return len(self.sequential_ids)


def _chunk_tokens(chunks: list) -> int:
    """Tokens forced chunks sample, nested ones included."""
    return sum(len(c.ids) + _chunk_tokens(c.chunks) if isinstance(c, ForcedChunk) else len(c)
               for c in chunks if c is not None)


def _chunk_shape(chunks: list, level: int = 1) -> tuple[int, int]:
    """``(count, depth)`` of forced chunks: how many (nested ones included) and how deeply they
    nest (a main thread's chunk is at depth 1; 0 when there is none)."""
    count, depth = 0, 0
    for c in chunks:
        if c is None:
            continue
        n, d = _chunk_shape(c.chunks, level + 1) if isinstance(c, ForcedChunk) else (0, 0)
        count, depth = count + 1 + n, max(depth, level, d)
    return count, depth


def _sync_ends(tokenizer: Any, main_ids: list[int], dialect: BaseDialect) -> list[int]:
    """1-based main-token indices at which a ``<sync/>`` tag (the dialect's join) completes
    (text as the interpreter's incremental detokenizer delivers it)."""
    detok = IncrementalDetokenizer(lambda ids: decode(tokenizer, ids), token_bytes_for(tokenizer))
    parser = dialect.parser()
    out = []
    for k, t in enumerate(main_ids, start=1):
        if any(isinstance(e, Sync) for e in parser.feed(detok.push(t))):
            out.append(k)
    return out


def _tree_structure(tree: ThreadTokens, joins_at_fork: bool) -> ResponseStructure:
    """The structure of a trace tree when every branch forks (children in depth-first fork
    order, a parent before its children); ``joins_at_fork``: each fork is also a join."""
    forks: list[tuple[int, int]] = []
    parents: list[int] = []
    syncs: dict[int, list[int]] = {0: []}
    inserted = 0

    def visit(t: ThreadTokens, tid: int) -> None:
        nonlocal inserted
        for end, branches, join in t.forks:
            if not any(b is not None for b in branches):
                continue
            if joins_at_fork:
                syncs[tid].append(end)
            inserted += len(join)
            for b in branches:
                if b is None:
                    continue
                forks.append((end, len(b.ids)))
                parents.append(tid)
                j = len(forks)
                syncs[j] = []
                inserted += len(b.header)
                visit(b, j)

    visit(tree, 0)
    return ResponseStructure(main_tokens=len(tree.ids) + 1, forks=forks, syncs=syncs[0], inserted=inserted,
                             parents=parents, fork_syncs=[syncs[j] for j in range(1, len(forks) + 1)])


def replay_script(tokenizer: Any, annotated: str, eos_id: int, dialect: Dialect = PASTA) -> ReplayScript:
    """Tokenize ``annotated`` for replay (see the module docstring).

    Args:
        tokenizer: a ``transformers`` tokenizer.
        annotated: the annotated response (malformed tags are text).
        eos_id: the end-of-sequence token the main thread ends with.
        dialect: the language it is written in (default PASTA-LANG).

    Never raises on content; raises TypeError for a ``dialect`` that lacks a member of the
    protocol (:func:`~pasta_engine.lang.dialect.as_dialect`)."""
    dialect = as_dialect(dialect)
    tok = tokenize_annotated(tokenizer, annotated, dialect)
    eos = int(eos_id)
    if tok.tree is not None:  # a nesting dialect: a tree of threads
        structure = _tree_structure(tok.tree, dialect.fork_joins)
        return ReplayScript(tok, tok.main_ids + [eos], tok.chunk_ids, tok.spliced_ids + [eos], structure)
    forks = [(end, len(c)) for end, c in zip(tok.promise_ends, tok.chunk_ids) if c is not None]
    structure = ResponseStructure(
        main_tokens=len(tok.main_ids) + 1,
        forks=forks,
        syncs=_sync_ends(tokenizer, tok.main_ids, dialect),
        inserted=len(tok.open_ids) * len(forks),
    )
    return ReplayScript(tok, tok.main_ids + [eos], tok.chunk_ids, tok.spliced_ids + [eos], structure)


def trace_content_figures(tokenizer: Any, annotated: str, eos_id: int, dialect: Dialect = PASTA) -> tuple[int, int, int]:
    """``(content_tokens, critical_path, forks)`` of an annotated response when every fork
    marker forks, without running a model: the tokens of its clean text (``dialect.clean_text``,
    under the canonical tokenization, no tag tokens, no EOS), the steps of its pasta replay at
    unlimited width (:func:`pasta_engine.metrics.critical_path` of :func:`replay_script`'s
    structure; tag tokens and the EOS step are on it), and the threads forked. Their ratio is the
    theoretical content speedup (docs/DESIGN.md section 3; :func:`pasta_engine.metrics.content_speedup`).

    Args: as :func:`replay_script`. Never raises on content."""
    structure = replay_script(tokenizer, annotated, eos_id, dialect).structure
    return len(encode_text(tokenizer, dialect.clean_text(annotated))), critical_path(structure), len(structure.forks)
