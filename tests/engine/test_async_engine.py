"""The async engine: one background thread owns the step loop; outputs are async iterators;
cancelling one aborts its request and frees its pages; an error it cannot pin on one request
marks it dead (EngineDeadError for every open and later request)."""

from __future__ import annotations

import asyncio

import pytest

from pasta_engine import AsyncEngine, ContextLengthError, Engine, EngineDeadError, ParameterError, SamplingParams
from pasta_engine.engine.async_engine import format_chat

ANNOTATED = ('Tips: <promise topic="a" tokens="10"/><async>Sleep early and often.</async> and '
             '<promise topic="b" tokens="10"/><async>Walk.</async><sync/> Then the rest of it.')
PROMPTS = [[5 + i % 20, 9, 10 + i % 7, 11] for i in range(32)]
PARAMS = [SamplingParams(max_new_tokens=8 + i % 9, temperature=0.0 if i % 4 == 0 else 0.9, seed=200 + i)
          for i in range(32)]
MODES = ["pasta" if i % 2 else "sequential" for i in range(32)]


def _engine(tiny_llama) -> Engine:
    return Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, page_size=4, max_running_requests=8)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """What generate() and replay() give for the requests below, on an engine of its own."""
    eng = _engine(tiny_llama)
    gen = [None] * len(PROMPTS)
    for mode in ("pasta", "sequential"):
        idx = [i for i, m in enumerate(MODES) if m == mode]
        for i, r in zip(idx, eng.generate([PROMPTS[i] for i in idx], [PARAMS[i] for i in idx], mode=mode)):
            gen[i] = r
    rep = eng.replay(["Give me tips."], [ANNOTATED])[0]
    return gen, rep


@pytest.fixture(scope="module")
def aengine(tiny_llama):
    a = AsyncEngine(_engine(tiny_llama))
    yield a
    a.shutdown()


def all_pages_free(stats: dict) -> bool:
    return stats["kv_pages_free"] == stats["kv_pages_total"] and stats["running"] == stats["waiting"] == 0


def test_stream_of_a_replay_concatenates_to_the_result(aengine, reference):
    async def main():
        outs = [o async for o in aengine.generate("Give me tips.", annotated_response=ANNOTATED, events=True,
                                                     output_kind="delta")]
        return outs

    outs = asyncio.run(main())
    final = outs[-1]
    assert final.finished and final.finish_reason == "stop" and all(not o.finished for o in outs[:-1])
    assert "".join(o.text for o in outs) == final.result.text == reference[1].text
    assert final.result.token_ids == reference[1].token_ids
    assert sum(len(o.token_ids) for o in outs) == final.stats.tokens_decoded
    kinds = [(e.kind, e.thread) for o in outs for e in o.events]
    assert kinds.count(("fork", 1)) == kinds.count(("fork", 2)) == 1 and kinds[-1] == ("finish", 0)
    assert final.decode_steps == final.stats.decode_steps and final.tokens_decoded == final.stats.tokens_decoded


def test_cancel_mid_stream_frees_every_page(aengine):
    async def main():
        started = asyncio.Event()
        got = []

        async def consume():
            async for out in aengine.generate([7, 8, 9], SamplingParams(max_new_tokens=500), mode="sequential"):
                got.append(out)
                if len(got) == 3:
                    started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        during = await aengine.stats()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = await aengine.stats()  # runs on the engine thread after the abort
        # closing a generator early (break + aclose) aborts too
        agen = aengine.generate([7, 8, 9], SamplingParams(max_new_tokens=500), mode="sequential")
        async for _ in agen:
            break
        await agen.aclose()
        return got, during, after, await aengine.stats()

    got, during, after, after_close = asyncio.run(main())
    assert not got[-1].finished
    assert during["running"] == 1 and during["kv_pages_free"] < during["kv_pages_total"]
    assert all_pages_free(after)
    assert all_pages_free(after_close)


