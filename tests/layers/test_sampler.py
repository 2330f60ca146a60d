"""One sampling call per step picks the tokens per-request sampling picks, for the same seeds."""

from __future__ import annotations

import pytest
import torch

from pasta_engine.config import SamplingParams
from pasta_engine.layers.sampler import draw_noise, logprobs_of, request_generator, sample, sample_batch

VOCAB = 97

MIXED = [
    SamplingParams(temperature=0.0, seed=0),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.3, top_k=5, seed=2),
    SamplingParams(temperature=0.9, top_p=0.6, seed=3),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=4),
    SamplingParams(temperature=1.0, top_k=VOCAB + 3, seed=5),  # top_k past the vocabulary: no filter
    SamplingParams(temperature=2.0, top_p=1e-6, seed=6),  # keeps one token
]


def _batched(params: list[SamplingParams], sizes: list[int], logits: torch.Tensor, gens) -> torch.Tensor:
    n, dev = logits.shape[0], logits.device
    rows = [p for p, m in zip(params, sizes) for _ in range(m)]
    greedy = torch.tensor([p.greedy for p in rows], device=dev)
    temp = torch.tensor([[1.0 if p.greedy else p.temperature] for p in rows], device=dev)
    top_k = torch.tensor([[p.top_k if not p.greedy and 0 < p.top_k < VOCAB else VOCAB] for p in rows], device=dev)
    top_p = torch.tensor([[p.top_p if not p.greedy and p.top_p < 1.0 else float("inf")] for p in rows], device=dev)
    noise = torch.ones(n, VOCAB, device=dev)
    at = 0
    for p, m, g in zip(params, sizes, gens):
        if not p.greedy:
            draw_noise(noise[at : at + m], g)
        at += m
    tokens, bad = sample_batch(logits, greedy, temp, top_k, top_p, noise)
    assert not bad.any()
    return tokens


def _compare(seed: int, device: str) -> None:
    torch.manual_seed(seed)
    order = torch.randperm(len(MIXED)).tolist()
    params = [MIXED[i] for i in order]
    sizes = torch.randint(1, 5, (len(params),)).tolist()
    steps = 5
    per_gens = [torch.Generator(device=device).manual_seed(p.seed) for p in params]
    batch_gens = [torch.Generator(device=device).manual_seed(p.seed) for p in params]
    for _ in range(steps):  # several steps: each generator's stream advances alike
        logits = torch.randn(sum(sizes), VOCAB).to(device) * 4
        expect, at = [], 0
        for p, m, g in zip(params, sizes, per_gens):
            expect.append(sample(logits[at : at + m], p, g))
            at += m
        expect = torch.cat(expect)
        got = _batched(params, sizes, logits, batch_gens)
        assert torch.equal(got, expect)
        torch.testing.assert_close(logprobs_of(logits, got), logprobs_of(logits, expect), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_one_call_for_all_requests_equals_per_request_sampling(seed):
    _compare(seed, "cpu")


@pytest.mark.gpu
def test_one_call_equals_per_request_sampling_on_cuda():
    """On CUDA too (``torch.multinomial`` draws its Exp(1) race from the CUDA generator)."""
    for seed in range(6):
        _compare(seed, "cuda")


def _stream(gen: torch.Generator) -> torch.Tensor:
    return draw_noise(torch.empty(2, VOCAB), gen)


@pytest.mark.parametrize("seed", [0, 5, 2**31 + 7, 2**32 - 1, 2**32 + 5, 2**40 + 3, 2**63, 2**64 - 2**32 - 1])
def test_seeds_a_multiple_of_2_32_apart_draw_different_streams(seed):
    """A CPU generator's manual_seed keeps only a seed's low 32 bits: seeds s and s + k * 2**32
    (a server's fresh 64-bit seeds too) drew the same numbers. A request's generator is a
    function of the whole seed: the same seed, the same stream; two seeds, two streams."""
    again = request_generator(seed)
    first = _stream(request_generator(seed))
    assert torch.equal(first, _stream(again))  # a seed is reproducible
    assert again.initial_seed() == seed
    for k in (1, 2, 2**31):
        other = seed + k * 2**32
        if other < 2**64:
            assert not torch.equal(first, _stream(request_generator(other))), (seed, other)
    if seed < 2**32:  # a seed below 2**32 draws what manual_seed always gave it (recorded goldens stay)
        assert torch.equal(first, _stream(torch.Generator().manual_seed(seed)))


@pytest.mark.gpu
def test_cuda_seeds_a_multiple_of_2_32_apart_draw_different_streams():
    """CUDA's Philox generator takes all 64 bits of a seed (manual_seed)."""
    for seed in (5, 2**40 + 3):
        first = draw_noise(torch.empty(2, VOCAB, device="cuda"), request_generator(seed, "cuda"))
        again = draw_noise(torch.empty(2, VOCAB, device="cuda"), request_generator(seed, "cuda"))
        other = draw_noise(torch.empty(2, VOCAB, device="cuda"), request_generator(seed + 2**32, "cuda"))
        assert torch.equal(first, again) and not torch.equal(first, other)


def test_request_generator_refuses_a_seed_out_of_range():
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="seed must be in"):
            request_generator(bad)
    assert _stream(request_generator(2**64 - 1)).isfinite().all()


def test_requests_whose_seeds_differ_by_2_32_sample_differently(tiny_engine):
    """Through the engine (the sampler's per-request generator): seeds s and s + 2**32 gave one
    stream, so the same prompt gave the same tokens; the same seed still does."""
    s = 12345
    prompts = [[5, 6, 7]] * 4
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=x) for x in (s, s + 2**32, s, s + 2**33)]
    a, b, c, d = [r.token_ids for r in tiny_engine.generate(prompts, params, mode="sequential")]
    assert a == c  # the same seed: the same tokens
    assert a != b and a != d and b != d
    [again] = tiny_engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, temperature=1.0, seed=s + 2**32),
                                   mode="sequential")
    assert again.token_ids == b


