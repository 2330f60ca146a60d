"""Incremental detokenization: token ids in, text deltas out (one per token).

The fast way (:class:`TokenBytes`): a table from token id to the bytes it stands for, built once
per tokenizer; a delta is the UTF-8 decoding of the new token's bytes appended to the bytes of
an incomplete character left over from earlier tokens (a UTF-8 tail carried across tokens). No
call into the tokenizer per token. Supported: byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen)
and SentencePiece-style ``▁`` pieces with ``<0xAB>`` byte fallback (Llama 2, Gemma). The table
checks itself against ``tokenizer.decode`` on sample texts when it is built and is not used
(None) for a tokenizer it does not reproduce exactly.

The general way (no table): each delta is the difference between decoding a short window of
recent ids with and without the new one (the scheme of vLLM's ``detokenize_incrementally``).

A special token that is no tag (``<|im_start|>``, BOS: the table's ``hidden`` ids,
:func:`~pasta_engine.lang.tokenization.hidden_special_ids`) gives no text, as vLLM's default
``skip_special_tokens=True`` decodes: a response's text never carries one. Tags, even those the
tokenizer has as special tokens, keep their text (the interpreter parses it). Without a table a
detokenizer hides only the ids it is given (``hidden``); the supported tokenizers (byte-level BPE
and SentencePiece) all have one.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Collection, Sequence

__all__ = ["Decode", "TokenBytes", "token_bytes_for", "token_bytes_table", "IncrementalDetokenizer"]

Decode = Callable[[Sequence[int]], str]

#: Texts a table must reproduce exactly (through every prefix) before it is trusted.
_CHECK_TEXTS = (
    "Hello world, it's 3.14 — ünïcödé 日本語のテキスト 🙌\n\n\tdef f(x):\n        return x  # ok",
    ' leading space, <promise topic="a" tokens="10"/><async>chunk</async><sync/> trailing  ',
    "Multiple   spaces\r\nand\u00a0nbsp, emoji 👩‍👩‍👧 and Ωmega.",
)


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode map (printable stand-ins for every byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenBytes:
    """Token id -> the bytes it decodes to.

    Args:
        table: bytes per token id (index = id).
        strip_first_space: the decoder drops one leading space of a whole text (SentencePiece's
            dummy prefix), so the first delta of a stream loses it too.
        replace_per_byte: invalid UTF-8 becomes one U+FFFD per byte (the byte-fallback decoder),
            instead of one per maximal invalid subsequence (byte-level BPE, Python's ``replace``).
        hidden: ids whose text an :class:`IncrementalDetokenizer` over this table leaves out (the
            special tokens that are no tags: :func:`~pasta_engine.lang.tokenization.hidden_special_ids`);
            ``table`` still holds their bytes (a logprob's ``bytes``, the grammar's masks)."""

    def __init__(self, table: list[bytes], strip_first_space: bool = False, replace_per_byte: bool = False,
                 hidden: Collection[int] = frozenset()):
        self.table = table
        self.strip_first_space = strip_first_space
        self.replace_per_byte = replace_per_byte
        self.hidden = frozenset(int(i) for i in hidden)

    def __getitem__(self, token_id: int) -> bytes:
        return self.table[token_id]

    def __len__(self) -> int:
        return len(self.table)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "TokenBytes | None":
        """The table of a ``transformers`` fast tokenizer, or None when its decoder is not one
        this module reproduces exactly (checked on sample texts); its ``hidden`` ids are the
        tokenizer's special tokens that are no tags."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        decoder = repr(backend.decoder)
        n = len(tokenizer)
        tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
        added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        table: list[bytes] = []
        strip = False
        if decoder.startswith("ByteLevel"):
            dec = _byte_level_decoder()
            for i, tok in enumerate(tokens):
                if i in added:
                    table.append(added[i].encode("utf-8"))
                elif tok is None:
                    table.append(b"")
                else:
                    try:
                        table.append(bytes(dec[c] for c in tok))
                    except KeyError:
                        return None
        elif "▁" in decoder or "Metaspace" in decoder:
            strip = "Strip" in decoder or "prepend_scheme" in decoder
            for i, tok in enumerate(tokens):
                if tok is not None and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                    try:
                        table.append(bytes([int(tok[3:5], 16)]))
                    except ValueError:
                        table.append(tok.encode("utf-8"))
                elif i in added:
                    table.append(added[i].encode("utf-8"))
                elif tok is None:
                    table.append(b"")
                else:
                    table.append(tok.replace("▁", " ").encode("utf-8"))
        else:
            return None
        from .tokenization import hidden_special_ids

        out = cls(table, strip, replace_per_byte="ByteFallback" in decoder, hidden=hidden_special_ids(tokenizer))
        return out if out._reproduces(tokenizer) else None

    def decode(self, data: bytes, final: bool = False) -> tuple[str, bytes]:
        """UTF-8 text of ``data`` and the bytes of an incomplete last character kept for later
        (none when ``final``: they become U+FFFD), invalid bytes replaced as the tokenizer does."""
        out: list[str] = []
        i, n = 0, len(data)
        while i < n:
            try:
                out.append(data[i:].decode("utf-8"))
                return "".join(out), b""
            except UnicodeDecodeError as e:
                out.append(data[i : i + e.start].decode("utf-8"))
                bad_lo, bad_hi = i + e.start, i + e.end
                if e.reason == "unexpected end of data" and not final:
                    return "".join(out), data[bad_lo:]
                if e.reason == "unexpected end of data":
                    bad_hi = n
                out.append("\ufffd" * (bad_hi - bad_lo) if self.replace_per_byte else
                           data[bad_lo:bad_hi].decode("utf-8", errors="replace"))
                i = bad_hi
        return "".join(out), b""

    def _reproduces(self, tokenizer: Any) -> bool:
        for text in _CHECK_TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            detok = IncrementalDetokenizer(None, self, hidden=())
            got = ""
            for k, t in enumerate(ids):
                got += detok.push(t)
                want = tokenizer.decode(ids[: k + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                # a prefix that ends inside a character decodes to U+FFFD, and a byte-fallback
                # decoder then replaces the whole byte run: compare where the prefix is whole
                if "\ufffd" not in want and got + detok.pending_text() != want:
                    return False
            if got + detok.flush() != tokenizer.decode(ids, skip_special_tokens=False,
                                                        clean_up_tokenization_spaces=False):
                return False
        return True


_TABLES: "weakref.WeakKeyDictionary[Any, tuple[int | None, TokenBytes | None]]" = weakref.WeakKeyDictionary()


def token_bytes_for(tokenizer: Any) -> TokenBytes | None:
    """:meth:`TokenBytes.from_tokenizer`, built once per tokenizer object (cached) and again
    when tokens were added to it in place since (its ``len`` grew: an adapter's tag tokens)."""
    try:
        hit = _TABLES.get(tokenizer)
    except TypeError:  # not weak-referenceable: no cache
        return TokenBytes.from_tokenizer(tokenizer)
    size = _vocab_size(tokenizer)
    if hit is not None and hit[0] == size:
        return hit[1]
    table = TokenBytes.from_tokenizer(tokenizer)
    _TABLES[tokenizer] = (size, table)
    return table


def _vocab_size(tokenizer: Any) -> int | None:
    """Tokens ``tokenizer`` has, added ones included (``len``), or None for one without a
    length (a test double): its cached table is then never rebuilt."""
    try:
        return len(tokenizer)
    except TypeError:
        return None


def token_bytes_table(tokenizer: Any) -> list[bytes]:
    """Bytes each token id of ``tokenizer`` decodes to: :func:`token_bytes_for`'s table, or, for
    a tokenizer it does not reproduce, each id decoded alone (UTF-8; a byte token that is part of
    a character comes out as U+FFFD's bytes, which is enough to classify tokens as text or
    digits)."""
    table = token_bytes_for(tokenizer)
    if table is not None:
        return table.table
    return [tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode("utf-8")
            for i in range(len(tokenizer))]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta per pushed token.

    A token that ends inside a UTF-8 character yields ``""``; its text arrives with a later
    token; :meth:`flush` returns what is still held back (an incomplete character decodes as
    U+FFFD). A hidden id (a special token that is no tag) yields ``""`` and changes nothing else,
    as if it had not been pushed. After every push that ends on a whole character, the deltas so
    far plus :meth:`pending_text` equal the tokenizer's decoding of all ids pushed but the hidden
    ones (nothing emitted is ever taken back). One exception: where a byte-fallback tokenizer (Llama-2's SentencePiece
    ``<0x..>`` tokens) was given invalid UTF-8, its decoder replaces every byte of the run of
    byte tokens and this replaces only the invalid sequences (``"\ufffd\n"`` for E6 then 0A
    where ``decode`` gives two U+FFFD); a token id past the tokenizer decodes to nothing.

    Args:
        decode: ``ids -> str`` with special tokens decoded to their text (used without a table).
        table: a :class:`TokenBytes` for the tokenizer (the fast way), or None.
        hidden: ids whose text is left out; None (default): the table's ``hidden`` ids (none
            without a table).

    Attributes:
        ids: the ids pushed, the hidden ones left out.
    """

    def __init__(self, decode: Decode | None, table: TokenBytes | None = None, *,
                 hidden: Collection[int] | None = None):
        if decode is None and table is None:
            raise ValueError("IncrementalDetokenizer needs a decode function or a TokenBytes table")
        self._decode = decode
        self._table = table
        self._hidden = (table.hidden if table is not None else frozenset()) if hidden is None else frozenset(hidden)
        self.ids: list[int] = []
        self._tail = b""  # bytes of an incomplete character (table mode)
        self._started = False  # a table stream has emitted text (for the dummy-prefix strip)
        self._prefix = 0  # start of the decode window (no table)
        self._read = 0  # ids before this have been emitted (no table)

    def push(self, token_id: int) -> str:
        """Append one token id; return the text it completes (possibly empty; always for a
        hidden id)."""
        token_id = int(token_id)
        if token_id in self._hidden:
            return ""
        self.ids.append(token_id)
        if self._table is not None:
            table = self._table.table
            # an id past the tokenizer (a model's vocabulary rows padded past it, e.g. Qwen2.5's
            # 152064 for 151665 tokens) decodes to nothing, as tokenizer.decode has it
            data = self._tail + (table[token_id] if 0 <= token_id < len(table) else b"")
            try:  # whole characters (the common case); else TokenBytes.decode keeps the tail
                text, self._tail = data.decode("utf-8"), b""
            except UnicodeDecodeError:
                text, self._tail = self._table.decode(data)
            if text and not self._started:
                self._started = True
                if self._table.strip_first_space and text.startswith(" "):
                    text = text[1:]
            return text
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.ids)
            return delta
        return ""

    @property
    def mid_character(self) -> bool:
        """Whether the ids pushed so far end inside a UTF-8 character: its first bytes are held
        back until a later token completes it (a flush now would give U+FFFD)."""
        if self._table is not None:
            return bool(self._tail)
        return self._read < len(self.ids) and self._decode(self.ids[self._prefix :]).endswith("\ufffd")

    def pending_text(self) -> str:
        """What :meth:`flush` would return now, without flushing."""
        if self._table is not None:
            if not self._tail:
                return ""
            text, _ = self._table.decode(self._tail, final=True)
            if not self._started and self._table.strip_first_space and text.startswith(" "):
                text = text[1:]
            return text
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        return self._decode(self.ids[self._prefix :])[len(prefix_text) :]

    def flush(self) -> str:
        """Text of ids not yet emitted (an incomplete character decodes as U+FFFD)."""
        text = self.pending_text()
        if self._table is not None:
            self._tail = b""
            self._started = self._started or bool(text)
        else:
            self._prefix = self._read = len(self.ids)
        return text