def test_32_concurrent_requests_some_cancelled_some_bad(aengine, reference):
    gen_ref, rep_ref = reference
    kinds = ["delta", "cumulative", "final"]
    cancel = {3, 10, 17, 24}
    bad = {5: dict(mode="fast"), 12: dict(prompt=[]), 19: dict(prompt=[7] * 5000), 26: dict(output_kind="all")}

    first = {i: asyncio.Event() for i in cancel}

    async def one(i: int):
        kw = dict(prompt=PROMPTS[i], params=PARAMS[i], mode=MODES[i], output_kind=kinds[i % 3])
        if i in cancel:  # long enough to be mid-stream when cancelled; pages leak unless the abort frees them
            kw.update(params=SamplingParams(max_new_tokens=400), output_kind="delta")
        kw.update(bad.get(i, {}))
        outs = []
        async for out in aengine.generate(**kw):
            outs.append(out)
            if i in cancel:
                first[i].set()
        return outs

    async def replay():
        return [o async for o in aengine.generate("Give me tips.", annotated_response=ANNOTATED, output_kind="delta")]

    async def main():
        tasks = [asyncio.create_task(one(i)) for i in range(32)] + [asyncio.create_task(replay())]
        for i in cancel:
            await first[i].wait()
            tasks[i].cancel()  # the consumer goes away mid-stream
        done = await asyncio.gather(*tasks, return_exceptions=True)
        return done, await aengine.stats()

    done, stats = asyncio.run(main())
    for i in range(32):
        got = done[i]
        if i in bad:
            assert isinstance(got, ParameterError), (i, got)
            assert got.param == {5: "mode", 12: "prompt", 19: "prompt", 26: "output_kind"}[i]
            if i == 19:
                assert isinstance(got, ContextLengthError)
            continue
        if i in cancel:
            assert isinstance(got, asyncio.CancelledError)
            continue
        ref = gen_ref[i]
        final = got[-1]
        assert final.finished and final.finish_reason in ("stop", "length")
        assert final.result.token_ids == ref.token_ids, i  # the same tokens as generate()
        kind = kinds[i % 3]
        if kind == "delta":
            assert "".join(o.text for o in got) == ref.text
            toks = [t for o in got for t in o.token_ids]
        else:
            assert final.text == ref.text
            toks = final.token_ids
            if kind == "final":
                assert len(got) == 1
        assert len(toks) == ref.stats.tokens_decoded
        if MODES[i] == "sequential":
            assert toks == ref.token_ids
    assert "".join(o.text for o in done[32]) == rep_ref.text
    assert all_pages_free(stats)


def test_a_lagging_consumer_gets_merged_deltas(aengine, reference):
    async def main():
        stream = await aengine.add_request(PROMPTS[1], PARAMS[1], MODES[1])
        while (await aengine.stats())["open"]:  # each call waits for the engine thread: the request runs
            pass
        return [o async for o in stream]

    outs = asyncio.run(main())
    ref = reference[0][1]
    assert len(outs) == 1 and outs[0].finished  # everything merged into the one pending output
    assert outs[0].text == ref.text and outs[0].token_ids == ref.token_ids


def test_the_default_output_is_cumulative_in_vllms_shape(aengine, reference):
    # issue 31 item 5: vLLM's AsyncLLM yields cumulative text in outputs[0].text; ours yielded deltas
    async def main():
        return [o async for o in aengine.generate("Give me tips.", annotated_response=ANNOTATED)]

    outs = asyncio.run(main())
    assert len(outs) >= 2
    texts = [o.outputs[0].text for o in outs]
    assert all(a == o.text for a, o in zip(texts, outs))
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each holds everything so far
    assert texts[-1] == reference[1].text
    assert len(outs[-1].outputs[0].token_ids) == outs[-1].stats.tokens_decoded  # every sampled token, so far
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[0].outputs[0].finish_reason is None
    assert outs[-1].outputs[0].index == 0


def test_stop_strings_end_the_stream_and_free_its_pages(aengine):
    async def main():
        outs = [o async for o in aengine.generate("Give me tips.", annotated_response=ANNOTATED, stop=["rest", "zzz"],
                                                     output_kind="delta")]
        return outs, await aengine.stats()

    outs, stats = asyncio.run(main())
    final = outs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == "rest"
    assert "".join(o.text for o in outs) == "Tips: Sleep early and often. and Walk. Then the "
    assert all_pages_free(stats)


