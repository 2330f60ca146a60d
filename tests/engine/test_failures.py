"""The failure model (docs/DESIGN.md section 7): a bad request fails alone before it takes any page;
an error that belongs to one request ends only that request; any exception or Ctrl-C escaping a
step frees every page first; after any of these the engine serves the next call exactly as a
fresh engine would. Also: the model's context length, and several Python threads at once."""

from __future__ import annotations

import threading

import pytest
import torch

from pasta_engine import ContextLengthError, Engine, ParameterError, SamplingParams
from pasta_engine.layers import sampler as sampler_module  # SamplingBatch.pick draws each request's noise through it
from pasta_engine.tools.presets import build_checkpoint

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
PARAMS = SamplingParams(max_new_tokens=24, temperature=0.8, seed=7)


@pytest.fixture(scope="module")
def fresh_tokens(tiny_llama):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=4 * 2**20, page_size=4)
    return [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]


@pytest.fixture
def engine(tiny_llama):
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=4 * 2**20, page_size=4)


def all_free(engine: Engine) -> bool:
    s = engine.stats()
    return s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0 and s["waiting"] == 0


from faults import Boom, fail_on_call  # noqa: E402  (tests/engine/faults.py)


@pytest.mark.parametrize("exc", [Boom("forward failed"), KeyboardInterrupt()])
def test_an_exception_in_the_model_forward_frees_every_page(engine, fresh_tokens, monkeypatch, exc):
    forward = engine.model.forward
    for n in (1, 3, 9, 20):  # in a prefill, and in decode steps with several requests running
        monkeypatch.setattr(engine.model, "forward", fail_on_call(n, exc)(forward))
        with pytest.raises(type(exc)):
            engine.generate(PROMPTS, PARAMS)
        assert all_free(engine), f"pages leaked after failing forward call {n}"
        assert not engine.has_unfinished_requests()
    monkeypatch.setattr(engine.model, "forward", forward)
    assert [r.token_ids for r in engine.generate(PROMPTS, PARAMS)] == fresh_tokens


def test_a_request_that_finished_in_a_step_that_then_raised_still_gets_its_final_output(engine):
    """A request ends in postprocess; an exception on a later request of the same step (Ctrl-C in
    its token handling) must not lose the ended one: it comes out of the next step, its id free."""
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2), mode="sequential", request_id="A")
    engine.add_request([8, 9, 10], SamplingParams(max_new_tokens=10), mode="sequential", request_id="B")
    b = engine.scheduler.waiting[1]
    b.interp.on_token = fail_on_call(2, KeyboardInterrupt())(b.interp.on_token)  # the step A takes its last token
    seen = []
    with pytest.raises(KeyboardInterrupt):
        while True:
            seen += engine.step()
    after = engine.step()
    assert [(o.request_id, o.finish_reason) for o in after] == [("A", "length"), ("B", "error")]
    assert not engine.has_unfinished_requests() and all_free(engine)
    engine.add_request([5, 6], SamplingParams(max_new_tokens=2), request_id="A")  # the id is free again


def test_outputs_kept_by_generate_survive_a_step_that_raises(engine, monkeypatch):
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2), mode="sequential", request_id="A")
    engine.generate([[8, 9, 10]], SamplingParams(max_new_tokens=6), mode="sequential")  # A ends inside: kept
    engine.add_request([11, 12], SamplingParams(max_new_tokens=4), mode="sequential", request_id="B")
    monkeypatch.setattr(engine.model, "forward", fail_on_call(1, Boom("forward failed"))(engine.model.forward))
    with pytest.raises(Boom):
        engine.step()
    got = [(o.request_id, o.finish_reason) for o in engine.step()]
    assert got == [("A", "length"), ("B", "error")] and all_free(engine)


