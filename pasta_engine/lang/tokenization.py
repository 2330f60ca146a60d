"""Tokenizing prompts and annotated responses, one way for everyone (no torch).

Replay (both modes), the sequential baseline and training all turn an annotated response into
tokens with :func:`tokenize_annotated` (docs/DESIGN.md section 3, "Tokenizing an annotated
response"):

* text segments and tag sources are tokenized apart, so a tag never shares a BPE token with
  its neighbours (SmolLM2's tokenizer merges ``/><`` into one token otherwise, which moves
  text across a tag);
* special-token text inside a response (``<|im_end|>``) is encoded as text, never as a control
  token; a tag the tokenizer has as an added special token (``<sync/>`` say) is that token;
* whitespace stays where it was: whitespace between a promise and its ``<async>`` starts the
  chunk (:func:`~pasta_engine.lang.tags.split_threads` with ``lead_whitespace="chunk"``), so
  the chunk follows its promise directly and the clean text keeps the whitespace in place.

Then the decoded text of the spliced tokens, tags stripped, equals ``strip_tags(annotated)``
exactly, in pasta and in sequential mode.

Prompts: :func:`encode_prompt` applies the chat template and tokenizes the users' text as text
(or, on request, lets special-token text in it become control tokens).

Responses: the text of a sampled special token that is no tag (``<|im_start|>``, BOS, padding)
is left out of the text a response carries, as vLLM's default ``skip_special_tokens=True`` does
(:func:`hidden_special_ids`; the incremental detokenizer applies it), while :func:`decode` keeps
every token's text (``/detokenize``, ``Engine.decode``).

A *tokenizer* here is a ``transformers`` tokenizer (``encode``/``decode``/``apply_chat_template``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from .dialect import BaseDialect, Dialect, Malformed, Promise, Text, TraceFork, TraceThread, as_dialect
from .pasta import PASTA

#: A SentencePiece byte-fallback piece (its text is one byte of text).
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

__all__ = [
    "eos_token_ids",
    "encode_text",
    "encode_tag",
    "decode",
    "hidden_special_ids",
    "encode_prompt",
    "AnnotatedTokens",
    "ForcedChunk",
    "ThreadTokens",
    "tokenize_annotated",
]


def eos_token_ids(tokenizer: Any, model_config: Any = None) -> list[int]:
    """Every token id that ends a thread: the model config's ``eos_token_id`` (an int or a
    list) and the tokenizer's. The first of the list, the tokenizer's when it is one of them, is
    what replay ends the main thread with (:func:`replay_eos_id`).

    Raises ValueError when neither names one."""
    ids: set[int] = set()
    for src in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    if not ids:
        raise ValueError("neither the tokenizer nor the model config names an end-of-sequence token")
    return sorted(ids)


def replay_eos_id(tokenizer: Any, eos_ids: Sequence[int]) -> int:
    """The end-of-sequence token a replayed main thread ends with: the tokenizer's when it is
    one of ``eos_ids``, else the first of them."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos if eos in eos_ids else eos_ids[0]


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with every character taken as text: no special tokens added, and
    special-token text (``<|im_end|>``) split into ordinary tokens.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        text: any string (empty gives ``[]``)."""
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def encode_tag(tokenizer: Any, source: str) -> list[int]:
    """Token ids of a tag's source (``<sync/>``, ``<promise topic="a" tokens="10"/>``): the
    added special token whose text it is when the tokenizer has one, else its text's tokens.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        source: the tag exactly as written."""
    return list(tokenizer.encode(source, add_special_tokens=False))


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Text of ``ids`` with special tokens kept (tags may be special tokens) and no clean-up of
    spaces, so decoding is the inverse of :func:`encode_text` on byte-level BPE tokenizers."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def hidden_special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the special tokens whose text a response leaves out (vLLM's default
    ``skip_special_tokens=True``): every token the tokenizer calls special (its special tokens:
    BOS, EOS, padding, the chat template's ``<|im_start|>`` and the like, and every added token
    flagged special, such as Llama 3's ``<|start_header_id|>``), except a tag's: a PASTA-LANG
    piece (:data:`~pasta_engine.lang.grammar.TAG_PIECES`: the tokens ``--tag-tokens`` adds, also
    flagged special) or a text some dialect reads as markup (Multiverse's ``<Path>``, ...), which
    the interpreter must see; and a byte-fallback piece (``<0xE6>``, special in some
    SentencePiece tokenizers), which is a byte of text.

    Args:
        tokenizer: a ``transformers`` tokenizer (one without these attributes hides nothing)."""
    from .dialect import DIALECT_NAMES, get_dialect
    from .grammar import TAG_PIECES

    special: dict[int, str] = {}
    for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(t, "special", False):
            special[int(i)] = str(getattr(t, "content", t))
    ids = list(getattr(tokenizer, "all_special_ids", None) or [])
    texts = list(getattr(tokenizer, "all_special_tokens", None) or [])
    for i, text in zip(ids, texts) if len(ids) == len(texts) else ():
        special.setdefault(int(i), str(text))
    dialects = []
    for name in DIALECT_NAMES:
        try:
            dialects.append(get_dialect(name))
        except Exception:  # noqa: BLE001 - a dialect this install lacks reads nothing as markup
            continue

    def is_text(text: str) -> bool:  # a tag's piece, or a byte-fallback piece (``<0xE6>``: a byte of text)
        return (text in TAG_PIECES or _BYTE_PIECE.fullmatch(text) is not None
                or any(type(item) is not Text for d in dialects for item in d.parse(text)))

    return frozenset(i for i, text in special.items() if not is_text(text))


def _markers(n: int, messages: Sequence[dict[str, str]]) -> list[str]:
    """Strings that occur in no message, one per message, to find contents in a template."""
    taken = "".join(m.get("content", "") for m in messages)
    base = "\u2063PASTA{}\u2063"
    salt = 0
    while True:
        out = [base.format(f"{salt}_{i}") for i in range(n)]
        if not any(m in taken for m in out):
            return out
        salt += 1


def encode_prompt(tokenizer: Any, messages: Sequence[dict[str, str]], special_tokens: str = "text") -> list[int]:
    """Token ids of a chat: the tokenizer's chat template with the generation prompt added.

    Args:
        tokenizer: a ``transformers`` tokenizer; without a chat template the contents are
            joined by blank lines and end with one.
        messages: ``[{"role": ..., "content": ...}, ...]``.
        special_tokens: ``"text"``: special-token text inside a message's content stays text
            (the template is rendered with a marker for each content, its own parts are
            tokenized with control tokens, each content with :func:`encode_text`); ``"control"``:
            the rendered string is tokenized whole, so such text becomes control tokens (what
            ``apply_chat_template(..., tokenize=True)`` does).

    Raises ValueError for an unknown ``special_tokens``."""
    if special_tokens not in ("text", "control"):
        raise ValueError(f"special_tokens must be 'text' or 'control', got {special_tokens!r}")
    contents = [m["content"] for m in messages]
    if not getattr(tokenizer, "chat_template", None):
        joined = "\n\n".join(contents) + "\n\n"
        if special_tokens == "control":
            return list(tokenizer.encode(joined, add_special_tokens=False))
        return encode_text(tokenizer, joined)
    if special_tokens == "control":
        rendered = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    marks = _markers(len(messages), messages)
    marked = [{**m, "content": mk} for m, mk in zip(messages, marks)]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    rest = rendered
    for mk, content in zip(marks, contents):
        head, sep, rest_after = rest.partition(mk)
        if not sep:  # the template transformed the content: tokenize the real rendering as text parts
            real = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
            return list(tokenizer.encode(real, add_special_tokens=False))
        ids += list(tokenizer.encode(head, add_special_tokens=False)) if head else []
        ids += encode_text(tokenizer, content)
        rest = rest_after
    if rest:
        ids += list(tokenizer.encode(rest, add_special_tokens=False))
    return ids


@dataclass
class ForcedChunk:
    """A forked thread's tokens in a replay when it forks threads of its own (a nesting
    dialect; a chunk that forks nothing is a plain list of ids).

    Attributes:
        ids: the tokens it samples (content, its fork markers, then its closing tag when the
            trace closes it), without the text the interpreter inserts.
        chunks: per branch its own fork markers start, in order: that branch's chunk (ids or
            a ForcedChunk), or None for a branch without a chunk in the trace.
        spliced: the same thread decoded inline (what its parent writes when the fork is
            refused): ``ids`` with each branch's inserted text and spliced tokens, and each
            join's inserted text, in place."""

    ids: list[int]
    chunks: list["list[int] | ForcedChunk | None"]
    spliced: list[int]


