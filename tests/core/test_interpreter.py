"""Interpreter + scheduler + block manager driven by a scripted model runner (no weights, no torch).

The scripted runner picks tokens at random from a vocabulary of tag fragments, so decoding
writes random PASTA-LANG, well-formed or not. Every step it checks that each thread's view ends
with the thread's own new slots and only holds slots that were written before or are written
in this very step."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_engine.config import Limits, PositionPolicy, SamplingParams
from pasta_engine.core.block_manager import BlockManager
from pasta_engine.core import render
from pasta_engine.core.interpreter import Interpreter
from pasta_engine.core.request import Request
from pasta_engine.core.scheduler import SampledTokens, ScheduledBatch, Scheduler
from pasta_engine.metrics import critical_path, simulate_steps

PIECES = [
    "a", "b", " ", "\n", "<", ">", "/", "é"[:1], "<promise", ' topic="x"', ' tokens="', "1", "0", '"/>',
    '<promise topic="t" tokens="20"/>', '<promise topic="u" tokens="0"/>', "<sync/>", "</async>", "<async>",
    "async", "sync", "</", "- ", "1. ", "</async>\n", '"/>\n', "<EOS>",
]
EOS = PIECES.index("<EOS>")
VOCAB = len(PIECES)
WEIGHTS = [0.1 if i == EOS else 1.0 for i in range(VOCAB)]  # responses of ~200 tokens


def decode(ids):
    return "".join(PIECES[i] for i in ids if i != EOS)


def encode_pieces(text):
    """Greedy longest-match encoding over PIECES (only used for the fixed '<async>' tag)."""
    out, i = [], 0
    while i < len(text):
        best = max((j for j, p in enumerate(PIECES) if p and j != EOS and text.startswith(p, i)), key=lambda j: len(PIECES[j]))
        out.append(best)
        i += len(PIECES[best])
    return out


OPEN = encode_pieces("<async>")
CLOSE_LEN = len(encode_pieces("</async>"))


class ScriptedRunner:
    """Stands in for the model runner: checks the batch's KV layout, returns random tokens."""

    def __init__(self, rng: random.Random, bm: BlockManager):
        self.rng = rng
        self.bm = bm
        self.written: set[int] = set()
        alloc = bm.pool.alloc
        page_size = bm.page_size

        def tracking_alloc():
            p = alloc()
            self.written.difference_update(range(p * page_size, (p + 1) * page_size))
            return p

        bm.pool.alloc = tracking_alloc

    def run(self, batch: ScheduledBatch) -> SampledTokens:
        slots = [s for st_ in batch.threads for s in st_.slots]
        assert len(set(slots)) == len(slots), "two new tokens share a slot"
        now = self.written | set(slots)
        ps = self.bm.page_size
        for st_ in batch.threads:
            flat = [p * ps + o for _, pages, lens in st_.runs for p, n in zip(pages, lens) for o in range(n)]
            q_len = len(st_.step.tokens)
            assert flat[-q_len:] == st_.slots, "new tokens are not the end of the view"
            missing = set(flat) - now
            assert not missing, f"view reads unwritten slots {sorted(missing)[:5]}"
        self.written |= set(slots)
        toks = [st_.step.forced if st_.step.forced is not None else self.rng.choices(range(VOCAB), WEIGHTS)[0]
                for st_ in batch.sampling]
        return SampledTokens(toks, [0.0] * len(toks))


def run_scripted(seed: int, limits: Limits, max_new: int, n_requests: int = 1, pages: int = 256, page_size: int = 4,
                 on_step=None, mode: str = "pasta"):
    """Decode ``n_requests`` scripted requests to the end; ``on_step(reqs)`` after every step."""
    rng = random.Random(seed)
    bm = BlockManager(pages, page_size)
    runner = ScriptedRunner(rng, bm)
    sched = Scheduler(bm, max_running_requests=n_requests)
    reqs = []
    for i in range(n_requests):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 9))]

        def make(prompt=prompt):
            return Interpreter(prompt, decode=decode, eos_ids=[EOS], open_ids=OPEN, close_len=CLOSE_LEN, limits=limits,
                               max_new_tokens=max_new, mode=mode, encode=encode_pieces)

        r = Request(request_id=str(i), index=i, mode=mode, params=SamplingParams(max_new_tokens=max_new),
                    make_interpreter=make)
        sched.add(r)
        reqs.append(r)
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        if batch:
            sched.postprocess(batch, runner.run(batch))
        if on_step is not None:
            on_step(reqs)
    assert not sched.has_unfinished(), "scheduler did not finish"
    assert all(r.finished and r.finish_reason in ("stop", "length") for r in reqs)
    assert all(rc == 0 for rc in bm.pool.refcount), "KV pages leaked"
    assert bm.num_free == bm.num_pages
    return reqs


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    max_new=st.integers(1, 150),
    width=st.sampled_from([None, 1, 2, 3]),
    min_cap=st.integers(1, 12),
    max_forks=st.integers(0, 6),
    n_requests=st.integers(1, 3),
)
def test_fuzzed_tag_streams_never_break_the_engine(seed, max_new, width, min_cap, max_forks, n_requests):
    limits = Limits(max_threads=width, async_min_cap=min_cap, cap_factor=0.1, max_forks=max_forks)
    for r in run_scripted(seed, limits, max_new, n_requests):
        it = r.interp
        st_ = it.structure()
        assert it.total_sampled == st_.tokens <= max_new
        assert r.steps == simulate_steps(st_, width)
        if width is None:
            assert r.steps == critical_path(st_)
        sp = it.spliced()
        assert len(sp.ids) == len(sp.positions) == len(sp.threads)
        # every forked child ran at most its cap
        for t in it.threads[1:]:
            assert t.n_sampled <= t.cap
        # the widest step counts the threads whose tokens were kept: at the token budget, a thread
        # sampled in the last step but cut (a promised chunk that never ran) is no width
        assert r.max_width <= 1 + sum(1 for t in it.threads[1:] if t.finish != "not_run")


