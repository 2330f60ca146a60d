"""Nested forks and k-way forks on the tiny model (issue 23 item 2): Multiverse replays through
the real engine (model, scheduler, block manager, attention over shared KV views) with replay
text == the dialect's clean text in both modes, decode steps == the critical path of the
structure at unlimited width (nested included), every KV page back after the requests, nesting
past the depth cap decoded inline, and the training forward (pasta_logprobs) == the replay's
log-probabilities."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from pasta_engine import Engine
from pasta_engine.config import Limits, SamplingParams
from pasta_engine.core.replay import replay_script
from pasta_engine.lang.multiverse import MULTIVERSE
from pasta_engine.lang.tokenization import eos_token_ids, replay_eos_id
from pasta_engine.metrics import critical_path, simulate_steps
from pasta_engine.train import pasta_logprobs

FLAT = ("Tips:\n<Parallel><Goal><Outline>1: sleep</Outline><Outline>2: walk</Outline><Outline>3: eat</Outline></Goal>"
        "<Path>\n1: Go to bed early, every day.\n</Path><Path>\n2: Walk daily.\n</Path><Path>\n3: Eat well.\n</Path>"
        "<Conclusion>\nThat is all.\n</Conclusion></Parallel>\nDone.")
NESTED = ("Plan:\n<Parallel><Goal><Outline>1: a</Outline><Outline>2: b</Outline></Goal>"
          "<Path>\n1: first, short\n</Path>"
          "<Path>\n2: second <Parallel><Goal><Outline>1: x</Outline><Outline>2: y</Outline></Goal>"
          "<Path>\n1: inner one</Path><Path>\n2: inner two is the longest path of all here</Path>"
          "<Conclusion>inner end</Conclusion></Parallel> after\n</Path>"
          "<Conclusion>\nSo.\n</Conclusion></Parallel>\nBye")
PROMPT = "Give me tips."


WORDS = st.lists(st.sampled_from(["sleep", "walk", "- item", "1. first", "\n", " ", "a<b", "<P", ":", "\u00e9"]),
                 max_size=5).map(" ".join)


@st.composite
def block(draw, depth: int):
    """A Multiverse block of 1 to 3 outlines, as many paths or fewer, each path perhaps
    holding a block of its own (``depth`` levels more)."""
    n = draw(st.integers(1, 3))
    outlines = "".join(f"<Outline>{i}: {draw(WORDS)}</Outline>" for i in range(1, n + 1))
    paths = ""
    for i in range(1, draw(st.integers(0, n)) + 1):
        inner = draw(block(depth - 1)) if depth > 0 and draw(st.booleans()) else ""
        paths += f"<Path>\n{i}: {draw(WORDS)}{inner}{draw(WORDS)}</Path>"
    conclusion = draw(st.sampled_from(["", "<Conclusion>" + draw(WORDS) + "</Conclusion>"]))
    return f"<Parallel><Goal>{outlines}</Goal>{paths}{conclusion}</Parallel>"


@st.composite
def multiverse_traces(draw):
    return draw(WORDS) + "".join(draw(block(2)) + draw(WORDS) for _ in range(draw(st.integers(1, 2))))


def unlimited(tiny_llama, **kw) -> Engine:
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4,
                                  limits=Limits(max_threads=None, **kw))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return unlimited(tiny_llama)


@pytest.mark.parametrize("trace", [FLAT, NESTED], ids=["flat", "nested"])
def test_replay_text_steps_and_pages(engine, trace):
    pool = engine.block_manager.pool
    want = MULTIVERSE.clean_text(trace)
    [p] = engine.replay([PROMPT], [trace], dialect="multiverse")
    [s] = engine.replay([PROMPT], [trace], mode="sequential", dialect="multiverse")
    assert p.text == want and s.text == want
    assert p.token_ids == s.token_ids[: len(p.token_ids)]
    script = replay_script(engine.tokenizer, trace, replay_eos_id(engine.tokenizer, eos_token_ids(engine.tokenizer)),
                           MULTIVERSE)
    assert p.stats.decode_steps == p.stats.critical_path == critical_path(script.structure)
    assert p.stats.decode_steps < s.stats.decode_steps == s.stats.tokens_decoded
    assert p.stats.forks == len(script.structure.forks) == (3 if trace is FLAT else 4)
    if trace is NESTED:
        assert script.structure.parents == [0, 0, 2, 2]  # the second path forks two of its own
    assert all(r == 0 for r in pool.refcount) and pool.num_free == pool.num_pages


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=multiverse_traces())
def test_generated_traces_replay_on_the_model(engine, trace):
    """Hypothesis: replay text == the dialect's clean text in pasta and sequential modes on the
    tiny model, decode steps == the critical path at unlimited width (nested blocks up to three
    levels, the default depth cap of 2 decoding the deepest inline), every KV page back."""
    pool = engine.block_manager.pool
    want = MULTIVERSE.clean_text(trace)
    [p] = engine.replay([PROMPT], [trace], dialect="multiverse")
    [s] = engine.replay([PROMPT], [trace], mode="sequential", dialect="multiverse")
    assert p.text == want and s.text == want
    assert p.stats.decode_steps == p.stats.critical_path
    assert all(r == 0 for r in pool.refcount) and pool.num_free == pool.num_pages


@pytest.mark.parametrize("trace", [FLAT, NESTED], ids=["flat", "nested"])
def test_width_limited_steps_follow_the_simulation(tiny_llama, trace):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4, limits=Limits(max_threads=2))
    [p] = engine.replay([PROMPT], [trace], dialect="multiverse")
    script = replay_script(engine.tokenizer, trace, replay_eos_id(engine.tokenizer, eos_token_ids(engine.tokenizer)),
                           MULTIVERSE)
    assert p.stats.max_width == 2
    assert p.stats.decode_steps == simulate_steps(script.structure, 2)
    if trace is FLAT:  # three paths at a width of two: one waits
        assert simulate_steps(script.structure, 2) > critical_path(script.structure)


def test_nesting_past_the_depth_cap_decodes_inline(tiny_llama):
    engine = unlimited(tiny_llama, max_fork_depth=1)
    [p] = engine.replay([PROMPT], [NESTED], dialect="multiverse")
    assert p.text == MULTIVERSE.clean_text(NESTED)
    assert p.stats.forks == 2  # the second path's block is its own text
    assert any("fork depth cap 1 reached" in d for d in p.diagnostics)
    assert p.stats.decode_steps == p.stats.critical_path
    pool = engine.block_manager.pool
    assert pool.num_free == pool.num_pages


@pytest.mark.parametrize("caps", [{}, {"max_fork_depth": 1}, {"max_forks": 3}, {"max_forks": 0}])
def test_a_nested_replays_budget_covers_what_it_samples(tiny_llama, caps):
    """A nested replay's budget (the server's bar for ``max_tokens``) is the tokens it samples
    when no fork can be refused, and with a cap that may refuse one (forks' order follows the
    schedule) the reading-order stream's, the most a replay samples: it always runs whole."""
    from pasta_engine.engine.input_processor import RequestInputs

    engine = unlimited(tiny_llama, **caps)
    need = engine.check_request(RequestInputs(PROMPT, SamplingParams(max_new_tokens=1), "pasta",
                                              annotated_response=NESTED, dialect="multiverse")).max_new_tokens
    [r] = engine.replay([PROMPT], [NESTED], dialect="multiverse")
    assert r.stats.finish_reason == "stop" and r.text == MULTIVERSE.clean_text(NESTED)
    seq = len(replay_script(engine.tokenizer, NESTED, replay_eos_id(engine.tokenizer, engine.eos_ids),
                            MULTIVERSE).sequential_ids)
    assert need == (r.stats.tokens_decoded if caps in ({}, {"max_forks": 0}) else seq) >= r.stats.tokens_decoded