@dataclass
class ThreadTokens:
    """One thread of a trace tree in tokens (a nesting dialect: :meth:`~.dialect.BaseDialect.split_tree`).

    Attributes:
        ids: the tokens it samples (its text, tags and fork markers; a child's closing tag
            when the trace closes it), without inserted text.
        header: the tokens inserted before its first sample (a child's header).
        forks: per fork marker: the number of ``ids`` up to and including it, its branches
            (None: no chunk in the trace) and the tokens its join inserts.
        spliced: ``ids`` with every branch (header then its own ``spliced``) and join text in
            place: what one thread decodes for it inline (its own header not included)."""

    ids: list[int]
    header: list[int]
    forks: list[tuple[int, list["ThreadTokens | None"], list[int]]]
    spliced: list[int]

    def forced(self) -> "list[int] | ForcedChunk":
        """What the interpreter forces for this thread as a child: its ids, or a
        :class:`ForcedChunk` when it forks threads of its own."""
        if not self.forks:
            return self.ids
        chunks = [None if b is None else b.forced() for _, bs, _ in self.forks for b in bs]
        return ForcedChunk(self.ids, chunks, self.spliced)


def _tokenize_tree(tokenizer: Any, t: TraceThread) -> ThreadTokens:
    """A trace thread's tokens: text runs tokenized as text, each tag apart (as
    :func:`_encode_segments` does), branches recursively."""
    ids: list[int] = []
    spliced: list[int] = []
    forks: list[tuple[int, list[ThreadTokens | None], list[int]]] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            x = encode_text(tokenizer, "".join(run))
            ids.extend(x)
            spliced.extend(x)
            run.clear()

    for it in t.items:
        if isinstance(it, TraceFork):
            flush()
            branches = [None if b is None else _tokenize_tree(tokenizer, b) for b in it.branches]
            join = encode_tag(tokenizer, it.join_insert) if it.join_insert else []
            forks.append((len(ids), branches, join))
            for b in branches:
                if b is not None:
                    spliced.extend(b.header + b.spliced)
            spliced.extend(join)
        elif it[0] == "text":
            run.append(it[1])
        else:
            flush()
            x = encode_tag(tokenizer, it[1])
            ids.extend(x)
            spliced.extend(x)
    flush()
    return ThreadTokens(ids, encode_tag(tokenizer, t.header) if t.header else [], forks, spliced)