def test_a_bad_distribution_is_flagged_not_sampled():
    logits = torch.randn(3, VOCAB)
    logits[1, 4] = float("nan")
    noise = draw_noise(torch.ones(3, VOCAB), torch.Generator().manual_seed(0))
    _, bad = sample_batch(logits, torch.tensor([False, False, True]), torch.ones(3, 1), None, None, noise)
    assert bad.tolist() == [False, True, False]


def test_all_greedy_is_argmax():
    logits = torch.randn(4, VOCAB)
    tokens, bad = sample_batch(logits, torch.ones(4, dtype=torch.bool), torch.ones(4, 1), None, None, None)
    assert torch.equal(tokens, logits.argmax(-1)) and not bad.any()  # finite logits: no row is bad


def test_repetition_penalty_follows_the_ctrl_rule():
    from pasta_engine.layers.sampler import apply_repetition_penalty

    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [3.0, 3.0, -1.0, 0.0]])
    out = apply_repetition_penalty(logits, [0], [[0, 1, 1]], [2.0])
    # row 0: seen 0 (positive: divided) and 1 (negative: multiplied), once each however often seen
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5], [3.0, 3.0, -1.0, 0.0]]
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = torch.tensor([[0, 1, 1], [2, 3, 3]])
    want = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    got = apply_repetition_penalty(logits, [0, 1], [[0, 1, 1], [2, 3, 3]], [1.3, 1.3])
    torch.testing.assert_close(got, want)
    for tiny in (0.0, 1e-45, 5e-324, 0.0099):  # issue 31 item 10: 1e-45 made the logits inf/NaN
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=tiny)
    SamplingParams(repetition_penalty=0.01)


def test_a_non_finite_logit_row_fails_its_request_alone(tiny_llama):
    """A row of NaN or +inf logits (weights that are not finite) ends its request with an error,
    greedy or sampled, and the other requests of the step go on; -inf (a mask) is no fault."""
    from pasta_engine import Engine
    from pasta_engine.layers.sampler import sample_batch

    logits = torch.tensor([[0.0, 1.0, float("-inf")], [float("nan"), 0.0, 1.0], [0.0, float("inf"), 1.0]])
    _, bad = sample_batch(logits, torch.tensor([True, True, True]), torch.ones(3, 1), None, None, None)
    assert bad.tolist() == [False, True, True]
    _, bad = sample_batch(logits, torch.tensor([False, False, True]), torch.ones(3, 1), None, None, torch.ones(3, 3))
    assert bad.tolist() == [False, True, True]

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, max_running_requests=4)
    poisoned = {}
    order: list[str] = []  # request ids in batch order: admission order, the prompts' order

    def hook(row, tid, logits):
        if row.request_id not in order:
            order.append(row.request_id)
        if order.index(row.request_id) == 1:
            logits.fill_(float("nan"))
            poisoned[row.request_id] = True

    engine.logits_hook = hook
    for temp in (0.0, 0.8):
        order.clear()
        res = engine.generate([[5, 6, 7], [5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=4, temperature=temp, seed=1))
        assert [r.stats.finish_reason for r in res] == ["length", "error", "length"]
        assert "the logits hold NaN or inf" in res[1].error
        s = engine.stats()
        assert s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0  # nothing leaked


def test_engine_repetition_penalty_equals_transformers_generate(tiny_llama):
    from transformers import AutoModelForCausalLM

    from pasta_engine import Engine

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20)
    prompt = [5, 6, 7, 5, 6, 7, 8]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    for penalty in (1.0, 1.5):
        [res] = engine.generate([prompt], SamplingParams(max_new_tokens=24, repetition_penalty=penalty),
                                mode="sequential")
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              repetition_penalty=penalty, pad_token_id=engine.eos_ids[0])
        want = out[0, len(prompt):].tolist()
        assert res.token_ids == want[: len(res.token_ids)], penalty
    # the penalty changes what a looping random model writes
    [a] = engine.generate([prompt], SamplingParams(max_new_tokens=24), mode="sequential")
    assert a.token_ids != res.token_ids


def test_a_vanishing_top_p_keeps_the_most_likely_token(tiny_engine):
    # 1e-300 is 0 in float32: it used to drop every token and fail the request (nan probabilities)
    [res] = tiny_engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1e-300),
                                 mode="sequential")
    [greedy] = tiny_engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6), mode="sequential")
    assert res.stats.finish_reason != "error", res.error
    assert res.token_ids == greedy.token_ids
    logits = torch.randn(3, VOCAB)
    assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-300), torch.Generator()).tolist() == \
        logits.argmax(-1).tolist()


def test_apply_fork_threshold_forces_or_masks_the_promise_per_row():
    from pasta_engine.layers.sampler import apply_fork_threshold

    # row 0: promise p = 0.5; row 1: promise p = 0.2; row 2: untouched
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.7, 0.1], [0.2, 0.7, 0.1]])
    logits = probs.log()
    out = apply_fork_threshold(logits, [0, 1], [0.4, 0.4], token=0)
    assert out[0, 0] == logits[0, 0] and torch.isinf(out[0, 1:]).all()  # 0.5 >= 0.4: only the promise
    assert torch.isinf(out[1, 0]) and torch.equal(out[1, 1:], logits[1, 1:])  # 0.2 < 0.4: no promise
    assert torch.equal(out[2], logits[2]) and torch.equal(logits, probs.log())  # other rows, input unchanged
    # a threshold at or under the probability forks: the row can then only promise
    assert apply_fork_threshold(logits, [1], [0.19], token=0)[1].argmax() == 0