def test_preemption_under_a_small_cache_frees_everything():
    limits = Limits(max_threads=None, async_min_cap=4, cap_factor=0.5)
    reqs = run_scripted(7, limits, 80, n_requests=3, pages=40, page_size=4)
    assert sum(r.preemptions for r in reqs) > 0
    assert all(r.interp.done for r in reqs)


def make_interp(**kw):
    kw.setdefault("decode", decode)
    return Interpreter([0, 1], eos_ids=[EOS], open_ids=OPEN, close_len=CLOSE_LEN, **kw)


def pick(it: Interpreter):
    """The scheduler's width rule without a token budget: every flush and at most
    ``max_width`` sampling threads of the interpreter's demand, each with all its tokens."""
    width = it.max_width
    out = []
    for s in it.runnable_threads():
        if s.sample:
            if width is not None and width <= 0:
                continue
            width = None if width is None else width - 1
        out.append(s)
    return out


def feed_main(it: Interpreter, pieces: list[str]):
    for p in pieces:
        it.step_done(pick(it))
        it.take_kv_ops()
        it.on_token(0, PIECES.index(p))


@pytest.mark.parametrize(
    "policy, main_next",
    [("predicted", 3 + len(OPEN) + 20 + CLOSE_LEN), ("constant:7", 3 + len(OPEN) + 7 + CLOSE_LEN), ("none", 3)],
)
def test_positions_after_a_promise(policy, main_next):
    it = make_interp(policy=policy)
    feed_main(it, ["a", '<promise topic="t" tokens="20"/>'])
    # prompt at 0,1; "a" at 2; the promise token at 3 (forwarded next step)
    child = it.threads[1]
    assert child.promise.topic == "t"
    assert child.pending_pos == list(range(4, 4 + len(OPEN)))  # right after the promise
    assert it.main.pending_pos == [3]
    feed_main(it, ["b"])
    assert it.main.pending_pos == [main_next + 1]


def test_oracle_needs_replay_and_bad_settings_are_named():
    with pytest.raises(ValueError, match="oracle"):
        make_interp(policy="oracle")
    with pytest.raises(ValueError, match="position_policy='constant:x'"):
        PositionPolicy.parse("constant:x")
    with pytest.raises(ValueError, match="max_threads=0"):
        Limits(max_threads=0)
    with pytest.raises(ValueError, match="cap_factor"):
        Limits(cap_factor=float("nan"))
    with pytest.raises(ValueError, match="unknown mode"):
        make_interp(mode="fast")
    with pytest.raises(ValueError, match="empty prompt"):
        Interpreter([], decode=decode, eos_ids=[EOS], open_ids=OPEN, close_len=CLOSE_LEN)


def test_fork_cap_turns_promises_into_text():
    it = make_interp(limits=Limits(max_forks=1))
    feed_main(it, ['<promise topic="t" tokens="20"/>', '<promise topic="u" tokens="0"/>'])
    assert len(it.threads) == 2
    assert any("fork cap 1 reached" in d for d in it.diagnostics)


def test_sync_waits_then_joins():
    it = make_interp(limits=Limits(max_threads=None))
    feed_main(it, ['<promise topic="t" tokens="20"/>', "<sync/>"])
    assert it.main.status.value == "stalled"
    steps = pick(it)
    assert [s.tid for s in steps] == [1]  # only the child runs
    it.take_kv_ops()
    it.step_done(steps)
    it.on_token(1, PIECES.index("</async>"))
    ops = it.take_kv_ops()
    assert [type(e).__name__ for e in ops] == ["KVJoin"]  # the flush's slot is allocated when scheduled
    steps = pick(it)
    assert [(s.tid, s.sample) for s in steps] == [(1, False), (0, True)]


class PieceTokenizer:
    """The PIECES vocabulary behind the tokenizer interface replay uses."""

    eos_token_id = EOS

    def encode(self, text, add_special_tokens=False, split_special_tokens=False):
        return encode_pieces(text)

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return decode(ids)


def test_replay_script_structure_matches_the_interpreter():
    from pasta_engine.core.replay import replay_script

    ann = "b" + '<promise topic="t" tokens="20"/>' + "<async>ab</async>" + "a<sync/>b"
    script = replay_script(PieceTokenizer(), ann, EOS)
    assert script.structure.forks == [(2, len(encode_pieces("ab</async>")))]
    assert script.structure.syncs == [4]
    assert script.sequential_ids == encode_pieces('b<promise topic="t" tokens="20"/>') + OPEN + encode_pieces(
        "ab</async>"
    ) + encode_pieces("a<sync/>b") + [EOS]
    assert decode(script.sequential_ids) == ann
    # the interpreter, forced with the script, decodes exactly that structure in critical-path steps
    it = make_interp(limits=Limits(max_threads=None), forced_main=script.forced_main,
                     forced_chunks=script.forced_chunks)
    steps = 0
    while not it.done:
        todo = pick(it)
        it.take_kv_ops()
        it.step_done(todo)
        sampling = [s for s in todo if s.sample]
        steps += bool(sampling)
        for s in sampling:
            it.on_token(s.tid, s.forced)
    assert it.structure() == script.structure
    assert steps == critical_path(script.structure)
    assert it.spliced().ids == script.sequential_ids