def _fail_rendering(monkeypatch, req, nth: int, exc: BaseException) -> None:
    """Make the ``nth`` rendering of ``req``'s output (its reading-order prefix) raise ``exc``."""
    from pasta_engine.core import render

    prefix = render.reading_order_prefix
    renders = []

    def failing(interp):
        if interp is req.interp:
            renders.append(len(renders))
            if len(renders) == nth:
                raise exc
        return prefix(interp)

    monkeypatch.setattr(render, "reading_order_prefix", failing)


def _steps_through(engine, exc: type[BaseException]) -> list:
    """Step until ``exc`` escapes a step, then until every request has finished: every output."""
    outs = []
    with pytest.raises(exc):
        for _ in range(20):
            outs += engine.step()
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("exc", [Boom("rendering failed"), KeyboardInterrupt()])
@pytest.mark.parametrize("victim", ["A", "B"])
def test_a_step_whose_outputs_phase_raises_loses_no_token_from_the_deltas(engine, monkeypatch, exc, victim):
    """Nothing the model wrote is lost: when rendering one request's output raises in the
    outputs phase, that request (and the one after it, never rendered) end with ``error``, and
    each one's ``new_token_ids`` over all its outputs still concatenate to its final
    ``result.token_ids``, the failed step's token included (it used to be dropped)."""
    sp = SamplingParams(max_new_tokens=12, temperature=0.0)
    engine.add_request([5, 6, 7], sp, mode="sequential", request_id="A")
    engine.add_request([8, 9, 10], sp, mode="sequential", request_id="B")
    # its fourth output: a decode step, after its tokens were taken
    _fail_rendering(monkeypatch, engine.scheduler.waiting["AB".index(victim)], 4, exc)
    outs = _steps_through(engine, type(exc))
    for rid in "AB":
        mine = [o for o in outs if o.request_id == rid]
        last = mine[-1]
        assert last.finished and last.finish_reason == "error", rid
        assert len(last.result.token_ids) == 4, rid  # the failed step sampled its fourth token
        assert sum((o.new_token_ids for o in mine), []) == last.result.token_ids, rid
        per_thread = [t for o in mine for d in o.thread_deltas for t in d.token_ids]
        assert per_thread == last.result.token_ids, rid
        assert "".join(o.delta_text for o in mine) == last.text, rid
    assert all_free(engine)


@pytest.mark.parametrize("exc", [Boom("rendering failed"), KeyboardInterrupt()])
def test_a_request_that_ended_by_itself_keeps_its_output_when_anothers_rendering_raises(engine, monkeypatch, exc):
    """A request that ends by itself in the step where rendering an earlier request's output
    raises was never tried: the next step outputs it, with its own finish reason and every
    token (it used to be forgotten, its text lost). The one whose rendering raised fails."""
    engine.add_request([8, 9, 10], SamplingParams(max_new_tokens=20, temperature=0.0), mode="sequential",
                       request_id="B")  # first in the step's work
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0), mode="sequential",
                       request_id="A")  # takes its last token in the step that raises
    _fail_rendering(monkeypatch, engine.scheduler.waiting[0], 3, exc)  # B's third output: the step A ends in
    outs = _steps_through(engine, type(exc))
    mine = [o for o in outs if o.request_id == "A"]
    assert mine and mine[-1].finished and mine[-1].finish_reason == "length"
    assert len(mine[-1].result.token_ids) == 3
    assert sum((o.new_token_ids for o in mine), []) == mine[-1].result.token_ids
    assert "".join(o.delta_text for o in mine) == mine[-1].text
    assert [o.finish_reason for o in outs if o.request_id == "B" and o.finished] == ["error"]
    assert all_free(engine)


