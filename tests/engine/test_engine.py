"""Engine semantics on tiny random-weight models.

The central check: replaying an annotated response through the engine gives, for every forced
token, the logits of ONE dense forward of transformers over the spliced sequence with an
explicit visibility mask built here from docs/DESIGN.md section 2 (a child sees the context up to
its promise and chunks joined before its fork, never its siblings; the main thread sees a
chunk only from the token that completed a later <sync/>) and the engine's logical positions.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pasta_engine import ContextLengthError, Engine, Limits, ParameterError, SamplingParams
from pasta_engine.core.replay import replay_script
from pasta_engine.lang.tags import Promise, Sync, parse, promise_tag
from pasta_engine.lang.tokenization import tokenize_annotated
from pasta_engine.metrics import simulate_steps

from sample_traces import ANNOTATED  # noqa: E402  (tests/sample_traces.py)
PROMPT = "Give me sleep tips."


def completions(engine, ids, tag_type):
    """1-based indices of the tokens of ``ids`` whose text completes a tag of ``tag_type``,
    from parses of whole prefixes (independent of the incremental parser)."""
    out, before = [], 0
    for k in range(1, len(ids) + 1):
        n = sum(isinstance(e, tag_type) for e in parse(engine.decode(ids[:k])))
        if n > before:
            out.append(k)
        before = n
    return out


def dense_reference(engine, hf, res):
    """Logits of one transformers forward over prompt + spliced response with the PASTA mask."""
    tok = tokenize_annotated(engine.tokenizer, ANNOTATED)
    eos = engine.tokenizer.eos_token_id
    main_ids = tok.main_ids
    chunk_ids = [tok.open_ids + c for c in tok.chunk_ids]
    # the engine laid out exactly these tokens
    tids = res.threads
    assert [t for t, i in zip(res.token_ids, tids) if i == 0] == main_ids + [eos]
    for c, ids in enumerate(chunk_ids, start=1):
        assert [t for t, i in zip(res.token_ids, tids) if i == c] == ids
    forks = completions(engine, main_ids, Promise)  # main index of each child's fork
    syncs = completions(engine, main_ids, Sync)
    assert len(forks) == 3 and len(syncs) == 1

    # the dense sequence: prompt, then the response without the main thread's final EOS
    P = len(res.prompt_ids)
    seq = list(res.prompt_ids) + res.token_ids[:-1]
    pos = list(range(P)) + res.positions[:-1]
    owner = [-1] * P + tids[:-1]
    index = [0] * P  # index of a token within its thread (1-based)
    counts: dict[int, int] = {}
    for t in tids[:-1]:
        counts[t] = counts.get(t, 0) + 1
        index.append(counts[t])

    def joined_before(i):  # children whose chunk the main thread has joined by its i-th token
        return {c for c, f in enumerate(forks, start=1) if any(f < s <= i for s in syncs)}

    n = len(seq)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            if owner[k] == -1:
                vis = True
            elif owner[q] == -1:
                vis = False
            elif owner[q] == 0:
                i = index[q]
                vis = (owner[k] == 0 and index[k] <= i) or (owner[k] > 0 and owner[k] in joined_before(i))
            else:
                f = forks[owner[q] - 1]
                vis = (
                    (owner[k] == 0 and index[k] <= f)
                    or (owner[k] == owner[q] and index[k] <= index[q])
                    or (owner[k] > 0 and owner[k] in joined_before(f))
                )
            mask[q, k] = vis and (owner[q] != -1 or k <= q)
    additive = torch.zeros(n, n).masked_fill(~mask, float("-inf"))  # eager attention (Gemma 2) adds a bool mask as 0/1
    with torch.no_grad():
        logits = hf(
            torch.tensor([seq]), attention_mask=additive[None, None], position_ids=torch.tensor([pos])
        ).logits[0].float()
    return logits, owner, index, seq


@pytest.mark.parametrize("ckpt,policy", [
    *[(ckpt, policy) for ckpt in ("tiny_llama", "tiny_qwen2") for policy in ("predicted", "none", "oracle")],
    # the other architectures under the default policy (positions do not depend on the architecture)
    *[(ckpt, "predicted") for ckpt in ("tiny_qwen3", "tiny_gemma", "tiny_phi3", "tiny_mistral_no_window",
                                       "tiny_gemma2_no_window")],
])
def test_replay_logits_equal_a_dense_forward_with_the_pasta_mask(ckpt, policy, request):
    path = request.getfixturevalue(ckpt)
    engine = Engine.from_pretrained(path, kv_cache_bytes=16 * 2**20, page_size=4, position_policy=policy)
    hooked: dict[int, list[torch.Tensor]] = {}
    engine.logits_hook = lambda req, tid, row: hooked.setdefault(tid, []).append(row.clone())
    [res] = engine.replay([PROMPT], [ANNOTATED], params=SamplingParams(return_logprobs=True))
    assert res.annotated_text == ANNOTATED
    assert res.stats.forks == 3
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dense, owner, index, seq = dense_reference(engine, hf, res)

    # each thread's k-th sampled token is predicted by the forward of its previous token
    P = len(res.prompt_ids)
    rows_of = {t: [q for q in range(len(seq)) if owner[q] == t] for t in hooked}
    checked = 0
    lp = torch.log_softmax(dense, -1)
    for t, got in hooked.items():
        if t == 0:
            inputs = [P - 1] + rows_of[0]  # last prompt token, then every main token but EOS
            skip = 0
        else:
            skip = len(engine.open_ids)
            inputs = rows_of[t][skip - 1 : -1]  # last inserted tag token, then all but the last
        assert len(inputs) == len(got), f"thread {t}"
        torch.testing.assert_close(torch.stack(got), dense[inputs], rtol=2e-4, atol=2e-4)
        # the returned logprobs are those of the forced tokens under the same distributions
        mine = [(tok, l) for tok, o, l in zip(res.token_ids, res.threads, res.logprobs) if o == t][skip:]
        want = lp[inputs, torch.tensor([tok for tok, _ in mine])]
        torch.testing.assert_close(torch.tensor([l for _, l in mine]), want, rtol=2e-4, atol=2e-4)
        checked += len(got)
    assert checked == res.stats.tokens_decoded


def test_positions_follow_the_policy(tiny_engine):
    [pred] = tiny_engine.replay([PROMPT], [ANNOTATED])
    # the first child starts right after its promise; main skips open + 30 + close
    first_child = pred.threads.index(1)
    promise_pos = pred.positions[first_child - 1]
    assert pred.positions[first_child] == promise_pos + 1
    after = [p for p, t in zip(pred.positions, pred.threads) if t == 0 and p > promise_pos][0]
    assert after == promise_pos + 1 + len(tiny_engine.open_ids) + 30 + tiny_engine.close_len


@pytest.mark.parametrize("width", [None, 1, 2, 3])
def test_replay_steps_equal_the_critical_path_or_its_width_bound(tiny_llama, width):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=16 * 2**20, limits=Limits(max_threads=width))
    [res] = engine.replay([PROMPT], [ANNOTATED])
    [seq] = engine.replay([PROMPT], [ANNOTATED], mode="sequential")
    s = res.stats
    assert seq.token_ids == res.token_ids
    assert seq.stats.decode_steps == len(res.token_ids)
    if width is None:
        assert s.decode_steps == s.critical_path
    assert s.critical_path <= s.decode_steps <= s.tokens_decoded
    assert s.max_width <= (width or 99)
    script = replay_script(engine.tokenizer, ANNOTATED, engine.tokenizer.eos_token_id)
    assert s.decode_steps == simulate_steps(script.structure, width)
    assert s.token_parallelism == pytest.approx(s.tokens_decoded / s.critical_path)
    assert s.content_tokens == len(engine.encode(res.text))  # the clean text: no tag tokens, no EOS
    assert s.content_speedup == pytest.approx(s.content_tokens / s.critical_path)


def test_replay_on_a_real_tokenizer_keeps_steps_equal_to_critical_path(smollm2_dir):
    """Same check with SmolLM2's BPE (tags merge with neighbouring characters), random
    prompts ids so the test does not depend on what the model would write."""
    engine = Engine.from_pretrained(None, kv_cache_bytes=64 * 2**20)
    [res] = engine.replay([[1, 2, 3, 4]], [ANNOTATED])
    assert res.stats.decode_steps == res.stats.critical_path
    assert res.annotated_text == ANNOTATED


def test_kv_pages_return_after_every_request(tiny_engine):
    pool = tiny_engine.block_manager.pool
    tiny_engine.generate(["a", "b c", "<promise"], SamplingParams(max_new_tokens=30, temperature=1.0, seed=5))
    tiny_engine.replay([PROMPT] * 2, [ANNOTATED] * 2)
    assert all(r == 0 for r in pool.refcount) and pool.num_free == pool.num_pages


def test_kv_exhaustion_fails_the_request_alone_and_frees_its_pages(tiny_llama):
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=40 * 1024, page_size=4)
    [r] = engine.generate([list(range(3, 40))], SamplingParams(max_new_tokens=200))
    assert r.stats.finish_reason == "error" and "KV cache exhausted" in r.error and "kv_cache_bytes" in r.error
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
    with pytest.raises(ContextLengthError, match="KV pages.*raise kv_cache_bytes"):
        engine.generate([list(range(3, 300)) * 3], SamplingParams(max_new_tokens=2))
    [ok] = engine.generate([list(range(3, 10))], SamplingParams(max_new_tokens=5))  # the engine still serves
    assert ok.stats.finish_reason == "length" and ok.error is None
    # issue 31 item 10: a replay whose tokens can never fit is refused before it takes anything
    # (it was admitted, decoded about a thousand tokens, then ended in error)
    long = " ".join(f"word{i}" for i in range(400))
    before = engine.stats()["total_steps"] if "total_steps" in engine.stats() else None
    with pytest.raises(ContextLengthError, match="KV pages.*raise kv_cache_bytes"):
        engine.replay([[5, 6, 7]], [long], mode="sequential")
    with pytest.raises(ContextLengthError, match="replay's .* KV tokens .* raise kv_cache_bytes"):
        engine.replay([[5, 6, 7]], ['<promise topic="a" tokens="10"/><async>' + long + "</async><sync/>"], mode="pasta")
    if before is not None:
        assert engine.stats()["total_steps"] == before  # not a step was taken for them
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
    [fits] = engine.replay([[5, 6, 7]], ["word0 word1 word2"], mode="sequential")  # a short one still runs
    assert fits.error is None and fits.text == "word0 word1 word2"


def test_a_request_that_must_sample_past_the_cache_is_refused_before_it_runs(tiny_llama):
    """``ignore_eos`` (no stop token or string) runs a request to ``max_new_tokens``, and none
    ends before ``min_tokens`` (in sequential mode, up to the context length): one whose floor
    cannot fit in the KV cache was admitted, decoded until the cache ran out and ended in error;
    it is refused first, naming the parameter. A stop string, a stop token, a floor that fits,
    or pasta mode (the context length may end it first), runs as before."""
    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=40 * 1024, page_size=4)
    total = engine.stats()["kv_pages_total"]
    prompt = list(range(3, 10))
    room = total * 4 - len(prompt) + 1  # the most tokens a request of this prompt can sample
    for params, param in [(SamplingParams(max_new_tokens=room + 1, ignore_eos=True), "max_new_tokens"),
                          (SamplingParams(max_new_tokens=room + 5, min_tokens=room + 1), "min_tokens")]:
        with pytest.raises(ContextLengthError, match=f"{param}={room + 1}: .* raise kv_cache_bytes or lower") as e:
            engine.generate([prompt], params, mode="sequential")
        assert e.value.param == param and e.value.value == room + 1
        assert engine.stats()["kv_pages_free"] == total and not engine.has_unfinished_requests()
    for params in (SamplingParams(max_new_tokens=room + 1, ignore_eos=True, stop=("zz",)),
                   SamplingParams(max_new_tokens=room + 1, ignore_eos=True, stop_token_ids=(5,))):
        assert engine.abort(engine.add_request(prompt, params, mode="sequential"))  # accepted: it may end in time
    assert engine.abort(engine.add_request(prompt, SamplingParams(max_new_tokens=room + 1, ignore_eos=True)))  # pasta
    [full] = engine.generate([prompt], SamplingParams(max_new_tokens=room, ignore_eos=True), mode="sequential")
    assert full.error is None and len(full.token_ids) == room  # the exact floor fits, and runs
    assert engine.stats()["kv_pages_free"] == total
    # the server: a 400 naming max_tokens (it was a 500 after the cache ran out), nothing taken
    import asyncio

    import httpx

    from pasta_engine import AsyncEngine
    from pasta_engine.entrypoints.openai.api_server import build_app

    aengine = AsyncEngine(engine)
    try:
        async def post():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(aengine, "tiny")),
                                         base_url="http://test", timeout=120) as h:
                return await h.post("/v1/completions", json={"prompt": prompt, "max_tokens": room + 1,
                                                             "ignore_eos": True, "pasta": {"mode": "sequential"}})

        r = asyncio.run(post())
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert engine.stats()["kv_pages_free"] == total
    finally:
        aengine.shutdown()


def test_preemption_keeps_outputs_unchanged(tiny_llama):
    prompts = [[5 + i, 9, 10, 11] for i in range(4)]
    params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=11)
    roomy = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, page_size=4)
    tight = Engine.from_pretrained(tiny_llama, kv_cache_bytes=48 * 1024, page_size=4)  # 24 pages
    want = roomy.generate(prompts, params, mode="sequential")
    got = tight.generate(prompts, params, mode="sequential")
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(r.stats.preemptions <= 1 for r in got)


def test_admission_waits_instead_of_thrashing(tiny_llama):
    """Four replays with four forks each in a 40-page cache (the issue's case, once preempted
    0, 13, 13 and 13 times): each request is preempted at most once, outputs unchanged."""
    body = " ".join(["word"] * 20)
    trace = "Intro.\n" + "".join(f"{i}. " + promise_tag(f"p{i}", 20) + "<async>" + body + "</async>\n"
                                 for i in range(4)) + "<sync/>Done."
    prompts = [[5, 6, 7, 8 + i] for i in range(4)]
    probe = Engine.from_pretrained(tiny_llama, kv_cache_bytes=2**20, page_size=16)
    per_page = probe.model_runner.kv_cache_bytes // probe.stats()["kv_pages_total"]
    tight = Engine.from_pretrained(tiny_llama, kv_cache_bytes=40 * per_page, page_size=16, max_running_requests=4,
                                   limits=Limits(max_threads=None))
    assert tight.stats()["kv_pages_total"] == 40
    got = tight.replay(prompts, [trace] * 4)
    alone = [probe.replay([p], [trace])[0] for p in prompts]
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    assert all(r.stats.finish_reason == "stop" for r in got)
    assert max(r.stats.preemptions for r in got) <= 1 and tight.stats()["preemptions"] >= 1
    assert tight.stats()["kv_pages_free"] == 40


def test_sampling_is_seeded_and_batching_does_not_change_outputs(tiny_engine):
    params = SamplingParams(max_new_tokens=25, temperature=0.8, top_p=0.9, top_k=50, seed=3)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    batch = tiny_engine.generate(prompts, params)
    one = [tiny_engine.generate([p], params)[0] for p in prompts]
    assert [r.token_ids for r in batch] == [r.token_ids for r in one]
    other = tiny_engine.generate(prompts, SamplingParams(max_new_tokens=25, temperature=0.8, seed=4))
    assert [r.token_ids for r in other] != [r.token_ids for r in batch]


def test_string_prompts_use_the_chat_template_and_pasta_system_prompt(tiny_engine):
    pasta = tiny_engine.format_prompt("hi", mode="pasta")
    seq = tiny_engine.format_prompt("hi", mode="sequential")
    assert tiny_engine.decode(seq) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = tiny_engine.decode(pasta)
    assert "PASTA-LANG" in text and text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_bad_inputs_are_named(tiny_engine):
    with pytest.raises(ParameterError, match="mode='fast'"):
        tiny_engine.generate(["x"], mode="fast")
    with pytest.raises(ValueError, match="2 prompts but 1"):
        tiny_engine.replay(["a", "b"], [ANNOTATED])
    with pytest.raises(ValueError, match="empty list of token ids"):
        tiny_engine.generate([[]])
    with pytest.raises(ParameterError, match=r"prompt 0: token id 999 \(position 1\) is outside"):
        tiny_engine.generate([[1, 999]])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="oracle"):
        Engine(tiny_engine.model, tiny_engine.tokenizer, position_policy="oracle", kv_cache_bytes=2**20).generate(["x"])
    with pytest.raises(ValueError, match="cuda_graphs=True needs"):
        Engine(tiny_engine.model, tiny_engine.tokenizer, kv_cache_bytes=2**20, cuda_graphs=True)
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        Engine(tiny_engine.model, tiny_engine.tokenizer, kv_cache_bytes=2**20, attention_backend="flash")


def test_generate_results_are_consistent(tiny_engine):
    [r] = tiny_engine.generate(["tips"], SamplingParams(max_new_tokens=60, temperature=1.0, seed=1))
    s = r.stats
    assert s.tokens_decoded <= 60
    assert s.decode_steps == s.critical_path  # default width 16 exceeds any fork count here
    assert r.text == r.annotated_text or "<" in r.annotated_text
    d = r.to_dict()
    assert set(d) >= {"text", "annotated_text", "token_ids", "logprobs", "stats", "diagnostics"}


@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_qwen2"])
def test_triton_backend_replays_like_the_torch_reference(ckpt, request):
    """The Triton kernels (under the interpreter here) give the same forced tokens, decode steps
    and logprobs as the torch reference, through forks, a sync and a fork after the join."""
    path = request.getfixturevalue(ckpt)
    prompt = [[3 + (7 * i) % 250 for i in range(30)]]
    params = SamplingParams(return_logprobs=True)
    ref = Engine.from_pretrained(path, kv_cache_bytes=8 * 2**20, page_size=4).replay(prompt, [ANNOTATED], params=params)[0]
    tri = Engine.from_pretrained(path, kv_cache_bytes=8 * 2**20, page_size=4, attention_backend="triton")
    got = tri.replay(prompt, [ANNOTATED], params=params)[0]
    assert got.token_ids == ref.token_ids
    assert got.stats.decode_steps == ref.stats.decode_steps == ref.stats.critical_path
    torch.testing.assert_close(
        torch.tensor([x for x in got.logprobs if x is not None]),
        torch.tensor([x for x in ref.logprobs if x is not None]), rtol=1e-4, atol=1e-4,
    )


def test_an_answer_that_never_forks_has_a_content_speedup_of_at_most_one(tiny_llama):
    """Random weights write byte-fallback text that the canonical tokenization splits finer; the
    content speedup of a one-thread answer must still not exceed 1."""
    engine = Engine.from_pretrained(tiny_llama, adapter=None, kv_cache_bytes=8 * 2**20)
    for seed in range(6):
        [r] = engine.generate(["Give me two tips."], SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed),
                              mode="sequential")
        assert r.stats.forks == 0 and r.stats.content_speedup <= 1.0
        assert r.stats.content_tokens <= r.stats.tokens_decoded


def test_check_request_makes_add_requests_checks_and_takes_nothing(tiny_engine):
    """``Engine.check_request``: the checks of ``add_request`` (a bad parameter, a prompt past
    the KV cache) without queuing anything or taking a page; a replay's budget comes back raised
    to its response's length."""
    from pasta_engine.engine.input_processor import RequestInputs
    from pasta_engine.errors import ContextLengthError, ParameterError

    free = tiny_engine.stats()["kv_pages_free"]
    with pytest.raises(ParameterError, match="mode"):
        tiny_engine.check_request(RequestInputs([1, 2, 3], None, "bogus"))
    with pytest.raises(ContextLengthError):
        tiny_engine.check_request(RequestInputs([5] * 100_000, SamplingParams(max_new_tokens=4)))
    params = tiny_engine.check_request(RequestInputs([1, 2, 3], SamplingParams(max_new_tokens=1), "pasta",
                                                     annotated_response="a b c d e f g h"))
    assert params.max_new_tokens > 1
    assert not tiny_engine.has_unfinished_requests() and tiny_engine.stats()["kv_pages_free"] == free


