"""Training at scale: the device and precision of a training run, its memory estimate, data
parallel training over ``torch.distributed``, and the FLOP arithmetic of the recipe in
docs/training_at_scale.md.

**Device and precision.** :func:`resolve_device` and :func:`resolve_dtype` turn the ``--device``
and ``--dtype`` flags into torch objects (ParameterError naming the flag for a bad value). The
base weights are held in that dtype and frozen; peft keeps the LoRA matrices and the tag-token
rows in float32 (its ``autocast_adapter_dtype``), so AdamW updates float32 values: the usual
mixed-precision recipe, with no loss scaling needed for bfloat16 (float16 gets torch's
``GradScaler``).

**Memory.** :func:`estimate_training_memory` counts, for a Llama-family model (``ModelShape``),
the base weights, the trainable parameters (LoRA + tag rows), their gradients, AdamW's two
moments and the activations autograd keeps for the longest example; :func:`check_memory` compares
the total with the device's memory (``torch.cuda.mem_get_info`` on a GPU, ``MemAvailable`` of
``/proc/meminfo`` via psutil on the CPU, or ``--max-memory-gib``) and raises a one-line
ParameterError naming the figure and the flag to change.

**Data parallel.** Under ``torchrun --nproc-per-node N`` (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment) :func:`init_data_parallel`
starts torch.distributed's default process group (gloo on a CPU, NCCL on CUDA); each rank holds
a replica of the model, runs its share of each optimizer step's examples (:meth:`DataParallel.shard`)
and the ranks sum their gradients with one ``all_reduce`` per optimizer step
(:meth:`DataParallel.all_reduce_gradients`), so every replica takes the same AdamW step as one
process over the same global batch would.

**FLOPs.** :func:`training_flops` (6 x parameters x tokens) and :func:`forward_flops`
(2 x parameters x tokens) against the H100's dense bfloat16 peak (:data:`H100_BF16_DENSE_FLOPS`);
``python -m pasta_engine.train.scale`` prints the recipe's table (:func:`recipe_table`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import ParameterError

__all__ = [
    "TRAIN_DTYPES",
    "resolve_device",
    "resolve_dtype",
    "ModelShape",
    "PUBLISHED_SHAPES",
    "MemoryEstimate",
    "estimate_training_memory",
    "estimate_inference_memory",
    "device_memory",
    "check_memory",
    "DataParallel",
    "init_data_parallel",
    "longest_layout",
    "training_flops",
    "forward_flops",
    "H100_BF16_DENSE_FLOPS",
    "H100_HBM_BYTES_PER_S",
    "recipe_table",
]

GiB = 2**30


def _size(n: float) -> str:
    """``n`` bytes as GiB (with two decimals), or as MiB below 1 GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"

#: ``--dtype`` names and their torch dtypes.
TRAIN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: NVIDIA H100 SXM5, dense (no sparsity) BF16 tensor-core peak, FLOP/s: 989.4 TFLOP/s in NVIDIA's
#: H100 Tensor Core GPU datasheet (the 1,979 figure there is with 2:4 sparsity).
H100_BF16_DENSE_FLOPS = 989e12
#: NVIDIA H100 SXM5 HBM3 bandwidth, bytes/s (3.35 TB/s, the same datasheet): the floor of a decode
#: step, which reads every weight once.
H100_HBM_BYTES_PER_S = 3.35e12


def resolve_device(flag: str) -> torch.device:
    """The torch device of ``--device`` (``cpu``, ``cuda``, ``cuda:N`` or ``auto``: cuda when torch
    sees a GPU). Raises ParameterError naming ``--device`` for another value, or for cuda when this
    torch sees no GPU."""
    from ..engine.llm_engine import check_device

    try:
        return check_device(flag)
    except ParameterError as e:
        raise ParameterError("--device", flag, message=f"--device {flag}: {e}") from None


def resolve_dtype(flag: str | None, device: torch.device) -> torch.dtype:
    """The dtype of the base weights for ``--dtype`` (``float32``, ``bfloat16``, ``float16``; None:
    float32 on a CPU, today's default, and bfloat16 on CUDA). Raises ParameterError naming
    ``--dtype`` for another value."""
    if flag is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if flag not in TRAIN_DTYPES:
        raise ParameterError("--dtype", flag, " | ".join(TRAIN_DTYPES))
    return TRAIN_DTYPES[flag]


