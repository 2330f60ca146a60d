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
from typing import Any

from ..lang.detokenizer import IncrementalDetokenizer, token_bytes_for
from ..lang.dialect import BaseDialect, Dialect, Sync, as_dialect
from ..lang.pasta import PASTA
from ..lang.tokenization import AnnotatedTokens, ThreadTokens, decode, encode_text, tokenize_annotated
from ..metrics import ResponseStructure, critical_path

__all__ = ["ReplayScript", "replay_script", "trace_content_figures"]


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
