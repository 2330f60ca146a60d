"""The dialect interface (pasta_engine/lang/dialect.py): PASTA-LANG implements it with no change
(replay text == the dialect's clean text in both modes, decode steps == the critical path at
unlimited width, on generated annotated responses), and a second, toy dialect written here (an
APAR-like one: a fork marker after a list item's header) runs through the same interpreter,
scheduler and block manager by the interface alone, checked against threads computed by hand."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_engine.config import Limits, PositionPolicy, SamplingParams
from pasta_engine.core.block_manager import BlockManager
from pasta_engine.core.interpreter import Interpreter
from pasta_engine.core.replay import replay_script
from pasta_engine.core.request import Request
from pasta_engine.lang import tags
from pasta_engine.lang.detokenizer import token_bytes_for
from pasta_engine.lang.dialect import PASTA, Dialect, PastaDialect, TextParser
from pasta_engine.lang.grammar import grammar_state
from pasta_engine.lang.tags import AsyncClose, AsyncOpen, Chunk, Promise, TagText, Text, Threads
from pasta_engine.lang.tokenization import decode, encode_tag, eos_token_ids, replay_eos_id
from pasta_engine.metrics import ResponseStructure, critical_path

# the PASTA round-trip cases and strategy of test_tokenization.py (same folder, on sys.path)
from test_tokenization import CASES, README_TRACE, annotated_responses, run_forced, smol_tok, special_tok  # noqa: F401


def dry_run(tok, annotated: str, mode: str, dialect: Dialect, limits: Limits | None = None,
            policy: PositionPolicy | None = None):
    """Replay ``annotated`` in ``dialect`` through interpreter, scheduler and block manager
    (no model: forced tokens), everything language-specific taken from ``dialect``. Returns the
    finished request."""
    eos = eos_token_ids(tok)
    script = replay_script(tok, annotated, replay_eos_id(tok, eos), dialect)
    max_new = len(script.sequential_ids) + 1
    if mode == "pasta":
        forced_main, forced_chunks = script.forced_main, script.forced_chunks
    else:
        forced_main, forced_chunks = script.sequential_ids, None
    open_ids = encode_tag(tok, dialect.open_tag)
    close_len = len(encode_tag(tok, dialect.close_tag))
    table = token_bytes_for(tok)

    def make():
        return Interpreter([1, 2, 3], decode=lambda ids: decode(tok, ids), eos_ids=eos, open_ids=open_ids,
                           close_len=close_len, mode=mode, max_new_tokens=max_new,
                           limits=limits or Limits(max_threads=None, max_forks=64), policy=policy or PositionPolicy(),
                           forced_main=forced_main, forced_chunks=forced_chunks, token_bytes=table, dialect=dialect)

    req = Request("r", 0, mode, SamplingParams(max_new_tokens=max_new), make)
    bm = BlockManager(4096, 4)
    run_forced(req, bm)
    assert bm.num_free == bm.num_pages  # every page back
    return req, script


def check_dialect_round_trip(tok, annotated: str, dialect: Dialect) -> None:
    """Replay text == the dialect's clean text in both modes; both modes decode the same tokens;
    pasta decode steps == the critical path of what the interpreter decoded (unlimited width)."""
    want = dialect.clean_text(annotated)
    pasta, _ = dry_run(tok, annotated, "pasta", dialect)
    seq, _ = dry_run(tok, annotated, "sequential", dialect)
    p, s = pasta.result(), seq.result()
    assert p.text == want, (p.text, want)
    assert s.text == want, (s.text, want)
    assert s.token_ids == p.token_ids
    assert pasta.steps == critical_path(pasta.interp.structure())
    assert seq.steps == critical_path(seq.interp.structure()) == s.stats.tokens_decoded


# --------------------------------------------------------------------------- PASTA-LANG


def test_pasta_implements_the_interface_and_is_the_default():
    assert isinstance(PASTA, Dialect) and isinstance(PASTA, PastaDialect)
    assert isinstance(PASTA.parser(), TextParser)
    assert (PASTA.name, PASTA.open_tag, PASTA.close_tag, PASTA.nesting) == ("pasta", "<async>", "</async>", False)
    it = Interpreter([1], decode=lambda ids: "", eos_ids=[0], open_ids=[5], close_len=1)
    assert it.dialect is PASTA
    # the dialect's answers are the functions the engine called before it existed
    for text in CASES:
        assert PASTA.parse(text) == tags.parse(text)
        assert PASTA.clean_text(text) == tags.clean_text(text)
        th = PASTA.split_threads(text, "chunk")
        assert th == tags.split_threads(text, "chunk")
        assert PASTA.splice(th.main, th.chunks) == tags.splice(th.main, th.chunks)
    for pending in ("", "<", '<promise topic="a', '<promise topic="a" tokens="1'):
        for main in (True, False):
            assert PASTA.grammar_state(main, pending, True) == grammar_state(main, pending, True)


def test_pasta_positions_follow_the_position_policy():
    lim = Limits(max_promise_tokens=100)
    p = Promise("t", 30, tags.promise_tag("t", 30))
    assert PASTA.reserved_positions(p, PositionPolicy.parse("predicted"), lim, 1, 2, None) == (33, None)
    assert PASTA.reserved_positions(p, PositionPolicy.parse("constant:7"), lim, 1, 2, None) == (10, None)
    assert PASTA.reserved_positions(p, PositionPolicy.parse("none"), lim, 1, 2, None) == (0, None)
    assert PASTA.reserved_positions(p, PositionPolicy.parse("oracle"), lim, 1, 2, 12) == (13, None)
    big = Promise("t", 500, tags.promise_tag("t", 500))
    assert PASTA.reserved_positions(big, PositionPolicy.parse("predicted"), lim, 1, 2, None) == (
        103, "promise tokens=500 clamped to 100")
    assert PASTA.child_cap(Limits(async_min_cap=4, cap_factor=2.0), p) == Limits(async_min_cap=4,
                                                                                  cap_factor=2.0).chunk_cap(30)


@pytest.mark.parametrize("annotated", CASES)
def test_pasta_cases_round_trip_through_the_interface(smol_tok, special_tok, annotated):
    check_dialect_round_trip(smol_tok, annotated, PASTA)
    check_dialect_round_trip(special_tok, annotated, PASTA)


def test_pasta_steps_equal_the_scripts_critical_path(smol_tok):
    req, script = dry_run(smol_tok, README_TRACE, "pasta", PASTA)
    assert req.interp.structure() == script.structure
    assert req.steps == critical_path(script.structure) < script.structure.tokens


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(annotated=annotated_responses())
def test_any_pasta_response_round_trips_through_the_interface(smol_tok, special_tok, annotated):
    check_dialect_round_trip(smol_tok, annotated, PASTA)
    check_dialect_round_trip(special_tok, annotated, PASTA)


# --------------------------------------------------------------------------- a toy second dialect

FORK, CHILD, END = "⟨fork⟩", "⟨child⟩", "⟨end⟩"  # APAR's [Fork], the child's inserted token, its end
MARKERS = (FORK, CHILD, END)


class ToyParser:
    """Markers are ``⟨fork⟩``, ``⟨child⟩`` and ``⟨end⟩``; a fork's topic is its line so far (the
    list item's header). Per character: a marker split across pieces is held back."""

    def __init__(self) -> None:
        self._buf = ""
        self._count = 0
        self._line = ""

    @property
    def pending(self) -> str:
        return self._buf

    def _text(self, out: list, text: str) -> None:
        if text:
            out.append(Text(text))
            self._count += len(text)
            self._line = (self._line + text).rsplit("\n", 1)[-1]

    def feed_plain(self, text: str) -> bool:
        if self._buf or "⟨" in text:
            return False
        self._text([], text)
        return True

    def feed(self, piece: str) -> list:
        out: list = []
        s, self._buf = self._buf + piece, ""
        i = 0
        while i < len(s):
            j = s.find("⟨", i)
            if j < 0:
                self._text(out, s[i:])
                break
            self._text(out, s[i:j])
            rest = s[j:]
            m = next((m for m in MARKERS if rest.startswith(m)), None)
            if m is not None:
                self._count += len(m)
                if m == FORK:
                    out.append(Promise(self._line.strip(), 0, m, end=self._count))
                else:
                    out.append((AsyncOpen if m == CHILD else AsyncClose)(m, end=self._count))
                i = j + len(m)
            elif any(m.startswith(rest) for m in MARKERS):
                self._buf = rest
                break
            else:
                self._text(out, "⟨")
                i = j + 1
        return out

    def finish(self) -> list:
        buf, self._buf = self._buf, ""
        return [TagText(buf)] if buf else []