def test_bad_arguments_raise_before_anything_is_queued(aengine):
    async def main():
        for kw, param in ((dict(stop=[""]), "stop"), (dict(events="yes"), "events"), (dict(output_kind=3), "output_kind"),
                          (dict(prompt=[{"role": "robot", "content": "x"}]), "messages")):
            args = {"prompt": [5, 6], **kw}
            with pytest.raises(ParameterError) as e:
                await aengine.add_request(**args)
            assert e.value.param == param
        s1 = await aengine.add_request([5, 6], request_id="dup")
        with pytest.raises(ParameterError, match="already in use"):
            await aengine.add_request([5, 6], request_id="dup")
        assert await aengine.abort("dup") is True
        assert await aengine.abort("dup") is False
        outs = [o async for o in s1]
        return outs, await aengine.stats()

    outs, stats = asyncio.run(main())
    assert outs[-1].finish_reason == "abort"
    assert all_pages_free(stats)


def test_format_chat_matches_the_engines_string_prompts(aengine):
    eng = aengine.engine
    msgs = [{"role": "user", "content": "Name three fruits."}]
    for mode in ("pasta", "sequential"):
        assert format_chat(eng, msgs, mode) == eng.format_prompt("Name three fruits.", mode)
    with_system = format_chat(eng, [{"role": "system", "content": "Be brief."}, *msgs], "pasta")
    assert eng.decode(with_system).count("Be brief.") == 1
    parts = format_chat(eng, [{"role": "user", "content": [{"type": "text", "text": "Name three fruits."}]}], "pasta")
    assert parts == format_chat(eng, msgs, "pasta")
    with pytest.raises(ParameterError, match="last message"):
        format_chat(eng, [*msgs, {"role": "assistant", "content": "ok"}])


def test_an_error_it_cannot_pin_on_one_request_marks_the_engine_dead(tiny_llama):
    eng = _engine(tiny_llama)
    real_run = eng.model_runner.run
    calls = []

    def run(batch):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device lost")
        return real_run(batch)

    eng.model_runner.run = run
    a = AsyncEngine(eng)

    async def consume(i):
        return [o async for o in a.generate([5, 6, 7 + i], SamplingParams(max_new_tokens=50), mode="sequential")]

    async def main():
        results = await asyncio.gather(*(consume(i) for i in range(3)), return_exceptions=True)
        later = []
        for call in (lambda: a.add_request([5, 6]), a.stats, a.check_health, lambda: a.abort("x")):
            try:
                await call()
            except EngineDeadError as e:
                later.append(e)
        return results, later

    results, later = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results), results
    assert len(later) == 4
    assert a.errored and not a.is_running and "device lost" in str(a.dead_error)
    assert all_pages_free(eng.stats())  # the step's failure freed every running request's pages
    a.shutdown()


def test_shutdown_aborts_open_requests_and_refuses_later_ones(tiny_llama):
    a = AsyncEngine(_engine(tiny_llama))
    engine_shutdowns = []
    real_shutdown = a.engine.shutdown
    a.engine.shutdown = lambda: (engine_shutdowns.append(1), real_shutdown())  # what stops tensor-parallel workers

    async def main():
        stream = await a.add_request([5, 6, 7], SamplingParams(max_new_tokens=400), mode="sequential")
        first = await stream.__anext__()
        await asyncio.to_thread(a.shutdown)
        rest = [o async for o in stream]
        with pytest.raises(EngineDeadError, match="shut down"):
            await a.add_request([5, 6])
        return first, rest

    first, rest = asyncio.run(main())
    assert not first.finished and rest[-1].finish_reason == "abort"
    assert not a.is_running and all_pages_free(a.engine.stats())
    assert engine_shutdowns == [1]  # the engine's own shutdown ran once, on the engine thread
    a.shutdown()  # twice is fine
    assert engine_shutdowns == [1]