def test_context_length_ends_the_request_with_length():
    it = make_interp(max_positions=6, limits=Limits(max_threads=None))
    feed_main(it, ["a", "b", "a"])  # prompt at 0,1; tokens at 2..4
    assert not it.done
    feed_main(it, ["b"])  # at position 5, the last: the request ends without a forward for position 6
    assert it.done and it.finish == "length" and it.runnable_threads() == []
    assert max(it.main.positions) == 5
    assert any("context length of 6" in d for d in it.diagnostics)
    # after a promise the main thread's reserved range counts too
    it = make_interp(max_positions=12, limits=Limits(max_threads=None))
    feed_main(it, ['<promise topic="t" tokens="20"/>', "a"])
    assert it.done and it.finish == "length"


def test_clean_text_splices_chunks_and_holds_a_partial_tag_back():
    it = make_interp(limits=Limits(max_threads=None))
    feed_main(it, ["a", '<promise topic="t" tokens="20"/>', "b", "<"])
    assert it.clean_text() == "ab"  # "<" may start a tag
    it.step_done(pick(it))
    it.on_token(1, PIECES.index("a"))
    it.on_token(0, PIECES.index("b"))  # "<b" is no tag: text now
    assert it.clean_text() == "aab<b"  # the chunk sits at its promise


# --------------------------------------------------------------------------- the clean text


#: The scripted requests the two stream tests below draw (check_stream_and_final's arguments).
STREAM_CASES = dict(
    seed=st.integers(0, 2**32 - 1),
    max_new=st.integers(1, 150),
    width=st.sampled_from([None, 1, 2]),
    min_cap=st.integers(1, 12),
    max_forks=st.integers(0, 4),
    mode=st.sampled_from(["pasta", "pasta", "sequential", "inline"]),
)


@settings(max_examples=120, deadline=None)
@given(**STREAM_CASES)
def test_clean_text_streams_and_ends_as_the_whole_string_rule(seed, max_new, width, min_cap, max_forks, mode):
    """Random PASTA-LANG, well-formed or not, cut anywhere: the interpreter's clean text and the
    reading-order stream agree with clean_text(annotated_text), and the stream never takes text
    back. (Step outputs used to carry snapshots of the clean text checked here too; they carry
    the reading-order stream now, tested in test_step_api.)"""
    check_stream_and_final(seed, max_new, width, min_cap, max_forks, mode)


#: Weights that write a lone '<' right before a tag, and text after it that would complete it
#: into a tag ("<" "<sync/>" "sync" "/>"), often.
LT_WEIGHTS = [6.0 if p in ("<", "<sync/>", "</async>", "sync", "/", '"/>', "async", "</", ">") else
              0.1 if p == "<EOS>" else 1.0 for p in PIECES]


@settings(max_examples=80, deadline=None)
@given(**STREAM_CASES)
def test_a_kept_lone_lt_streams_and_ends_as_the_whole_string_rule(seed, max_new, width, min_cap, max_forks, mode):
    """The same, with a lone '<' written right before a tag often and text after it that would
    complete it into a tag: the '<' stays, whatever would complete it is left out (in a thread's
    text, a chunk's after its promise, the main thread's after a chunk), the same in the stream,
    the interpreter's clean text and clean_text(annotated_text), and no tag reaches a reader."""
    global WEIGHTS
    saved, WEIGHTS = WEIGHTS, LT_WEIGHTS
    try:
        check_stream_and_final(seed, max_new, width, min_cap, max_forks, mode, no_tags=True)
    finally:
        WEIGHTS = saved


def check_stream_and_final(seed, max_new, width, min_cap, max_forks, mode, no_tags=False):
    """Decode two scripted requests; check that the stream never takes text back and that the
    interpreter's clean text, the stream and the result end as clean_text(annotated_text)
    (``no_tags``: and that no tag or tag-like text is in any of them)."""
    from pasta_engine.engine.streaming import ReadingOrderStream, reading_order_prefix
    from pasta_engine.lang.tags import AsyncClose, AsyncOpen, Promise, Sync, TagText, parse
    from pasta_engine.lang.tags import clean_text

    limits = Limits(max_threads=width, async_min_cap=min_cap, cap_factor=0.1, max_forks=max_forks)
    streams: dict[str, tuple[ReadingOrderStream, list[str]]] = {}
    # per request: each thread's streamed text (ThreadDelta.text) and the main thread's text events
    per_thread: dict[str, tuple[render.OutputRenderer, dict[int, str], list[str]]] = {}

    def on_step(reqs):
        for r in reqs:
            stream, deltas = streams.setdefault(r.request_id, (ReadingOrderStream(), []))
            if stream._finished or r.preemptions:
                continue
            it = r.interp
            renderer, texts, main_events = per_thread.setdefault(r.request_id, (render.OutputRenderer(), {}, []))
            step = renderer.update(it, finish_reason=r.finish_reason if r.finished else None)
            for d in step.thread_deltas:
                texts[d.thread] = texts.get(d.thread, "") + d.text
            main_events += [e.text for e in step.events if e.kind == "text" and e.thread == 0]
            if r.finished:
                deltas.append(stream.update(it, r.finish_reason)[0])
                stream._finished = True
            else:
                prefix = reading_order_prefix(it)
                assert prefix.startswith(stream.sent), "the stream would take text back"
                deltas.append(stream.update(it)[0])

    reqs = run_scripted(seed, limits, max_new, n_requests=2, on_step=on_step, mode=mode)
    for r in reqs:
        it = r.interp
        final = clean_text(it.annotated_text())
        assert it.clean_text() == final
        if r.finish_reason == "length" and any(c.finish in ("length", "not_run") for c in it.threads[1:]):
            final = r.result().text  # Limits.length_cut "prefix": it ends at the first chunk cut off
            assert final == render.final_text(it) and len(final) <= len(it.clean_text()) + 1
        assert final == r.result().text
        stream, deltas = streams[r.request_id]
        if not r.preemptions:
            assert "".join(deltas) == final  # nothing taken back, nothing missing
        if not r.preemptions:  # each thread's deltas build its own text, the main thread's events the same
            _, texts, main_events = per_thread[r.request_id]
            for t in it.threads:
                assert texts.get(t.tid, "") == render._thread_view(t, True)[0], t.tid
            assert "".join(main_events) == texts.get(0, "")
        if no_tags:
            shown = [final, it.clean_text(), stream.sent] + (list(per_thread[r.request_id][1].values())
                                                             if not r.preemptions else [])
            assert not [e for t in shown for e in parse(t) if isinstance(e, (Promise, AsyncOpen, AsyncClose, Sync,
                                                                            TagText))], shown