@pytest.mark.parametrize("trace", [FLAT, NESTED], ids=["flat", "nested"])
def test_training_forward_equals_the_replay(tiny_llama, engine, trace):
    [res] = engine.replay([PROMPT], [trace], params=SamplingParams(return_logprobs=True), dialect="multiverse")
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids, lps = pasta_logprobs(hf, engine.tokenizer, PROMPT, trace, limits=Limits(max_threads=None),
                              dialect=MULTIVERSE)
    assert ids == res.token_ids
    assert [x is None for x in lps] == [x is None for x in res.logprobs]
    assert sum(x is None for x in lps) > 0  # path headers and the conclusion tags are inserted
    got = torch.tensor([x for x in lps if x is not None])
    want = torch.tensor([x for x in res.logprobs if x is not None])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


# --------------------------------------------------------------------------- the interpreter's tree rules

from pasta_engine.config import PositionPolicy  # noqa: E402
from pasta_engine.core.batch import KVJoin, SampledTokens  # noqa: E402
from pasta_engine.core.block_manager import BlockManager  # noqa: E402
from pasta_engine.core.interpreter import Interpreter  # noqa: E402
from pasta_engine.core.request import Request  # noqa: E402
from pasta_engine.core.scheduler import Scheduler  # noqa: E402
from pasta_engine.lang.dialect import PastaDialect  # noqa: E402


