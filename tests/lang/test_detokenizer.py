"""Incremental detokenization from a token-bytes table equals the tokenizer's own decoding of
every prefix, on SmolLM2's byte-level BPE and on a SentencePiece-style tokenizer (``▁`` pieces,
byte fallback, dummy prefix), with multi-byte characters split across tokens."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_engine.lang.detokenizer import IncrementalDetokenizer, TokenBytes, token_bytes_for

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Sleep well, eat well, walk every day.",
          '<promise topic="a" tokens="10"/><async>chunk</async><sync/>', "plain words and more words"] * 30


@pytest.fixture(scope="module")
def smol_tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def sp_tok():
    """A small SentencePiece-style BPE (Llama 2's layout): '▁' word pieces, byte fallback for
    anything unseen, a decoder that strips the dummy prefix."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def check_every_prefix(tok, table: TokenBytes, ids: list[int]) -> None:
    """Deltas plus what is held back equal the tokenizer's decoding of every prefix that ends on
    a whole character (one that ends inside a character decodes to U+FFFD; a byte-fallback
    decoder then replaces its whole byte run, which no incremental decoder can match without
    taking text back), and of the whole sequence."""
    detok = IncrementalDetokenizer(None, table)
    got = ""
    for k, t in enumerate(ids):
        got += detok.push(t)
        want = tok.decode(ids[: k + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if "\ufffd" not in want:
            assert got + detok.pending_text() == want, (k, got, want)
    assert got + detok.flush() == tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


TEXTS = st.lists(st.sampled_from(list("ab cé日本🙌\n\t<>/") + ["👩‍👩‍👧", "Ωmega", " the", "\u00a0", "word"]),
                 max_size=30).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_byte_level_table_equals_decode_on_every_prefix(smol_tok, text):
    table = token_bytes_for(smol_tok)
    assert table is not None and not table.strip_first_space
    check_every_prefix(smol_tok, table, smol_tok.encode(text, add_special_tokens=False))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_sentencepiece_table_equals_decode_on_every_prefix(sp_tok, text):
    table = token_bytes_for(sp_tok)
    assert table is not None and table.strip_first_space
    check_every_prefix(sp_tok, table, sp_tok.encode(text, add_special_tokens=False))


def test_a_character_split_across_tokens_waits_for_its_last_byte(smol_tok):
    ids = smol_tok.encode("日", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits this character
    detok = IncrementalDetokenizer(None, token_bytes_for(smol_tok))
    deltas = [detok.push(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "日"
    cut = IncrementalDetokenizer(None, token_bytes_for(smol_tok))
    cut.push(ids[0])
    assert cut.flush() == "\ufffd"  # as the tokenizer decodes a cut character


def test_special_tokens_and_the_fallback_without_a_table(smol_tok):
    end = smol_tok.convert_tokens_to_ids("<|im_end|>")
    table = token_bytes_for(smol_tok)
    assert table[end] == b"<|im_end|>" and end in table.hidden  # its bytes kept; its text hidden
    ids = smol_tok.encode("a 日 b", add_special_tokens=False) + [end]
    fast = IncrementalDetokenizer(None, table)
    decode = lambda x: smol_tok.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    slow = IncrementalDetokenizer(decode, hidden=table.hidden)
    assert "".join(fast.push(t) for t in ids) + fast.flush() == "".join(slow.push(t) for t in ids) + slow.flush()
    shown = IncrementalDetokenizer(decode)  # without a table nothing is hidden unless given
    assert "".join(shown.push(t) for t in ids) + shown.flush() == "a 日 b<|im_end|>"
    assert token_bytes_for(smol_tok) is table  # built once per tokenizer
    with pytest.raises(ValueError, match="needs a decode function"):
        IncrementalDetokenizer(None, None)


def test_unsupported_decoders_get_no_table():
    class NoBackend:
        pass

    assert TokenBytes.from_tokenizer(NoBackend()) is None


def test_an_id_past_the_tokenizer_decodes_to_nothing(smol_tok):
    """A model whose vocabulary rows are padded past its tokenizer (Qwen2.5: 152064 rows for
    151665 tokens) can sample such an id; the table raised IndexError inside the engine step."""
    ids = smol_tok.encode("Hello", add_special_tokens=False) + [len(smol_tok), len(smol_tok) + 7]
    fast = IncrementalDetokenizer(None, token_bytes_for(smol_tok))
    got = "".join(fast.push(t) for t in ids) + fast.flush()
    assert got == smol_tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == "Hello"


def test_a_special_token_that_is_no_tag_leaves_no_text(tiny_llama):
    """A sampled special token (``<|im_start|>``, EOS) gives no text, as vLLM's default
    ``skip_special_tokens=True`` decodes (the server's text, streamed or not, never carries one),
    also between the bytes of a character; a tag the tokenizer has as a special token (the
    PASTA-LANG pieces ``--tag-tokens`` adds) keeps its text: the interpreter parses it."""
    from transformers import AutoTokenizer

    from pasta_engine.lang.grammar import TAG_PIECES, add_tag_tokens
    from pasta_engine.lang.tokenization import encode_text, hidden_special_ids

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tags = add_tag_tokens(tok)
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    hidden = hidden_special_ids(tok)
    assert {start, end} <= hidden and not hidden & set(tags.ids)
    table = token_bytes_for(tok)
    assert table is not None and table.hidden == hidden and table[start] == b"<|im_start|>"
    sync = tok.convert_tokens_to_ids("<sync/>")
    assert "<sync/>" in TAG_PIECES and sync not in hidden
    char = encode_text(tok, "é")
    ids = encode_text(tok, "a") + [start] + char[:1] + [end] + char[1:] + [sync] + encode_text(tok, "b") + [start]
    detok = IncrementalDetokenizer(None, table)
    assert "".join(detok.push(t) for t in ids) + detok.flush() == "aé<sync/>b"


def test_a_lone_lt_before_a_tag_token_stays_in_the_clean_text(tiny_llama):
    """The model writes ``a <`` as text tokens and then the ``<promise topic="`` piece (an added
    token), or ``<`` then ``<sync/>`` / ``</async>`` tokens: the detokenized pieces, parsed as
    the interpreter parses them, keep the '<' in the clean text and leave the tags out."""
    from transformers import AutoTokenizer

    from pasta_engine.lang.grammar import add_tag_tokens
    from pasta_engine.lang.tags import AsyncClose, Malformed, Promise, Sync, TagParser, Text, clean_text, drop_empty_items
    from pasta_engine.lang.tokenization import encode_text

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tags = add_tag_tokens(tok)
    for before in ["a <", "a<", "a <<", "<"]:
        ids = (encode_text(tok, before) + [tags.promise_open] + encode_text(tok, "Sleep") + [tags.promise_length]
               + encode_text(tok, "10") + [tags.promise_close] + encode_text(tok, " b <") + [tags.sync]
               + encode_text(tok, " c<") + [tags.async_close] + encode_text(tok, " d"))
        detok, parser = IncrementalDetokenizer(None, token_bytes_for(tok)), TagParser()
        text, drops, items, shown = "", [], [], []
        for t in ids:
            for e in parser.feed(detok.push(t)):
                items.append(e)
                if type(e) is Text:
                    text += e.text
                elif not isinstance(e, Malformed):
                    drops.append(len(text))
            shown.append(drop_empty_items(text, drops, final=False))
        assert detok.flush() == "" and parser.finish() == []
        annotated = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        want = before + " b < c< d"
        assert drop_empty_items(text, drops) == clean_text(annotated) == want, (before, items)
        assert [type(e) for e in items if not isinstance(e, Text)] == [Promise, Sync, AsyncClose]
        assert all(want.startswith(s) for s in shown) and before in shown  # the '<' shows with the promise