def drive(it: Interpreter, tid_pieces: list[tuple[int, str]]):
    """Give each (thread, piece) in turn, stepping the interpreter as the engine would."""
    for tid, p in tid_pieces:
        steps = pick(it)
        it.take_kv_ops()
        it.step_done(steps)
        assert tid in [s.tid for s in steps if s.sample], (tid, [s.tid for s in steps])
        it.on_token(tid, PIECES.index(p))


def test_a_partial_tag_at_a_length_cut_never_reaches_the_clean_text():
    from pasta_engine.lang.tags import clean_text

    it = make_interp(max_new_tokens=7)
    drive(it, [(0, "a"), (0, "\n"), (0, "1. "), (0, "<promise"), (0, ' topic="x"'), (0, ' tokens="'), (0, "1")])
    assert it.done and it.finish == "length"
    assert it.annotated_text() == 'a\n1. <promise topic="x" tokens="1'  # nothing the model wrote is lost
    assert it.clean_text() == clean_text(it.annotated_text()) == "a\n"  # the tag and the item it emptied go
    assert any("partial tag at its end left out of the clean text" in d for d in it.diagnostics)


def test_a_malformed_tag_is_left_out_of_the_clean_text_but_kept_in_the_annotated_text():
    it = make_interp()
    drive(it, [(0, "a"), (0, "<promise"), (0, ' topic="x"'), (0, '"/>'), (0, " "), (0, "b"), (0, "<EOS>")])
    assert it.annotated_text() == 'a<promise topic="x""/> b'
    assert it.clean_text() == "a b"
    assert any("malformed tag left out of the clean text" in d for d in it.diagnostics)
    # plain text with '<' stays
    it = make_interp()
    drive(it, [(0, "a"), (0, " "), (0, "<"), (0, " "), (0, "b"), (0, "<"), (0, "a"), (0, "<EOS>")])
    assert it.clean_text() == it.annotated_text() == "a < b<a"


def test_a_promise_inside_a_chunk_leaves_no_empty_list_item():
    from pasta_engine.engine.streaming import ReadingOrderStream
    from pasta_engine.lang.tags import clean_text

    it = make_interp(limits=Limits(max_threads=None))
    stream, deltas = ReadingOrderStream(), []
    script = [(0, "a"), (0, '<promise topic="t" tokens="20"/>'), (1, "\n"), (1, "- "), (0, "\n"),
              (1, '<promise topic="u" tokens="0"/>'), (1, "\n"), (1, "- "), (1, "a"), (0, "b"), (1, "\n"),
              (1, "- "), (1, "</async>"), (0, "<EOS>")]
    for step in script:
        drive(it, [step])
        deltas.append(stream.update(it, it.finish if it.done else None)[0])
        assert "- \n" not in stream.sent and not stream.sent.endswith("- ")
    ann = it.annotated_text()
    assert ann == 'a<promise topic="t" tokens="20"/><async>\n- <promise topic="u" tokens="0"/>\n- a\n- </async>\nb'
    # the chunk's last item, emptied by its </async>, goes too; the line before it was held, not sent
    assert clean_text(ann) == it.clean_text() == "a\n- a\nb" == "".join(deltas)
    assert any("inside a chunk not acted on (no nesting)" in d for d in it.diagnostics)


T, U = '<promise topic="t" tokens="20"/>', '<promise topic="u" tokens="0"/>'


@pytest.mark.parametrize("length_cut, want", [("prefix", "b\n- a"), ("keep", "b\n- a\n- bb\na")])
def test_a_length_cut_ends_the_clean_text_where_the_first_unfinished_chunk_stopped(length_cut, want):
    from pasta_engine.lang.tags import clean_text

    it = make_interp(max_new_tokens=13, limits=Limits(max_threads=None, length_cut=length_cut))
    drive(it, [(0, "b"), (0, "\n"), (0, "- "), (0, T), (0, "\n"), (0, "- "), (0, U),
               (1, "a"), (2, "b"), (2, "b"), (2, "</async>"), (0, "\n"), (0, "a")])
    assert it.done and it.finish == "length" and it.threads[1].finish == "length"
    # chunk 1 was cut mid-way: with "prefix" nothing after it reaches the reader (no hole mid-answer)
    from pasta_engine.core.render import final_text

    assert final_text(it) == want
    assert clean_text(it.annotated_text()) == "b\n- a\n- bb\na"  # nothing the model wrote is lost
    assert any("chunk 1 cut off" in d for d in it.diagnostics) == (length_cut == "prefix")


def test_a_chunk_never_run_at_a_length_cut_ends_the_clean_text_at_its_promise():
    from pasta_engine.core.render import final_text

    it = make_interp(max_new_tokens=7, limits=Limits(max_threads=2))  # the second chunk waits for a free row
    drive(it, [(0, "b"), (0, T), (0, "\n"), (0, U), (1, "a"), (0, "a"), (1, "</async>")])
    assert it.finish == "length" and it.threads[2].finish == "not_run"
    assert final_text(it) == "ba\n"


