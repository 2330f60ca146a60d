"""The step API (vLLM's names): add_request / step / abort / has_unfinished_requests / stats,
and generate() and replay() as loops over it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_engine import Engine, Limits, ParameterError, SamplingParams

ANNOTATED = 'Tips: <promise topic="a" tokens="10"/><async>Sleep.</async> <promise topic="b" tokens="10"/>' \
            '<async>Walk.</async><sync/> Done.'

PROMPTS = [[5 + i, 9, 10 + i, 11] for i in range(6)]
PARAMS = [SamplingParams(max_new_tokens=6 + 3 * i, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(6)]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, page_size=4, max_running_requests=3)


@pytest.fixture(scope="module")
def reference(engine):
    """Each prompt generated alone."""
    return [engine.generate([p], sp)[0] for p, sp in zip(PROMPTS, PARAMS)]


def drain(engine: Engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_add_step_until_done(engine, reference):
    ids = [engine.add_request(p, sp, mode="sequential" if i % 2 else "pasta") for i, (p, sp) in
           enumerate(zip(PROMPTS[:2], PARAMS[:2]))]
    assert len(set(ids)) == 2 and all(isinstance(i, str) for i in ids)
    s = engine.stats()
    assert s["waiting"] == 2 and s["running"] == 0 and s["kv_pages_free"] == s["kv_pages_total"]
    deltas = {i: [] for i in ids}
    texts = {}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id] += out.new_token_ids
            texts[out.request_id] = out.text
            if out.finished:
                assert out.finish_reason in ("stop", "length") and out.error is None
                assert out.stats is out.result.stats and out.result.request_id == out.request_id
                finals[out.request_id] = out
    for i, rid in enumerate(ids):
        r = finals[rid].result
        assert len(deltas[rid]) == r.stats.tokens_decoded  # every sampled token delivered once
        if r.mode == "sequential":
            assert deltas[rid] == r.token_ids
        assert texts[rid] == r.text
    assert finals[ids[0]].result.token_ids == reference[0].token_ids  # pasta, same seed: same tokens
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]


def test_abort_frees_pages_at_once_and_reports_abort(engine):
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=200, temperature=1.0, seed=1))
    engine.step()
    engine.step()
    assert engine.stats()["running"] == 1 and engine.stats()["kv_pages_free"] < engine.stats()["kv_pages_total"]
    assert engine.abort(rid) is True
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
    assert engine.has_unfinished_requests()  # the abort's final output is still to be returned
    [out] = engine.step()
    assert out.request_id == rid and out.finished and out.finish_reason == "abort"
    assert out.result.stats.finish_reason == "abort" and out.result.stats.tokens_decoded >= 1
    assert not engine.has_unfinished_requests()
    assert engine.abort(rid) is False  # finished: nothing to abort
    assert engine.abort("no-such-id") is False
    waiting = engine.add_request(PROMPTS[1])
    assert engine.abort(waiting) is True  # aborted before it ever ran
    [out] = engine.step()
    assert out.finish_reason == "abort" and out.result.stats.tokens_decoded == 0


def test_request_ids_are_checked(engine):
    rid = engine.add_request(PROMPTS[0], request_id="mine")
    assert rid == "mine"
    with pytest.raises(ParameterError, match="'mine' is already in use"):
        engine.add_request(PROMPTS[1], request_id="mine")
    with pytest.raises(ParameterError, match="request_id"):
        engine.add_request(PROMPTS[1], request_id=7)
    engine.abort("mine")
    drain(engine)


def test_generate_takes_one_sampling_params_per_prompt(engine, reference):
    got = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference]
    assert [r.stats.tokens_decoded for r in got] == [r.stats.tokens_decoded for r in reference]
    with pytest.raises(ParameterError, match="2 SamplingParams for 6 prompts"):
        engine.generate(PROMPTS, PARAMS[:2])


def test_replay_is_a_step_api_request_too(engine):
    rid = engine.add_request("Give me two tips.", annotated_response=ANNOTATED)
    finals = drain(engine)
    r = finals[rid].result
    assert r.annotated_text == ANNOTATED
    assert r.stats.decode_steps == r.stats.critical_path


def test_generate_keeps_the_outputs_of_step_api_requests(engine):
    """generate() steps every request; what it advanced for others comes back from step()."""
    rid = engine.add_request(PROMPTS[3], PARAMS[3])
    [g] = engine.generate([PROMPTS[4]], PARAMS[4])
    assert g.stats.finish_reason in ("stop", "length")
    got = []
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += out.new_token_ids if out.request_id == rid else []
            if out.finished:
                finals[out.request_id] = out
    r = finals[rid].result
    assert len(got) == r.stats.tokens_decoded  # nothing lost while generate() ran
    assert r.token_ids == engine.generate([PROMPTS[3]], PARAMS[3])[0].token_ids


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(["add", "step", "step", "abort"]), min_size=6, max_size=40),
       victim=st.integers(0, 5))
def test_interleaved_add_step_abort(engine, reference, ops, victim):
    """Random interleavings of add_request / step / abort over 6 requests: unaborted requests
    give the tokens of generate(); every page is free at the end."""
    added: list[str] = []
    aborted: set[str] = set()
    finals = {}
    order = list(range(6))

    def collect(outs):
        for out in outs:
            if out.finished:
                finals[out.request_id] = out

    for op in ops:
        if op == "add" and len(added) < 6:
            i = order[len(added)]
            added.append(engine.add_request(PROMPTS[i], PARAMS[i], request_id=f"h{i}-{id(ops)}"))
        elif op == "step":
            collect(engine.step())
        elif op == "abort" and added:
            rid = added[victim % len(added)]
            if engine.abort(rid):
                aborted.add(rid)
    while len(added) < 6:
        i = order[len(added)]
        added.append(engine.add_request(PROMPTS[i], PARAMS[i], request_id=f"h{i}-{id(ops)}"))
    while engine.has_unfinished_requests():
        collect(engine.step())
    for i, rid in enumerate(added):
        out = finals[rid]
        if rid in aborted:
            assert out.finish_reason == "abort"
        else:
            assert out.finish_reason in ("stop", "length")
            assert out.result.token_ids == reference[i].token_ids
    s = engine.stats()
    assert s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == s["waiting"] == 0


def test_step_text_is_a_prefix_stable_reading_order(engine):
    """The issue's case: out.text used to be a snapshot in the response's order, so
    "Tips: Sleep Done" became "Tips: Sleep early Done". Now every output's text extends the
    previous one's (the main text after a chunk still decoding is held), delta_text is what it
    gained, and the last one is the result's text."""
    from pasta_engine.lang.tags import strip_tags

    rid = engine.add_request("Give me tips.", annotated_response=ANNOTATED)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) > 3 and all(o.request_id == rid for o in outs)
    text = ""
    for o in outs:
        assert o.text == text + o.delta_text, (text, o.delta_text, o.text)  # prefix-stable, nothing taken back
        text = o.text
    assert len({o.text for o in outs}) > 2  # it grew step by step (not one final string)
    assert outs[-1].text == outs[-1].result.text == strip_tags(ANNOTATED)
    assert "".join(o.delta_text for o in outs) == outs[-1].result.text
    # the main text after promise "a" ("Tips: " ... " Done.") waits for chunk "a": never "Tips:  ..." first
    assert all(o.text == "Tips: " or not o.text.startswith("Tips:  ") for o in outs)