def test_streams_through_preemptions_send_each_token_and_character_once(tiny_llama):
    """A cache that preempts: the async engine, reading only the engine's RequestOutputs, sends
    no token twice and no text twice when a request restarts, and no logprob twice: each
    output's logprobs concatenate to the result's (a restart re-decodes the same tokens)."""
    probe = Engine.from_pretrained(tiny_llama, kv_cache_bytes=2**20, page_size=4)
    per_page = probe.model_runner.kv_cache_bytes // probe.stats()["kv_pages_total"]
    tight = AsyncEngine(Engine.from_pretrained(tiny_llama, kv_cache_bytes=24 * per_page, page_size=4,
                                               max_running_requests=4))
    idx = [i for i in range(8) if MODES[i] == "sequential"] + [0]  # 0 twice: two requests, same tokens
    params = [SamplingParams(max_new_tokens=40, temperature=PARAMS[i].temperature, seed=PARAMS[i].seed,
                             return_logprobs=True) for i in idx]

    async def one(k):
        return [o async for o in tight.generate(PROMPTS[idx[k]], params[k], mode="sequential", output_kind="delta")]

    async def main():
        return await asyncio.gather(*(one(k) for k in range(len(idx)))), await tight.stats()

    try:
        runs, stats = asyncio.run(main())
    finally:
        tight.shutdown()
    assert stats["preemptions"] >= 1
    for outs in runs:
        final = outs[-1]
        assert final.finish_reason in ("stop", "length")
        assert [t for o in outs for t in o.token_ids] == final.result.token_ids  # sequential: in order, once
        assert "".join(o.text for o in outs) == final.result.text
        lps = [e for o in outs for e in o.logprobs]
        assert [t for t, _ in lps] == final.result.token_ids
        assert [lp for _, lp in lps] == pytest.approx(final.result.logprobs, abs=1e-4)
    assert any(o[-1].stats.preemptions for o in runs)


def test_a_task_cancelled_after_its_request_was_accepted_aborts_it(aengine):
    """The engine accepted the request and handed its id to the caller's future, but the task was
    cancelled before it resumed from add_request: add_request aborts the request itself (nobody
    else knows its id), instead of letting it decode to max_new_tokens."""
    real_accept = aengine._accept
    task = None

    def accept_then_cancel(fut, rid, *rest):
        real_accept(fut, rid, *rest)  # the id is handed over...
        task.cancel()  # ...and the task is cancelled before it resumes from `await fut`

    async def main():
        nonlocal task
        before = await aengine.stats()
        aengine._accept = accept_then_cancel
        try:
            task = asyncio.create_task(aengine.add_request(
                [7, 8, 9], SamplingParams(max_new_tokens=400, ignore_eos=True), mode="sequential", request_id="late"))
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            del aengine._accept
        while (s := await aengine.stats())["open"] or s["running"] or s["waiting"]:
            await asyncio.sleep(0.01)
        return before, s

    before, after = asyncio.run(main())
    assert after["steps"] - before["steps"] < 400  # aborted, not decoded to the end
    assert all_pages_free(after)


def test_a_bad_command_fails_its_caller_alone(aengine):
    """abort() with an id that is not a string is refused (ParameterError naming request_id); a
    command that fails on the engine thread anyway fails its own caller, and the engine (and
    every other request) goes on."""
    async def main():
        other = await aengine.add_request([7, 8, 9], SamplingParams(max_new_tokens=30, ignore_eos=True),
                                          mode="sequential")
        for bad in (["x"], None, 5):
            with pytest.raises(ParameterError, match="request id string") as e:
                await asyncio.wait_for(aengine.abort(bad), 10)
            assert e.value.param == "request_id"
        # past the check, the engine thread's own handling of a command that raises (Engine.abort
        # refuses the id there too)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        aengine._post_command(("abort", ["x"], loop, fut))
        with pytest.raises(ParameterError):
            await asyncio.wait_for(fut, 10)
        outs = [o async for o in other]
        return outs, await aengine.stats()

    outs, stats = asyncio.run(main())
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 30
    assert aengine.is_running and all_pages_free(stats)


