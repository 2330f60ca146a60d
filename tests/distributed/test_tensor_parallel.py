"""Tensor parallelism on CPUs (gloo): the sharded engine decodes what the one-process engine does.

Two ranks on the tiny Llama preset (4 query heads, 2 KV heads): greedy tokens in sequential and
pasta mode and a replay with forks and joins equal the one-process engine's; a rank that raises
mid-step ends the step on every rank with every page free and the engine still usable; a dead
rank makes the engine raise EngineDeadError; shutdown leaves no process behind; a size that
does not divide the KV heads is refused before any process starts. Three ranks on SmolLM2-135M
(9 heads, 3 KV heads) are marked slow.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch

from pasta_engine import Engine, ParameterError, SamplingParams
from pasta_engine.distributed import TensorParallelStepError
from pasta_engine.errors import EngineDeadError

from sample_traces import ANNOTATED  # noqa: E402  (tests/sample_traces.py)
PROMPTS = ["Give me sleep tips.", "Name three fruits."]
KV = dict(kv_cache_bytes=8 * 2**20, page_size=4)
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def single(tiny_llama):
    return Engine.from_pretrained(tiny_llama, **KV)


@pytest.fixture(scope="module")
def tp2(tiny_llama):
    engine = Engine.from_pretrained(tiny_llama, tensor_parallel_size=2, **KV)
    yield engine
    engine.shutdown()


def _alive(procs) -> list:
    return [p for p in procs if p.is_alive()]


def all_free(engine: Engine) -> bool:
    """Every page free and no request left (as tests/engine/test_failures.py checks)."""
    s = engine.stats()
    return s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0 and s["waiting"] == 0


def test_two_ranks_shard_the_kv_cache(tp2, single):
    assert tp2.model.size == 2
    assert tp2.model.config.num_heads == 2 and tp2.model.config.num_kv_heads == 1
    # each rank holds half the KV heads, so the same budget holds twice the pages
    assert tp2.model_runner.kv_cache.kv.shape[-2] == 1
    assert tp2.model_runner.num_pages == 2 * single.model_runner.num_pages
    assert len(_alive(tp2.model.procs)) == 1


@pytest.mark.parametrize("mode", ["sequential", "pasta"])
def test_greedy_tokens_equal_one_process(tp2, single, mode):
    want = single.generate(PROMPTS, GREEDY, mode=mode)
    got = tp2.generate(PROMPTS, GREEDY, mode=mode)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_replay_with_forks_and_joins_equals_one_process(tp2, single):
    params = SamplingParams(return_logprobs=True)
    [want] = single.replay([PROMPTS[0]], [ANNOTATED], params=params)
    [got] = tp2.replay([PROMPTS[0]], [ANNOTATED], params=params)
    assert got.token_ids == want.token_ids and got.threads == want.threads
    assert got.stats.forks == 3  # three children forked, and were joined
    assert [lp is None for lp in got.logprobs] == [lp is None for lp in want.logprobs]
    pairs = [(a, b) for a, b in zip(got.logprobs, want.logprobs) if a is not None]
    assert len(pairs) > 20
    torch.testing.assert_close(torch.tensor([a for a, _ in pairs]), torch.tensor([b for _, b in pairs]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rank,after", [(1, 1), (0, 2), (1, 0)])
def test_a_rank_that_raises_mid_step_ends_the_step_and_frees_every_page(tp2, single, rank, after):
    tp2.model.fail_next_step(rank, after_reduces=after)
    with pytest.raises(TensorParallelStepError, match=f"rank {rank}: InjectedFault") as info:
        tp2.generate(PROMPTS, GREEDY, mode="sequential")
    assert list(info.value.failures) == [rank]  # reported once, naming the rank
    assert all_free(tp2)
    # the engine (and every rank) is still usable and still exact
    want = single.generate(PROMPTS[:1], GREEDY, mode="sequential")
    got = tp2.generate(PROMPTS[:1], GREEDY, mode="sequential")
    assert got[0].token_ids == want[0].token_ids


def test_indivisible_kv_heads_are_refused_before_any_process_starts(tiny_llama):
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(ParameterError, match=r"tensor_parallel_size=3 .*2 KV heads \(4 query heads"):
        Engine.from_pretrained(tiny_llama, tensor_parallel_size=3, **KV)
    assert set(multiprocessing.active_children()) == before


def test_dead_rank_makes_the_engine_dead_and_shutdown_leaves_no_process(tp2):
    """Last user of the module's engine: it kills its worker."""
    procs = list(tp2.model.procs)
    tp2.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4))
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].join(10)
    with pytest.raises(EngineDeadError):
        tp2.generate(PROMPTS[:1], GREEDY)
    assert all_free(tp2)
    with pytest.raises(EngineDeadError):  # and stays dead
        tp2.generate(PROMPTS[:1], GREEDY)
    tp2.shutdown()
    assert not _alive(procs)