def _dtype_bytes(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        dtype = TRAIN_DTYPES[dtype]
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder (Llama, Qwen2/3, Mistral, Gemma) that fix its memory.

    Attributes:
        hidden: hidden size h; layers: decoder layers L; heads: query heads a; kv_heads: key/value
        heads g; head_dim: d; intermediate: MLP width m; vocab: embedding rows V; tied: the LM head
        is the embedding; qkv_bias: q/k/v projections have biases (Qwen2); qk_norm: per-head
        RMSNorm of q and k (Qwen3); norms_per_layer: RMSNorms in a layer (2; 4 in Gemma 2);
        source: where the numbers come from."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    source: str = ""

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelShape":
        """The shape of a ``transformers`` config (``hidden_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
        ``vocab_size``, ``tie_word_embeddings``, ``model_type``). Raises AttributeError when a
        field is missing."""
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        mt = getattr(cfg, "model_type", "")
        return cls(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=heads,
                   kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
                   tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                   qkv_bias=mt == "qwen2" or bool(getattr(cfg, "attention_bias", False)), qk_norm=mt == "qwen3",
                   norms_per_layer=4 if mt in ("gemma2", "gemma3_text") else 2, source=f"config ({mt})")

    def linears(self) -> dict[str, tuple[int, int]]:
        """``{name: (in features, out features)}`` of one layer's seven projections."""
        h, q, kv, m = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}

    def params(self, added_rows: int = 0) -> int:
        """Parameters of the whole model (embedding of ``vocab + added_rows`` rows, the LM head
        unless tied, every layer's projections, q/k/v biases and norms, the final norm): exact for
        the configurations tests/train/test_scale.py checks against ``transformers`` (Llama,
        Qwen2, Qwen3, Gemma, Gemma 2 as published). Not counted: ``o_proj``'s bias of a Llama
        config with ``attention_bias``, the MLP biases of ``mlp_bias``, Gemma 3's q/k norms
        (hundreds of parameters per layer: nothing at the memory scale this plans for)."""
        per_layer = sum(i * o for i, o in self.linears().values()) + self.norms_per_layer * self.hidden
        if self.qkv_bias:
            per_layer += (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        rows = self.vocab + added_rows
        return rows * self.hidden * (1 if self.tied else 2) + self.layers * per_layer + self.hidden

    def lora_params(self, r: int, targets: Sequence[str]) -> int:
        """LoRA parameters at rank ``r`` on ``targets``: ``r x (in + out)`` per adapted
        projection (A is ``[r, in]``, B is ``[out, r]``; Hu et al. 2021), every layer."""
        lin = self.linears()
        return self.layers * sum(r * (lin[t][0] + lin[t][1]) for t in targets if t in lin)


#: The published configs of the recipe's models (config.json on the Hugging Face Hub; the same
#: numbers as pasta_engine/tools/presets.py's llama-3-8b, qwen3-8b and gemma-7b presets).
PUBLISHED_SHAPES: dict[str, ModelShape] = {
    "Llama-3.1-8B-Instruct": ModelShape(
        hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, tied=False,
        source="https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json"),
    "Qwen3-8B": ModelShape(
        hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936, tied=False,
        qk_norm=True, source="https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json"),
    "Gemma-7B-it": ModelShape(
        hidden=3072, layers=28, heads=16, kv_heads=16, head_dim=256, intermediate=24576, vocab=256000, tied=True,
        source="https://huggingface.co/google/gemma-7b-it/blob/main/config.json"),
}


@dataclass
class MemoryEstimate:
    """A memory estimate in bytes, by part (``parts``: name -> bytes, in print order), with what it
    assumed (``notes``). ``total`` is their sum."""

    parts: dict[str, int] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """The sum of the parts, bytes."""
        return sum(self.parts.values())

    def describe(self) -> str:
        """One line: the total and each part (GiB, or MiB below 1 GiB), then the notes."""
        parts = ", ".join(f"{k} {_size(v)}" for k, v in self.parts.items())
        notes = ", ".join(f"{k} {v}" for k, v in self.notes.items())
        return f"{_size(self.total)} ({parts}; {notes})"


def _layer_activation_bytes(shape: ModelShape, tokens: int, b: int, lora_r: int, targets: Sequence[str],
                            lora_dropout: float) -> int:
    """Bytes autograd keeps for the backward of one decoder layer over ``tokens`` tokens."""
    t, h, m = tokens, shape.hidden, shape.intermediate
    qd = shape.heads * shape.head_dim
    lin = shape.linears()
    norms = shape.norms_per_layer * (4 * t * h + 4 * t)  # float32 input and 1/rms per row
    # peft's LoRA path in float32, and A's rank-r output
    if lora_dropout > 0:  # each adapter's own dropout: mask and output at its input's width
        lora = sum(2 * 4 * t * lin[k][0] for k in targets if k in lin)
    else:  # no dropout: A reads the input itself, one float32 copy per distinct input (q/k/v, o, gate/up, down)
        groups = [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)]
        lora = sum(4 * t * lin[g[0]][0] for g in groups if any(k in targets for k in g))
    lora += sum(4 * t * lora_r for k in targets if k in lin)
    attention = 4 * t * qd * b + 4 * t * shape.heads  # q, k, v (repeated to the query heads), output; logsumexp
    mlp = 3 * t * m * b  # gate (for the activation), up, act(gate) (for the product)
    return norms + lora + attention + mlp


