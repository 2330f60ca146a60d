"""Random-weight checkpoints at published model shapes, for timing and tests.

Speed does not depend on weight values, so replay at the paper's model scale needs no
download: :func:`build_checkpoint` writes a ``transformers`` checkpoint (config, safetensors,
tokenizer) with random weights at a preset's shape into a cache folder, and the engine loads
it through the same loader as a real checkpoint.

Tokenizers (:data:`PRESET_TOKENIZERS`): tiny presets get a byte-level BPE tokenizer trained in
milliseconds on a few PASTA-LANG sentences (320 tokens, tags split into several tokens,
multi-byte characters split across tokens); full-size presets use the embedded SmolLM2
tokenizer when the model package is installed (realistic token counts), else the same tiny one.
No family tokenizer (Llama 3's, Qwen's, Gemma's) can be built offline: they are vocabulary files
from a hub, so every full-size preset, ``gemma-7b``, ``gemma-2-9b`` and ``qwen3-8b`` included,
uses SmolLM2's (its 49152 ids fit every preset's vocabulary).

The tiny presets of the newer architectures set their options so that each one changes the
logits of a random-weight model (parity tests then check that it is honoured): windows of 8
tokens, soft-caps near the size of the scores, ``query_pre_attn_scalar`` unlike ``head_dim``,
LongRoPE factors far from 1.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..models.loader import cache_root

__all__ = ["PRESETS", "PRESET_TOKENIZERS", "tiny_tokenizer", "preset_tokenizer", "build_checkpoint", "SHARD_BYTES"]

_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=4096,
             rms_norm_eps=1e-6, tie_word_embeddings=False)

#: name -> transformers config fields (published shapes; weights are random).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", rope_theta=10000.0, **_TINY),
    "tiny-qwen2": dict(model_type="qwen2", rope_theta=1000000.0, **{**_TINY, "num_key_value_heads": 1,
                                                                     "tie_word_embeddings": True}),
    "tiny-mistral": dict(model_type="mistral", rope_theta=10000.0, sliding_window=8, **_TINY),
    "tiny-qwen3": dict(model_type="qwen3", rope_theta=1000000.0, **_TINY),
    "tiny-gemma": dict(model_type="gemma", rope_theta=10000.0, hidden_act="gelu_pytorch_tanh",
                       **{**_TINY, "num_key_value_heads": 4, "head_dim": 32, "tie_word_embeddings": True}),
    "tiny-gemma2": dict(model_type="gemma2", rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh",
                        sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=0.1,
                        final_logit_softcapping=0.3, **{**_TINY, "tie_word_embeddings": True}),
    "tiny-phi3": dict(model_type="phi3", original_max_position_embeddings=2048, pad_token_id=0,
                      rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0, 1.0, 1.2, 4.0, 1.1],
                                    "long_factor": [2.0, 5.0, 3.0, 8.0, 1.5, 6.0, 2.5, 9.0]},
                      **{**_TINY, "num_key_value_heads": 4}),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=152064,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=False),
    # the paper's model (Jin et al. 2025 finetune Gemma-7B): multi-head attention, head_dim 256
    "gemma-7b": dict(model_type="gemma", hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=16, head_dim=256, vocab_size=256000,
                     max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
                     hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    "gemma-2-9b": dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                       max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
                       hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=False),
}

#: name -> the tokenizer :func:`build_checkpoint` saves with it: ``"tiny"`` (:func:`tiny_tokenizer`)
#: or ``"smollm2"`` (the embedded SmolLM2-135M-Instruct's, or the tiny one when the model
#: package is missing); see the module docstring.
PRESET_TOKENIZERS: dict[str, str] = {name: "tiny" if name.startswith("tiny-") else "smollm2" for name in PRESETS}

_CORPUS = [
    'Here are three tips:\n1. <promise topic="sleep" tokens="30"/><async>Go to bed early.</async>\n'
    '2. <promise topic="screens" tokens="20"/><async>Avoid screens.</async>\n<sync/>\nDone.',
    "The quick brown fox jumps over the lazy dog. Sleep well, eat well, and walk every day.",
]


def tiny_tokenizer() -> Any:
    """A 320-token byte-level BPE ``PreTrainedTokenizerFast`` with a ChatML template and
    ``<|im_end|>`` as EOS (id 2). Deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = _CHATML
    return fast


def preset_tokenizer(name: str) -> Any:
    """The tokenizer :func:`build_checkpoint` saves with preset ``name`` (:data:`PRESET_TOKENIZERS`)."""
    if PRESET_TOKENIZERS.get(name, "tiny") == "tiny":
        return tiny_tokenizer()
    try:
        from transformers import AutoTokenizer

        from ..models.loader import embedded_model_dir

        return AutoTokenizer.from_pretrained(embedded_model_dir())
    except FileNotFoundError:
        return tiny_tokenizer()