def test_shutdown_and_garbage_collection_leave_no_process(tiny_llama):
    engine = Engine.from_pretrained(tiny_llama, tensor_parallel_size=2, **KV)
    procs = list(engine.model.procs)
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert not _alive(procs)
    with pytest.raises(EngineDeadError):
        engine.generate(PROMPTS[:1], GREEDY)
    # an engine dropped without shutdown: its workers are reaped at collection
    engine = Engine.from_pretrained(tiny_llama, tensor_parallel_size=2, **KV)
    procs = list(engine.model.procs)
    del engine
    gc.collect()
    deadline = time.monotonic() + 10
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(procs)
    assert not torch.distributed.is_initialized()  # the process may start another one


@pytest.mark.slow
def test_three_ranks_on_smollm2_equal_one_process(smollm2_dir):
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    single = Engine.from_pretrained(smollm2_dir, adapter=None, kv_cache_bytes=96 * 2**20)
    want = single.generate(PROMPTS, params, mode="sequential")
    [want_replay] = single.replay([PROMPTS[0]], [ANNOTATED])
    del single
    engine = Engine.from_pretrained(smollm2_dir, adapter=None, tensor_parallel_size=3, kv_cache_bytes=96 * 2**20)
    try:
        assert engine.model.config.num_heads == 3 and engine.model.config.num_kv_heads == 1
        got = engine.generate(PROMPTS, params, mode="sequential")
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        [got_replay] = engine.replay([PROMPTS[0]], [ANNOTATED])
        assert want_replay.stats.finish_reason == "stop" and want_replay.stats.forks == 3
        assert got_replay.token_ids == want_replay.token_ids
    finally:
        engine.shutdown()


@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_phi3"])
def test_sliced_safetensors_read_equals_the_whole_checkpoint_sliced(ckpt, request, monkeypatch):
    """Each rank reads only its slices from safetensors (Phi-3: fused qkv_proj / gate_up_proj cut
    part by part); the same shard as reading the whole state dict and slicing it."""
    from pasta_engine.models import loader

    path = request.getfixturevalue(ckpt)
    read, seen = loader._read_safetensors_shard, []
    monkeypatch.setattr(loader, "_read_safetensors_shard", lambda *a: seen.append(read(*a)) or seen[-1])
    sliced, _, _ = loader.load_model(path, with_tokenizer=False, tp_rank=1, tp_size=2)
    assert seen and seen[0] is not None  # the sliced path ran
    monkeypatch.setattr(loader, "_read_safetensors_shard", lambda *a: None)  # the transformers path
    whole, _, _ = loader.load_model(path, with_tokenizer=False, tp_rank=1, tp_size=2)
    assert sliced.config == whole.config
    for a, b in zip(sliced.weights.tensors(), whole.weights.tensors()):
        assert torch.equal(a, b)


def test_one_kv_head_is_refused_naming_the_head_counts(tiny_qwen2):
    with pytest.raises(ParameterError, match=r"tensor_parallel_size=2 does not divide the model's 1 KV heads"):
        Engine.from_pretrained(tiny_qwen2, tensor_parallel_size=2, **KV)


