"""Streaming in reading order (docs/DESIGN.md section 7): replayed annotated responses with several
promises, syncs and chunks of any lengths (so they end in any order), stepped one forward at a
time; at every step the streamed text is checked against an oracle built from the response's
known layout and each thread's progress."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_engine import Engine, Limits, SamplingParams
from pasta_engine.engine.streaming import OutputKind, ReadingOrderStream, StopMatcher, reading_order_prefix

PROMPT = [5, 9, 10, 11]  # token ids: no chat template, a short prefill
WORDS = st.text(alphabet="abcdefgh ijk.,\n", min_size=1, max_size=16)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4, max_running_requests=4)


def build(mains: list[str], chunks: list[str], syncs: list[bool]) -> tuple[str, str]:
    """An annotated response m0 P1 C1 m1 P2 C2 ... mk (with <sync/> after m_i where syncs[i])
    and its clean text."""
    ann, clean = [], []
    for k, chunk in enumerate(chunks):
        ann.append(mains[k] + ("<sync/>" if syncs[k] else ""))
        ann.append(f'<promise topic="t{k + 1}" tokens="10"/><async>{chunk}</async>')
        clean += [mains[k], chunk]
    ann.append(mains[-1])
    clean.append(mains[-1])
    return "".join(ann), "".join(clean)


def expected_sent(mains: list[str], interp) -> int:
    """The oracle: characters of the reading order that are final, from the layout and each
    thread's progress (main text decoded so far; each chunk's text and whether it ended), less
    a last line that could still become an empty list item (these texts have no list markers:
    a last line of spaces only)."""
    main_done = len("".join(interp.main.clean))
    children = interp.threads[1:]  # fork order = promise order = reading order here
    out: list[str] = []
    pos = 0
    for k, seg in enumerate(mains):
        take = min(len(seg), main_done - pos)
        out.append(seg[:take])
        pos += take
        if take < len(seg) or k == len(mains) - 1:
            break
        if k >= len(children):
            break  # the promise after this segment has not completed yet
        c = children[k]
        out.append("".join(c.clean))
        if not c.ended:
            break
    text = "".join(out)
    last = text[text.rfind("\n") + 1:]
    return len(text) - (len(last) if last.strip(" ") == "" else 0)


def drive(engine: Engine, rid: str, stream: ReadingOrderStream, mains: list[str] | None):
    """Step until ``rid`` finishes; check the oracle and the no-tag rule at every step."""
    req = next(r for r in (*engine.scheduler.waiting, *engine.scheduler.running) if r.request_id == rid)
    deltas: list[str] = []
    events = []
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id != rid:
                continue
            delta, evs = stream.update(req.interp, out.finish_reason if out.finished else None)
            deltas.append(delta)
            events += evs
            if mains is not None:  # texts without "<" or ">": any such character would be tag text
                assert "<" not in delta and ">" not in delta, f"tag text in a delta: {delta!r}"
            if mains is not None and not out.finished:
                assert len(stream.sent) == expected_sent(mains, req.interp), (stream.sent, deltas)
            if out.finished:
                final = out
    return deltas, events, final


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), n=st.integers(2, 4), width=st.sampled_from([None, 2]))
def test_reading_order_stream_matches_the_oracle(engine, data, n, width):
    mains = [data.draw(WORDS)] + [data.draw(st.text(alphabet="abcdefgh ijk.,\n", max_size=16)) for _ in range(n)]
    chunks = [data.draw(st.text(alphabet="pqrstuvw xyz.", min_size=1, max_size=30)) for _ in range(n)]
    syncs = [False] + [data.draw(st.booleans()) for _ in range(n - 1)]
    annotated, clean = build(mains, chunks, syncs)
    rid = engine.add_request(PROMPT, annotated_response=annotated, limits=Limits(max_threads=width))
    stream = ReadingOrderStream(events=True)
    deltas, events, final = drive(engine, rid, stream, mains)
    assert final.finish_reason == "stop"
    assert final.result.text == clean  # replay decodes exactly the stripped text
    assert "".join(deltas) == clean  # the deltas concatenate to the final clean text exactly
    assert stream.sent == clean
    # events: per thread, fork first, text concatenating to what that thread wrote, end, join
    by_thread: dict[int, list] = {}
    for e in events:
        by_thread.setdefault(e.thread, []).append(e)
    assert "".join(e.text for e in by_thread[0] if e.kind == "text") == "".join(mains)
    for k in range(1, n + 1):
        evs = by_thread[k]
        kinds = [e.kind for e in evs]
        assert kinds[0] == "fork" and kinds[-2:] == ["end", "join"], kinds
        assert evs[0].topic == f"t{k}" and evs[0].tokens == 10 and evs[0].parent == 0
        assert evs[0].at == len("".join(mains[:k]))  # splices after the main text before its promise
        assert "".join(e.text for e in evs if e.kind == "text") == chunks[k - 1]
        assert evs[-2].reason == "close"
    assert events[-1].kind == "finish" and events[-1].reason == "stop"
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]


def test_main_text_after_an_unfinished_chunk_is_held_then_flushed(engine):
    """A long chunk: the main text after its promise is decoded while the chunk still
    decodes, is held, and arrives whole in one delta once the chunk ends."""
    mains, chunks = ["Intro: ", " and the rest of the main text."], ["a long chunk " * 4]
    annotated, clean = build(mains, chunks, [False])
    rid = engine.add_request(PROMPT, annotated_response=annotated)
    stream = ReadingOrderStream(events=True)
    deltas, events, final = drive(engine, rid, stream, mains)
    assert "".join(deltas) == clean
    kinds = [(e.kind, e.thread) for e in events]
    fork, end = kinds.index(("fork", 1)), kinds.index(("end", 1))
    assert ("text", 0) in kinds[fork:end]  # the main thread wrote after its promise before the chunk ended
    i = next(i for i, d in enumerate(deltas) if d.endswith(mains[1]))  # ... and that text arrives whole
    before = "".join(deltas[:i])
    assert before.startswith(mains[0]) and chunks[0].startswith(before[len(mains[0]):])  # intro, then chunk only
    assert "".join(deltas[i + 1:]) == ""


def test_sequential_and_generated_streams_concatenate_to_the_result(engine):
    for mode in ("sequential", "pasta"):
        rid = engine.add_request([5, 9, 10, 11], SamplingParams(max_new_tokens=40, temperature=1.0, seed=3), mode=mode)
        stream = ReadingOrderStream(events=True)
        deltas, events, final = drive(engine, rid, stream, None)
        assert "".join(deltas) == final.result.text
        assert events[-1].kind == "finish"


def test_reading_order_prefix_stops_after_the_first_unfinished_chunk(engine):
    mains, chunks = ["A ", " B ", " C"], ["one two three four five", "x"]
    annotated, _ = build(mains, chunks, [False, False])
    rid = engine.add_request(PROMPT, annotated_response=annotated)
    req = next(r for r in engine.scheduler.waiting if r.request_id == rid)
    seen_hold = False
    while engine.has_unfinished_requests():
        engine.step()
        it = req.interp
        if len(it.threads) == 3 and not it.threads[1].ended:
            prefix = reading_order_prefix(it)
            assert prefix == "A " + "".join(it.threads[1].clean)  # B, chunk 2 and C wait for chunk 1
            seen_hold = seen_hold or it.threads[2].ended
    assert seen_hold  # the short second chunk ended while the first still decoded


def test_stop_strings_cut_the_text_and_hold_possible_starts(engine):
    m = StopMatcher(["END", "xyz"])
    assert m.held("abc EN") == 2 and m.held("abc E") == 1 and m.held("abc") == 0 and m.held("abc xy") == 2
    assert m.find("abc END more") == (4, "END")
    assert m.find("aa xyz END", 0) == (3, "xyz")
    with pytest.raises(ValueError):
        StopMatcher([""])
    mains, chunks = ["Start ", " then STOPHERE and more"], ["chunk text"]
    annotated, _ = build(mains, chunks, [False])
    rid = engine.add_request(PROMPT, annotated_response=annotated)
    stream = ReadingOrderStream(stop=["STOPHERE"])
    req = next(r for r in engine.scheduler.waiting if r.request_id == rid)
    sent = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            sent.append(stream.update(req.interp, out.finish_reason if out.finished else None)[0])
            assert not stream.sent.endswith(("S", "ST", "STO", "STOP"))  # a possible start is held
            if stream.stopped:
                engine.abort(rid)
    assert "".join(sent) == "Start chunk text then "
    assert stream.stop_reason == "STOPHERE"
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]


def test_output_kind_parse():
    assert OutputKind.parse("delta") is OutputKind.DELTA and OutputKind.parse(OutputKind.FINAL) is OutputKind.FINAL
    with pytest.raises(ValueError, match="delta"):
        OutputKind.parse("final_only")


def _no_tag_text(text: str) -> bool:
    return "<" not in text and ">" not in text and "- \n" not in text and not text.endswith("- ")


def _replay_streamed(engine, annotated: str, mode: str = "pasta"):
    """Replay ``annotated`` through add_request/step: the reading-order deltas of a
    ReadingOrderStream, each step output's text, and the final output."""
    rid = engine.add_request(PROMPT, annotated_response=annotated, mode=mode)
    stream = ReadingOrderStream(events=True)
    req = next(r for r in engine.scheduler.waiting if r.request_id == rid)
    deltas, texts, final = [], [], None
    while final is None:
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(stream.update(req.interp, out.finish_reason if out.finished else None)[0])
                texts.append(out.text)
                final = out if out.finished else None
    return deltas, texts, final