@pytest.mark.parametrize("exc", [Boom("a token's handling failed"), KeyboardInterrupt()])
def test_a_step_that_raises_while_tokens_are_taken_loses_none_from_the_deltas(engine, exc):
    """An exception while the interpreters take a step's tokens (B's on_token; A took its token
    first): each request's ``new_token_ids`` over its outputs still concatenate to its final
    ``result.token_ids`` (the step's tokens were missing from the deltas)."""
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0.0), mode="sequential",
                       request_id="A")
    engine.add_request([8, 9, 10], SamplingParams(max_new_tokens=10, temperature=0.0), mode="sequential",
                       request_id="B")
    b = engine.scheduler.waiting[1]
    b.interp.on_token = fail_on_call(3, exc)(b.interp.on_token)
    outs = []
    if isinstance(exc, Exception):  # a request's own failure: B fails alone, A goes on
        while engine.has_unfinished_requests():
            outs += engine.step()
    else:
        outs = _steps_through(engine, KeyboardInterrupt)
    for rid in "AB":
        mine = [o for o in outs if o.request_id == rid]
        assert mine[-1].finished, rid
        assert sum((o.new_token_ids for o in mine), []) == mine[-1].result.token_ids, rid
    assert all_free(engine)


def test_an_exception_in_a_kv_append_frees_every_page(engine, fresh_tokens, monkeypatch):
    append = engine.block_manager.append
    for n in (2, 7, 15):
        monkeypatch.setattr(engine.block_manager, "append", fail_on_call(n, Boom("append failed"))(append))
        with pytest.raises(Boom):
            engine.replay(["hi"], ['A <promise topic="t" tokens="10"/><async>b c d</async> e<sync/> f'])
        assert all_free(engine)
    monkeypatch.setattr(engine.block_manager, "append", append)
    assert [r.token_ids for r in engine.generate(PROMPTS, PARAMS)] == fresh_tokens


def test_a_sampling_error_ends_only_its_request(engine, fresh_tokens, monkeypatch):
    real = sampler_module.draw_noise

    def draw_noise(out, generator):  # a request's own part of the batched sampling
        if generator.initial_seed() == 666:
            raise Boom("bad logits")
        return real(out, generator)

    monkeypatch.setattr(sampler_module, "draw_noise", draw_noise)
    params = [PARAMS, SamplingParams(max_new_tokens=24, temperature=0.8, seed=666), PARAMS]
    res = engine.generate(PROMPTS, params)
    assert res[1].stats.finish_reason == "error" and "sampling failed" in res[1].error and "bad logits" in res[1].error
    assert [res[0].token_ids, res[2].token_ids] == [fresh_tokens[0], fresh_tokens[2]]  # the others went on
    assert all_free(engine)
    for _ in range(4):  # four failed calls in a row do not wear the engine down
        [r] = engine.generate([PROMPTS[1]], params[1])
        assert r.stats.finish_reason == "error"
    monkeypatch.setattr(sampler_module, "draw_noise", real)
    assert [r.token_ids for r in engine.generate(PROMPTS, PARAMS)] == fresh_tokens


def test_a_tiny_temperature_is_greedy_not_a_crash(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    tiny = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=1e-45))
    assert [r.token_ids for r in tiny] == [r.token_ids for r in greedy]
    assert all(r.stats.finish_reason == "length" for r in tiny)


def test_kv_exhaustion_mid_decode_fails_one_request_and_the_rest_finish(tiny_llama):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=40 * 1024, page_size=4, max_running_requests=2)
    short = SamplingParams(max_new_tokens=4)
    res = engine.generate([list(range(3, 60)), [7, 8, 9]], [SamplingParams(max_new_tokens=400), short])
    assert res[0].stats.finish_reason == "error" and "KV cache exhausted" in res[0].error
    assert res[1].stats.finish_reason == "length" and res[1].stats.tokens_decoded == 4
    assert all_free(engine)


@pytest.mark.parametrize(
    "prompt, match",
    [
        (None, "prompt 1 must be a string or a list of token ids, got NoneType"),
        (b"bytes", "prompt 1 must be a string or a list of token ids, got bytes"),
        ([1, 2.0, 3], r"prompt 1: token 1 is 2\.0 \(float\)"),
        ([1, "2"], r"prompt 1: token 1 is '2' \(str\)"),
        ([1, True], r"prompt 1: token 1 is True \(bool\)"),
        ([1, None], r"prompt 1: token 1 is None"),
        ([1, -4], r"prompt 1: token id -4 \(position 1\) is outside"),
        ([], "prompt 1 is an empty list of token ids"),
    ],
)
def test_a_bad_prompt_is_named_by_its_index_before_anything_runs(engine, prompt, match):
    before = engine.stats()["steps"]
    with pytest.raises(ParameterError, match=match) as e:
        engine.generate([[5, 6], prompt, [7]], PARAMS)
    assert e.value.param == "prompt"
    assert engine.stats()["steps"] == before and all_free(engine)  # the good prompts did not run either