def sampled_tokens(interp, open_len: int, eos: int) -> dict[int, list[int]]:
    """Each thread's sampled tokens, from a finished interpreter (a chunk's inserted <async>
    is not sampled; its EOS is not kept in its tokens)."""
    out = {}
    for t in interp.threads:
        toks = list(t.tokens) if t.is_main else list(t.tokens[open_len:]) + ([eos] if t.finish == "eos" else [])
        if t.n_sampled:
            out[t.tid] = toks
    return out


def test_per_thread_deltas_concatenate_to_each_threads_tokens_and_text(engine):
    rids = [engine.add_request([5, 9, 10, 11], annotated_response=ANNOTATED),
            engine.add_request(PROMPTS[1], PARAMS[1], mode="pasta")]
    reqs = {rid: engine._requests[rid] for rid in rids}
    toks = {rid: {} for rid in rids}
    texts = {rid: {} for rid in rids}
    flat = {rid: [] for rid in rids}
    events = {rid: [] for rid in rids}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            flat[out.request_id] += out.new_token_ids
            events[out.request_id] += out.events
            assert [d.thread for d in out.thread_deltas] == sorted({d.thread for d in out.thread_deltas})
            for d in out.thread_deltas:
                toks[out.request_id].setdefault(d.thread, []).extend(d.token_ids)
                texts[out.request_id].setdefault(d.thread, []).append(d.text)
            if out.finished:
                finals[out.request_id] = out
    assert len(engine.eos_ids) == 1
    for rid in rids:
        it, r = reqs[rid].interp, finals[rid].result
        assert len(flat[rid]) == r.stats.tokens_decoded == finals[rid].tokens_decoded  # each sampled token once
        assert toks[rid] == sampled_tokens(it, len(it.open_ids), engine.eos_ids[0])
        assert sorted(flat[rid]) == sorted(t for ts in toks[rid].values() for t in ts)
        assert {k: "".join(v) for k, v in texts[rid].items()} == {t.tid: "".join(t.clean) for t in it.threads
                                                                   if "".join(t.clean)}
        assert events[rid][-1].kind == "finish"
    assert len(toks[rids[0]]) == 3  # the replay forked twice: the main thread and two chunks