@dataclass
class AnnotatedTokens:
    """An annotated response in tokens, canonically (see the module docstring).

    Attributes:
        main_ids: the main thread's tokens: the response without its chunks (promise and sync
            tags kept), no end-of-sequence token.
        chunk_ids: per promise, in order: the child's tokens (content then ``</async>`` when the
            chunk is closed), without the ``<async>`` the interpreter inserts; None for a
            promise without a chunk.
        open_ids: the tokens of ``<async>``.
        promise_ends: per promise, the number of main tokens up to and including its tag.
        spliced_ids: the same content in reading order (each chunk's ``open_ids + chunk_ids``
            right after its promise's tokens): what one thread decodes sequentially.
        canonical: the annotated text these tokens decode to (the input, with whitespace
            between a promise and its ``<async>`` moved into the chunk).
        diagnostics: what :func:`~pasta_engine.lang.tags.split_threads` noted (stray or
            malformed tags, kept as text).
        tree: the main thread as a tree of threads, for a nesting dialect (its ``chunk_ids``
            are then the main thread's branches, a :class:`ForcedChunk` for one that forks);
            None otherwise."""

    main_ids: list[int]
    chunk_ids: list[list[int] | None]
    open_ids: list[int]
    promise_ends: list[int]
    spliced_ids: list[int]
    canonical: str
    diagnostics: list[str] = field(default_factory=list)
    tree: ThreadTokens | None = None