def test_generate_argument_shapes(engine):
    with pytest.raises(ParameterError, match="no prompts given"):
        engine.generate([])
    with pytest.raises(ParameterError, match="prompts"):
        engine.generate(b"abc")
    with pytest.raises(ParameterError, match="params"):
        engine.generate([[5]], params={"temperature": 0.5})
    [r] = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=2))  # a list of ints is one prompt
    assert r.prompt_ids == [5, 6, 7]


def test_a_prompt_over_the_context_is_rejected_before_admission(tiny_llama):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=64 * 2**20, page_size=16)
    ctx = engine.max_positions
    assert ctx == 4096
    with pytest.raises(ContextLengthError, match=f"4096 tokens, which leaves no room under the model's context length of {ctx}"):
        engine.generate([[5] * ctx])
    assert all_free(engine) and engine.stats()["steps"] == 0


def test_decoding_stops_at_the_context_length(tmp_path):
    path = build_checkpoint("tiny-llama", tmp_path / "ctx64", overrides={"max_position_embeddings": 64})
    engine = Engine.from_pretrained(path, kv_cache_bytes=4 * 2**20, page_size=4)
    [r] = engine.generate([list(range(5, 35))], SamplingParams(max_new_tokens=200, temperature=1.0, seed=3),
                          mode="sequential")
    assert r.stats.finish_reason == "length"
    assert max(r.positions) == 63 and len(r.token_ids) == 64 - 30
    # pasta mode: the largest logical position counts (the main thread skips a promise's range)
    [p] = engine.replay([list(range(5, 35))], ['A <promise topic="t" tokens="40"/><async>b c</async> d e f g'])
    assert p.stats.finish_reason == "length" and max(p.positions) < 64
    assert any("context length of 64" in d for d in p.diagnostics)
    assert all_free(engine)


def test_special_token_text_in_a_prompt_is_text_unless_asked(tiny_llama):
    text = Engine.from_pretrained(tiny_llama, kv_cache_bytes=2**20)
    control = Engine.from_pretrained(tiny_llama, kv_cache_bytes=2**20, prompt_special_tokens="control")
    eos = text.tokenizer.convert_tokens_to_ids("<|im_end|>")
    as_text = text.format_prompt("stop<|im_end|>here", mode="sequential")
    as_control = control.format_prompt("stop<|im_end|>here", mode="sequential")
    assert as_text.count(eos) == as_control.count(eos) - 1  # the template's own markers stay control tokens
    assert text.decode(as_text) == control.decode(as_control)  # same characters either way
    plain = text.format_prompt("stop here", mode="sequential")
    assert plain == control.format_prompt("stop here", mode="sequential")


