"""PASTA-LANG tags as added tokens, and the grammar the sampler enforces with them (no torch).

Each fixed piece of PASTA-LANG can be one token of the tokenizer (docs/DESIGN.md section 2):

====================  ==========================================
piece                 role
====================  ==========================================
``<promise topic="``  opens a promise (main thread only)
``" tokens="``        ends the topic, starts the predicted length
``"/>``               closes the promise (also ordinary text)
``<async>``           opens a chunk (the interpreter inserts it)
``</async>``          closes a chunk (async threads only)
``<sync/>``           barrier (main thread only)
====================  ==========================================

The text the model writes and the user reads stays the paper's syntax (Jin et al., ICML 2025,
arXiv 2502.11517, section 3): a piece token decodes to exactly its text, so the tag parser
(:mod:`pasta_engine.lang.tags`) reads tags the same way whether they came as pieces or as text.
A promise ``<promise topic="Sleep" tokens="10"/>`` is then 6 tokens on SmolLM2
(``<promise topic="``, ``Sleep``, ``" tokens="``, ``1``, ``0``, ``"/>``) instead of 17.

:func:`add_tag_tokens` adds the pieces a tokenizer lacks as special tokens (so user text and
prose that contains ``<async>`` still tokenizes as text: :func:`~pasta_engine.lang.tokenization.encode_text`
splits special tokens) and :func:`tag_tokens_of` finds them in a tokenizer that has them.

Grammar: with the pieces as tokens, what a thread may write next depends on where it is, and the
sampler masks the rest (:class:`GrammarState`, one row of a ``[states, vocab]`` mask per state,
applied to a whole step's logits in one tensor operation by the model runner):

* main thread, outside a tag: no ``</async>``, no ``<async>`` (the interpreter writes it), no
  ``" tokens="``; once the fork cap is reached, no ``<promise topic="`` either;
* async thread (inside a chunk): no ``<promise topic="`` (no nesting), no ``<sync/>``, no
  ``<async>``, no ``" tokens="``; with a tail (``Limits.chunk_clean_end``), no ``</async>`` and
  no end-of-sequence while the chunk is empty, its text stops at a colon, a comma or a
  semicolon, or its last line is a bare list marker (:func:`chunk_may_end`; ``CHUNK_OPEN``): "Some popular items include:" and nothing
  after, the defect blind readers named in forked answers (a chunk at its cap mid-sentence is the
  interpreter's to finish, :func:`ends_sentence`);
* inside a promise's topic: only tokens whose text holds none of ``" < > newline`` (at least one;
  the first holds a letter or a non-ASCII byte, so a topic is never a bare number), then
  ``" tokens="``; end-of-sequence is masked until the tag closes; a topic of
  :data:`MAX_TOPIC_BYTES` bytes (UTF-8) or more must end (the token that reaches the cap may
  carry it past, by that token's bytes; the masks are per state, not per byte left); a topic
  equal to one already promised in the same response (:func:`topic_key`: case, spacing and
  punctuation ignored) may not end there
  (``TOPIC_TAKEN``: it must say something more), so siblings are never promised the same topic;
  a token that starts with a UTF-8 continuation byte is topic text only right after the first
  bytes of a character, and there nothing else is: a token that starts with as many
  continuation bytes as the character still needs, or fewer and nothing else
  (``TOPIC_CONT1`` to ``TOPIC_CONT3``, set by the interpreter from its detokenizer and the
  tokens' bytes; without a bytes table, ``TOPIC_CONT``: any number); a character begun at the
  byte cap is finished first, so such a topic may run a few bytes over it: a topic never holds
  U+FFFD, as one did on the README's sample prompt (and, with a token of two continuation bytes
  after a two-byte lead, on SmolLM2's vocabulary);
* a topic's first word, with ``Limits.independent_topics`` (``TOPIC_OPENING``, set by the
  interpreter): as ``TOPIC_EMPTY``, and no token that is a word leaning on what came before
  (:data:`LEANING_WORDS`: "Another", "Furthermore", "This", "Finally", ...). A chunk opens with
  its topic's words (83% of the shipped adapter's chunks), so a chunk promised "Another
  challenge" opens by leaning on a sibling its thread cannot see (issue 30; masking them raised
  the forks passing the lexical independence test from 70% to 93%, but did not read better
  blind, so it is off by default: bench/results/leaning-topics-smollm2-cpu/);
* inside the length: digits only (at least one, the first not ``0``), then ``"/>``; a length of
  :data:`MAX_LENGTH_DIGITS` digits or more must end (the token that reaches it may carry it past:
  a digit token holds at most :data:`MAX_DIGIT_TOKEN` digits, so a length never has more digits
  than the tag parser reads, :data:`~pasta_engine.lang.tags.MAX_TOKENS_DIGITS`; GPT-2-style
  vocabularies have tokens such as ``0000``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Sequence

from .tags import MAX_TOKENS_DIGITS, is_empty_list_item

__all__ = [
    "PROMISE_OPEN",
    "PROMISE_LENGTH",
    "PROMISE_CLOSE",
    "TAG_PIECES",
    "MAX_TOPIC_BYTES",
    "MAX_LENGTH_DIGITS",
    "MAX_DIGIT_TOKEN",
    "TagTokens",
    "add_tag_tokens",
    "tag_tokens_of",
    "GrammarState",
    "grammar_state",
    "topic_cont_state",
    "topic_problem",
    "topic_key",
    "ends_sentence",
    "chunk_may_end",
    "state_masks",
]

PROMISE_OPEN = '<promise topic="'
PROMISE_LENGTH = '" tokens="'
PROMISE_CLOSE = '"/>'
#: The fixed pieces of PASTA-LANG, each one token in a tokenizer that has them.
TAG_PIECES = (PROMISE_OPEN, PROMISE_LENGTH, PROMISE_CLOSE, "<async>", "</async>", "<sync/>")
#: A promise topic this long (bytes, UTF-8) must end: the sampler then allows only ``" tokens="``.
#: The annotators write topics of at most 32 characters (``pasta_engine.tools.annotate.TOPIC_CHARS``),
#: so a learned model never needs more; every topic token is on the main thread's critical path.
#: Bytes, not characters: a byte-level tokenizer spends a token on at least one byte, so the cap
#: bounds the topic's tokens too (32 emoji of 4 bytes would be about 100 tokens, and the learned
#: model once wrote them).
MAX_TOPIC_BYTES = 32
#: A predicted length this many digits long must end: the sampler then allows only ``"/>``.
MAX_LENGTH_DIGITS = 4
#: The most digits one length token may hold: the token that reaches :data:`MAX_LENGTH_DIGITS`
#: may carry the length past it, but never past what the tag parser reads
#: (:data:`~pasta_engine.lang.tags.MAX_TOKENS_DIGITS`), else the promise would be lost.
MAX_DIGIT_TOKEN = MAX_TOKENS_DIGITS - MAX_LENGTH_DIGITS + 1


@dataclass(frozen=True)
class TagTokens:
    """The token id of each piece (see the module docstring)."""

    promise_open: int
    promise_length: int
    promise_close: int
    async_open: int
    async_close: int
    sync: int

    @property
    def ids(self) -> tuple[int, ...]:
        """The six ids, in :data:`TAG_PIECES` order."""
        return (self.promise_open, self.promise_length, self.promise_close, self.async_open, self.async_close,
                self.sync)

    def as_dict(self) -> dict[str, int]:
        """``piece text -> id`` (what an adapter's manifest records)."""
        return dict(zip(TAG_PIECES, self.ids))


def _single_id(tokenizer: Any, piece: str) -> int | None:
    ids = tokenizer.encode(piece, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def tag_tokens_of(tokenizer: Any) -> TagTokens | None:
    """The piece tokens of ``tokenizer`` (a ``transformers`` tokenizer), or None when any piece
    is not one token (a tokenizer without the added tokens: tags are written as text)."""
    ids = [_single_id(tokenizer, p) for p in TAG_PIECES]
    if any(i is None for i in ids) or len(set(ids)) != len(ids):
        return None
    return TagTokens(*ids)  # type: ignore[arg-type]


def add_tag_tokens(tokenizer: Any) -> TagTokens:
    """Add every piece that is not yet one token to ``tokenizer`` as a special token (in place;
    special so that :func:`~pasta_engine.lang.tokenization.encode_text` keeps such text in user
    prompts and prose as text), in :data:`TAG_PIECES` order. Idempotent.

    Returns the pieces' ids. The model's embeddings must then have ``len(tokenizer)`` rows
    (``resize_token_embeddings``). Raises ValueError when the tokenizer still does not encode
    each piece as one token (a tokenizer whose normalizer rewrites the pieces)."""
    from tokenizers import AddedToken

    missing = [p for p in TAG_PIECES if _single_id(tokenizer, p) is None]
    if missing:
        tokenizer.add_tokens([AddedToken(p, special=True, normalized=False, lstrip=False, rstrip=False)
                              for p in missing], special_tokens=True)
    tags = tag_tokens_of(tokenizer)
    if tags is None:
        raise ValueError(f"the tokenizer does not encode the PASTA-LANG pieces {TAG_PIECES} as one token each "
                         "after adding them")
    return tags


class GrammarState(enum.IntEnum):
    """Where a sampling thread is in the grammar; the index of its row in :func:`state_masks`.

    ``FREE``: no mask (sequential mode, replay, or a tokenizer without the piece tokens).
    ``TOPIC_CONT1``-``TOPIC_CONT3``: inside a topic's UTF-8 character that needs that many more
    continuation bytes; ``TOPIC_CONT``: inside one, the count unknown."""

    FREE = 0
    MAIN = 1
    MAIN_NO_FORK = 2
    CHUNK = 3
    TOPIC_EMPTY = 4
    TOPIC = 5
    TOPIC_FULL = 6
    LENGTH_EMPTY = 7
    LENGTH = 8
    LENGTH_FULL = 9
    TOPIC_TAKEN = 10
    CHUNK_OPEN = 11
    TOPIC_CONT = 12
    TOPIC_OPENING = 13
    TOPIC_CONT1 = 14
    TOPIC_CONT2 = 15
    TOPIC_CONT3 = 16


#: Words that lean on what came before when they open a text: connectives, anaphora, sequence
#: words (the single words of the independence measurement's leaning openings,
#: :mod:`pasta_engine.tools.annotate_independent`). ``TOPIC_OPENING`` masks every token whose
#: text, stripped and lower-cased, is one of them.
LEANING_WORDS = frozenset(
    "now then next finally lastly also another other additionally furthermore moreover however but and so thus "
    "therefore overall this these that those it its they their he she his her such similarly likewise after "
    "afterwards once remember meanwhile again still instead otherwise repeat step".split())


def topic_key(topic: str) -> str:
    """A topic as :func:`grammar_state` compares it with the topics already promised: its words
    lower-cased, joined by one space (``"Dining Drawers:"`` and ``"dining  drawers"`` are one)."""
    return " ".join(re.findall(r"\w+", topic.lower()))


#: Characters that end a sentence, and what may close around its end (quotes, brackets, emphasis).
_SENTENCE_END = ".!?\u2026"
_CLOSERS = "\"')]*_`\u201d\u2019"


def ends_sentence(tail: str) -> bool:
    """Whether a chunk whose text ends with ``tail`` (its last characters, tags left out) may end:
    its last line is finished (``tail`` ends with a newline after some text) or its last
    non-space character ends a sentence (``. ! ? …``, possibly followed by closing quotes,
    brackets or emphasis: ``"Yes."``, ``(see below.)``, ``**Done!**``). False for an empty
    chunk, for one that stops at a colon, a comma or inside a sentence, and for one whose last
    line is an empty list item (``"...\n\n1."``: :func:`chunk_may_end`)."""
    if not tail.strip() or _ends_on_bare_marker(tail):
        return False
    if tail.endswith("\n"):
        return True
    return tail.rstrip().rstrip(_CLOSERS)[-1:] in tuple(_SENTENCE_END)


#: The last characters after which a chunk may not end: it announced more (a list, a clause).
_OPENERS = ":,;"


def chunk_may_end(tail: str) -> bool:
    """Whether a chunk whose text ends with ``tail`` (its last characters, tags left out) may end
    there: not when it is empty, not when its last non-space character is ``:``, ``,`` or
    ``;`` (it announced more than it wrote), and not when its last line is an empty list item
    (:func:`~pasta_engine.lang.tags.is_empty_list_item`: ``"...\n\n1."``, ``"- "``; the item it
    opened would reach the reader empty; a year alone on its last line, ``"1949."``, reads the
    same and goes on too). A chunk that ends without a full stop ("...for every budget") may
    end: forcing it on taught nothing and, on a degenerate chunk, made it repeat itself to the
    token limit."""
    text = tail.rstrip()
    return bool(text) and text[-1] not in _OPENERS and not _ends_on_bare_marker(text)


def _ends_on_bare_marker(tail: str) -> bool:
    """Whether the last line of ``tail`` (trailing spaces and newlines left out) is only list
    markers (:func:`~pasta_engine.lang.tags.is_empty_list_item`): one regex match on a few
    characters, per chunk and step where the grammar holds chunks open."""
    return is_empty_list_item(tail.rstrip().rpartition("\n")[2])


def _cont_fits(token: bytes, need: int) -> bool:
    """Whether ``token`` may follow the first bytes of a UTF-8 character that needs ``need`` more:
    it starts with exactly ``need`` continuation bytes (0x80-0xBF), or is fewer of them only."""
    run = 0
    while run < len(token) and 0x80 <= token[run] <= 0xBF:
        run += 1
    return run == need or 0 < run == len(token) < need


def topic_cont_state(held: bytes) -> GrammarState:
    """The state of a topic that ends inside a UTF-8 character, from the bytes its thread wrote
    last (the character's first bytes; the last four bytes suffice): ``TOPIC_CONT1``,
    ``TOPIC_CONT2`` or ``TOPIC_CONT3`` by the continuation bytes the character still needs, or
    ``TOPIC_CONT`` (any token that starts with a continuation byte) when ``held`` does not end
    inside a character (the bytes are unknown)."""
    run = 0
    for b in reversed(held[-4:]):
        if 0x80 <= b <= 0xBF:
            run += 1
            continue
        size = 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 0
        need = size - 1 - run
        if 1 <= need <= 3:
            return (GrammarState.TOPIC_CONT1, GrammarState.TOPIC_CONT2, GrammarState.TOPIC_CONT3)[need - 1]
        break
    return GrammarState.TOPIC_CONT


def topic_problem(topic: str, taken: set[str]) -> str | None:
    """Why ``topic`` is not one these masks let a model write (the annotators' check of what they
    ask a model to learn), or None when it is: empty; a ``"``, ``<``, ``>`` or newline; a first
    character that is no letter (``TOPIC_EMPTY`` takes only a first token holding a letter or a
    non-ASCII byte); over :data:`MAX_TOPIC_BYTES` UTF-8 bytes; or a :func:`topic_key` in
    ``taken`` (the keys of the topics promised before it in the answer: ``TOPIC_TAKEN``)."""
    if not topic.strip():
        return "an empty topic"
    if any(c in topic for c in '"<>\n'):
        return f"the topic {topic!r} holds a quote, < or > or a newline"
    first = topic.lstrip()[0]
    if not (first.isalpha() or ord(first) > 127):  # the grammar's first topic token holds a letter
        return f"the topic {topic!r} does not open with a letter"
    if len(topic.encode()) > MAX_TOPIC_BYTES:
        return f"the topic {topic!r} is over the grammar's {MAX_TOPIC_BYTES} bytes"
    if topic_key(topic) in taken:
        return f"the topic {topic!r} was promised before in the answer"
    return None


def grammar_state(is_main: bool, pending: str, can_fork: bool = True,
                  taken: Collection[str] = (), tail: str | None = None) -> GrammarState:
    """The state of a pasta-mode thread from the tag parser's held-back text.

    Args:
        is_main: the main thread (else an async thread).
        pending: :attr:`~pasta_engine.lang.tags.TagParser.pending` (a partial tag, or ``""``).
        can_fork: the request may still fork (below its fork cap).
        taken: :func:`topic_key` of each topic already promised in the response: a topic equal
            to one of them is ``TOPIC_TAKEN`` (it may not end yet), unless it is full.
        tail: an async thread's own text so far, tags left out (its last few characters
            suffice): a chunk whose text :func:`chunk_may_end` refuses is ``CHUNK_OPEN`` (it
            may not end yet); None: no such rule (``CHUNK``).

    A partial promise written as text tokens (``<prom``) is not constrained: only what follows a
    ``<promise topic="`` prefix is (the piece token writes exactly that prefix), and only while
    it is what the pieces write: a topic (no ``"``, which topic text never holds) and then
    digits. Text tokens that went past the topic's quote (``topic=""`` as one token) or put
    anything but digits in the length leave the tag unconstrained (``MAIN``): a state never
    allows what the parser rejects there, nor holds the thread in a tag that can only end
    malformed."""
    if not is_main:
        return GrammarState.CHUNK_OPEN if tail is not None and not chunk_may_end(tail) else GrammarState.CHUNK
    # the parser holds back a broken partial tag before a promise too ("<" then the piece): the
    # promise is what follows the piece (a topic holds no "<", so it is the last one)
    at = pending.rfind(PROMISE_OPEN)
    if at < 0:
        return GrammarState.MAIN if can_fork else GrammarState.MAIN_NO_FORK
    rest = pending[at + len(PROMISE_OPEN):]
    topic, sep, digits = rest.partition(PROMISE_LENGTH)
    if '"' in topic or (digits and not (digits.isascii() and digits.isdigit())):
        # text tokens wrote past the topic's closing quote or into the length ('=""' is one
        # token of SmolLM2's): no piece wrote this, so it is unconstrained as any text-written tag
        return GrammarState.MAIN if can_fork else GrammarState.MAIN_NO_FORK
    if not sep:
        if not topic:
            return GrammarState.TOPIC_EMPTY
        if len(topic.encode("utf-8")) >= MAX_TOPIC_BYTES:
            return GrammarState.TOPIC_FULL
        return GrammarState.TOPIC_TAKEN if taken and topic_key(topic) in taken else GrammarState.TOPIC
    if not digits:
        return GrammarState.LENGTH_EMPTY
    return GrammarState.LENGTH_FULL if len(digits) >= MAX_LENGTH_DIGITS else GrammarState.LENGTH


def state_masks(tags: TagTokens, token_bytes: Sequence[bytes], vocab: int,
                eos_ids: Iterable[int]) -> list[tuple[bool, list[int]]]:
    """What each :class:`GrammarState` lets a thread sample, as ``(allow, ids)`` per state in
    state order: ``allow=False`` forbids ``ids`` (everything else allowed), ``allow=True``
    allows only ``ids``. The model runner turns them into a ``[states, vocab]`` bool mask once.

    Args:
        tags: the piece tokens.
        token_bytes: bytes each token id decodes to (``TokenBytes.table``); ids past its end
            (padding rows of the LM head) count as neither topic text nor digits.
        vocab: the logits' width (the LM head's rows; may exceed ``len(token_bytes)``).
        eos_ids: end-of-sequence ids (never allowed inside a tag).

    Raises ValueError when a state would allow nothing (a vocabulary without digit tokens)."""
    eos = set(int(e) for e in eos_ids)
    pieces = set(tags.ids)
    n = min(vocab, len(token_bytes))
    text_ok = [i for i in range(n) if token_bytes[i] and i not in pieces and i not in eos
               and not any(c in token_bytes[i] for c in (b'"', b"<", b">", b"\n"))]
    # a token whose first byte continues a UTF-8 character (0x80-0xBF) is topic text only right
    # after the first bytes of one (TOPIC_CONT; TOPIC_CONT1-3: as many as the character still
    # needs, or fewer and nothing else: one more is U+FFFD too); anywhere else it decodes as U+FFFD
    cont = [i for i in text_ok if 0x80 <= token_bytes[i][0] <= 0xBF]
    cont_set = set(cont)
    topic_ok = [i for i in text_ok if i not in cont_set]
    digits = [i for i in range(n) if token_bytes[i] and i not in pieces and i not in eos
              and token_bytes[i].isdigit() and token_bytes[i].isascii()
              and len(token_bytes[i]) <= MAX_DIGIT_TOKEN]  # a length the parser reads (MAX_DIGIT_TOKEN)
    # a topic starts with a letter (ASCII, or any non-ASCII byte: a letter of another script)
    topic_first = [i for i in topic_ok if re.search(rb"[A-Za-z\x80-\xff]", token_bytes[i])]
    digits_first = [i for i in digits if not token_bytes[i].startswith(b"0")]
    leaning = {i for i in topic_first if token_bytes[i].decode("utf-8", "replace").strip().lower() in LEANING_WORDS}
    if not topic_first or not digits_first:
        raise ValueError("the vocabulary has no topic-text or no digit tokens: the promise grammar cannot be enforced")
    # outside a promise, its length and close pieces are stray tag text (a chunk that wrote
    # `1. 20"/>` eight times showed it: bench/results/request-penalty-smollm2-cpu/)
    main_never = [tags.async_open, tags.async_close, tags.promise_length, tags.promise_close]
    chunk_never = [tags.promise_open, tags.sync, tags.async_open, tags.promise_length, tags.promise_close]
    out: list[tuple[bool, list[int]]] = [
        (False, []),  # FREE
        (False, main_never),  # MAIN
        (False, main_never + [tags.promise_open]),  # MAIN_NO_FORK
        (False, chunk_never),  # CHUNK
        (True, topic_first),  # TOPIC_EMPTY
        (True, topic_ok + [tags.promise_length]),  # TOPIC
        (True, [tags.promise_length]),  # TOPIC_FULL
        (True, digits_first),  # LENGTH_EMPTY
        (True, digits + [tags.promise_close]),  # LENGTH
        (True, [tags.promise_close]),  # LENGTH_FULL
        (True, topic_ok),  # TOPIC_TAKEN
        (False, chunk_never + [tags.async_close, *sorted(eos)]),  # CHUNK_OPEN
        (True, cont or topic_ok),  # TOPIC_CONT (a vocabulary without such tokens never gets here)
        (True, [i for i in topic_first if i not in leaning] or topic_first),  # TOPIC_OPENING (never empty)
        # TOPIC_CONT1, TOPIC_CONT2, TOPIC_CONT3 (never empty)
        *[(True, [i for i in cont if _cont_fits(token_bytes[i], k)] or cont or topic_ok) for k in (1, 2, 3)],
    ]
    assert len(out) == len(GrammarState)
    return out
