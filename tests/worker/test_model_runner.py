"""The model runner (issue 21 item 3): it needs nothing of a model but the
:class:`~pasta_engine.models.protocol.CausalLM` protocol, it sizes and owns the KV cache (and
the per-slot key positions, only where a layer has a window), it records every new token's
position before the forward, and it refuses settings it cannot run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pasta_engine import Engine, ParameterError, SamplingParams
from pasta_engine.config import EngineConfig
from pasta_engine.worker.model_runner import ModelRunner
from pasta_engine.layers.kv_cache import KVCache, kv_bytes_per_token
from pasta_engine.models.config import ModelConfig
from pasta_engine.models.loader import load_model
from pasta_engine.models.protocol import CausalLM

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47]
from sample_traces import ANNOTATED  # noqa: E402  (tests/sample_traces.py)


class PositionEcho:
    """A CausalLM with no weights: the next token after position ``p`` is ``100 + p % 5``. It
    checks that every call carries what the protocol says."""

    def __init__(self, vocab_size: int):
        self.config = ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=8, intermediate_size=8,
                                  num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6,
                                  tie_word_embeddings=True, attention_bias=False, max_position_embeddings=512)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.calls = 0

    @property
    def weight_bytes(self) -> int:
        return 0

    def projection_weights(self) -> list[torch.Tensor]:
        return []

    def forward(self, input_ids, positions, slot_mapping, kv_cache, backend, logits_indices):
        self.calls += 1
        t = input_ids.shape[0]
        assert input_ids.dtype == positions.dtype == slot_mapping.dtype == torch.long
        assert positions.shape == slot_mapping.shape == (t,)
        assert isinstance(kv_cache, KVCache) and kv_cache.kv.shape[:2] == (2, 2)
        rows = positions if logits_indices is None else positions[logits_indices]
        logits = torch.zeros(rows.shape[0], self.config.vocab_size)
        logits[torch.arange(rows.shape[0]), 100 + rows % 5] = 1.0
        return logits


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_model(tiny_llama)[1]


def test_any_causal_lm_runs_through_the_runner(tokenizer):
    model = PositionEcho(len(tokenizer))
    assert isinstance(model, CausalLM)
    engine = Engine(model, tokenizer, kv_cache_bytes=2**20, page_size=4)
    assert not {100, 101, 102, 103, 104} & set(engine.eos_ids)
    [res] = engine.generate([PROMPT], SamplingParams(max_new_tokens=7), mode="sequential")
    assert res.token_ids == [100 + p % 5 for p in range(len(PROMPT) - 1, len(PROMPT) + 6)]
    assert model.calls == 7  # one prefill, then one decode step per token
    assert engine.model_runner.kv_cache.key_positions is None  # no window: no positions table
    assert engine.model_runner.weight_bytes == 0


@pytest.mark.parametrize("ckpt,windowed", [("tiny_llama", False), ("tiny_mistral", True)])
def test_the_kv_cache_is_sized_by_the_budget(ckpt, windowed, request):
    model = load_model(request.getfixturevalue(ckpt), with_tokenizer=False)[0]
    c = model.config
    budget = 3 * 2**20 + 123
    runner = ModelRunner(model, EngineConfig(kv_cache_bytes=budget, page_size=4))
    per_page = 4 * kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
    assert runner.num_pages == budget // per_page
    cache = runner.kv_cache
    assert cache.kv.shape == (c.num_layers, 2, runner.num_pages, 4, c.num_kv_heads, c.head_dim)
    assert cache.dtype == model.dtype
    assert (cache.key_positions is not None) == windowed
    if windowed:
        assert cache.key_positions.shape == (runner.num_pages, 4)
    assert runner.describe() == {"kv_cache_bytes": budget, "kv_cache_pages": runner.num_pages, "page_size": 4,
                                 "attention_backend": "torch", "cuda_graphs": False}


def test_positions_are_in_the_cache_before_every_forward(tiny_mistral):
    """In a PASTA replay slots and positions part ways (a fork's tokens take positions after its
    promise); a windowed layer must find each new key's logical position in the cache."""
    engine = Engine.from_pretrained(tiny_mistral, kv_cache_bytes=8 * 2**20, page_size=4)
    cache = engine.model_runner.kv_cache
    forward = engine.model.forward
    checked = []

    def checking_forward(input_ids, positions, slot_mapping, kv_cache, *rest):
        assert kv_cache is cache
        keep = slot_mapping >= 0
        table = kv_cache.key_positions.reshape(-1)
        assert torch.equal(table[slot_mapping[keep]], positions[keep].to(torch.int32))
        checked.append(int(keep.sum()))
        return forward(input_ids, positions, slot_mapping, kv_cache, *rest)

    engine.model.forward = checking_forward
    [res] = engine.replay(["Give me sleep tips."], [ANNOTATED])
    assert res.stats.forks == 3 and sum(checked) >= len(res.token_ids)