def test_a_dying_engine_settles_the_command_in_flight_and_shuts_the_engine_down(tiny_llama):
    """An error that ends the engine thread while it handles a command: that command's caller
    gets EngineDeadError (it was off the queue, so nothing else would settle it), and the thread's
    last act is Engine.shutdown() (what stops tensor-parallel workers), once."""
    a = AsyncEngine(_engine(tiny_llama))
    engine_shutdowns = []
    real_shutdown = a.engine.shutdown
    a.engine.shutdown = lambda: (engine_shutdowns.append(1), real_shutdown())

    def fatal():
        raise SystemExit("the engine thread ends")  # not an Exception: it escapes the command's handling

    async def main():
        with pytest.raises(EngineDeadError, match="SystemExit"):
            await asyncio.wait_for(a._call(fatal), 10)
        with pytest.raises(EngineDeadError):
            await a.stats()

    asyncio.run(main())
    a.shutdown()  # waits for the thread
    assert a.errored and not a.is_running
    assert engine_shutdowns == [1]
    a.shutdown()
    assert engine_shutdowns == [1]


def test_a_dead_async_engine_stops_its_tensor_parallel_workers(tiny_llama):
    """A step error kills the async engine; its thread then shuts the engine down: no worker
    process and no process group is left (a new tensor-parallel engine may start)."""
    import torch.distributed as dist

    eng = Engine.from_pretrained(tiny_llama, tensor_parallel_size=2, kv_cache_bytes=8 * 2**20, page_size=4)
    procs = list(eng.model.procs)
    a = AsyncEngine(eng)
    try:
        eng.model.fail_next_step(1, after_reduces=1)

        async def main():
            with pytest.raises(EngineDeadError, match="TensorParallelStepError"):
                async for _ in a.generate([7, 8, 9], mode="sequential"):
                    pass

        asyncio.run(main())
        a.shutdown()  # waits for the engine thread, whose last act stopped the workers
        assert a.errored
        assert not [p for p in procs if p.is_alive()]
        assert not dist.is_initialized()
    finally:
        a.shutdown()
        eng.shutdown()  # the old code left them running: do not leak them into later tests


def test_a_stale_stream_abort_leaves_a_request_that_reused_the_id_alone(aengine):
    """A stream closed before reading its request's final output posts an abort; if the id was
    reused meanwhile (the engine frees an id once the final output is out), the new request of
    another caller is not aborted."""
    async def main():
        old = await aengine.add_request([7, 8, 9], SamplingParams(max_new_tokens=2, ignore_eos=True),
                                        mode="sequential", request_id="job")
        while (await aengine.stats())["open"]:  # finished in the engine; its final output waits unread
            await asyncio.sleep(0.01)
        new = await aengine.add_request([7, 8, 9], SamplingParams(max_new_tokens=200, ignore_eos=True),
                                        mode="sequential", request_id="job")
        old.abort()  # stale: its request finished
        outs = [o async for o in new]
        # the stream's own abort still works while its request runs
        third = await aengine.add_request([7, 8, 9], SamplingParams(max_new_tokens=400, ignore_eos=True),
                                          mode="sequential", request_id="job")
        third.abort()
        while (s := await aengine.stats())["open"] or s["running"] or s["waiting"]:
            await asyncio.sleep(0.01)
        return outs, s

    outs, stats = asyncio.run(main())
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 200
    assert all_pages_free(stats)


def test_token_bytes_and_decode_tokens_refuse_ids_outside_the_vocabulary(aengine):
    """A negative id would read another token's bytes (Python's negative index), True would be
    token 1: both are refused, naming token_ids, as are non-integers and ids past the vocabulary."""
    vocab = aengine.engine.input_processor.vocab_size

    async def main():
        for call in (aengine.token_bytes, aengine.decode_tokens):
            for bad in ([-1], [True], [vocab], [5, 2**70], [1.0], ["5"], [None], "5", 5):
                with pytest.raises(ParameterError) as e:
                    await call(bad)
                assert e.value.param == "token_ids", (call, bad)
        good = await aengine.token_bytes([vocab - 1, 0]), await aengine.decode_tokens([vocab - 1, 0])
        return good, await aengine.stats()

    (raw, texts), stats = asyncio.run(main())
    assert len(raw) == len(texts) == 2 and all(isinstance(b, bytes) for b in raw)
    assert stats["open"] == 0