def test_stop_strings_end_the_thread_that_writes_one_while_an_earlier_chunk_decodes():
    it = make_interp(limits=Limits(max_threads=None), stop_strings=["bb"])
    drive(it, [(0, "b"), (0, T), (0, U), (2, "b"), (2, "b")])
    t2 = it.threads[2]
    assert t2.finish == "stop" and t2.closed_by_interpreter and t2.ended  # ended at its stop string
    assert any("thread 2 (topic 'u'): wrote the stop string 'bb'" in d for d in it.diagnostics)
    assert it.threads[1].finish is None and not it.done  # the earlier chunk goes on
    drive(it, [(1, "a"), (1, "</async>")])
    # chunk 1 ended: the reading-order text "b" "a" "bb" now holds the stop string, so the request
    # ends at once (the stop rule is the engine's: no caller has to abort it), cut right before it
    assert it.done and it.finish == "stop" and it.stop_reason == "bb" and not it.length_end
    assert render.final_text(it) == "ba" and it.annotated_text() == f"b{T}<async>a</async>{U}<async>bb</async>"
    assert any("reading-order text holds the stop string 'bb'" in d for d in it.diagnostics)
    # the main thread ends at its own stop string as at end of sequence
    it = make_interp(limits=Limits(max_threads=None), stop_strings=["ab"])
    drive(it, [(0, "a"), (0, "b")])
    assert it.done and it.finish == "stop" and it.main.finish == "stop" and it.stop_reason == "ab"
    assert render.final_text(it) == ""
    # a replay applies them too (the text a reader gets is cut the same in every API)
    assert make_interp(stop_strings=["a"], forced_main=[PIECES.index("a"), EOS]).stop_strings == ("a",)


def test_a_length_end_whose_text_holds_a_stop_string_is_a_stop():
    """vLLM's rule: a stop string in the output makes the finish ``stop`` even when the budget
    ran out in the same step (the text is cut before it, and ``length_end`` remembers the cut)."""
    # "a b" spans the chunk's text and the main text after it: no thread's own text holds it
    it = make_interp(limits=Limits(max_threads=None, length_cut="keep"), stop_strings=["a b"], max_new_tokens=5)
    drive(it, [(0, "b"), (0, T), (1, "a"), (0, " "), (0, "b")])
    assert it.done and it.finish == "stop" and it.stop_reason == "a b" and it.length_end
    assert render.final_text(it) == "b"


# --------------------------------------------------------------------------- inline mode


def inline_interp(**kw):
    kw.setdefault("limits", Limits(max_threads=None))
    return make_interp(mode="inline", encode=encode_pieces, **kw)


def drive_kv(it: Interpreter, tid_pieces: list[tuple[int, str]]) -> list:
    """:func:`drive`, returning every KV operation the interpreter issued."""
    ops = []
    for tid, p in tid_pieces:
        steps = pick(it)
        ops += it.take_kv_ops()
        it.step_done(steps)
        assert tid in [s.tid for s in steps if s.sample], (tid, [s.tid for s in steps])
        it.on_token(tid, PIECES.index(p))
    return ops + it.take_kv_ops()


CLOSE = encode_pieces("</async>")


def test_inline_mode_decodes_each_chunk_in_place_in_one_thread():
    it = inline_interp()
    ops = drive_kv(it, [(0, "a"), (0, T), (0, "b"), (0, "b"), (0, "</async>"), (0, " "), (0, "a"), (0, "<EOS>")])
    assert it.done and it.finish == "stop"
    assert len(it.threads) == 1 and it.n_forks == 0 and it.n_inline == 1
    assert all(type(op).__name__ == "KVRelease" for op in ops)  # no fork, no join: only the end's release
    assert it.annotated_text() == f"a{T}<async>bb</async> a"
    assert it.clean_text() == render.final_text(it) == "abb a"  # main, chunk, main: no tag text
    main = it.main
    # the <async> right after the promise was inserted (not sampled): no logprob, not counted
    k = main.tokens.index(PIECES.index(T)) + 1
    assert main.inserted_idx == list(range(k, k + len(OPEN))) and main.tokens[k:k + len(OPEN)] == OPEN
    assert all(main.logprobs[i] is None for i in main.inserted_idx)
    assert main.n_sampled == 8 and len(main.tokens) == 8 + len(OPEN)
    # consecutive positions right after the prompt: nothing reserved at the promise
    assert main.positions == list(range(2, 2 + len(main.tokens)))
    st_ = it.structure()
    assert st_.forks == [] and st_.inserted == len(OPEN) and critical_path(st_) == it.total_sampled == 8
    res = Request(request_id="r", index=0, mode="inline", params=SamplingParams(), make_interpreter=lambda: it).result()
    assert (res.stats.forks, res.stats.threads, res.stats.critical_path) == (0, 1, 8)
    assert res.text == "abb a" and res.mode == "inline"
    assert it.worst_case_kv().forks == 0


def test_an_inline_chunks_penalty_leaves_its_own_promise_out_until_it_closes():
    """As a forked chunk does: inside its inline chunk the thread counts every token but the
    chunk's promise; once the chunk closes the promise counts again (main text). ``Thread.uncounted``,
    which the scheduler's incremental counts watch, changes at both ends."""
    it = inline_interp()
    main = it.main
    drive(it, [(0, "a")])
    assert main.uncounted is None and it.seen_tokens(0) == [0, 1] + main.tokens
    drive(it, [(0, T)])  # the chunk opens right after its promise's token (<async> inserted)
    k = main.tokens.index(PIECES.index(T))
    assert main.inline and main.uncounted == (k, k + 1)
    drive(it, [(0, "b")])
    assert it.seen_tokens(0) == [0, 1] + main.tokens[:k] + main.tokens[k + 1:]
    drive(it, [(0, "</async>"), (0, " ")])
    assert not main.inline and main.uncounted is None
    assert it.seen_tokens(0) == [0, 1] + main.tokens  # its promise counts again
    # a forked chunk's count, for comparison: the same rule
    forked = make_interp(limits=Limits(max_threads=None))
    drive(forked, [(0, "a"), (0, T), (1, "b")])
    assert forked.seen_tokens(1) == [0, 1] + [PIECES.index("a")] + forked.threads[1].tokens


