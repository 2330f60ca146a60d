"""bench/model_serving_8b.py (issue 33 item 3): the step-cost model's arithmetic against shapes
computed by hand (Llama-3-8B's weight and KV bytes, a decode step and a prefill step on an H100,
a toy shape where every term is small enough to check on paper), the work read from a
scheduled batch, and the replay's step and row accounting on a tiny trace through the real
engine: two requests, one of which forks, with exact expected step counts at concurrency 1 and
2 and under a token budget that splits the prompt."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from bench_loader import load_bench  # noqa: E402  (tests/bench_loader.py)


@pytest.fixture(scope="module")
def msv():
    return load_bench("model_serving_8b.py")


# --------------------------------------------------------------------------- the cost model


def test_llama3_8b_bytes_by_hand(msv):
    shape = msv.ModelShape.from_preset("llama-3-8b")
    # one layer: q 4096*4096 = 16,777,216; k+v 2*4096*1024 = 8,388,608; o 16,777,216;
    # gate+up+down 3*4096*14336 = 176,160,768 -> 218,103,808
    assert shape.layer_linear_params == 218_103_808
    assert shape.linear_params == 32 * 218_103_808 == 6_979_321_856
    assert shape.lm_head_params == 128_256 * 4096 == 525_336_576
    assert shape.norm_params == 65 * 4096
    # (6,979,321,856 + 266,240 + 525,336,576) * 2 bytes
    assert shape.weight_bytes_per_step == 15_009_849_344
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    # 0.4 * (80e9 - (15,009,849,344 + 1,050,673,152 embedding)) // (16 * 131,072) = 25,575,791,001 // 2,097,152
    assert msv.h100_kv_pages(shape, msv.Hardware()) == 12_195


def test_8b_decode_step_is_the_weight_read(msv):
    shape, hw = msv.ModelShape.from_preset("llama-3-8b"), msv.Hardware()
    work = msv.StepWork(rows=1, sampled=1, tokens=1, kv_tokens=500, kv_tokens_plain=500, attn_pairs=500)
    c = msv.step_cost(shape, hw, work)
    # bytes: 15,009,849,344 weights + 8,192 embedding row + (500 read + 1 written) * 131,072 = 15,075,524,608
    assert c["bytes"] == 15_075_524_608
    # flops: 2 * 6,979,321,856 + 2 * 525,336,576 + 4 * 32 * 128 * 32 * 500 = 15,271,460,864
    assert c["flops"] == 15_271_460_864
    assert c["memory_s"] == pytest.approx(15_075_524_608 / 3.35e12)  # 4.5002 ms
    assert c["compute_s"] == pytest.approx(15_271_460_864 / 989.4e12)  # 15.4 us
    assert c["host_s"] == pytest.approx(63e-6)  # 58 us + 5 us * 1 row
    assert c["time_s"] == pytest.approx(4.5002e-3 + 63e-6, rel=1e-4)
    # sixteen rows cost barely more than one: the weights dominate
    work16 = msv.StepWork(rows=16, sampled=16, tokens=16, kv_tokens=8000, kv_tokens_plain=8000, attn_pairs=8000)
    c16 = msv.step_cost(shape, hw, work16)
    # 15,009,849,344 + 16 * 8,192 + (8,000 + 16) * 131,072 = 16,060,653,568 bytes; host 58 + 16 * 5 us
    assert c16["bytes"] == 16_060_653_568
    assert c16["time_s"] == pytest.approx(16_060_653_568 / 3.35e12 + 138e-6)  # 4.932 ms against 4.563 ms
    assert c16["time_s"] / c["time_s"] == pytest.approx(1.0809, abs=1e-4)


def test_8b_long_prefill_is_compute_bound(msv):
    shape, hw = msv.ModelShape.from_preset("llama-3-8b"), msv.Hardware()
    pairs = 2048 * 2049 // 2  # one row, 2048 new tokens, causal
    assert msv.attention_pairs(2048, 2048) == pairs == 2_098_176
    work = msv.StepWork(rows=1, sampled=1, tokens=2048, kv_tokens=2048, kv_tokens_plain=2048, attn_pairs=pairs)
    c = msv.step_cost(shape, hw, work)
    # 2 * 6,979,321,856 * 2048 + 2 * 525,336,576 + 524,288 * 2,098,176
    assert c["flops"] == 28_587_302_322_176 + 1_050_673_152 + 1_100_048_498_688
    assert c["compute_s"] > c["memory_s"]
    assert c["time_s"] == pytest.approx(c["flops"] / 989.4e12 + 63e-6)  # about 30.0 ms


def test_toy_shape_every_term_by_hand(msv):
    shape = msv.ModelShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10)
    assert shape.layer_linear_params == 16 + 16 + 16 + 96  # q, k+v, o, mlp
    assert shape.weight_bytes_per_step == (288 + 20 + 40) * 2 == 696
    assert shape.kv_bytes_per_token == 16
    hw = msv.Hardware(hbm_bytes_per_s=1000.0, flops_per_s=2000.0, host_fixed_s=0.5, host_per_row_s=0.25)
    work = msv.StepWork(rows=2, sampled=1, tokens=3, kv_tokens=10, kv_tokens_plain=12, attn_pairs=9)
    c = msv.step_cost(shape, hw, work)
    assert c["bytes"] == 696 + 3 * 4 * 2 + (10 + 3) * 16 == 928
    assert c["flops"] == 2 * 288 * 3 + 2 * 40 * 1 + 32 * 9 == 2096
    assert c["time_s"] == pytest.approx(2096 / 2000 + 0.5 + 0.5)  # compute-bound: 1.048 > 0.928
    one = msv.step_cost(shape, hw, msv.StepWork(1, 1, 1, 10, 10, 10))
    assert one["bytes"] == 696 + 8 + 11 * 16 == 880 and one["flops"] == 576 + 80 + 320
    assert one["time_s"] == pytest.approx(0.880 + 0.5 + 0.25)  # memory-bound
    assert msv.step_cost(shape, hw, msv.StepWork(0, 0, 0, 0, 0, 0))["time_s"] == 0.0


def test_attention_pairs(msv):
    assert msv.attention_pairs(1, 10) == 10
    assert msv.attention_pairs(3, 3) == 6
    assert msv.attention_pairs(2, 5) == 2 * 3 + 3
    with pytest.raises(ValueError):
        msv.attention_pairs(4, 3)


def test_step_work_counts_shared_segments_once(msv):
    def thread(tokens, sample, runs):
        return SimpleNamespace(step=SimpleNamespace(tokens=tokens, sample=sample), runs=runs)

    batch = SimpleNamespace(threads=[
        thread([1], True, [(0, [0, 1], [16, 4]), (1, [2], [3])]),   # parent: shared 20 + own 3
        thread([1], True, [(0, [0, 1], [16, 4]), (2, [3], [2])]),   # child: shared 20 + own 2
        thread([5, 6, 7], False, [(3, [4], [3])]),                  # a prefill piece that samples nothing
    ])
    w = msv.step_work(batch)
    assert (w.rows, w.sampled, w.tokens) == (3, 2, 5)
    assert w.kv_tokens == 20 + 3 + 2 + 3
    assert w.kv_tokens_plain == 23 + 22 + 3
    assert w.attn_pairs == 23 + 22 + 6


# --------------------------------------------------------------------------- the replay's accounting


MAIN_BEFORE, MAIN_AFTER, CHUNK, PLAIN = "Tips:\n1. ", "\nDone.", "Sleep well and eat well.", "The quick brown fox."


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from pasta_engine import Engine
    from pasta_engine.lang.tags import promise_tag

    def engine(**kw):
        return msv_mod.record_steps(Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20,
                                                           max_running_requests=4, **kw))

    msv_mod = load_bench("model_serving_8b.py")
    promise = promise_tag("sleep", 10)
    probe = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20)
    n = lambda text: len(probe.encode(text))  # noqa: E731
    counts = SimpleNamespace(
        plain=n(PLAIN) + 1,  # its tokens, then EOS
        before=n(MAIN_BEFORE), promise=n(promise), after=n(MAIN_AFTER) + 1,  # main thread, EOS last
        chunk=n(CHUNK) + n("</async>"),  # the child: its content, then the close tag
        prompt=len(probe.format_prompt("Q?", "pasta")))
    forking = MAIN_BEFORE + promise + "<async>" + CHUNK + "</async>" + MAIN_AFTER
    jobs = [msv_mod.Job("Q?", PLAIN), msv_mod.Job("Q?", forking)]
    return SimpleNamespace(engine=engine, counts=counts, jobs=jobs, msv=msv_mod)


def _expected(k):
    """Hand counts: a request's decode steps are its sampled tokens on the critical path (the
    prefill step samples the first token). The plain request samples ``plain`` tokens in as many
    steps; the forking one forks when its main thread samples the promise's last token (step
    ``before + promise``), the child samples its first token in the next step, and the request
    ends when the later of its threads does."""
    fork_step = k.before + k.promise
    return SimpleNamespace(plain=k.plain, fork=fork_step + max(k.after, k.chunk), fork_step=fork_step,
                           sampled=k.plain + k.before + k.promise + k.after + k.chunk)


def test_replay_steps_at_concurrency_1(tiny):
    k, msv = tiny.counts, tiny.msv
    e = _expected(k)
    shape, hw = msv.ModelShape.from_preset("llama-3-8b"), msv.Hardware()
    records, steps, duration = msv.run_point(tiny.engine(), tiny.jobs, "pasta", shape, hw, concurrency=1)
    rows = [s[1] for s in steps]
    sampled = [s[2] for s in steps]
    tokens = [s[3] for s in steps]
    assert [r["decode_steps"] for r in records] == [e.plain, e.fork]
    assert [r["forks"] for r in records] == [0, 1]
    assert len(steps) == e.plain + e.fork  # one after the other: the second is sent when the first ends
    assert records[1]["sent_step"] == e.plain and records[1]["last_step"] == len(steps) - 1
    # one row a step, except while the child runs beside the main thread: exactly its sampled tokens
    assert sum(rows) == sum(sampled) == e.sampled
    two = [i for i, r in enumerate(rows) if r == 2]
    assert two[0] == e.plain + e.fork_step and len(two) == min(k.after, k.chunk)
    assert max(rows) == 2
    assert tokens[0] == k.prompt
    # the modelled clock: every step priced, each request's latency the sum of its steps
    times = [s[7] for s in steps]
    assert duration == pytest.approx(sum(times))
    assert records[0]["e2e_s"] == pytest.approx(sum(times[:e.plain]))
    assert records[1]["e2e_s"] == pytest.approx(sum(times[e.plain:]))
    assert records[0]["ttft_s"] == pytest.approx(times[0])
    first = msv.StepWork(*[int(x) for x in steps[0][1:7]])
    assert steps[0][7] == pytest.approx(msv.step_cost(shape, hw, first)["time_s"])


def test_replay_steps_at_concurrency_2_and_under_a_budget(tiny):
    k, msv = tiny.counts, tiny.msv
    e = _expected(k)
    shape, hw = msv.ModelShape.from_preset("llama-3-8b"), msv.Hardware()
    records, steps, _ = msv.run_point(tiny.engine(), tiny.jobs, "pasta", shape, hw, concurrency=2)
    assert len(steps) == max(e.plain, e.fork)  # both admitted in the first step
    assert steps[0][1] == 2 and steps[0][3] == 2 * k.prompt  # two prompts prefilled together (no cache hit yet)
    assert sum(s[2] for s in steps) == e.sampled
    assert [r["decode_steps"] for r in records] == [e.plain, e.fork]
    # a budget under the prompt's length: the prompt is prefilled in budget-sized pieces, the
    # pieces before the last sample nothing; nothing else changes for a request alone
    budget = k.prompt // 2 + 1  # two pieces
    records, steps, _ = msv.run_point(tiny.engine(max_num_batched_tokens=budget, thread_policy="fcfs"),
                                      tiny.jobs[:1], "pasta", shape, hw, concurrency=1)
    assert len(steps) == math.ceil(k.prompt / budget) - 1 + e.plain
    assert [s[3] for s in steps[:2]] == [budget, k.prompt - budget] and [s[2] for s in steps[:2]] == [0, 1]
    assert records[0]["decode_steps"] == e.plain


def test_sequential_jobs_are_the_clean_text(msv):
    from pasta_engine.lang.tags import clean_text

    pasta, seq = msv.load_jobs("pasta", 3), msv.load_jobs("sequential", 3)
    assert [j.instruction for j in pasta] == [j.instruction for j in seq]
    assert [clean_text(j.response) for j in pasta] == [j.response for j in seq]
    assert any("<promise" in j.response for j in pasta) and not any("<promise" in j.response for j in seq)
    base = msv.load_jobs("base", 3)
    assert [j.instruction for j in base] == [j.instruction for j in pasta]
    with pytest.raises(ValueError):
        msv.load_jobs("nope", 1)