def test_tag_text_never_reaches_the_text_step_outputs_or_deltas(engine):
    """A nested promise in a list inside a chunk, a malformed tag and a partial tag at the end
    of the response (the trace ends mid-tag): none of it is shown, no empty list item is left,
    and all of it is in the annotated text and the diagnostics."""
    from pasta_engine.lang.tags import clean_text, promise_tag

    annotated = ("Tips:" + promise_tag("list", 30) + '<async>\n- <promise topic="x" tokens="10"/>\n- Sleep well.\n'
                 '</async>\nA <promise topic="t" tokens="N"/> b.\n4. <promise topic="Premature Death" tokens="1')
    deltas, texts, final = _replay_streamed(engine, annotated)
    want = "Tips:\n- Sleep well.\n\nA  b.\n"
    assert final.result.text == clean_text(final.result.annotated_text) == want
    assert final.result.annotated_text == annotated  # nothing the model wrote is lost
    assert "".join(deltas) == want and texts[-1] == want
    assert all(_no_tag_text(t) for t in deltas + texts), [t for t in deltas + texts if not _no_tag_text(t)]
    diags = "\n".join(final.result.diagnostics)
    assert "malformed tag left out of the clean text: '<promise topic=\"t\" tokens=\"N'" in diags
    assert "partial tag at its end left out of the clean text" in diags
    assert "inside a chunk not acted on (no nesting)" in diags