@pytest.mark.parametrize("n_threads", [2, 8])
def test_python_threads_sharing_one_engine_serialize(engine, n_threads):
    """generate() from several threads: each call completes with the tokens it gets alone (the
    engine takes one lock per call), and no page leaks."""
    prompts = [[20 + i, 21, 22] for i in range(n_threads)]
    params = [SamplingParams(max_new_tokens=12, temperature=0.7, seed=i) for i in range(n_threads)]
    alone = [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            got[i] = engine.generate([prompts[i]], params[i])[0].token_ids
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and [got[i] for i in range(n_threads)] == alone
    assert all_free(engine)


def test_bad_engine_settings_fail_at_construction(tiny_llama):
    with pytest.raises(ParameterError, match="max_running_requests=0"):
        Engine.from_pretrained(tiny_llama, max_running_requests=0)
    with pytest.raises(ParameterError, match="page_size=0"):
        Engine.from_pretrained(tiny_llama, page_size=0)
    with pytest.raises(ParameterError, match="holds no page"):
        Engine.from_pretrained(tiny_llama, kv_cache_bytes=100)
    if not torch.cuda.is_available():
        with pytest.raises(ParameterError, match="sees no CUDA GPU"):
            Engine.from_pretrained(tiny_llama, device="cuda")
    with pytest.raises(ParameterError, match="dtype"):
        Engine.from_pretrained(tiny_llama, dtype="float32")


def test_replay_of_a_trace_ending_right_after_async_ends_the_chunk_and_frees_its_pages(tiny_llama):
    from pasta_engine import Engine

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=4 * 2**20, page_size=4)
    [r] = engine.replay(["Tips:"], ['Intro <promise topic="a" tokens="5"/><async>'], mode="pasta")
    assert r.stats.finish_reason == "stop" and r.text == "Intro "
    assert any("trace ended without a closing tag" in d for d in r.diagnostics)
    s = engine.stats()
    assert s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0


THREE_CHUNKS = ('Tips: <promise topic="a" tokens="10"/><async>Sleep well every night, it matters.</async> '
                '<promise topic="b" tokens="10"/><async>Walk daily.</async> <promise topic="c" tokens="10"/>'
                '<async>Eat greens and fruit.</async><sync/> Done with the list.')


def test_a_replay_that_fits_the_kv_cache_is_not_refused(tiny_llama):
    """A cache of exactly the pages a replay holds at its peak runs it (the per-step page bound
    counts a page only where a thread's last page is full, and fork tags only while the trace
    has chunks left); one page fewer fails it alone, with an error that names the cache."""
    big = Engine.from_pretrained(tiny_llama, kv_cache_bytes=4 * 2**20, page_size=4)
    per_page = big.model_runner.kv_cache_bytes // big.model_runner.num_pages
    peak = 0
    postprocess = big.scheduler.postprocess

    def tracked(*a, **k):
        nonlocal peak
        out = postprocess(*a, **k)
        peak = max(peak, big.block_manager.num_pages - big.block_manager.num_free)
        return out

    big.scheduler.postprocess = tracked
    [ref] = big.replay(["tips"], [THREE_CHUNKS])
    assert ref.stats.finish_reason == "stop" and ref.stats.forks == 3
    for pages in (peak, peak + 1, peak + 2, peak + 3):  # refused up to peak + 3 before
        engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=pages * per_page, page_size=4)
        assert engine.stats()["kv_pages_total"] == pages
        [r] = engine.replay(["tips"], [THREE_CHUNKS])
        assert r.stats.finish_reason == "stop" and r.token_ids == ref.token_ids, (pages, r.error)
        assert all_free(engine)
    short = Engine.from_pretrained(tiny_llama, kv_cache_bytes=(peak - 1) * per_page, page_size=4)
    [r] = short.replay(["tips"], [THREE_CHUNKS])
    assert r.stats.finish_reason == "error" and "KV cache exhausted" in r.error and all_free(short)
    # the bound counts the trace's tokens, not a large max_new_tokens the replay never reaches
    [r] = engine.replay(["tips"], [THREE_CHUNKS], params=SamplingParams(max_new_tokens=4096))
    assert r.stats.finish_reason == "stop" and r.token_ids == ref.token_ids and all_free(engine)


def test_a_prompt_that_fills_the_kv_cache_exactly_runs(tiny_llama):
    """Its prefill needs its pages and its first token no more: a prompt of every cache token,
    asked for one token, runs (it was refused for a page its first token does not take)."""
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=4 * 2**20, page_size=4)
    per_page = engine.model_runner.kv_cache_bytes // engine.model_runner.num_pages
    small = Engine.from_pretrained(tiny_llama, kv_cache_bytes=20 * per_page, page_size=4)
    for n in (77, 79, 80):
        [r] = small.generate([[5] * n], SamplingParams(max_new_tokens=1), mode="sequential")
        assert r.stats.finish_reason == "length" and len(r.token_ids) == 1 and all_free(small)
    with pytest.raises(ContextLengthError, match="the prompt's 81 tokens need 21 KV pages"):
        small.generate([[5] * 81], SamplingParams(max_new_tokens=1), mode="sequential")
    assert all_free(small)