def test_a_stopped_worker_makes_the_engine_dead_within_the_step_timeout(tiny_llama):
    """Issue 31 item 10: a hung worker (SIGSTOP) blocked step() until it was killed. With
    ``tensor_parallel_step_timeout_s`` the step's collective gives up and the engine is dead."""
    engine = Engine.from_pretrained(tiny_llama, tensor_parallel_size=2, tensor_parallel_step_timeout_s=3, **KV)
    procs = list(engine.model.procs)
    try:
        engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
        os.kill(procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            engine.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - t0 < 30
        assert all_free(engine)
    finally:
        if procs[0].is_alive():  # the dead engine has killed it; else let it go on to be stopped
            os.kill(procs[0].pid, signal.SIGCONT)
        engine.shutdown()
    assert not _alive(procs)
    with pytest.raises(ParameterError, match="tensor_parallel_step_timeout_s"):
        Engine.from_pretrained(tiny_llama, tensor_parallel_size=2, tensor_parallel_step_timeout_s=0, **KV)


# ---------------------------------------------------------------------------- issue 32 item 2


def _run_script(code: str, path=None, timeout: float = 240):
    """Run ``code`` in a fresh Python (from standard input as ``python - <<EOF`` does, or as the
    file ``path``); returns the completed process."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.getcwd())
    if path is None:
        return subprocess.run([sys.executable, "-"], input=code, text=True, capture_output=True, timeout=timeout,
                              env=env)
    path.write_text(code)
    return subprocess.run([sys.executable, str(path)], text=True, capture_output=True, timeout=timeout, env=env)


_SCRIPT = """
from pasta_engine import Engine, SamplingParams
engine = Engine.from_pretrained({ckpt!r}, tensor_parallel_size=2, kv_cache_bytes=8 * 2**20, page_size=4)
print("TOKENS", engine.generate([[1, 40, 41]], SamplingParams(max_new_tokens=4))[0].token_ids)
engine.shutdown()
"""


def test_a_script_without_the_main_guard_gets_one_error_naming_it(tiny_llama, tmp_path):
    """Spawn runs the main script again in each worker: from standard input it cannot, and a
    file without the guard would start an engine in every worker. Either way one error (one
    traceback, no worker's) names the guard, instead of "worker rank 1 exited while starting"."""
    code = _SCRIPT.format(ckpt=str(tiny_llama))
    for path in (None, tmp_path / "no_guard.py"):
        res = _run_script(code, path)
        assert res.returncode == 1, res.stderr[-2000:]
        assert res.stderr.count("Traceback") == 1, res.stderr[-4000:]
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("pasta_engine.distributed.executor.MainGuardError") and \
            'if __name__ == "__main__":' in last, last
        assert "exited while starting" not in res.stderr
    assert "python -" in _run_script(code).stderr  # says where the script came from


@pytest.mark.slow
def test_the_same_script_with_the_guard_runs(tiny_llama, tmp_path, single):
    body = "".join("    " + line + "\n" for line in _SCRIPT.format(ckpt=str(tiny_llama)).strip().splitlines())
    res = _run_script('if __name__ == "__main__":\n' + body, tmp_path / "guarded.py")
    assert res.returncode == 0, res.stderr[-3000:]
    want = single.generate([[1, 40, 41]], SamplingParams(max_new_tokens=4))[0].token_ids
    assert f"TOKENS {want}" in res.stdout


def test_cuda_graphs_with_tensor_parallelism_are_allowed_and_refused_only_for_the_device(tiny_llama):
    """Graphs and tensor parallelism go together now (every rank captures its own, all-reduces
    inside); on a CPU, cuda_graphs=True is refused as for one process (graphs are GPU-only),
    before the workers are left behind."""
    import multiprocessing

    from pasta_engine.config import EngineConfig

    assert EngineConfig(tensor_parallel_size=2, cuda_graphs=True).cuda_graphs is True
    before = set(multiprocessing.active_children())
    with pytest.raises(ParameterError, match="cuda_graphs=True needs the model on a CUDA device"):
        Engine.from_pretrained(tiny_llama, tensor_parallel_size=2, cuda_graphs=True, **KV)
    deadline = time.monotonic() + 10
    while set(multiprocessing.active_children()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(multiprocessing.active_children()) - before


def test_every_rank_runs_the_engines_runner(tp2):
    """Rank 0's runner executes through the group (its executor), and its captures were asked
    for at attach (a no-op on a CPU, where no runner wants graphs)."""
    runner = tp2.model_runner
    assert runner.executor == tp2.model.execute and tp2.model.runner is runner
    assert runner.config.tensor_parallel_size == 2 and not runner.wants_graphs and runner.cuda_graphs is None


@pytest.mark.gpu
def test_two_gpu_ranks_with_cuda_graphs_equal_one_process(tiny_llama):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    kw = dict(device="cuda", attention_backend="triton", **KV)
    single = Engine.from_pretrained(tiny_llama, **kw)
    want = single.generate(PROMPTS, GREEDY, mode="pasta")
    engine = Engine.from_pretrained(tiny_llama, tensor_parallel_size=2, **kw)
    try:
        assert engine.model_runner.cuda_graphs is not None
        got = engine.generate(PROMPTS, GREEDY, mode="pasta")
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert engine.model_runner.cuda_graphs.replays > 0
    finally:
        engine.shutdown()


def test_rank_0s_status_exchange_after_a_forward_waits_only_the_step_timeout():
    """A worker hung after its all-reduces kept rank 0 in the status exchange for the control
    group's timeout (a month): step() blocked as long as the worker hung (40 s against a 3 s step
    timeout). Rank 0 now hands the step timeout to the exchange and to the gather after it."""
    from types import SimpleNamespace

    from pasta_engine.distributed.executor import _guarded_forward

    waits = []

    class Group:
        rank = 0

        def all_reduce(self, x):
            return x

        def failed_ranks(self, failed, timeout_s=None):
            waits.append(("status", timeout_s))
            return [1]

        def gather_to_rank0(self, obj, timeout_s=None):
            waits.append(("gather", timeout_s))
            return [None, "RuntimeError: boom"]

    model = SimpleNamespace(config=SimpleNamespace(num_layers=1), row_parallel_reduce=None)
    out, err = _guarded_forward(model, Group(), None, lambda: 1, lambda: "logits", timeout_s=3.0)
    assert out is None and isinstance(err, TensorParallelStepError) and "boom" in str(err)
    assert waits == [("status", 3.0), ("gather", 3.0)]