TWO_FORKS = ('Intro <promise topic="a" tokens="5"/><async>x y z</async> mid <promise topic="b" tokens="5"/>'
             "<async>u v</async> end<sync/> done")


@pytest.mark.parametrize("limits", [None, Limits(max_forks=1), Limits(max_forks=0), Limits(max_threads=1)])
@pytest.mark.parametrize("mode", ["pasta", "inline", "sequential"])
def test_a_replays_budget_is_exactly_the_tokens_it_samples(tiny_llama, mode, limits):
    """A replay's budget (``check_request``, the server's bar for ``max_tokens``) is the tokens
    it samples (``stats.tokens_decoded``, the server's ``usage.completion_tokens``): it was the
    reading-order stream plus one, so a pasta replay of 46 tokens asked for 49 (the inserted
    ``<async>`` tokens, which are not sampled, and the one). Past the fork cap a chunk is decoded
    inline, its inserted tag forced: counted too. With exactly that budget it runs whole."""
    from pasta_engine.engine.input_processor import RequestInputs

    engine = Engine.from_pretrained(tiny_llama, kv_cache_bytes=8 * 2**20, **({"limits": limits} if limits else {}))
    [whole] = engine.replay([PROMPT], [TWO_FORKS], mode=mode, params=SamplingParams(max_new_tokens=4096))
    need = engine.check_request(RequestInputs(PROMPT, SamplingParams(max_new_tokens=1), mode,
                                              annotated_response=TWO_FORKS)).max_new_tokens
    assert need == whole.stats.tokens_decoded and whole.stats.finish_reason == "stop"
    for budget in (need, need + 1):
        [r] = engine.replay([PROMPT], [TWO_FORKS], mode=mode, params=SamplingParams(max_new_tokens=budget))
        assert (r.text, r.stats.finish_reason, r.stats.tokens_decoded) == (whole.text, "stop", need)

def test_a_stop_token_is_the_results_stop_reason(tiny_engine):
    """vLLM's ``stop_reason``: the ``stop_token_ids`` id that ended the response (the engine's
    result, so the server and the Python API say the same), None for a response that ran out."""
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    [free] = tiny_engine.generate([[1, 2, 3]], greedy, mode="sequential")
    stop = next(t for t in free.token_ids[2:] if t not in tiny_engine.eos_ids)
    [cut] = tiny_engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                             stop_token_ids=[stop]), mode="sequential")
    assert cut.stats.finish_reason == "stop" and cut.stop_reason == stop and cut.token_ids[-1] == stop
    assert free.stop_reason is None