class NestingPasta(PastaDialect):
    """PASTA-LANG with nesting on: a promise in a chunk forks, a <sync/> in a chunk joins that
    chunk's own children (scoped joins), and a chunk's </async> ends it once its children end."""

    nesting = True


def scripted(scripts: dict[int, str], limits: Limits, dialect=None):
    """Decode with every thread's text scripted by thread id (characters as tokens, EOS 0 at
    the main thread's end), through scheduler and block manager. Returns (request, block
    manager, the step at which each thread was first seen ended)."""
    dialect = dialect or NestingPasta()
    enc = lambda s: [ord(c) for c in s]  # noqa: E731
    main_text = scripts[0]
    make = lambda: Interpreter([1, 2, 3], decode=lambda ids: "".join(chr(i) for i in ids), eos_ids=[0],  # noqa: E731
                               open_ids=enc(dialect.open_tag), close_len=len(dialect.close_tag), max_new_tokens=10_000,
                               limits=limits, policy=PositionPolicy(), dialect=dialect, encode=enc)
    req = Request("r", 0, "pasta", SamplingParams(max_new_tokens=10_000), make)
    bm = BlockManager(1024, 4)
    sched = Scheduler(bm, 1)
    sched.add(req)
    ended_at: dict[int, int] = {}
    step = 0
    while sched.has_unfinished():
        step += 1
        batch = sched.schedule()
        toks = []
        for s in batch.sampling:
            t = req.interp.threads[s.step.tid]
            text = scripts[t.tid] if t.tid else main_text
            k = t.n_sampled
            toks.append(ord(text[k]) if k < len(text) else 0)
        sched.postprocess(batch, SampledTokens(toks, [0.0] * len(toks)))
        for t in req.interp.threads:
            if t.ended and t.tid not in ended_at:
                ended_at[t.tid] = step
    return req, bm, ended_at


def test_a_chunk_forks_joins_its_own_children_and_ends_after_them():
    p = '<promise topic="{}" tokens="100"/>'
    scripts = {
        0: f"Main {p.format('x')} main goes on <sync/> after.",
        1: f"chunk {p.format('y')} <sync/> chunk after its own join {p.format('z')} bye</async>",
        2: "grandchild y, quite a long one</async>",
        3: "grandchild z, the longest of all of them by far</async>",
    }
    req, bm, ended_at = scripted(scripts, Limits(max_threads=None))
    it = req.interp
    assert [t.depth for t in it.threads] == [0, 1, 2, 2] and [t.parent and t.parent.tid for t in it.threads] == \
        [None, 0, 1, 1]
    s = it.structure()
    assert s.parents == [0, 1, 1] and s.fork_syncs[0] and s.syncs
    assert req.steps == critical_path(s)
    # thread 1 joined only its own first child at its <sync/>; its end waited for its second;
    # the main thread's join came after
    r = req.result()
    assert r.text == "Main chunk grandchild y, quite a long one  chunk after its own join grandchild z, the longest " \
                     "of all of them by far bye main goes on  after."
    assert bm.num_free == bm.num_pages
    # the child wrote its </async> while thread 3 still ran: it ended with it (its end joins its
    # children), and the main thread's join waited for both
    assert it.threads[1].finish == "close" and ended_at[1] == ended_at[3]
    assert it.main.n_sampled > it.main.syncs[0]
    assert "</async>" not in r.text and r.annotated_text.count("<async>") == 3
    t1, t2 = it.threads[1], it.threads[2]
    # the penalties' tokens: each ancestor's up to the fork, the chunk's own promise left out
    assert "".join(t1.pieces[t2.promise_from:t2.fork_at]) == p.format('y')
    assert it.seen_tokens(2) == [1, 2, 3] + it.main.tokens[: t1.fork_at] + t1.tokens[: t2.promise_from] + t2.tokens
    assert KVJoin(1, [2]) not in it.kv_ops  # applied: taken by the scheduler


def test_nesting_past_the_depth_cap_is_text_in_generation():
    p = '<promise topic="{}" tokens="10"/>'
    scripts = {0: f"Main {p.format('x')} go <sync/> end.", 1: f"chunk {p.format('y')} bye</async>"}
    req, bm, _ = scripted(scripts, Limits(max_threads=None, max_fork_depth=1))
    it = req.interp
    assert len(it.threads) == 2 and any("fork depth cap 1 reached" in d for d in it.diagnostics)
    assert req.result().text == "Main chunk  bye go  end."
    assert req.steps == critical_path(it.structure()) and bm.num_free == bm.num_pages