def estimate_training_memory(
    shape: ModelShape,
    dtype: torch.dtype | str,
    *,
    tokens: int,
    targets: int | None = None,
    lora_r: int = 16,
    lora_targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    lora_dropout: float = 0.05,
    trainable_rows: int = 0,
    added_rows: int = 0,
    gradient_checkpointing: bool = False,
    sequences: int = 1,
    frozen_copies: int = 0,
) -> MemoryEstimate:
    """The peak memory of one LoRA training step on one example (or ``sequences`` examples whose
    graphs live together: BoNBoN's best and worst), in bytes, by part.

    Args:
        shape: the model's sizes (h, L, a, d, m, V as in :class:`ModelShape`).
        dtype: the base weights' dtype (b bytes per element; activations are in it too).
        tokens: T, the tokens of the longest example's training forward (prompt + every thread's
            tokens, as :func:`~pasta_engine.train.forward.layout_for` lays them out).
        targets: S, its sampled (predicted) tokens (default T).
        lora_r, lora_targets, lora_dropout: the adapter (:class:`~pasta_engine.train.common.LoraSettings`).
        trainable_rows: embedding rows trained besides the LoRA (the tag tokens; twice for an untied
            LM head); added_rows: rows the embedding grows by.
        gradient_checkpointing: each layer keeps only its input and recomputes the rest in the backward.
        sequences: examples whose activations are alive at once.
        frozen_copies: other full copies of the base weights in memory (the distillation teacher;
            BoNBoN's quality scorer).

    The parts (bytes; peft keeps trainable tensors in float32, its ``autocast_adapter_dtype``):

    * base weights: ``params(added_rows) x b`` (:meth:`ModelShape.params`), ``x (1 + frozen_copies)``;
    * trainable (LoRA + tag rows): ``P = L x sum r (in + out) + rows x h``, ``4P``; gradients ``4P``;
      AdamW state ``8P`` (``exp_avg`` and ``exp_avg_sq``, torch.optim.AdamW);
    * activations: per layer the tensors autograd saves for the backward, counted as Korthikanti
      et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv
      2205.05198, section 4.1) count them, here for a Llama layer under peft LoRA with torch's
      scaled-dot-product attention (flash or memory-efficient kernels, which keep no T x T
      matrix), read off the autograd graph's ``_saved_*`` tensors:
      ``2 x (4Th + 4T)`` (two RMSNorms in float32) ``+ sum_targets (2 x 4T in + 4Tr)`` (the
      LoRA dropout's mask and output, float32, and A's output) ``+ 4T a d b + 4Ta`` (q, k, v,
      attention output; log-sum-exp) ``+ 3Tmb`` (the gated MLP); shared by the layers, the
      ``T x T`` mask ``T^2 b`` (and its bool source, ``T^2``) and the rotary tables ``2Tdb``.
      Beside what the layers keep, the larger of two moments: the end of the forward, with the
      head's ``TVb + SV(b + 4 + 4)`` (the logits, the predicting rows, their float32 copy unless
      b is 4, the log-softmax); and the backward, with the larger of the head's ``12SV + TVb``
      (the saved log-softmax, two float32 gradients of it, the logits' gradient) and one layer's
      float32 activation gradients in flight, ``4 x 4Tm``. With gradient checkpointing the layers
      keep ``L x Thb`` and the backward recomputes one layer at a time (one layer's activations
      beside the gradients in flight).

    Not counted: the CUDA context and the allocator's cache (see :func:`check_memory`), the
    Python process itself. Measured on a CPU against torch's profiler (tests/train/test_scale.py):
    within the margin stated there. Raises ValueError for tokens < 1."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    b = _dtype_bytes(dtype)
    t = tokens
    s = t if targets is None else targets
    h, m, v = shape.hidden, shape.intermediate, shape.vocab + added_rows
    weights = shape.params(added_rows) * b
    trainable = shape.lora_params(lora_r, lora_targets) + trainable_rows * h
    layer = _layer_activation_bytes(shape, t, b, lora_r, lora_targets, lora_dropout)
    shared = t * t * (b + 1) + 2 * t * shape.head_dim * b
    # the head: forward, the logits [T, V], the predicting rows [S, V], their float32 copy, the log-softmax;
    # backward, the saved log-softmax, its two float32 gradients and the logits' gradient [T, V]
    head_forward = t * v * b + s * v * (b + (4 if b != 4 else 0) + 4)
    head_backward = 12 * s * v + t * v * b
    if gradient_checkpointing:  # each layer keeps its input; the backward recomputes one layer at a time
        kept, recomputed = shape.layers * t * h * b, layer
    else:
        kept, recomputed = shape.layers * layer, 0
    working = 4 * 4 * t * m  # one layer's float32 activation gradients in flight
    forward_peak = sequences * (kept + shared) + head_forward
    backward_peak = sequences * (kept + shared) + max(head_backward, recomputed + working)
    parts = {"base weights": weights * (1 + frozen_copies), "LoRA + tag rows": 4 * trainable,
             "gradients": 4 * trainable, "AdamW state": 8 * trainable,
             "activations": max(forward_peak, backward_peak)}
    notes = {"longest example": f"{t} tokens", "dtype": str(dtype).replace("torch.", ""),
             "gradient checkpointing": "on" if gradient_checkpointing else "off"}
    if sequences > 1:
        notes["sequences"] = sequences
    if frozen_copies:
        notes["frozen copies of the weights"] = frozen_copies
    return MemoryEstimate(parts, notes)


def estimate_inference_memory(shape: ModelShape, dtype: torch.dtype | str, kv_cache_bytes: int,
                              frozen_copies: int = 0) -> MemoryEstimate:
    """Memory of sampling with the engine (``train answers``, ``train chunks``, BoNBoN's
    candidates): the weights (``params x b``, plus ``frozen_copies`` more copies, e.g. BoNBoN's
    scorer) and the KV cache budget the engine allocates up front (bytes). Raises nothing."""
    b = _dtype_bytes(dtype)
    return MemoryEstimate({"base weights": shape.params() * b * (1 + frozen_copies), "KV cache": kv_cache_bytes},
                          {"dtype": str(dtype).replace("torch.", "")})


def device_memory(device: torch.device) -> tuple[int, str]:
    """``(bytes, what)``: the memory a run on ``device`` can use: the GPU's free memory
    (``torch.cuda.mem_get_info``), or the CPU's available memory (psutil's ``available``, the
    kernel's ``MemAvailable``; ``/proc/meminfo`` when psutil is missing). Raises OSError when
    neither can be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"the {device} GPU's free memory"
    try:
        import psutil

        return int(psutil.virtual_memory().available), "this machine's available memory"
    except ImportError:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "this machine's available memory (/proc/meminfo)"
        raise OSError("no MemAvailable in /proc/meminfo") from None


