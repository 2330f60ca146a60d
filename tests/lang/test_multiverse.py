"""The Multiverse dialect (pasta_engine/lang/multiverse.py; Yang et al. 2025, arXiv 2506.09991):
its parser (malformed input is text, no tag text in the clean text, a partial tag at the end
left out and reported), its trace trees, and its replay through the interpreter, scheduler and
block manager (no model: forced tokens) in both modes, nested blocks included: replay text ==
the dialect's clean text, decode steps == the critical path at unlimited width, every KV page
back. The forward on the tiny model is in tests/engine/test_nested_forks.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_engine.config import Limits, PositionPolicy, SamplingParams
from pasta_engine.core.block_manager import BlockManager
from pasta_engine.core.request import Request, interpreter_factory
from pasta_engine.core.replay import replay_script
from pasta_engine.lang.dialect import Dialect, Markup, TextParser, get_dialect
from pasta_engine.lang.multiverse import MULTIVERSE, GoalFork, MultiverseDialect, path_header
from pasta_engine.lang.tags import AsyncClose, Malformed, TagText, Text
from pasta_engine.lang.tokenization import eos_token_ids
from pasta_engine.metrics import critical_path

from sample_traces import NESTED_MULTIVERSE  # tests/sample_traces.py
from test_tokenization import run_forced  # same folder, on sys.path

M = MULTIVERSE

TRACE = ("Intro.\n<Parallel><Goal><Outline>1: a</Outline><Outline>2: b</Outline></Goal>\n"
         "<Path>\n1: first point\n</Path>\n<Path>\n2: second point\n</Path>\n"
         "<Conclusion>\nSo both.\n</Conclusion>\n</Parallel>\nBye")
NESTED = NESTED_MULTIVERSE  # tests/sample_traces.py


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def dry_run(tok, annotated: str, mode: str, limits: Limits | None = None, width: int | None = None):
    """Replay ``annotated`` in Multiverse through interpreter, scheduler and block manager with
    forced tokens; checks every KV page comes back. Returns the finished request."""
    limits = limits or Limits(max_threads=width, max_forks=64)
    make, max_new = interpreter_factory(tok, [1, 2, 3], mode=mode, max_new_tokens=1, limits=limits,
                                        policy=PositionPolicy(), max_positions=None, eos_ids=eos_token_ids(tok),
                                        annotated_response=annotated, dialect=M)
    req = Request("r", 0, mode, SamplingParams(max_new_tokens=max_new), make)
    bm = BlockManager(4096, 4)
    run_forced(req, bm)
    assert bm.num_free == bm.num_pages  # every page back
    return req


def check_round_trip(tok, annotated: str, limits: Limits | None = None) -> None:
    want = M.clean_text(annotated)
    pasta = dry_run(tok, annotated, "pasta", limits)
    seq = dry_run(tok, annotated, "sequential", limits)
    p, s = pasta.result(), seq.result()
    assert p.text == want, (p.text, want)
    assert s.text == want, (s.text, want)
    assert s.token_ids == p.token_ids
    assert pasta.steps == critical_path(pasta.interp.structure())
    assert seq.steps == critical_path(seq.interp.structure()) == s.stats.tokens_decoded
    return pasta


# --------------------------------------------------------------------------- the interface


def test_multiverse_implements_the_interface():
    assert isinstance(M, Dialect) and isinstance(M, MultiverseDialect) and get_dialect("multiverse") is M
    assert isinstance(M.parser(), TextParser)
    assert (M.name, M.open_tag, M.close_tag, M.join_tag, M.nesting, M.fork_joins) == \
        ("multiverse", "<Path>", "</Path>", "<Conclusion>", True, True)
    assert path_header(2) == "<Path>\n2:"
    with pytest.raises(ValueError, match="i must be >= 1, got 0"):
        path_header(0)
    fork = GoalFork("", 0, "</Goal>", 10, ("1: a ", "2: b"))
    assert [(p.topic, h) for p, h in M.branches(fork)] == [("1: a", "<Path>\n1:"), ("2: b", "<Path>\n2:")]
    assert M.reserved_positions(fork, PositionPolicy(), Limits(), 3, 3, None) == (0, None)
    assert M.join_position(50, [60, 80, 70]) == 80 and M.join_position(90, [60]) == 90  # after the longest path
    # a path's thread: its inserted header opens it, its own </Path> closes it, a nested one does not
    p = M.parser()
    assert [type(e) for e in p.feed(path_header(1))] == [Markup]
    inner = p.feed("x <Parallel><Goal><Outline>o</Outline></Goal><Path>\n1:y</Path></Parallel>")
    assert [type(e) for e in inner if not isinstance(e, Text)] == [Markup, Markup, Markup, Markup, GoalFork, Markup,
                                                                  Markup, Markup]
    assert [type(e) for e in p.feed(" z</Path>")] == [Text, AsyncClose]


# --------------------------------------------------------------------------- the parser


def test_parse_marks_planning_and_layout_as_never_shown():
    items = M.parse(TRACE)
    shown = "".join(e.text for e in items if type(e) is Text)
    assert shown == M.clean_text(TRACE) == "Intro.\n first point\n second point\n\nSo both.\n\nBye"
    assert [e.raw for e in items if isinstance(e, Markup)][:3] == ["<Parallel>", "<Goal>", "<Outline>"]
    [fork] = [e for e in items if isinstance(e, GoalFork)]
    assert fork.outlines == ("1: a", "2: b") and TRACE[: fork.end].endswith("</Goal>")
    # the path headers (with their labels) are tags, not body
    assert "<Path>\n1:" in [e.raw for e in items if isinstance(e, Markup)]


def test_feeding_piece_by_piece_equals_the_whole_parse():
    for trace in (TRACE, NESTED, "a <Pathway> b <Path>\n12x", "x <Goal y> <Parallel><Goal></Goal></Parallel> z <"):
        p = M.parser()
        items = [e for ch in trace for e in p.feed(ch)] + p.finish()
        shown = "".join(e.text for e in items if type(e) is Text)
        assert shown == "".join(e.text for e in M.parse(trace) if type(e) is Text)
        # nothing is lost: text, tag-like text and tags rebuild the input
        assert "".join(e.text if isinstance(e, Text) else "" if isinstance(e, Malformed) else e.raw
                       for e in items) == trace


def test_malformed_input_is_text_and_never_shown():
    # words that begin like tags are text; broken tags and tags out of place are tag-like
    assert M.clean_text("a <Pathway> and <Goals> b") == "a <Pathway> and <Goals> b"
    items = M.parse("x <Path y> </Path> <Goal> <Conclusion>z</Conclusion>")
    assert [e.raw for e in items if isinstance(e, Malformed)] == ["<Path ", "</Path>", "<Goal>", "<Conclusion>",
                                                                  "</Conclusion>"]
    assert M.clean_text("x <Path y> </Path> <Goal> <Conclusion>z</Conclusion>") == "x  y>   z"
    assert [e.text for e in items if isinstance(e, TagText)] == ["<Path", "</Path>", "<Goal>", "<Conclusion>",
                                                               "</Conclusion>"]
    # a Path label that never completes: the tag, then its whitespace and digits as body
    assert M.clean_text("<Parallel><Goal><Outline>o</Outline></Goal><Path>\n12 apples</Path></Parallel>") \
        == "\n12 apples"


def test_a_partial_tag_at_the_end_is_left_out_and_reported(tok):
    for cut, kept in (("Hello <Para", "Hello "), ("Hi </Pa", "Hi "), ("a <", "a <")):
        items = M.parse(cut)
        assert M.clean_text(cut) == kept
        assert any(isinstance(e, Malformed) and "unterminated" in e.reason for e in items) == (kept != cut)
    # in a replay whose path is cut inside a tag: the interpreter notes it, the text has no tag text
    trace = "<Parallel><Goal><Outline>o</Outline></Goal><Path>\n1: body <Concl"
    assert M.clean_text(trace) == " body "
    pasta = check_round_trip(tok, trace)
    assert pasta.interp.n_forks == 1
    assert any("partial tag at its end left out of the clean text: '<Concl'" in d for d in pasta.interp.diagnostics)


@st.composite
def texts(draw):
    pieces = ["a", "b c", " ", "\n", "- ", "1. ", "word", "<", "<P", "<Pathway>", "x:y", "\u00e9t\u00e9"]
    return "".join(draw(st.lists(st.sampled_from(pieces), max_size=6)))


@st.composite
def blocks(draw, depth: int = 0):
    n = draw(st.integers(1, 3))
    outlines = "".join(f"<Outline>{i}: {draw(texts())}</Outline>" for i in range(1, n + 1))
    paths = []
    for i in range(1, draw(st.integers(0, n)) + 1):
        body = draw(texts())
        if depth < 1 and draw(st.booleans()):
            body += draw(blocks(depth + 1)) + draw(texts())
        close = "</Path>" if i < n or draw(st.booleans()) else ""
        paths.append(f"<Path>\n{i}:{body}{close}" if close else f"<Path>\n{i}:{body}</Path>")
    layout = draw(st.sampled_from(["", "\n"]))
    conclusion = draw(st.sampled_from(["", f"<Conclusion>{draw(texts())}</Conclusion>"]))
    return f"<Parallel>{layout}<Goal>{outlines}</Goal>{layout}{layout.join(paths)}{layout}{conclusion}</Parallel>"


@st.composite
def traces(draw):
    parts = [draw(texts())]
    for _ in range(draw(st.integers(0, 2))):
        parts += [draw(blocks()), draw(texts())]
    return "".join(parts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=traces())
def test_generated_traces_round_trip_in_both_modes(tok, trace):
    """Replay text == the dialect's clean text (pasta and sequential modes), decode steps == the
    critical path at unlimited width, nested blocks included, and every KV page back."""
    check_round_trip(tok, trace)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=traces(), depth=st.integers(1, 2), max_forks=st.integers(0, 4))
def test_caps_decode_blocks_inline_with_the_same_text(tok, trace, depth, max_forks):
    check_round_trip(tok, trace, Limits(max_threads=None, max_forks=max_forks, max_fork_depth=depth))


def test_a_path_that_ends_on_the_fork_of_a_nested_block_still_forks_it(tok):
    """A path whose last token opens a nested block (the trace ends inside it, or the path's cap
    is reached there) ends waiting for that block's paths, which need its fork token's KV: it
    flushes the token at once (pasta mode raised "must run with a fork or join but was not picked")."""
    ann = "<Parallel><Goal><Outline>1</Outline></Goal><Path><Parallel><Goal><Outline>2</Outline></Goal><Path>x"
    texts = {mode: dry_run(tok, ann, mode).result().text for mode in ("pasta", "sequential")}
    assert texts == {"pasta": "x", "sequential": "x"}


def test_split_threads_and_splice_are_inverse():
    th = M.split_threads(NESTED)
    assert [c.content is not None for c in th.chunks] == [True, True]  # the main thread's two paths
    assert (th.chunks[0].content, th.chunks[0].closed) == (" first\n", True)
    assert "<Path>" in th.chunks[1].content  # its own block stays in its text
    assert M.splice(th.main, th.chunks) == M.split_tree(NESTED).text()
    assert M.clean_text(M.splice(th.main, th.chunks)) == M.clean_text(NESTED)


def test_the_replay_structure_is_the_interpreters(tok):
    pasta = check_round_trip(tok, NESTED)
    it = pasta.interp
    script = replay_script(tok, NESTED, eos_token_ids(tok)[0], M)
    s = it.structure()
    assert (s.forks, s.parents, s.fork_syncs, s.syncs) == \
        (script.structure.forks, script.structure.parents, script.structure.fork_syncs, script.structure.syncs)
    assert s.inserted == script.structure.inserted
    assert critical_path(s) == pasta.steps
    # positions: the paths start right after </Goal>; the conclusion after the longest path
    main, p1, p2 = it.threads[0], it.threads[1], it.threads[2]
    assert p1.positions[0] == p2.positions[0] == main.positions[p1.fork_at - 1] + 1
    first_join = main.inserted_idx[0]
    assert main.positions[first_join] == max(p1.next_pos, p2.next_pos)
    assert [t.depth for t in it.threads] == [0, 1, 1, 2, 2]


def test_nesting_past_the_cap_decodes_inline(tok):
    pasta = check_round_trip(tok, NESTED, Limits(max_threads=None, max_fork_depth=1))
    assert pasta.interp.n_forks == 2
    assert any("fork depth cap 1 reached" in d for d in pasta.interp.diagnostics)
    flat = check_round_trip(tok, TRACE, Limits(max_threads=None, max_forks=1))
    assert flat.interp.n_forks == 0 and any("fork cap 1 reached" in d for d in flat.interp.diagnostics)


# --------------------------------------------------------------------------- the annotator

ANSWER = ("Here are tips:\n\n1. **Sleep well**: go to bed early.\n2. Walk daily - it helps.\n   - even short walks\n"
          "3. Eat well.\n\nIn short, be kind to yourself.")


def test_the_annotator_makes_one_path_per_item_and_keeps_the_answer():
    from pasta_engine.tools.annotate_multiverse import multiverse_trace

    trace = multiverse_trace(ANSWER, None)
    assert M.clean_text(trace) == ANSWER
    assert trace.startswith("Here are tips:\n\n<Parallel><Goal><Outline>1: Sleep well</Outline>"
                            "<Outline>2: Walk daily</Outline><Outline>3: Eat well</Outline></Goal>")
    assert "<Path>\n2:2. Walk daily - it helps.\n   - even short walks\n</Path>" in trace  # nested lines stay
    assert trace.endswith("<Conclusion>\n\nIn short, be kind to yourself.</Conclusion></Parallel>")
    [fork] = [e for e in M.parse(trace) if isinstance(e, GoalFork)]
    assert len(fork.outlines) == 3
    # answers without a list of two items, or with Multiverse tag text, stay as they are
    for text in ("No list here.", "1. only one item", "Use <Path> tags:\n- a\n- b"):
        assert multiverse_trace(text, None) == text
    # the largest list by tokens is the block's
    two = "- a\n- b\n\nThen:\n\n- a much longer item with many words\n- and another long one here"
    t2 = multiverse_trace(two, lambda s: len(s.split()))
    assert t2.startswith("- a\n- b\n\nThen:\n\n<Parallel>") and M.clean_text(t2) == two


def test_annotated_alpaca_eval_answers_replay_to_the_answer(tok, alpaca_outputs):
    import json

    from pasta_engine.tools.annotate_multiverse import multiverse_trace

    rows = json.loads(alpaca_outputs.read_text())[:40]
    forked = 0
    for row in rows:
        answer = row["output"]
        trace = multiverse_trace(answer, lambda s: len(tok.encode(s, add_special_tokens=False)))
        assert M.clean_text(trace) == answer
        if trace != answer:
            forked += 1
            pasta = dry_run(tok, trace, "pasta")
            assert pasta.result().text == answer
            assert pasta.interp.n_forks >= 2 and pasta.steps == critical_path(pasta.interp.structure())
    assert forked >= 15, forked  # most AlpacaEval answers hold a list


def test_a_path_closed_inside_a_nested_block_closes_the_block_too(tok):
    """A path that ends while a block it opened is still open (its end or cap came inside the
    nested goal): the ``</Path>`` the interpreter writes closes that block as well, so the
    parent's conclusion is shown; it was read as tag-like text inside the open goal, and the
    final text dropped the conclusion the stream had shown."""
    ann = ("<Parallel><Goal><Outline>o</Outline></Goal><Path>\n1:a<Parallel><Goal><Outline>x"
           "</Path><Conclusion>\nDone.</Conclusion></Parallel>")
    assert M.clean_text(ann) == "a\nDone."
    check_round_trip(tok, ann)