def _encode_segments(tokenizer: Any, text: str, dialect: BaseDialect) -> tuple[list[int], list[int]]:
    """Tokens of ``text`` with each tag source tokenized apart from the text around it, and
    the token counts at which each promise tag (the dialect's fork marker) ends."""
    ids: list[int] = []
    promise_ends: list[int] = []
    run: list[str] = []  # text between tags: plain and tag-like (TagText) alike, tokenized as one
    for item in dialect.parse(text):
        if isinstance(item, Malformed):
            continue  # a diagnostic: its characters also come as Text
        if isinstance(item, Text):
            run.append(item.text)
            continue
        if run:
            ids += encode_text(tokenizer, "".join(run))
            run = []
        ids += encode_tag(tokenizer, item.raw)
        if isinstance(item, Promise):
            promise_ends.append(len(ids))
    if run:
        ids += encode_text(tokenizer, "".join(run))
    return ids, promise_ends


def tokenize_annotated(tokenizer: Any, annotated: str, dialect: Dialect = PASTA) -> AnnotatedTokens:
    """Tokenize an annotated response canonically (see the module docstring).

    Args:
        tokenizer: a ``transformers`` tokenizer.
        annotated: a response with the dialect's tags; anything malformed is text.
        dialect: the language (:class:`~pasta_engine.lang.dialect.Dialect`; its
            ``split_tree``, ``split_threads``, ``parse``, ``splice``, ``open_tag`` and
            ``close_tag``).

    Returns :class:`AnnotatedTokens`. Never raises on content; raises TypeError for a
    ``dialect`` that lacks a member of the protocol (:func:`~pasta_engine.lang.dialect.as_dialect`).
    A nesting dialect's trace (one whose ``split_tree`` gives a tree) is tokenized as a tree:
    each thread's text runs and tags as here, each branch's own forks nested
    (:class:`ThreadTokens`)."""
    dialect = as_dialect(dialect)
    tree = dialect.split_tree(annotated)
    if tree is not None:
        tt = _tokenize_tree(tokenizer, tree)
        chunks = [None if b is None else b.forced() for _, bs, _ in tt.forks for b in bs]
        ends = [end for end, bs, _ in tt.forks for _ in bs]
        return AnnotatedTokens(tt.ids, chunks, encode_tag(tokenizer, dialect.open_tag), ends, tt.spliced,
                               tree.text(), [], tt)
    th = dialect.split_threads(annotated, lead_whitespace="chunk")
    main_ids, promise_ends = _encode_segments(tokenizer, th.main, dialect)
    open_ids = encode_tag(tokenizer, dialect.open_tag)
    close_ids = encode_tag(tokenizer, dialect.close_tag)
    chunk_ids: list[list[int] | None] = []
    for c in th.chunks:
        if c.content is None:
            chunk_ids.append(None)
            continue
        ids, _ = _encode_segments(tokenizer, c.content, dialect)
        chunk_ids.append(ids + (close_ids if c.closed else []))
    spliced: list[int] = []
    at = 0
    for end, chunk in zip(promise_ends, chunk_ids):
        spliced += main_ids[at:end]
        at = end
        if chunk is not None:
            spliced += open_ids + chunk
    spliced += main_ids[at:]
    canonical = dialect.splice(th.main, th.chunks)
    return AnnotatedTokens(main_ids, chunk_ids, open_ids, promise_ends[: len(chunk_ids)], spliced, canonical,
                           list(th.diagnostics))