#: Room left on a GPU beyond the estimate: the CUDA context, cuBLAS workspaces and the caching
#: allocator's fragmentation (a round allowance, not measured here).
CUDA_RESERVE_BYTES = 2 * GiB


def check_memory(estimate: MemoryEstimate, device: torch.device, what: str, *, max_memory_gib: float | None = None,
                 flags: Sequence[str] = ()) -> str:
    """Compare ``estimate`` with the memory of ``device`` (or ``max_memory_gib``, GiB) and return
    the line to print: ``"<what>: memory estimate ... of <limit>"``.

    ``flags``: what to change to need less (``--dtype bfloat16``, ``--gradient-checkpointing``...),
    named in the error. On a GPU, :data:`CUDA_RESERVE_BYTES` is kept free beyond the estimate.

    Raises ParameterError (one line; ``param`` is the first flag, or ``--max-memory-gib``) when
    the estimate does not fit, naming the figure, the limit and the flags."""
    if max_memory_gib is not None:
        have, source = int(max_memory_gib * GiB), f"--max-memory-gib {max_memory_gib:g}"
    else:
        have, source = device_memory(device)
    reserve = CUDA_RESERVE_BYTES if device.type == "cuda" and max_memory_gib is None else 0
    line = f"{what}: memory estimate {estimate.describe()}; limit {_size(have)} ({source})"
    if estimate.total + reserve > have:
        change = ", ".join(flags) if flags else "a smaller model"
        biggest = max(estimate.parts, key=estimate.parts.get)
        plus = f" + {_size(reserve)} kept free for CUDA" if reserve else ""
        raise ParameterError(flags[0].split()[0] if flags else "--max-memory-gib", estimate.total, message=(
            f"{what} needs an estimated {_size(estimate.total)} (largest part: {biggest} "
            f"{_size(estimate.parts[biggest])}){plus}, more than {_size(have)} ({source}): change {change}"
            + ("" if max_memory_gib is not None else " (or set --max-memory-gib)")))
    return line