def test_settings_it_cannot_run_are_refused(tiny_llama):
    model = load_model(tiny_llama, with_tokenizer=False)[0]
    with pytest.raises(ParameterError, match="holds no page"):
        ModelRunner(model, EngineConfig(kv_cache_bytes=1000, page_size=4))
    with pytest.raises(ParameterError, match="cuda_graphs=True needs the model on a CUDA device"):
        ModelRunner(model, EngineConfig(kv_cache_bytes=2**20, page_size=4, cuda_graphs=True))
    runner = ModelRunner(model, EngineConfig(kv_cache_bytes=2**20, page_size=4))
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=f"outside the vocabulary of {vocab}"):
        runner.set_grammar([(True, [vocab])])
    runner.set_grammar([(True, [1, 2]), (False, [3])])
    assert runner.grammar_masks.shape == (2, vocab)
    assert runner.grammar_masks[0].sum() == vocab - 2 and runner.grammar_masks[1].sum() == 1


def test_a_model_config_without_windows_needs_no_table_even_if_its_type_has_them(tiny_mistral):
    """Tracking follows the loaded config's windows, not the architecture's name."""
    model = load_model(tiny_mistral, with_tokenizer=False)[0]
    model.config = dataclasses.replace(model.config, sliding_windows=(None,) * model.config.num_layers)
    runner = ModelRunner(model, EngineConfig(kv_cache_bytes=2**20, page_size=4))
    assert runner.kv_cache.key_positions is None


def test_the_runner_is_three_verbs_and_the_forward_recipe_is_written_once():
    """Issue 32's done-when, held: ``run`` and ``execute`` within 15 lines and ``sample`` within
    20 (docstrings included), no ``Any`` in the batch contract, and the recipe's device half
    (record positions, forward) only in ``forward.forward_step``: graph capture and the
    tensor-parallel ranks call it through the runner, not a copy of it."""
    import inspect

    from pasta_engine.distributed import executor
    from pasta_engine.core import batch
    from pasta_engine.worker import cuda_graphs, forward

    for fn, most in ((ModelRunner.run, 15), (ModelRunner.execute, 15), (ModelRunner.sample, 20)):
        assert len(inspect.getsource(fn).splitlines()) <= most, fn.__name__
    assert "Any" not in inspect.getsource(batch)
    for module in (cuda_graphs, executor, __import__("pasta_engine.worker.model_runner", fromlist=["x"])):
        src = inspect.getsource(module)
        assert "record_positions(" not in src and ".forward(input_ids" not in src.replace("shard.forward", ""), module
    assert "record_positions(" in inspect.getsource(forward.forward_step)


def test_a_tensor_parallel_rank_captures_its_graphs_when_asked_once(tiny_llama, monkeypatch):
    """CUDA graphs run only on a GPU; what a CPU can check is the capture logic: the real class
    refuses a CPU model, and a tensor-parallel rank's runner does not capture in its constructor
    but when :meth:`capture_graphs` is called (every rank at once, at attach), once."""
    from pasta_engine.worker import cuda_graphs

    model = load_model(tiny_llama, with_tokenizer=False)[0]
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        cuda_graphs.CudaGraphs(model, None, None)
    captured = []
    monkeypatch.setattr(cuda_graphs, "CudaGraphs", lambda model, kv, backend: captured.append(kv) or "graphs")
    rank = ModelRunner(model, EngineConfig(kv_cache_bytes=2**20, page_size=4, tensor_parallel_size=2))
    assert rank.cuda_graphs is None and not rank.wants_graphs  # a CPU model: graphs off by default
    rank.capture_graphs()
    assert rank.cuda_graphs is None and not captured  # nothing wanted, nothing captured
    rank.wants_graphs = True  # as on CUDA with a graph-capable backend
    rank.capture_graphs()
    rank.capture_graphs()
    assert rank.cuda_graphs == "graphs" and captured == [rank.kv_cache]