def test_abort_of_a_finished_or_unknown_request_says_so(engine, caplog):
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3))
    drain(engine)
    with caplog.at_level("WARNING", logger="pasta_engine.engine.llm_engine"):
        assert engine.abort(rid) is False
        assert engine.abort("never-added") is False
    assert "already finished (finish_reason 'length')" in caplog.text
    assert "'never-added'): no request has this id" in caplog.text
    assert not engine.has_unfinished_requests() and engine.step() == []
    # aborted, its final output not yet returned: abort again says the abort's output is coming
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3))
    assert engine.abort(rid) is True
    caplog.clear()
    with caplog.at_level("WARNING", logger="pasta_engine.engine.llm_engine"):
        assert engine.abort(rid) is False
    assert "its final output comes from the next step()" in caplog.text
    [out] = engine.step()
    assert out.finish_reason == "abort" and out.finished


def test_abort_says_true_only_when_the_scheduler_aborted_the_request(engine, caplog):
    """``abort`` used to answer True for any unfinished request the engine knew, even one the
    scheduler no longer held (a request stranded out of both queues was not aborted at all)."""
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3))
    req = engine.scheduler.waiting.pop()  # stranded: the engine knows it, the scheduler does not
    try:
        with caplog.at_level("WARNING", logger="pasta_engine.engine.llm_engine"):
            assert engine.abort(rid) is False
        assert "in neither the waiting nor the running queue; nothing was aborted" in caplog.text
        assert not req.finished
    finally:
        engine.scheduler.waiting.append(req)
    assert engine.abort(rid) is True
    [out] = engine.step()
    assert out.finish_reason == "abort" and out.finished and not engine.has_unfinished_requests()


# --------------------------------------------------------------------------- interleavings with preemptions

TRACE3 = ("Intro.\n" + "".join(f"{i}. <promise topic=\"p{i}\" tokens=\"10\"/><async>" + "word " * (3 + 2 * i)
                               + "</async>\n" for i in range(3)) + "<sync/>Done.")
JOBS = [  # (prompt, params, mode, annotated response)
    ([5, 9, 10, 11], None, "pasta", ANNOTATED),
    ([6, 9, 10, 12], None, "pasta", TRACE3),
    ([7, 9, 10, 13], SamplingParams(max_new_tokens=30, temperature=0.9, seed=21), "sequential", None),
    ([8, 9, 10, 14], SamplingParams(max_new_tokens=30, temperature=0.9, seed=22), "pasta", None),
    ([9, 9, 10, 15], SamplingParams(max_new_tokens=24, temperature=1.0, seed=23), "sequential", None),
]