def longest_layout(examples: Sequence[Any], tokenizer: Any, config: Any, position_policy: str = "predicted", *,
                   pasta_prompt: Any = None, candidates: int = 3) -> tuple[int, int]:
    """``(T, S)``: the forwarded and the sampled tokens of the longest training forward among
    ``examples`` (:class:`~pasta_engine.train.data.TrainExample`), laid out as training lays them
    out (:func:`~pasta_engine.train.forward.layout_for`) for the ``candidates`` examples with the
    most characters of prompt and answer (the layout follows the tokens, the tokens the
    characters). With tags as text (``tokenizer`` without the tag tokens) a promise takes more
    tokens than with them: an upper bound then. Raises ValueError for no examples."""
    from types import SimpleNamespace

    from ..config import Limits
    from ..lang.prompts import LEARNED_PASTA_PROMPT
    from .forward import layout_for

    if not examples:
        raise ValueError("no examples to estimate the memory of")
    ranked = sorted(examples, key=lambda e: len(e.prompt) + len(e.annotated), reverse=True)[:candidates]
    stub = SimpleNamespace(config=config)
    best = (0, 0)
    for ex in ranked:
        lay = layout_for(stub, tokenizer, ex.prompt, ex.annotated, position_policy,
                         pasta_prompt=pasta_prompt or LEARNED_PASTA_PROMPT, limits=Limits(max_threads=None))
        best = max(best, (len(lay), len(lay.sampled()[0])))
    return best


# ---- data parallel -------------------------------------------------------------------------