def test_a_partial_tag_at_a_length_cut_never_reaches_the_text(tmp_path):
    """The context length cuts the response inside a promise tag (finish 'length')."""
    from pasta_engine.lang.tags import clean_text
    from pasta_engine.tools.presets import build_checkpoint

    path = build_checkpoint("tiny-llama", tmp_path / "ctx64", overrides={"max_position_embeddings": 64})
    eng = Engine.from_pretrained(path, kv_cache_bytes=4 * 2**20, page_size=4)
    head = 'Intro:\n4. <promise topic="Premature Death'
    annotated = head + ' and more" tokens="10"/><async>x</async> end.'
    n_head = len(eng.tokenizer.encode(head, add_special_tokens=False))
    rid = eng.add_request(list(range(5, 5 + 64 - n_head)), annotated_response=annotated)
    stream = ReadingOrderStream()
    req = next(r for r in eng.scheduler.waiting if r.request_id == rid)
    deltas, texts, final = [], [], None
    while final is None:
        for out in eng.step():
            deltas.append(stream.update(req.interp, out.finish_reason if out.finished else None)[0])
            texts.append(out.text)
            final = out if out.finished else None
    res = final.result
    assert res.stats.finish_reason == "length"
    assert "<promise" in res.annotated_text and '"/>' not in res.annotated_text  # cut inside the tag
    assert res.text == clean_text(res.annotated_text) == "Intro:\n" == "".join(deltas) == texts[-1]
    assert all(_no_tag_text(t) for t in deltas + texts)
    assert any("partial tag at its end left out of the clean text" in d for d in res.diagnostics)


@pytest.mark.parametrize("mode", ["pasta", "sequential"])
def test_text_around_a_left_out_tag_never_joins_into_a_tag(engine, mode):
    """Issue 31 item 10: ``<pro<sync/>mise topic="x" tokens="3"/>`` read as the promise tag once
    the sync was left out. The partial tag a tag cut short goes with it, in the result, the
    streamed deltas and every output, in both modes; the annotated text keeps every character."""
    from pasta_engine.lang.tags import AsyncClose, AsyncOpen, Promise, Sync, parse, promise_tag

    annotated = ('Intro. <pro<sync/>mise topic="x" tokens="3"/> and ' + promise_tag("t", 10)
                 + '<async>a <as<sync/>ync> b</async> end.')
    [res] = engine.replay([PROMPT], [annotated], mode=mode)
    tags = (Promise, AsyncOpen, AsyncClose, Sync)
    assert res.annotated_text == annotated  # nothing the model wrote is lost
    assert not any(isinstance(e, tags) for e in parse(res.text)), res.text
    assert res.text.startswith('Intro. mise topic="x" tokens="3"/> and ')
    deltas, texts, final = _replay_streamed(engine, annotated, mode)
    assert "".join(deltas) == texts[-1] == final.result.text == res.text
    assert not any(isinstance(e, tags) for t in deltas + texts for e in parse(t))