#: Bump when the files build_checkpoint writes change, so cached folders are rebuilt.
_FORMAT = 2
#: Largest safetensors shard build_checkpoint writes, in bytes (like ``save_pretrained``'s
#: ``max_shard_size``); a checkpoint that fits is one ``model.safetensors``.
SHARD_BYTES = 2 * 10**9
#: Standard deviation of random matrices (``initializer_range`` of the Llama family).
INIT_STD = 0.02


def _tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed, so each tensor depends only on (seed, name), not on the build order."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Norm weights (1-D ``*norm*`` tensors) are ones; every other tensor (matrices, biases) is
    drawn from ``normal(0, INIT_STD)`` directly in ``dtype`` (no float32 copy) by a
    ``torch.Generator`` seeded by :func:`_tensor_seed`."""
    if "norm" in name and len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(_tensor_seed(seed, name))
    return torch.empty(shape, dtype=dtype).normal_(0.0, INIT_STD, generator=g)


def _shard_plan(shapes: dict[str, tuple[int, ...]], element_size: int, shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``shard_bytes`` (a tensor larger than that
    gets a shard of its own), in the given order."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * element_size
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def build_checkpoint(
    name: str,
    out_dir: str | Path | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write a random-weight checkpoint of preset ``name`` (config + safetensors + tokenizer).

    No ``transformers`` model is materialized: the model is instantiated on the ``meta``
    device only to get its parameter names and shapes (tied weights once); each tensor is
    then created in ``dtype`` with its own seeded ``torch.Generator`` (``normal * 0.02``,
    norm weights = 1; tensors of a shard are drawn in parallel threads, which does not change
    them) and written shard by shard, so peak memory is about one shard
    (``shard_bytes``, default 2 GB): llama-3-8b in bfloat16 (16 GB on disk) took 100 s and
    2.4 GB of RAM on a 2-core VM (most of it page faults and writing; more cores draw faster). Several shards are named like
    ``save_pretrained``'s (``model-00001-of-00008.safetensors`` + ``model.safetensors.index.json``),
    so :func:`pasta_engine.models.loader.load_model` reads the folder like any HF checkpoint.

    Args:
        name: a key of :data:`PRESETS`.
        out_dir: target folder (default ``cache_root()/presets/NAME-SEED``); reused when it
            already holds a complete checkpoint with the same config, seed and dtype (the
            ``preset.json`` stamp, written last).
        seed: seed of the weights (same seed, same weights, whatever the build order).
        dtype: storage dtype of the weights.
        overrides: config fields replacing the preset's.
        shard_bytes: largest shard in bytes.

    Processes that build the same folder at once take turns on a lock file beside it
    (``.NAME-SEED.lock``, filelock): the first builds, the others wait and reuse it.

    Returns the folder. Raises KeyError naming the known presets for an unknown name."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}: known {sorted(PRESETS)}")
    fields = {**PRESETS[name], **(overrides or {})}
    out = Path(out_dir) if out_dir is not None else cache_root() / "presets" / f"{name}-{seed}"
    stamp = json.dumps(
        {"fields": fields, "seed": seed, "dtype": str(dtype), "format": _FORMAT, "shard_bytes": shard_bytes},
        sort_keys=True,
    )
    if (out / "preset.json").exists() and (out / "preset.json").read_text() == stamp:
        return out
    from filelock import FileLock

    # One builder per folder: processes started together (bench_dialects' jobs, torchrun ranks) on
    # a fresh cache each found no stamp, and one deleted model.safetensors while another loaded it.
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if (out / "preset.json").exists() and (out / "preset.json").read_text() == stamp:
            return out  # built by another process while this one waited
        _write_checkpoint(out, name, fields, stamp, seed=seed, dtype=dtype, shard_bytes=shard_bytes)
    return out


def _write_checkpoint(out: Path, name: str, fields: dict[str, Any], stamp: str, *, seed: int, dtype: torch.dtype,
                      shard_bytes: int) -> None:
    """Write :func:`build_checkpoint`'s folder ``out`` (the caller holds its lock); ``preset.json``
    (``stamp``) last, so a folder without it is incomplete."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg.eos_token_id = 2
    cfg.bos_token_id = 1
    cfg.dtype = dtype
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}  # tied weights appear once
    arch = type(meta).__name__
    del meta
    cfg.architectures = [arch]

    out.mkdir(parents=True, exist_ok=True)
    (out / "preset.json").unlink(missing_ok=True)  # the stamp marks a complete folder
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    shards = _shard_plan(shapes, torch.empty((), dtype=dtype).element_size(), shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards, 1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:  # torch ops release the GIL
            made = pool.map(lambda n: _random_tensor(n, shapes[n], dtype, seed), names)
            tensors = dict(zip(names, made))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
        weight_map.update({n: fname for n in names})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    cfg.save_pretrained(out)
    preset_tokenizer(name).save_pretrained(out)
    (out / "preset.json").write_text(stamp)