@dataclass
class DataParallel:
    """One rank of a data-parallel run (a world of 1 is a plain run: nothing is communicated).

    Attributes:
        rank: this process's global rank (0 logs, checkpoints and exports); world_size: ranks;
        local_rank: rank on this node (its GPU index); device: this rank's device; backend: gloo
        or nccl (None for a world of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    def shard(self, batch: Sequence[Any]) -> list[Any]:
        """This rank's share of one optimizer step's global batch: ``batch[rank::world_size]``
        (every example on exactly one rank; shares differ by at most one)."""
        return list(batch[self.rank:: self.world_size])

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum the ``.grad`` of ``params`` over the ranks, in place (one flat ``all_reduce`` of every
        gradient, float32, on this rank's device). A parameter without a gradient counts as zeros.
        Each rank's loss is already divided by the global batch size, so the sum is the global
        batch's mean gradient. No-op for a world of 1. Raises RuntimeError when the collective
        fails."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        at = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[at: at + n].view_as(g).to(g.dtype)
            at += n

    def broadcast_parameters(self, params: Sequence[torch.Tensor]) -> None:
        """Copy rank 0's values of ``params`` to every rank, in place (``broadcast`` per tensor, as
        DistributedDataParallel does when it wraps a model), so the replicas start equal. No-op for
        a world of 1."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """``values`` (floats, the same count on every rank) summed over the ranks, as float64
        (one ``all_reduce``). Returns them unchanged for a world of 1."""
        if self.world_size == 1:
            return [float(x) for x in values]
        import torch.distributed as dist

        dev = self.device if self.backend == "nccl" else torch.device("cpu")
        t = torch.tensor([float(x) for x in values], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def barrier(self) -> None:
        """Wait for every rank (no-op for a world of 1)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """Destroy the process group this object started (no-op for a world of 1)."""
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def init_data_parallel(device: torch.device) -> DataParallel:
    """This process's rank, from the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``; ``MASTER_ADDR``/``MASTER_PORT`` for the rendezvous). With ``WORLD_SIZE`` > 1
    it starts torch.distributed's default group (gloo for a CPU ``device``, NCCL for CUDA, whose
    rank uses GPU ``cuda:LOCAL_RANK``); without it, a world of 1 on ``device``.

    Raises ParameterError when the variables are malformed, or a CUDA run has more local ranks
    than GPUs."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ParameterError("WORLD_SIZE", os.environ.get("WORLD_SIZE"), message="RANK, WORLD_SIZE and LOCAL_RANK must "
                             "be integers (as torchrun sets them)") from None
    if world < 1 or not 0 <= rank < world:
        raise ParameterError("RANK", rank, message=f"RANK {rank} is not in [0, WORLD_SIZE {world})")
    if world == 1:
        return DataParallel(device=device)
    import torch.distributed as dist

    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ParameterError("LOCAL_RANK", local, message=f"LOCAL_RANK {local} but this node has "
                                 f"{torch.cuda.device_count()} GPUs: --nproc-per-node must be at most that")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return DataParallel(rank=rank, world_size=world, local_rank=local, device=device, backend=backend)


# ---- FLOPs and the recipe ---------------------------------------------------------------------

def training_flops(params: int, tokens: float) -> float:
    """FLOPs of training on ``tokens`` tokens: ``6 x params x tokens`` (forward 2N, backward 4N per
    token: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1). With LoRA
    the frozen weights get no weight gradient (the backward is about 2N), and gradient
    checkpointing adds a forward (2N) back: 6N holds for LoRA with checkpointing and is an
    upper bound without it. Attention's ``T^2`` terms are left out (T <= 1024 << 6h here)."""
    return 6.0 * params * tokens


def forward_flops(params: int, tokens: float) -> float:
    """FLOPs of a forward over ``tokens`` tokens (prefill, decode, a reference or scoring pass):
    ``2 x params x tokens`` (one multiply-add per weight per token)."""
    return 2.0 * params * tokens