def toy_parse(text: str) -> list:
    p = ToyParser()
    return p.feed(text) + p.finish()


class ToyApar:
    """An APAR-like dialect: the main thread writes ``⟨fork⟩`` after a list item's header; the
    child (``⟨child⟩`` inserted) writes the item and ends at ``⟨end⟩``; the main thread goes on
    with the next item; everything joins at the end (no join marker). Each fork reserves a fixed
    8 positions for its content (plus the two markers), whatever the position policy."""

    name = "toy-apar"
    open_tag = CHILD
    close_tag = END
    nesting = False

    def parser(self) -> ToyParser:
        return ToyParser()

    def parse(self, text: str) -> list:
        return toy_parse(text)

    def grammar_state(self, is_main: bool, pending: str, can_fork: bool) -> int:
        return 0

    def child_cap(self, limits: Limits, fork: Promise) -> int:
        return 64

    def reserved_positions(self, fork, policy, limits, open_len, close_len, chunk_len):
        return open_len + close_len + 8, None

    def split_threads(self, annotated: str, lead_whitespace: str = "main") -> Threads:
        main: list[str] = []
        chunks: list[Chunk] = []
        body: list[str] | None = None
        after_fork = False
        for e in toy_parse(annotated):
            if body is not None:
                if isinstance(e, AsyncClose):
                    chunks[-1].content, body = "".join(body), None
                else:
                    body.append(e.text if isinstance(e, Text) else e.raw)
                continue
            if isinstance(e, AsyncOpen) and after_fork:
                body = []
            else:
                main.append(e.text if isinstance(e, Text) else e.raw)
                if isinstance(e, Promise):
                    chunks.append(Chunk(e.topic, 0, None))
            after_fork = isinstance(e, Promise)
        if body is not None:
            chunks[-1].content, chunks[-1].closed = "".join(body), False
        return Threads("".join(main), chunks)

    def splice(self, main: str, chunks) -> str:
        out, i = [], 0
        for e in toy_parse(main):
            out.append(e.text if isinstance(e, Text) else e.raw)
            if isinstance(e, Promise):
                c = chunks[i] if i < len(chunks) else None
                if c is not None and c.content is not None:
                    out.append(CHILD + c.content + (END if c.closed else ""))
                i += 1
        return "".join(out)

    def clean_text(self, annotated: str) -> str:
        return "".join(e.text for e in toy_parse(annotated) if type(e) is Text)