@pytest.mark.parametrize("prompt_len", [58, 63])
def test_a_prompt_at_the_context_edge_runs_no_forward_whose_token_is_dropped(tmp_path, prompt_len):
    """With a context of 64, a prompt of n tokens leaves 64 - n positions: 64 - n tokens in
    64 - n forwards (the last token is kept without a forward whose sample would be dropped)."""
    path = build_checkpoint("tiny-llama", tmp_path / "ctx64", overrides={"max_position_embeddings": 64})
    engine = Engine.from_pretrained(path, kv_cache_bytes=4 * 2**20, page_size=4)
    [r] = engine.generate([[7] * prompt_len], SamplingParams(max_new_tokens=200), mode="sequential")
    assert r.stats.finish_reason == "length" and engine.eos_ids[0] not in r.token_ids
    assert len(r.token_ids) == 64 - prompt_len and max(r.positions) == 63
    assert r.stats.decode_steps == engine.stats()["steps"] == 64 - prompt_len
    assert all_free(engine)


def test_an_abort_after_a_preemption_keeps_what_was_streamed(tiny_llama):
    """A preempted request restarts from its prompt; aborted before the restart catches up, its
    result is what it had written (the text already streamed), not the restart's shorter one."""
    probe = Engine.from_pretrained(tiny_llama, kv_cache_bytes=4 * 2**20, page_size=4)
    per_page = probe.model_runner.kv_cache_bytes // probe.model_runner.num_pages
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=20 * per_page, page_size=4)
    sp = SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=1.0, seed=1)
    for rid, p in (("A", [5, 6, 7, 8, 9, 10, 11, 12]), ("B", [13, 14, 15, 16, 17, 18, 19, 20])):
        engine.add_request(p, sp, mode="sequential", request_id=rid)
    outs: dict[str, list] = {"A": [], "B": []}
    while engine.stats()["preemptions"] == 0:
        for o in engine.step():
            outs[o.request_id].append(o)
    victim = engine.scheduler.waiting[0].request_id
    streamed = outs[victim][-1].text
    assert streamed
    for o in engine.step():
        outs[o.request_id].append(o)
    assert engine.abort(victim)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].append(o)
    last = outs[victim][-1]
    assert last.finished and last.finish_reason == "abort"
    assert last.result.text == last.text == "".join(o.delta_text for o in outs[victim])
    assert last.result.text.startswith(streamed) and last.result.stats.finish_reason == "abort"
    assert all_free(engine)


FORKING_TIPS = ('Tips: <promise topic="a" tokens="10"/><async>Sleep well every night, it matters.</async> '
                '<promise topic="b" tokens="10"/><async>Walk daily.</async><sync/> Done.')
FORKING_LIST = ('List <promise topic="x" tokens="10"/><async>one two three</async> and <promise topic="y" '
                'tokens="10"/><async>four five</async> end<sync/> bye')