@dataclass(frozen=True)
class RecipeAssumptions:
    """The data and the machine the recipe's figures assume (docs/training_at_scale.md).

    Token counts: prompts with the chat template and the one-line PASTA-LANG system prompt have
    68 tokens on average and 538 at most over AlpacaEval's 725 training prompts (SmolLM2's
    tokenizer; the others' differ by some percent); answers are capped at ``answer_tokens``;
    SFT examples are cut to ``response_tokens``. The longest training forward is
    ``538 + 448 + tags`` <= ``longest_tokens``. Stage sizes are those of the adapter shipped
    before 2026-11-29 (docs/learning.md; its manifest's stages, commit 997f896): SFT 1 on 340
    examples, 2 epochs; BoNBoN 2 rounds of 48 prompts x 4 samples, ~45 pairs a round; SFT 3 on
    190 examples x 2 epochs; SFT 4 on 140 x 1.
    Utilisation: ``train_mfu`` of the dense bf16 peak for training and ``sample_mfu`` for the
    forward-only passes; a decode step is at least one read of the weights at the HBM bandwidth
    (:data:`H100_HBM_BYTES_PER_S`) for ``batch`` requests at once."""

    train_prompts: int = 725
    prompt_tokens: int = 68
    longest_tokens: int = 1024
    answer_tokens: int = 512
    response_tokens: int = 448
    sft1_examples: int = 340
    sft1_epochs: int = 2
    bonbon_rounds: int = 2
    bonbon_prompts: int = 48
    bonbon_n: int = 4
    bonbon_new_tokens: int = 320
    bonbon_pairs: int = 45
    sft3_examples: int = 190
    sft3_epochs: int = 2
    sft4_examples: int = 140
    sft4_epochs: int = 1
    answers_batch: int = 16
    bonbon_batch: int = 8
    train_mfu: float = 0.30
    sample_mfu: float = 0.30
    lora_r: int = 16


def _sample_seconds(n_params: int, weight_bytes: int, requests: int, prompt: int, new: int, batch: int,
                    a: RecipeAssumptions) -> float:
    flop_s = forward_flops(n_params, requests * (prompt + new)) / (H100_BF16_DENSE_FLOPS * a.sample_mfu)
    bandwidth_s = math.ceil(requests / batch) * new * weight_bytes / H100_HBM_BYTES_PER_S
    return max(flop_s, bandwidth_s)