EOS_ID = 3


@dataclass
class ToyTokenizer:
    """One token per character (id ``ord(c) + 10``), a marker one token (0, 1, 2), EOS 3; the
    interface replay uses."""

    eos_token_id: int = EOS_ID

    def encode(self, text, add_special_tokens=False, split_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            m = next((k for k, m in enumerate(MARKERS) if text.startswith(m, i)), None)
            if m is not None and not split_special_tokens:
                ids.append(m)
                i += len(MARKERS[m])
            else:
                ids.append(ord(text[i]) + 10)
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(MARKERS[i] if i < 3 else "" if i == EOS_ID else chr(i - 10) for i in ids)


def toy(text: str) -> list[int]:
    return ToyTokenizer().encode(text)


TOY_TRACE = f"Tips:\n1. Sleep{FORK}{CHILD} early.{END}\n2. Walk{FORK}{CHILD} daily.{END}\nDone."


def test_the_toy_dialect_satisfies_the_interface():
    d = ToyApar()
    assert isinstance(d, Dialect) and isinstance(d.parser(), TextParser)
    th = d.split_threads(TOY_TRACE)
    assert th.main == f"Tips:\n1. Sleep{FORK}\n2. Walk{FORK}\nDone."
    assert [(c.topic, c.content) for c in th.chunks] == [("1. Sleep", " early."), ("2. Walk", " daily.")]
    assert d.splice(th.main, th.chunks) == TOY_TRACE
    # split across pieces, a marker is still one event
    p = ToyParser()
    got = [e for piece in ["1. a⟨fo", "rk", "⟩x⟨", "z"] for e in p.feed(piece)] + p.finish()
    assert got == [Text("1. a"), Promise("1. a", 0, FORK), Text("x"), Text("⟨"), Text("z")]


def test_a_toy_apar_trace_runs_through_the_interpreter_as_computed_by_hand():
    d = ToyApar()
    tok = ToyTokenizer()
    req, script = dry_run(tok, TOY_TRACE, "pasta", d)
    it = req.interp
    # the forced streams: the main thread without the items' bodies, each child its body and ⟨end⟩
    main_text = "Tips:\n1. Sleep" + FORK + "\n2. Walk" + FORK + "\nDone."
    assert script.forced_main == toy(main_text) + [EOS_ID]
    assert script.forced_chunks == [toy(" early." + END), toy(" daily." + END)]
    # threads: main + one child per list item, topics from the headers, forked at main tokens 15 and 24
    main, c1, c2 = it.threads
    assert [c.promise.topic for c in (c1, c2)] == ["1. Sleep", "2. Walk"]
    assert (c1.fork_at, c2.fork_at) == (15, 24)  # "Tips:\n1. Sleep" is 14 tokens, then ⟨fork⟩
    assert c1.tokens == toy(CHILD + " early." + END) and c2.tokens == toy(CHILD + " daily." + END)
    assert (c1.inserted, c1.n_sampled, c1.finish, c2.finish) == (1, 8, "close", "close")
    assert main.tokens == toy(main_text) + [EOS_ID] and main.finish == "eos"
    # positions: prompt 0..2; main 3..17 (the first ⟨fork⟩ at 17); child 1 right after, 18..26;
    # main skips 1 + 1 + 8 = 10: 28..36 (the second ⟨fork⟩ at 36); child 2 37..45; main 47..52, EOS 53
    assert main.positions == list(range(3, 18)) + list(range(28, 37)) + list(range(47, 54))
    assert c1.positions == list(range(18, 27)) and c2.positions == list(range(37, 46))
    # joins at the end only: no sync, the request stops when the main thread's EOS and both children are in
    assert it.syncs == [] and it.finish == "stop"
    # steps: main samples 31 tokens (steps 1..31); child 1 samples its 8 at steps 16..23, child 2,
    # forked by the token sampled at step 24, at steps 25..32: the request takes 32 steps
    st = it.structure()
    assert st == ResponseStructure(main_tokens=31, forks=[(15, 8), (24, 8)], syncs=[], inserted=2)
    assert st == script.structure
    assert req.steps == critical_path(st) == 32
    r = req.result()
    assert r.annotated_text == TOY_TRACE
    assert r.text == "Tips:\n1. Sleep early.\n2. Walk daily.\nDone."
    assert r.token_ids == toy(TOY_TRACE) + [EOS_ID]  # spliced: each item's child right after its ⟨fork⟩


def test_a_nesting_dialect_runs_with_its_fork_depth_capped():
    # the interpreter nests forks now (issue 23 item 2): a nesting dialect is accepted, and the
    # main thread is at depth 0, under any fork depth cap (Limits.max_fork_depth >= 1)
    class Nesting(ToyApar):
        nesting = True

    it = Interpreter([1], decode=lambda ids: "", eos_ids=[0], open_ids=[5], close_len=1, dialect=Nesting(),
                     limits=Limits(max_fork_depth=1))
    assert it.main.depth == 0 and it.main.is_main and it.dialect.nesting


def test_the_toy_dialect_round_trips_in_both_modes():
    check_dialect_round_trip(ToyTokenizer(), TOY_TRACE, ToyApar())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text("ab \n", max_size=5), st.text("xy .", max_size=6), st.booleans()), max_size=4),
       st.text("z\n", max_size=4))
def test_generated_toy_lists_round_trip(items, tail):
    ann = "".join(f"\n{i}. {h}{FORK}" + (CHILD + b + END if has else "") for i, (h, b, has) in enumerate(items)) + tail
    check_dialect_round_trip(ToyTokenizer(), ann, ToyApar())


def test_a_dialect_without_a_prompt_of_its_own_gets_none_and_pasta_gets_the_configured_one():
    from pasta_engine.lang.dialect import dialect_prompt
    from pasta_engine.lang.prompts import DEFAULT_PASTA_PROMPT, LEARNED_PASTA_PROMPT, NO_PROMPT

    assert dialect_prompt(PASTA, LEARNED_PASTA_PROMPT) is LEARNED_PASTA_PROMPT
    assert dialect_prompt(PastaDialect(), DEFAULT_PASTA_PROMPT) is DEFAULT_PASTA_PROMPT
    assert dialect_prompt(ToyApar(), LEARNED_PASTA_PROMPT) is NO_PROMPT
    assert NO_PROMPT.messages("hi") == [{"role": "user", "content": "hi"}]