def test_a_tensor_parallel_rank_pads_with_the_rows_the_step_ran():
    """A graphed decode step whose plan is over its bucket's capacity runs eagerly with T rows
    on every rank; a rank whose part failed padded the others' all-reduces with the bucket's
    rows (4 against 3: gloo aborts the process on the size mismatch). CPU: the graph's
    bookkeeping only (capturing needs CUDA)."""
    from types import SimpleNamespace

    from pasta_engine.worker.cuda_graphs import CudaGraphs
    from pasta_engine.worker.model_runner import ModelRunner

    graphs = CudaGraphs.__new__(CudaGraphs)  # no capture: the entries' plans say "over capacity"
    graphs.buckets, graphs.fallbacks, graphs.last = (1, 2, 4, 8), 0, None
    graphs.entries = {b: SimpleNamespace(backend=SimpleNamespace(plan=lambda meta: False)) for b in graphs.buckets}
    inputs = SimpleNamespace(meta=SimpleNamespace(is_decode=True, q_lens=[1, 1, 1]), input_ids=[5, 6, 7])
    runner = SimpleNamespace(cuda_graphs=graphs)
    assert ModelRunner.forward_rows(runner, inputs) == 4  # before the step: its bucket
    assert graphs.replay(inputs) is None and graphs.fallbacks == 1
    assert ModelRunner.forward_rows(runner, inputs) == 3  # it ran eagerly: T rows, as the others
    other = SimpleNamespace(meta=inputs.meta, input_ids=[5, 6, 7])
    assert ModelRunner.forward_rows(runner, other) == 4  # another step's inputs: not this record


def test_a_graph_replay_rewrites_its_pinned_host_buffer_only_after_the_last_copies(monkeypatch):
    """Replays copy ids, positions and slots to the GPU asynchronously from one pinned host
    buffer; a step that samples nothing has no sync of its own, so the next replay must wait for
    the last one's copies (an event recorded after them) before rewriting the buffer. CPU: the
    real ``replay`` with a fake event that checks the buffer is unchanged until it is waited for."""
    from types import SimpleNamespace

    from pasta_engine.worker.cuda_graphs import CudaGraphs

    log = []

    class Event:
        def record(self):
            self.seen = graphs._host.clone()
            log.append("record")

        def synchronize(self):
            assert torch.equal(graphs._host, self.seen), "the host buffer was rewritten before its copies were done"
            log.append("synchronize")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    graphs = CudaGraphs.__new__(CudaGraphs)  # no capture: plans fit, graphs replay nothing
    graphs.buckets, graphs.max_seqs, graphs.fallbacks, graphs.replays, graphs.last = (1, 2, 4), 4, 0, 0, None
    graphs._host = torch.zeros(3, 4, dtype=torch.long)
    graphs._copied = None
    graphs.input_ids, graphs.positions = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    graphs.slots = torch.full((4,), -1, dtype=torch.long)
    graphs.entries = {b: SimpleNamespace(backend=SimpleNamespace(plan=lambda meta: True),
                                         graph=SimpleNamespace(replay=lambda: log.append("replay")),
                                         logits=torch.zeros(b, 8)) for b in graphs.buckets}
    for step in range(3):  # pure decode steps of 3 rows (bucket 4) that sample nothing
        inputs = SimpleNamespace(meta=SimpleNamespace(is_decode=True, q_lens=[1, 1, 1], slots=[step, 10 + step, 20]),
                                 input_ids=[step] * 3, positions=[7, 8, 9 + step], logits_indices=[])
        assert graphs.replay(inputs).shape == (3, 8)
        assert graphs.slots.tolist() == [step, 10 + step, 20, -1] and graphs.input_ids.tolist() == [step] * 3 + [0]
    assert log == ["record", "replay", "synchronize", "record", "replay", "synchronize", "record", "replay"]


def test_settings_it_cannot_run_are_refused_before_the_kv_cache_is_allocated(tiny_llama, monkeypatch):
    """CUDA graphs on a CPU, and a budget that holds no page, are refused before the KV cache
    (up to the whole budget) is allocated, naming the field and its command-line flag."""
    import pasta_engine.worker.model_runner as mr

    model = load_model(tiny_llama, with_tokenizer=False)[0]

    def no_allocation(*a, **k):
        raise AssertionError("the KV cache was allocated before the refusal")

    monkeypatch.setattr(mr, "KVCache", no_allocation)
    with pytest.raises(ParameterError, match=r"cuda_graphs=True needs the model on a CUDA device.*--cuda-graphs on "
                                             r"needs --device cuda") as e:
        ModelRunner(model, EngineConfig(kv_cache_bytes=512 * 2**20, page_size=4, cuda_graphs=True))
    assert e.value.param == "cuda_graphs"
    with pytest.raises(ParameterError, match=r"holds no page .* raise kv_cache_bytes \(--kv-cache-mb\)") as e:
        ModelRunner(model, EngineConfig(kv_cache_bytes=1000, page_size=4))
    assert e.value.param == "kv_cache_bytes"