def _forking_replays(tiny_llama, abort_at: int | None = None) -> tuple[Engine, list, list]:
    """Two forking replays in a 22-page cache under a 3-token budget: "L" is preempted once and
    restarts. Aborts "L" before step ``abort_at`` (None: never). Returns the engine, the outputs
    of "L", and per step before it ran: "L"'s preemptions and per thread its sampled tokens."""
    probe = Engine.from_pretrained(tiny_llama, kv_cache_bytes=4 * 2**20, page_size=4)
    per_page = probe.model_runner.kv_cache_bytes // probe.model_runner.num_pages
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=22 * per_page, page_size=4, max_num_batched_tokens=3)
    engine.add_request([11, 12, 13], annotated_response=FORKING_TIPS, request_id="T")
    engine.add_request([14, 15, 16, 17], annotated_response=FORKING_LIST, request_id="L")
    outs, seen, n = [], [], 0
    while engine.has_unfinished_requests():
        req = engine.scheduler.get("L")
        seen.append(None if req is None else (req.preemptions, [t.n_sampled for t in req.interp.threads]))
        if n == abort_at:
            assert engine.abort("L")
        n += 1
        outs += [o for o in engine.step() if o.request_id == "L"]
    return engine, outs, seen


def test_an_abort_after_a_preemption_of_a_forking_request_keeps_what_was_streamed(tiny_llama):
    """Under a token budget a restarted forking request runs its threads at another pace: it can
    be ahead of what it had written in one chunk and behind in the main thread. Its result was
    chosen by all threads' tokens together, so an abort then gave the earlier run's text while
    the restart's (further in that chunk) had been streamed: the final text took back streamed
    text and the deltas did not add up to it. Now each thread counts on its own, and the text
    extends what was streamed, aborted at every step of that window."""
    _, _, seen = _forking_replays(tiny_llama)
    restart = next(i for i, s in enumerate(seen) if s is not None and s[0])
    written = seen[restart - 1][1]  # per thread, what it had sampled when it was preempted

    def ahead_and_behind(now: list[int]) -> bool:
        n = max(len(now), len(written))
        now, was = now + [0] * (n - len(now)), written + [0] * (n - len(written))
        return any(a > b for a, b in zip(now, was)) and any(a < b for a, b in zip(now, was))

    mixed = [i for i, s in enumerate(seen[restart:], restart) if s is not None and ahead_and_behind(s[1])]
    assert mixed, "the scenario no longer has a restart ahead in one thread and behind in another"
    for k in mixed:
        engine, outs, _ = _forking_replays(tiny_llama, abort_at=k)
        last = outs[-1]
        assert last.finished and last.finish_reason == "abort", k
        assert last.result.text == last.text == "".join(o.delta_text for o in outs), k
        assert all(last.text.startswith(o.text) for o in outs), k
        assert all_free(engine) and not engine.has_unfinished_requests()


@pytest.mark.parametrize("exc", [Boom("the detokenizer failed"), KeyboardInterrupt()])
def test_a_preempted_request_whose_text_snapshot_raises_ends_alone(tiny_llama, monkeypatch, exc):
    """Preempting a request keeps the text it had written (its result) for its restart. When
    taking that raised, the request used to be out of both queues already: it never ended, no
    step reported it, ``has_unfinished_requests()`` stayed True for good and its id stayed
    taken. Now it ends with an error naming the preemption and gets a final output, its pages
    free; an ordinary exception goes no further (the other request finishes), a Ctrl-C is raised
    again (the step's recovery ends the others)."""
    import pasta_engine.core.request as request_module

    probe = Engine.from_pretrained(tiny_llama, kv_cache_bytes=4 * 2**20, page_size=4)
    per_page = probe.model_runner.kv_cache_bytes // probe.model_runner.num_pages
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=20 * per_page, page_size=4)
    sp = SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=1.0, seed=1)
    for rid, p in (("A", [5, 6, 7, 8, 9, 10, 11, 12]), ("B", [13, 14, 15, 16, 17, 18, 19, 20])):
        engine.add_request(p, sp, mode="sequential", request_id=rid)
    final_text = request_module.render.final_text
    fired = []

    def failing(interp, *a, **k):  # only a preemption renders a running request's final text
        req = next((r for r in engine._requests.values() if r.interp is interp), None)
        if not fired and req is not None and not req.finished:
            fired.append(req.request_id)
            raise exc
        return final_text(interp, *a, **k)

    monkeypatch.setattr(request_module.render, "final_text", failing)
    outs: dict[str, list] = {"A": [], "B": []}
    raised = False
    for _ in range(300):
        try:
            for o in engine.step():
                outs[o.request_id].append(o)
        except KeyboardInterrupt:
            raised = True
        if not engine.has_unfinished_requests():
            break
    assert fired and raised == isinstance(exc, KeyboardInterrupt)
    victim, other = fired[0], "AB".replace(fired[0], "")
    last = outs[victim][-1]
    assert last.finished and last.finish_reason == "error"
    assert "preempting request" in last.error and type(exc).__name__ in last.error
    assert outs[other][-1].finished
    assert outs[other][-1].finish_reason == ("error" if raised else "length")
    assert not engine.has_unfinished_requests() and all_free(engine)
    assert not engine.abort(victim)  # nothing left to abort
    engine.add_request([5, 6], SamplingParams(max_new_tokens=2), mode="sequential", request_id=victim)  # id free
    while engine.has_unfinished_requests():
        engine.step()
    assert all_free(engine)