def test_inline_chunk_has_a_chunks_grammar_state_then_the_main_threads():
    from pasta_engine.lang.grammar import GrammarState as G

    def state(it):
        [s] = [s for s in it.runnable_threads() if s.sample]
        return G(s.grammar)

    for max_forks, after in ((1, G.MAIN_NO_FORK), (2, G.MAIN)):
        it = inline_interp(grammar=True, limits=Limits(max_threads=None, max_forks=max_forks))
        drive(it, [(0, "a")])
        assert state(it) is G.MAIN
        drive(it, [(0, T)])
        # the chunk's own text is empty (the main text "a" before it does not count): it may not end yet
        assert it.main.inline and state(it) is G.CHUNK_OPEN
        drive(it, [(0, "b")])
        assert state(it) is G.CHUNK  # </async> allowed now
        drive(it, [(0, "</async>")])
        assert not it.main.inline
        # max_forks bounds the promises acted on, with no fork counted
        assert it.n_forks == 0 and state(it) is after
    # a promise written inside an inline chunk is not acted on (the grammar forbids it anyway)
    it = inline_interp()
    drive(it, [(0, T), (0, U), (0, "a"), (0, "</async>")])
    assert it.n_inline == 1 and any("inside an inline chunk kept as text" in d for d in it.diagnostics)


def test_an_inline_chunk_at_its_cap_is_closed_and_the_thread_goes_on_as_main_text():
    limits = Limits(max_threads=None, async_min_cap=2, cap_factor=0.05)  # a cap of 2 tokens
    it = inline_interp(limits=limits)
    drive(it, [(0, "a"), (0, T), (0, "b"), (0, "b")])
    assert not it.main.inline and it.main.pending == [PIECES.index("b")] + CLOSE  # </async> inserted
    assert any("inline chunk reached its cap of 2 tokens; closed by the interpreter" in d for d in it.diagnostics)
    drive(it, [(0, " "), (0, "a"), (0, "<EOS>")])
    assert it.annotated_text() == f"a{T}<async>bb</async> a"  # well-formed
    assert it.clean_text() == "abb a"
    assert len(it.main.inserted_idx) == len(OPEN) + len(CLOSE)
    # with chunk_clean_end and the grammar, a chunk at its cap mid-sentence gets to end its sentence
    it = inline_interp(limits=limits, grammar=True)
    drive(it, [(0, T), (0, "b"), (0, "b")])
    assert it.main.inline
    drive(it, [(0, "\n")])
    assert not it.main.inline and it.annotated_text() == f"{T}<async>bb\n</async>"
    # an end-of-sequence token inside the chunk ends the chunk (closed, the EOS not kept), not the answer
    it = inline_interp()
    drive(it, [(0, T), (0, "a"), (0, "<EOS>"), (0, "b"), (0, "<EOS>")])
    assert it.annotated_text() == f"{T}<async>a</async>b" and it.clean_text() == "ab"
    assert it.done and it.main.n_sampled == 5


def test_an_unknown_mode_is_refused_naming_all_three():
    with pytest.raises(ValueError, match="unknown mode 'fast': expected 'pasta', 'sequential' or 'inline'"):
        make_interp(mode="fast")
    with pytest.raises(ValueError, match="needs encode="):  # it inserts </async> into a chunk it closes
        make_interp(mode="inline")
    from pasta_engine.lang.dialect import get_dialect

    with pytest.raises(ValueError, match="'multiverse' dialect nests or joins at its forks"):
        make_interp(mode="inline", encode=encode_pieces, dialect=get_dialect("multiverse"))


def test_pasta_and_inline_modes_give_the_same_text_for_the_same_chunks():
    from pasta_engine.lang.tags import clean_text

    main1, chunk1, main2, chunk2, main3 = ["b", "\n", "- ", T], ["a", "</async>"], ["\n", "- ", U], \
        ["b", "b", "</async>"], ["\n", "a", "<EOS>"]
    pasta = make_interp(limits=Limits(max_threads=None))
    drive(pasta, [(0, p) for p in main1] + [(1, chunk1[0]), (0, main2[0]), (1, chunk1[1])]
          + [(0, p) for p in main2[1:]] + [(2, p) for p in chunk2] + [(0, p) for p in main3])
    inline = inline_interp()
    drive(inline, [(0, p) for p in main1 + chunk1 + main2 + chunk2 + main3])
    assert len(pasta.threads) == 3 and len(inline.threads) == 1
    assert inline.annotated_text() == pasta.annotated_text()
    assert inline.clean_text() == pasta.clean_text() == clean_text(pasta.annotated_text()) == "b\n- a\n- bb\na"
    assert render.final_text(inline) == render.final_text(pasta)