@pytest.fixture(scope="module")
def tight(tiny_llama):
    """A cache small enough that running requests get preempted (each one alone fits: 38 pages
    is the replay of TRACE3's peak alone; the scheduler's page check is exact per step, since it
    allocates a step's slots when it schedules it, so a larger cache no longer preempts)."""
    probe = Engine.from_pretrained(tiny_llama, kv_cache_bytes=2**20, page_size=4)
    per_page = probe.model_runner.kv_cache_bytes // probe.stats()["kv_pages_total"]
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=38 * per_page, page_size=4, max_running_requests=4,
                                  limits=Limits(max_threads=None))


@pytest.fixture(scope="module")
def alone(engine):
    """Each job run alone by generate() / replay()."""
    out = []
    for prompt, params, mode, ann in JOBS:
        if ann is None:
            out.append(engine.generate([prompt], params, mode=mode)[0])
        else:
            out.append(engine.replay([prompt], [ann], mode=mode)[0])
    return out


def test_the_tight_engine_preempts(tight, alone):
    ids = [tight.add_request(p, sp, mode=m, annotated_response=a) for p, sp, m, a in JOBS]
    finals = drain(tight)
    assert tight.stats()["preemptions"] >= 1
    assert [finals[i].result.text for i in ids] == [r.text for r in alone]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(["add", "step", "step", "step", "abort"]), min_size=6, max_size=40),
       order=st.permutations(range(len(JOBS))), victim=st.integers(0, 10))
def test_interleaved_step_outputs_are_prefix_stable_and_end_as_generate(tight, alone, ops, order, victim):
    """Random interleavings of add_request / step / abort in a cache that preempts: each
    request's text only ever grows (a restart included) and ends as generate()'s, its deltas
    concatenate to it, every sampled token comes out once (per thread, with its thread id),
    and every page is free at the end."""
    added: list[tuple[str, int]] = []
    aborted: set[str] = set()
    reqs, outs = {}, {}
    tag = f"{id(ops)}-{len(ops)}-{victim}"

    def add():
        j = order[len(added)]
        p, sp, m, a = JOBS[j]
        rid = tight.add_request(p, sp, mode=m, annotated_response=a, request_id=f"i{j}-{tag}")
        added.append((rid, j))
        reqs[rid] = tight._requests[rid]
        outs[rid] = []

    def step():
        for out in tight.step():
            outs[out.request_id].append(out)

    for op in ops:
        if op == "add" and len(added) < len(JOBS):
            add()
        elif op == "step":
            step()
        elif op == "abort" and added:
            rid = added[victim % len(added)][0]
            if tight.abort(rid):
                aborted.add(rid)
    while len(added) < len(JOBS):
        add()
    while tight.has_unfinished_requests():
        step()
    for rid, j in added:
        seq = outs[rid]
        assert seq and seq[-1].finished and all(not o.finished for o in seq[:-1])
        text = ""
        for o in seq:
            assert o.text == text + o.delta_text  # prefix-stable
            text = o.text
        final = seq[-1]
        flat = [t for o in seq for t in o.new_token_ids]
        per = {}
        for o in seq:
            for d in o.thread_deltas:
                per.setdefault(d.thread, []).extend(d.token_ids)
        assert sorted(flat) == sorted(t for ts in per.values() for t in ts)
        if rid in aborted:
            assert final.finish_reason == "abort"
            if not final.result.stats.preemptions:
                assert final.text == final.result.text
            continue
        assert final.finish_reason in ("stop", "length"), final.error
        assert final.text == final.result.text == alone[j].text  # generate()'s text
        assert final.result.token_ids == alone[j].token_ids
        it = reqs[rid].interp
        assert per == sampled_tokens(it, len(it.open_ids), tight.eos_ids[0])  # no token twice after a restart
        assert len(flat) == final.result.stats.tokens_decoded
    s = tight.stats()
    assert s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == s["waiting"] == 0


def test_output_kind_final_gives_only_the_final_output(engine):
    rid = engine.add_request([5, 9, 10, 11], annotated_response=ANNOTATED, output_kind="final")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    [out] = outs
    assert out.request_id == rid and out.finished and out.finish_reason == "stop"
    assert out.text == out.delta_text == out.result.text and out.new_token_ids == [] and out.events == []
    with pytest.raises(ParameterError, match="output_kind"):
        engine.add_request([5, 9], output_kind="final_only")