@pytest.mark.parametrize("mode", ["pasta", "sequential"])
def test_a_lone_lt_right_before_a_tag_stays_in_the_text(engine, mode):
    """The model's '<' right before a promise, a sync or a chunk's </async> is its text: the
    result, the streamed deltas and every output keep it, the tags are left out; the text after
    a tag that would complete a kept '<' into a tag ("sync/>" after "<<sync/>") is left out."""
    from pasta_engine.lang.tags import AsyncClose, AsyncOpen, Promise, Sync, parse, promise_tag

    annotated = ("Intro <" + promise_tag("t", 10) + "<async>a <<sync/> b<</async> then <<sync/>sync/> x<<"
                 + promise_tag("u", 10) + "<async>c</async> end.")
    want = "Intro <a < b< then < x<<c end."
    [res] = engine.replay([PROMPT], [annotated], mode=mode)
    assert res.annotated_text == annotated  # nothing the model wrote is lost
    assert res.text == want
    deltas, texts, final = _replay_streamed(engine, annotated, mode)
    assert "".join(deltas) == texts[-1] == final.result.text == want
    assert not any(isinstance(e, (Promise, AsyncOpen, AsyncClose, Sync)) for t in deltas + texts for e in parse(t))


def test_step_outputs_carry_each_tokens_logprob_with_its_text(engine):
    """With ``return_logprobs`` each step output carries the logprobs of the tokens whose text it
    reaches (``new_logprobs``, the settled spliced order: a chunk's while it decodes, the main
    text's after it once it ends), not all of them at the end; over the outputs they concatenate
    to the result's sampled tokens and logprobs. A request that asked for none gets none."""
    from pasta_engine.lang.tags import strip_tags

    mains, chunks = ["Two tips: ", " and ", " That is all."], ["Sleep early, every day.", "Walk."]
    annotated, clean = build(mains, chunks, [False, True])
    sampled = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, return_logprobs=True)
    for kw in ({"annotated_response": annotated, "params": SamplingParams(return_logprobs=True)},
               {"params": sampled, "mode": "pasta"}, {"params": sampled, "mode": "sequential"}):
        rid = engine.add_request(PROMPT, **kw)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == rid]
        res = outs[-1].result
        want = [(t, lp) for t, lp in zip(res.token_ids, res.logprobs) if lp is not None]
        assert [e for o in outs for e in o.new_logprobs] == want, kw
        assert sum(1 for o in outs if o.new_logprobs) > 1, kw  # spread over the outputs
        if "annotated_response" not in kw:
            continue
        assert res.text == clean and len(want) < len(res.token_ids)  # the inserted <async> tokens left out
        tokens, text = "", ""
        for o in outs:  # the tokens so far write the text so far; what they write past it is a tag's start
            tokens += "".join(engine.decode([t]) for t, _ in o.new_logprobs)
            text += o.delta_text
            rest = strip_tags(tokens)
            assert rest.startswith(text) and (rest == text or rest[len(text)] == "<"), (rest, text)
        assert len(outs[0].new_logprobs) == 1  # the prefill's token: "Two tips" is not all at once
    rid = engine.add_request(PROMPT, sampled, output_kind="final")
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished and outs[-1].new_logprobs == [] and outs[-1].result.logprobs


def test_logprob_deltas_of_a_request_ended_with_a_chunk_that_never_ran(engine):
    """A chunk forked but not run yet (one thread at a time) has only its inserted ``<async>``
    tokens; when the request ends then, it never ran and the result leaves it out. The logprob
    deltas must not have counted it: they still concatenate to the result's (they used to skip
    as many of the later tokens as the chunk had inserted ones)."""
    annotated, _ = build(["A ", " B ", " C"], ["one two three four five six", "x y z"], [False, False])
    for extra_steps in (0, 3):
        rid = engine.add_request(PROMPT, SamplingParams(return_logprobs=True), annotated_response=annotated,
                                 limits=Limits(max_threads=1))
        req = next(r for r in engine.scheduler.waiting if r.request_id == rid)
        outs, waited = [], None
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == rid]
            if waited is None and any(not c.started for c in req.interp.threads[1:]):
                waited = 0
            if waited is not None and not req.finished:
                waited += 1
                if waited > extra_steps:
                    engine.abort(rid)
        res = outs[-1].result
        assert waited is not None and res.stats.finish_reason == "abort"
        assert "never ran" in "\n".join(res.diagnostics)
        want = [(t, lp) for t, lp in zip(res.token_ids, res.logprobs) if lp is not None]
        assert [e for o in outs for e in o.new_logprobs] == want