def test_an_inline_replay_forces_each_chunk_in_place():
    from pasta_engine.core.replay import replay_script

    ann = "b" + T + "<async>ab</async>" + "a<sync/>b"
    script = replay_script(PieceTokenizer(), ann, EOS)
    it = inline_interp(forced_main=script.forced_main, forced_chunks=script.forced_chunks)
    steps = 0
    while not it.done:
        todo = pick(it)
        assert not it.take_kv_ops() or it.done
        it.step_done(todo)
        sampling = [s for s in todo if s.sample]
        assert len(sampling) <= 1
        steps += bool(sampling)
        for s in sampling:
            it.on_token(s.tid, s.forced)
    assert len(it.threads) == 1 and it.annotated_text() == ann
    assert it.spliced().ids == script.sequential_ids  # the same tokens in reading order, <async> inserted
    assert steps == it.total_sampled == critical_path(it.structure()) == len(script.sequential_ids) - len(OPEN)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_new=st.integers(1, 150), min_cap=st.integers(1, 12),
       max_forks=st.integers(0, 4))
def test_fuzzed_inline_streams_stay_one_thread_and_free_every_page(seed, max_new, min_cap, max_forks):
    from pasta_engine.lang.tags import clean_text

    limits = Limits(max_threads=None, async_min_cap=min_cap, cap_factor=0.1, max_forks=max_forks)
    for r in run_scripted(seed, limits, max_new, n_requests=2, mode="inline"):  # it checks the pages
        it = r.interp
        assert len(it.threads) == 1 and it.n_forks == 0 and it.n_inline <= max_forks
        assert r.steps == it.total_sampled == critical_path(it.structure()) <= max_new
        assert it.clean_text() == render.final_text(it) == clean_text(it.annotated_text())  # no tag text
        assert r.result().stats.forks == 0


def test_a_chunks_penalty_counts_its_siblings_promises_but_not_its_own():
    """``seen_tokens`` (the penalties' tokens): the main thread counts all it wrote; a chunk
    counts the main thread up to its own promise, which it leaves out (also a promise written
    in several tokens), its earlier siblings' promises included, then its own tokens."""
    it = make_interp()
    first = ['<promise topic="t" tokens="20"/>']
    second = ["<promise", ' topic="x"', ' tokens="', "1", "0", '"/>']
    drive(it, [(0, p) for p in ["a", " "] + first + ["b"] + second + ["a"]])
    main, c1, c2 = it.threads
    ids = [PIECES.index(p) for p in ["a", " "] + first + ["b"] + second]
    assert main.tokens[:len(ids)] == ids
    assert (c1.promise_from, c1.fork_at, c2.promise_from, c2.fork_at) == (2, 3, 4, 10)
    assert it.seen_tokens(0) == [0, 1] + main.tokens
    assert it.seen_tokens(1) == [0, 1] + ids[:2] + c1.tokens
    assert it.seen_tokens(2) == [0, 1] + ids[:4] + c2.tokens  # the first promise counted, its own not
    assert decode(c2.tokens) == "<async>"


def test_a_partial_tag_a_chunk_leaves_at_its_cap_never_meets_the_text_after_it():
    """A chunk the interpreter closes is read with the </async> the annotated text gives it: the
    bare '<' it ended with is cut short by that tag; a lone '<' is the model's text and stays, so
    the main thread's "sync/>" after the splice, which would complete it into a tag (as text it
    showed "<sync/>"), is left out instead."""
    from pasta_engine.lang.tags import Sync, clean_text, parse

    limits = Limits(max_threads=None, async_min_cap=2, cap_factor=0.01)  # a cap of 2 tokens
    it = make_interp(limits=limits)
    drive(it, [(0, "a"), (0, T), (1, "b"), (1, "<")])
    assert it.threads[1].finish == "cap" and it.threads[1].closed_by_interpreter
    drive(it, [(0, "sync"), (0, "/"), (0, ">"), (0, "<EOS>")])
    assert it.annotated_text() == f"a{T}<async>b<</async>sync/>"
    assert it.clean_text() == clean_text(it.annotated_text()) == render.final_text(it) == "ab<"
    assert not [e for e in parse(it.clean_text()) if isinstance(e, Sync)]
    # a stray </async> on the main thread cuts "<" short the same way
    it = make_interp()
    drive(it, [(0, "a"), (0, "<"), (0, "</async>"), (0, "sync"), (0, "/"), (0, ">"), (0, "<EOS>")])
    assert it.clean_text() == clean_text(it.annotated_text()) == "a<"
    # a replay whose trace ends inside a chunk leaves the chunk as the trace has it (no </async>
    # added): its text reads as the trace's clean text does, a partial tag at its end included
    trace = f"a{T}<async>b<"
    ids = [PIECES.index(p) for p in ("a", T, "<EOS>")]
    it = make_interp(forced_main=ids, forced_chunks=[[PIECES.index("b"), PIECES.index("<")]])
    drive(it, [(0, "a"), (0, T), (1, "b"), (0, "<EOS>"), (1, "<")])
    assert it.done and it.threads[1].finish == "trace_end" and not it.threads[1].closed_by_interpreter
    assert it.annotated_text() == trace
    assert it.clean_text() == render.final_text(it) == clean_text(trace) == "ab<"


