"""The step API (vLLM's names): add_request / step / abort / has_unfinished_requests / stats,
and generate() and replay() as loops over it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_engine import Engine, ParameterError, SamplingParams

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


def test_output_text_read_late_is_the_text_as_of_its_step(engine, tiny_llama):
    from pasta_engine.lang.tags import strip_tags

    rid = engine.add_request("Give me tips.", annotated_response=ANNOTATED)
    req = engine.scheduler.waiting[0]
    kept, eager = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            kept.append(out)
            eager.append(req.interp.clean_text())  # what the step's text was, computed now
    assert len(kept) > 3 and all(o.request_id == rid for o in kept)
    assert [o.text for o in kept] == eager  # read only after the request ended
    assert len(set(eager)) > 2  # the text grew step by step (not one final string)
    assert kept[-1].text == strip_tags(ANNOTATED)