def recipe_table(assumptions: RecipeAssumptions = RecipeAssumptions(), dtype: str = "bfloat16",
                 shapes: dict[str, ModelShape] | None = None) -> list[dict[str, Any]]:
    """Per model of ``shapes`` (default :data:`PUBLISHED_SHAPES`) and stage of the recipe: the
    memory estimate (GiB, :func:`estimate_training_memory` at the longest example, bf16 weights,
    LoRA r 16 on the seven projections, 6 tag rows; with and without gradient checkpointing;
    :func:`estimate_inference_memory` plus the KV cache of the sampling batch for the sampling
    stages) and the time on one H100 and on 8 (seconds: FLOPs / (peak x utilisation), sampling at
    least the bandwidth floor; data parallel training divides by 8, sampling runs on one GPU).
    Returns JSON-ready rows: model, stage, params, tokens, flops, memory_gib, memory_gc_gib,
    h100_s, h100x8_s."""
    a = assumptions
    rows = []
    b = _dtype_bytes(dtype)
    for name, shape in (shapes or PUBLISHED_SHAPES).items():
        n = shape.params()
        w = n * b
        rows_tag = 6 * (1 if shape.tied else 2)
        ex_tokens = a.prompt_tokens + a.response_tokens

        def train_mem(seqs: int = 1, frozen: int = 0, gc: bool = False, tokens: int = a.longest_tokens) -> float:
            return estimate_training_memory(shape, dtype, tokens=tokens, lora_r=a.lora_r, trainable_rows=rows_tag,
                                            added_rows=6, gradient_checkpointing=gc, sequences=seqs,
                                            frozen_copies=frozen).total / GiB

        kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * b
        answers_kv = a.answers_batch * (a.longest_tokens) * kv_per_token
        bonbon_kv = a.bonbon_batch * (a.longest_tokens) * kv_per_token
        sft_stages = [("SFT 1", a.sft1_examples * a.sft1_epochs), ("SFT 3", a.sft3_examples * a.sft3_epochs),
                      ("SFT 4", a.sft4_examples * a.sft4_epochs)]
        answers_s = _sample_seconds(n, w, a.train_prompts, a.prompt_tokens, a.answer_tokens, a.answers_batch, a)
        rows.append({"model": name, "stage": "answers", "params": n,
                     "tokens": a.train_prompts * (a.prompt_tokens + a.answer_tokens),
                     "flops": forward_flops(n, a.train_prompts * (a.prompt_tokens + a.answer_tokens)),
                     "memory_gib": estimate_inference_memory(shape, dtype, answers_kv).total / GiB,
                     "memory_gc_gib": None, "h100_s": answers_s, "h100x8_s": answers_s})
        for stage, examples in sft_stages[:1]:
            toks = examples * ex_tokens
            s1 = training_flops(n, toks) / (H100_BF16_DENSE_FLOPS * a.train_mfu)
            rows.append({"model": name, "stage": stage, "params": n, "tokens": toks, "flops": training_flops(n, toks),
                         "memory_gib": train_mem(), "memory_gc_gib": train_mem(gc=True), "h100_s": s1,
                         "h100x8_s": s1 / 8})
        # BoNBoN round: sample n per prompt (the engine; the scorer's forward over each sample), then
        # the reference's forward and the training of best and worst per pair
        samples = a.bonbon_prompts * a.bonbon_n
        seq = a.prompt_tokens + a.bonbon_new_tokens
        sample_s = _sample_seconds(n, w, samples, a.prompt_tokens, a.bonbon_new_tokens, a.bonbon_batch, a)
        score_s = forward_flops(n, samples * seq) / (H100_BF16_DENSE_FLOPS * a.sample_mfu)
        pair_toks = 2 * a.bonbon_pairs * seq
        train_s = (forward_flops(n, pair_toks) + training_flops(n, pair_toks)) / (H100_BF16_DENSE_FLOPS * a.train_mfu)
        bonbon_longest = min(a.longest_tokens, 538 + a.bonbon_new_tokens)
        rows.append({"model": name, "stage": f"BoNBoN ({a.bonbon_rounds} rounds)", "params": n,
                     "tokens": a.bonbon_rounds * (samples * seq + pair_toks),
                     "flops": a.bonbon_rounds * (forward_flops(n, 2 * samples * seq + pair_toks)
                                                 + training_flops(n, pair_toks)),
                     "memory_gib": max(estimate_inference_memory(shape, dtype, bonbon_kv, frozen_copies=1).total / GiB,
                                       train_mem(seqs=2, frozen=1, tokens=bonbon_longest)),
                     "memory_gc_gib": max(estimate_inference_memory(shape, dtype, bonbon_kv, frozen_copies=1).total
                                          / GiB, train_mem(seqs=2, frozen=1, gc=True, tokens=bonbon_longest)),
                     "h100_s": a.bonbon_rounds * (sample_s + score_s + train_s),
                     "h100x8_s": a.bonbon_rounds * (sample_s + score_s + train_s)})
        for stage, examples in sft_stages[1:]:
            toks = examples * ex_tokens
            s1 = training_flops(n, toks) / (H100_BF16_DENSE_FLOPS * a.train_mfu)
            rows.append({"model": name, "stage": stage, "params": n, "tokens": toks, "flops": training_flops(n, toks),
                         "memory_gib": train_mem(), "memory_gc_gib": train_mem(gc=True), "h100_s": s1,
                         "h100x8_s": s1 / 8})
    return rows


def _format_table(rows: list[dict[str, Any]]) -> str:
    out = ["| model | stage | params | tokens | FLOPs | memory GiB (GC off / on) | 1 x H100 | 8 x H100 |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def t(s: float) -> str:
        return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"

    for r in rows:
        mem = f"{r['memory_gib']:.1f}" + ("" if r["memory_gc_gib"] is None else f" / {r['memory_gc_gib']:.1f}")
        out.append(f"| {r['model']} | {r['stage']} | {r['params'] / 1e9:.2f} B | {r['tokens']:,} | {r['flops']:.2e} | "
                   f"{mem} | {t(r['h100_s'])} | {t(r['h100x8_s'])} |")
    return "\n".join(out)


if __name__ == "__main__":  # python -m pasta_engine.train.scale: the recipe's table (docs/training_at_scale.md)
    print(_format_table(recipe_table()))