@pytest.mark.parametrize("trace", [FLAT, NESTED], ids=["flat", "nested"])
def test_streamed_text_is_prefix_stable_and_ends_as_the_clean_text(engine, trace):
    """The step API's reading-order text over a tree of threads: every output extends the
    previous one, and the last is the dialect's clean text; fork and join events name each
    thread's own parent."""
    rid = engine.add_request(PROMPT, annotated_response=trace, dialect="multiverse")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    text = ""
    for o in outs:
        assert o.request_id == rid and o.text == text + o.delta_text, (text, o.delta_text)
        text = o.text
    assert len({o.text for o in outs}) > 3
    assert outs[-1].text == outs[-1].result.text == MULTIVERSE.clean_text(trace)
    events = [e for o in outs for e in o.events]
    forks = {e.thread: e.parent for e in events if e.kind == "fork"}
    joins = {e.thread: e.parent for e in events if e.kind == "join"}
    assert forks == joins == ({1: 0, 2: 0, 3: 0} if trace is FLAT else {1: 0, 2: 0, 3: 2, 4: 2})


# --------------------------------------------------------------------------- the tree's critical path

from pasta_engine.metrics import ResponseStructure  # noqa: E402


def test_the_critical_path_of_a_tree_by_hand():
    # main: 10 tokens, forks A at its 2nd, joins at its 3rd; A: 5 tokens, forks G at its 1st and
    # ends without a join of its own; G: 8 tokens. Steps: main 1-3 (stalls), A 3-7, G 4-11; A's
    # end waits for G, so the main thread resumes at step 12: tokens 4..10 at steps 12-18.
    s = ResponseStructure(main_tokens=10, forks=[(2, 5), (1, 8)], syncs=[3], parents=[0, 1], fork_syncs=[[], []])
    assert critical_path(s) == 18
    assert simulate_steps(s, 1) == s.tokens == 23
    # a join of A's own at its 2nd token: A stalls there until G ends (step 11), then 3 more
    s2 = ResponseStructure(main_tokens=10, forks=[(2, 5), (1, 8)], syncs=[3], parents=[0, 1], fork_syncs=[[2], []])
    assert critical_path(s2) == 14 + 7  # A resumes at 12, ends at 14; main resumes at 15: 7 tokens, 15-21
    # without parents every child is the main thread's, as before (PASTA-LANG): G runs at steps
    # 2-9, A at 3-7, the main thread resumes at 10: tokens 4..10 at steps 10-16
    flat = ResponseStructure(main_tokens=10, forks=[(2, 5), (1, 8)], syncs=[3])
    assert critical_path(flat) == 16


@pytest.mark.parametrize("bad, match", [
    (dict(forks=[(1, 2)], parents=[1]), "fork 1 has parent 1: a parent comes before its child"),
    (dict(forks=[(1, 2), (3, 1)], parents=[0, 1]), r"fork \(3, 1\) outside thread 1 of 2 tokens"),
    (dict(forks=[(1, 2)], fork_syncs=[[3]]), "sync at 3 outside thread 1 of 2 tokens"),
    (dict(forks=[(1, 2)], parents=[0, 0]), "parents has 2 entries for 1 forks"),
])
def test_a_malformed_tree_is_refused_naming_what(bad, match):
    with pytest.raises(ValueError, match=match):
        critical_path(ResponseStructure(main_tokens=4, **bad))


def test_an_abort_at_any_step_of_a_nested_request_frees_every_page(tiny_engine):
    """Abort a nested Multiverse replay after k steps, for every k up to its end: whatever its
    threads are doing (children stalled at their own joins, a parent ending while its children
    run), every KV page is free once the abort's final output is returned, and the engine
    serves the next request (docs/DESIGN.md section 7)."""
    engine = tiny_engine
    total = engine.block_manager.num_free
    [full] = engine.replay([PROMPT], [NESTED], dialect="multiverse")
    steps = full.stats.decode_steps
    for k in range(1, steps + 1, max(1, steps // 12)):
        rid = engine.add_request(PROMPT, annotated_response=NESTED, dialect="multiverse")
        for _ in range(k):
            engine.step()
        engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.block_manager.num_free == total, k
    [again] = engine.replay([PROMPT], [NESTED], dialect="multiverse")
    assert again.text == full.text