def test_a_lone_lt_right_before_a_tag_stays_in_the_clean_text_and_the_stream():
    """The model's '<' right before a promise, a sync or a chunk's </async> is its text: it stays
    in the clean text, the streamed text and each thread's text; the tags are left out, and the
    annotated text keeps everything. Text after the tag that would complete a kept '<' into a
    tag ("sync/>" after "<<sync/>") is left out instead."""
    from pasta_engine.engine.streaming import ReadingOrderStream
    from pasta_engine.lang.tags import clean_text

    it = make_interp(limits=Limits(max_threads=None))
    stream, deltas = ReadingOrderStream(), []
    script = [(0, "a"), (0, " "), (0, "<"), (0, T), (1, "b"), (0, " "), (1, "<"), (1, "</async>"), (0, "<"),
              (0, "<sync/>"), (0, "a"), (0, "<"), (0, "<"), (0, "<sync/>"), (0, "sync"), (0, "/"), (0, ">"),
              (0, " "), (0, "b"), (0, "<EOS>")]
    for step in script:
        drive(it, [step])
        deltas.append(stream.update(it, it.finish if it.done else None)[0])
    ann = it.annotated_text()
    assert ann == f"a <{T}<async>b<</async> <<sync/>a<<<sync/>sync/> b"  # nothing the model wrote is lost
    want = "a <b< <a<< b"
    assert it.clean_text() == clean_text(ann) == render.final_text(it) == "".join(deltas) == want
    # each thread's own text keeps its '<' too (the reading-order rule, what would complete a kept
    # '<' into a tag is left out, is applied where the threads are spliced)
    assert render.joined(it.threads[1]) == "b<" and render.joined(it.main).startswith("a < <a<<")
    assert not [d for d in it.diagnostics if "'<'" in d or "'<<'" in d]  # no '<' reported as a malformed tag

def test_a_promise_in_a_broken_topics_tail_forks_with_the_token_that_completes_it():
    """A promise written where an earlier promise's topic broke on '<' forks at its own token:
    the child's view is the main thread's tokens up to it, nothing written after it (the parser
    once held the tail until it failed, tokens later, and forked then)."""
    pieces = ["<EOS>", "<async>", "</async>", '<promise topic="a', "<", "promise topic='b' tokens='1'/>", "x", '"',
              "y", "z", "sync/>", '<promise topic="t" tokens="20"/>']
    it = Interpreter([1], decode=lambda ids: "".join(pieces[i] for i in ids if i), eos_ids=[0], open_ids=[1],
                     close_len=1, limits=Limits(max_threads=None))

    def give(tid, p):
        steps = pick(it)
        it.take_kv_ops()
        it.step_done(steps)
        it.on_token(tid, pieces.index(p))

    for p in ['<promise topic="a', "<", "promise topic='b' tokens='1'/>"]:
        give(0, p)
    assert len(it.threads) == 2 and it.threads[1].fork_at == 3 and it.threads[1].promise.topic == "b"
    for tid, p in [(0, "x"), (0, '"'), (0, "y"), (1, "z"), (1, "</async>"), (0, "<EOS>")]:
        give(tid, p)
    assert it.annotated_text() == "<promise topic=\"a<promise topic='b' tokens='1'/><async>z</async>x\"y"
    assert it.spliced().threads == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    # a <sync/> there stalls the main thread with its own token
    it = Interpreter([1], decode=lambda ids: "".join(pieces[i] for i in ids if i), eos_ids=[0], open_ids=[1],
                     close_len=1, limits=Limits(max_threads=None))
    for p in ['<promise topic="t" tokens="20"/>', '<promise topic="a', "<", "sync/>"]:
        give(0, p)
    assert it.main.status.value == "stalled" and it.main.syncs == [4]


def test_a_topic_never_holds_a_replacement_character():
    """Inside a topic's UTF-8 character the grammar allows only a token with as many continuation
    bytes as the character still needs (or fewer and nothing else): after the lead byte of "é"
    (one more needed) SmolLM2's token of the euro sign's two last bytes once put U+FFFD in a
    topic; that token is allowed after the first byte of a three-byte character only."""
    from pasta_engine.lang.detokenizer import TokenBytes
    from pasta_engine.lang.grammar import TAG_PIECES, GrammarState as G, TagTokens, state_masks

    table = [p.encode() for p in TAG_PIECES] + [b"Caf", b"\xc3", b"\xa9", b"\x82\xac", b"\xe2", b"\xf0\x9f",
                                                 b"\xf0", b"\x98\x80", b"\x98", b"1", b""]
    ids = {b: i for i, b in enumerate(table)}
    tags = TagTokens(*range(6))
    masks = state_masks(tags, table, len(table), [ids[b""]])

    def allowed(state):
        allow, some = masks[state]
        return {table[i] for i in range(len(table)) if (i in some) == allow}

    def states(script):
        it = Interpreter([ids[b"1"]], decode=lambda t: b"".join(table[i] for i in t).decode("utf-8", "replace"),
                         eos_ids=[ids[b""]], open_ids=[tags.async_open], close_len=1, grammar=True,
                         limits=Limits(max_threads=None), token_bytes=TokenBytes(table))
        out = []
        for b in [b'<promise topic="', b"Caf"] + script:
            it.step_done(pick(it))
            it.take_kv_ops()
            it.on_token(0, ids[b])
            [st_] = [st_ for st_ in it.runnable_threads() if st_.tid == 0]
            out.append(G(st_.grammar))
        return out[2:]

    cont = {b"\xa9", b"\x98", b"\x82\xac", b"\x98\x80"}
    assert states([b"\xc3", b"\xa9"]) == [G.TOPIC_CONT1, G.TOPIC]
    assert allowed(G.TOPIC_CONT1) == {b"\xa9", b"\x98"}  # one continuation byte: not b"\x82\xac"
    assert states([b"\xe2", b"\x82\xac"]) == [G.TOPIC_CONT2, G.TOPIC]
    assert allowed(G.TOPIC_CONT2) == cont  # two, or one and nothing else
    assert states([b"\xf0", b"\x98", b"\x98", b"\xa9"]) == [G.TOPIC_CONT3, G.TOPIC_CONT2, G.TOPIC_CONT1, G.TOPIC]
    assert states([b"\xf0\x9f", b"\x98\x80"]) == [G.TOPIC_CONT2, G.TOPIC]
    assert allowed(G.TOPIC_CONT3) == cont  # no token of three here: fewer, and nothing else
    assert allowed(G.TOPIC_CONT) == cont  # without a bytes table the count is unknown: any