@pytest.mark.parametrize("options, match", [
    ({"cuda_graphs": True}, r"cuda_graphs=True needs the model on a CUDA device.*--cuda-graphs on"),
    ({"kv_cache_bytes": 100}, r"holds no page of 16 tokens .*\(--kv-cache-mb\)"),
    ({"kv_cache_bytes": 2**60}, r"more than this machine's memory.*\(--kv-cache-mb\)"),
    ({"attention_backend": "nope"}, r"attention_backend='nope'.*'torch', 'triton', 'flex'"),
    ({"attention_backend": 5}, r"attention_backend=5"),
])
def test_settings_the_runner_would_refuse_fail_before_the_weights_load(tiny_llama, monkeypatch, options, match):
    """Failure model (docs/DESIGN.md section 7): a bad setting fails before anything is loaded or
    allocated. The KV budget is checked against the checkpoint's config.json sizes."""
    import pasta_engine.engine.llm_engine as llm_engine

    def no_load(*a, **k):
        raise AssertionError("the weights loaded before the refusal")

    monkeypatch.setattr(llm_engine, "load_model", no_load)
    with pytest.raises(ParameterError, match=match):
        Engine.from_pretrained(tiny_llama, device="cpu", **options)


def test_ctrl_c_while_building_a_finished_requests_output_leaves_no_request_stuck(engine, monkeypatch):
    """A KeyboardInterrupt while ``step()`` builds the output of a request that has just
    finished (out of the scheduler already) used to leave it in the engine for good: every later
    step returned nothing, ``has_unfinished_requests()`` stayed True and its id stayed taken. It
    is forgotten now (the caller got the exception), its id free, every page back."""
    import pasta_engine.core.request as request_module

    original = request_module.Request.result
    armed = [True]

    def result(self):
        if armed[0] and self.finished:
            armed[0] = False
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(request_module.Request, "result", result)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0), mode="sequential",
                       request_id="a")
    with pytest.raises(KeyboardInterrupt):
        for _ in range(10):
            engine.step()
    for _ in range(3):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), mode="sequential", request_id="a")  # id free
    while engine.has_unfinished_requests():
        engine.step()


def test_one_step_gives_one_output_per_request_after_a_generate(engine):
    """``generate`` from the same thread advances a step-API request and keeps its outputs; the
    next ``step()`` folds them into that step's output of the request (one id, one output), and
    the deltas still concatenate to the final text."""
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=12, temperature=0.0), mode="sequential",
                       request_id="s")
    outs = engine.step()
    engine.generate([[4, 5, 6]], SamplingParams(max_new_tokens=3, temperature=0.0), mode="sequential")
    while engine.has_unfinished_requests():
        step = engine.step()
        ids = [o.request_id for o in step]
        assert len(ids) == len(set(ids)), ids
        outs += step
    mine = [o for o in outs if o.request_id == "s"]
    assert mine[-1].finished and "".join(o.delta_text for o in mine) == mine[-1].text
    assert sum((o.new_token_ids for o in mine), []) == mine[-1].result.token_ids
