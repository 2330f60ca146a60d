"""LoRA adapters in peft's format, merged into a checkpoint's weights at load.

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
section 4.1) adds ``(alpha / r) * B @ A`` to a linear layer's weight ``W [out, in]``, with
``A [r, in]`` and ``B [out, r]``. peft saves it as ``adapter_config.json`` plus
``adapter_model.safetensors`` whose tensors are named
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``. Merging once at load costs
nothing per step: the engine then runs the merged weights like any checkpoint.

Added tokens. An adapter may also replace whole rows of the token embedding (peft's
``trainable_token_indices``: the rows of tokens added to the tokenizer, e.g. the PASTA-LANG
pieces of :mod:`pasta_engine.lang.grammar`); peft saves the rows' values as
``<module>.token_adapter.trainable_tokens_delta`` (``[n, hidden]``, the new values, not a
difference). Merging grows the embedding (and an untied LM head) to the largest index + 1 rows
and writes the values in; with tied embeddings the LM head is the same matrix, so the new
tokens can be sampled. The tokenizer gets the same tokens from the manifest's
``added_tokens`` (``{text: id}``, :func:`added_tokens`).

LoRA scale. ``lora_scale`` multiplies every low-rank delta at the merge (``W + lora_scale *
(alpha / r) * B @ A``; peft's ``scale_layer``, diffusers' ``lora_scale``), leaving the added
token rows as trained: between 0 (the base model's weights with the tag tokens' rows) and 1 (the
adapter as trained). It is the weight-space interpolation of WiSE-FT (Wortsman et al. 2022,
"Robust fine-tuning of zero-shot models", section 3): for a PASTA-LANG adapter, a knob between the
base model's answers and the adapter's forking (issue 30; bench/results/lora-scale-smollm2-cpu/).
A shipped adapter's manifest may set its default (``lora_scale``, :func:`manifest_lora_scale`).

The project's shipped adapters (``pasta_engine/adapters/<name>/``) carry a ``manifest.json``:
the base model file's SHA-256, the data split, annotator, commands, commit and evaluation
figures, and the short system prompt the adapter was trained with.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ParameterError, UnsupportedModelError
from ..lang.prompts import PastaPrompt

__all__ = ["merge_lora", "check_lora_scale", "manifest_lora_scale", "manifest_pasta_prompt", "read_manifest", "added_tokens", "file_sha256", "SHIPPED_ADAPTERS", "shipped_adapter"]

#: Folder of the adapters shipped in the package.
SHIPPED_ADAPTERS = Path(__file__).resolve().parents[1] / "adapters"


#: peft ``LoraConfig`` fields whose non-default value changes what the adapter computes.
_UNMERGED_OPTIONS = ("alora_invocation_tokens", "kasa_config", "use_bdlora", "use_qalora", "layer_replication",
                     "target_parameters", "monteclora_config", "arrow_config", "use_kasa")
#: ``init_lora_weights`` values after which peft rewrites the base weights on load.
_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
#: The adapter tensors the merge reads.
_MERGED_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".token_adapter.trainable_tokens_delta")

def file_sha256(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                return h.hexdigest()
            h.update(block)


def shipped_adapter(name: str = "smollm2-135m-pasta") -> Path | None:
    """The folder of a shipped adapter, or None when the package carries none by that name."""
    path = SHIPPED_ADAPTERS / name
    return path if (path / "adapter_config.json").exists() else None


def _read_json_object(path: Path, adapter_dir: str | Path) -> dict[str, Any]:
    """``path`` read as a JSON object; CheckpointError naming the adapter and the file if it is not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: {path.name} is not a "
                              f"JSON file ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: {path.name} holds a "
                              f"JSON {type(value).__name__}, not an object")
    return value


def read_manifest(adapter_dir: str | Path) -> dict[str, Any] | None:
    """The adapter's ``manifest.json`` (None when it has none). Raises CheckpointError (a
    ParameterError naming the adapter) when it is not a JSON object."""
    p = Path(adapter_dir) / "manifest.json"
    return _read_json_object(p, adapter_dir) if p.exists() else None


#: An adapter may grow the embedding by at most this many rows (the PASTA-LANG pieces are six).
MAX_ADDED_ROWS = 65536


def added_tokens(manifest: dict[str, Any] | None) -> dict[str, int]:
    """The tokens an adapter added to its tokenizer (``{text: id}``, from its manifest's
    ``added_tokens``; empty when it added none). Raises ParameterError naming ``added_tokens``
    when it is not an object of texts to token ids (integers >= 0)."""
    spec = (manifest or {}).get("added_tokens") or {}
    if not isinstance(spec, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                             and v >= 0 for k, v in spec.items()):
        raise ParameterError("added_tokens", spec, "an object of token texts to token ids (integers >= 0) in the "
                             "adapter's manifest.json")
    return dict(spec)


def _check_token_indices(cfg: dict[str, Any], adapter_dir: Path) -> None:
    """Raises CheckpointError naming the adapter and ``trainable_token_indices`` unless the field
    is absent or peft's shape: a list of integers, or an object of module names to such lists
    (a bool or a float is no row index: ``int()`` would turn ``True`` and ``1.7`` into row 1)."""
    spec = cfg.get("trainable_token_indices")

    def rows(ids: Any) -> bool:
        return isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)

    if spec is not None and not rows(spec) and not (isinstance(spec, dict) and all(map(rows, spec.values()))):
        raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: adapter_config.json "
                              f"has trainable_token_indices={spec!r:.200}: expected a list of integer row "
                              "indices, or an object of module names to such lists")


def _token_indices(cfg: dict[str, Any], module: str) -> list[int]:
    """The row indices peft's ``trainable_token_indices`` (checked by :func:`_check_token_indices`)
    gives ``module`` (a list applies to the input embedding; a dict maps a module-name suffix to
    its list)."""
    spec = cfg.get("trainable_token_indices")
    if isinstance(spec, list):
        return list(spec)
    if isinstance(spec, dict):
        for name, ids in spec.items():
            if module == name or module.endswith("." + name):
                return list(ids)
    return []


def _merge_token_rows(weights: dict[str, torch.Tensor], cfg: dict[str, Any], tensors: dict[str, torch.Tensor],
                      adapter_dir: Path) -> list[str]:
    """Write peft's trainable token rows into the embedding (grown as needed); see the module
    docstring. Returns the names of the weights changed."""
    merged = []
    for name, values in tensors.items():
        if not name.endswith(".token_adapter.trainable_tokens_delta"):
            continue
        module = name.removesuffix(".token_adapter.trainable_tokens_delta").removeprefix("base_model.model.")
        base = module + ".weight"
        idx = _token_indices(cfg, module)  # the full name: a key may be "model.embed_tokens" (peft matches suffixes)
        if base not in weights or not idx or len(idx) != values.shape[0] or values.dim() != 2:
            raise ParameterError("adapter", str(adapter_dir), message=f"trainable token rows {name} "
                                 f"{tuple(values.shape)} do not fit {base!r} with indices {idx}")
        w = weights[base]
        if any(i < 0 or i >= w.shape[0] + MAX_ADDED_ROWS for i in idx):
            raise ParameterError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: "
                                 f"trainable_token_indices of {name} must be "
                                 f"rows in [0, {w.shape[0] + MAX_ADDED_ROWS}) ({base} has {w.shape[0]} rows), got "
                                 f"{min(idx)}..{max(idx)}")
        if values.shape[1] != w.shape[1]:
            raise ParameterError("adapter", str(adapter_dir),
                                 message=f"token rows of width {values.shape[1]} do not fit {base} {tuple(w.shape)}")
        rows = max(w.shape[0], max(idx) + 1)
        if rows > w.shape[0]:
            w = torch.cat([w, w.new_zeros((rows - w.shape[0], w.shape[1]))])
        w = w.clone()
        w[torch.tensor(idx)] = values.to(w.dtype)
        weights[base] = w
        merged.append(base)
    emb, head = weights.get("model.embed_tokens.weight"), weights.get("lm_head.weight")
    if merged and emb is not None and head is not None and head.shape[0] < emb.shape[0]:
        # an untied LM head without trained rows for the new tokens: grow it (zero logits' rows)
        weights["lm_head.weight"] = torch.cat([head, head.new_zeros((emb.shape[0] - head.shape[0], head.shape[1]))])
        merged.append("lm_head.weight")
    return merged


def _adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    st = adapter_dir / "adapter_model.safetensors"
    binf = adapter_dir / "adapter_model.bin"
    for file in (st, binf):
        if not file.exists():
            continue
        try:
            return load_file(st) if file is st else torch.load(binf, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001  (safetensors, pickle and OS errors: the file is unreadable)
            first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: cannot read "
                                  f"{file.name} (truncated or not a weights file): {first[:200]}") from None
    raise FileNotFoundError(f"{adapter_dir} has no adapter_model.safetensors (a peft LoRA adapter folder)")


def check_lora_scale(lora_scale: Any) -> float:
    """``lora_scale`` as a float; raises ParameterError naming ``lora_scale`` unless it is a
    number in ``[0, 1]`` (0: the low-rank deltas off, 1: the adapter as trained)."""
    if isinstance(lora_scale, bool) or not isinstance(lora_scale, (int, float)) or not 0.0 <= lora_scale <= 1.0:
        raise ParameterError("lora_scale", lora_scale, "a number in [0, 1]: 1 merges the adapter as trained, "
                             "lower values move the weights toward the base model's")
    return float(lora_scale)


def manifest_lora_scale(manifest: dict[str, Any] | None, adapter_dir: str | Path | None = None) -> float:
    """The ``lora_scale`` an adapter's manifest sets as its default (1.0 when it sets none).
    Raises CheckpointError naming the adapter for a value :func:`check_lora_scale` refuses."""
    value = (manifest or {}).get("lora_scale", 1.0)
    try:
        return check_lora_scale(value)
    except ParameterError:
        raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: manifest.json has "
                              f"lora_scale={value!r}: expected a number in [0, 1]") from None


def manifest_pasta_prompt(manifest: dict[str, Any] | None, adapter_dir: str | Path | None = None) -> PastaPrompt | None:
    """The :class:`~pasta_engine.lang.prompts.PastaPrompt` an adapter's manifest sets
    (``pasta_prompt``; None when it sets none, or an empty object: the engine's default).
    Raises CheckpointError naming the adapter and ``pasta_prompt`` for a value
    :meth:`PastaPrompt.from_dict <pasta_engine.lang.prompts.PastaPrompt.from_dict>` refuses
    (not an object, another key, a system prompt that is no string, an example that is no
    [user, assistant] pair of strings), so that a bad manifest fails at load, not in every
    pasta-mode request."""
    value = (manifest or {}).get("pasta_prompt")
    if value is None or value == {}:
        return None
    try:
        return PastaPrompt.from_dict(value)
    except ParameterError as e:
        raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: manifest.json: "
                              f"{e}") from None


def _pattern(cfg: dict[str, Any], field: str, adapter_dir: Path) -> dict[str, float]:
    """``adapter_config.json``'s ``rank_pattern`` or ``alpha_pattern`` (peft: a module-name
    pattern -> that module's rank or alpha), checked: an object of regular expressions to positive
    numbers. Raises CheckpointError naming the adapter and the field otherwise."""
    pat = cfg.get(field) or {}

    def refuse(why: str) -> CheckpointError:
        return CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: "
                               f"adapter_config.json {field}: {why}")

    if not isinstance(pat, dict):
        raise refuse(f"{pat!r} is not an object")
    for k, v in pat.items():
        try:
            re.compile(k)
        except re.error as e:
            raise refuse(f"key {k!r} is not a regular expression ({e})") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise refuse(f"{k!r}: {v!r} is not a positive number")
        if field == "rank_pattern" and v != int(v):
            raise refuse(f"{k!r}: {v!r} is not a whole rank")
    return pat


def _pattern_value(pattern: dict[str, float], module: str, default: float) -> float:
    """The value of the first key of ``pattern`` that matches the end of ``module``'s dotted name
    (``model.layers.0.self_attn.q_proj``), else ``default``: peft's ``get_pattern_key`` (the
    key as a regular expression after an optional dotted prefix), so that an adapter merges here
    as peft loads it."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def merge_lora(weights: dict[str, torch.Tensor], adapter_dir: str | Path, lora_scale: float = 1.0, *,
               tied_head: bool = False) -> list[str]:
    """Merge a peft LoRA adapter into ``weights`` (a ``transformers`` state dict), in place.

    Args:
        weights: ``name -> tensor`` of the base checkpoint (``model.layers.0.self_attn.q_proj.weight``, ...).
        adapter_dir: a folder with peft's ``adapter_config.json`` and ``adapter_model.safetensors``.
        lora_scale: multiplies each low-rank delta (in ``[0, 1]``; see the module docstring);
            the added token rows are written as trained whatever it is.
        tied_head: the model ties its LM head to the embedding: a LoRA pair on ``lm_head`` is
            refused (the head is the embedding, so a merged copy of it would be dropped).

    Returns the names of the merged weights. The sum is computed in float32 and cast back to
    the weight's dtype. Trainable token rows (peft's ``trainable_token_indices``) replace rows of
    the embedding, which grows to hold them (see the module docstring). A module's rank and alpha
    are peft's: ``rank_pattern`` and ``alpha_pattern`` (module-name patterns) override ``r`` and
    ``lora_alpha`` per module.

    Raises FileNotFoundError for a folder that is no adapter, UnsupportedModelError for a peft
    option this merge does not implement (DoRA, biases and ``lora_bias``, fan-in-fan-out, extra
    modules to save, LoRA on an embedding),
    ParameterError when a LoRA pair names a weight the checkpoint does not have or shapes disagree,
    CheckpointError (a ParameterError naming the adapter) for an ``adapter_config.json`` that is
    not JSON or has no valid rank ``r``, a ``rank_pattern``/``alpha_pattern`` that is not an
    object of regular expressions to positive numbers, a ``trainable_token_indices`` that is not
    a list of integers (or an object of module names to such lists), a module whose tensors'
    rank is not its configured one, a lora_A or lora_B without its partner, or weights that
    cannot be read (truncated); ParameterError
    naming ``lora_scale`` for a scale outside ``[0, 1]``."""
    lora_scale = check_lora_scale(lora_scale)
    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{adapter_dir} is not a LoRA adapter folder (no adapter_config.json)")
    cfg = _read_json_object(cfg_path, adapter_dir)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UnsupportedModelError(f"adapter type {cfg.get('peft_type')!r} is not supported (LoRA only)")
    for opt, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(opt) == bad:
            raise UnsupportedModelError(f"LoRA option {opt}={bad} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias") or cfg.get("modules_to_save"):
        raise UnsupportedModelError("LoRA adapters with trained biases (bias, lora_bias) or modules_to_save are not "
                                    "supported")
    # peft options that change what the adapter computes beyond W + scale * B A: merging as if
    # they were unset would give another model (KaSA's singular values, aLoRA's invocation,
    # layer replication...), so each is refused when set, never dropped
    for opt in _UNMERGED_OPTIONS:
        if cfg.get(opt) not in (None, False, [], {}):
            raise UnsupportedModelError(f"adapter {str(adapter_dir)!r}: LoRA option {opt}={cfg.get(opt)!r} is not "
                                        "supported (the merge is W + scale * B A; merge it with peft first)")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_REWRITING_INITS):
        raise UnsupportedModelError(f"adapter {str(adapter_dir)!r}: init_lora_weights={init!r} rewrites the base "
                                    "weights when peft loads it (a residual, not the checkpoint's own), which this "
                                    "merge does not do: convert it with peft's path_initial_model_for_weight_conversion "
                                    "or merge it with peft first")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: adapter_config.json "
                              f"has r={r!r}{' (missing)' if 'r' not in cfg else ''}: the LoRA rank must be an integer >= 1")
    alpha = cfg.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: adapter_config.json "
                              f"has lora_alpha={alpha!r}: expected a number")
    alpha = float(alpha)
    rank_pattern = _pattern(cfg, "rank_pattern", adapter_dir)
    alpha_pattern = _pattern(cfg, "alpha_pattern", adapter_dir)
    _check_token_indices(cfg, adapter_dir)
    tensors = _adapter_tensors(adapter_dir)
    # tensors this merge has no rule for are refused, never dropped: LoRA on an embedding
    # (lora_embedding_A/B), a LoRA bias (lora_B.bias)
    unsupported = [n for n in tensors if ".lora_embedding_" in n or (".lora_B." in n and n.endswith(".bias"))]
    if unsupported:
        raise UnsupportedModelError(f"adapter {str(adapter_dir)!r}: {unsupported[0]} is not supported (LoRA on "
                                    "embeddings and LoRA biases are not merged)")
    # and any tensor it has no rule for at all (KaSA's lora_diag, a variant's extra factors)
    unknown = [n for n in tensors if not n.endswith(_MERGED_SUFFIXES)]
    if unknown:
        raise UnsupportedModelError(f"adapter {str(adapter_dir)!r}: tensor {unknown[0]} is not supported (the merge "
                                    "reads lora_A/lora_B weights and trainable token rows only)")
    # a lora_B whose lora_A is missing (a truncated or partial adapter) is refused, never skipped
    orphan = next((n for n in tensors if ".lora_B." in n and n.replace(".lora_B.", ".lora_A.") not in tensors), None)
    if orphan is not None:
        raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: {orphan} has no "
                              "lora_A partner")
    merged = _merge_token_rows(weights, cfg, tensors, adapter_dir)
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: {name} has no "
                                  "lora_B partner")
        base = module.removeprefix("base_model.model.") + ".weight"
        if tied_head and base == "lm_head.weight":
            raise UnsupportedModelError(f"adapter {str(adapter_dir)!r} adapts lm_head, which the model ties to its "
                                        "embedding: such an adapter cannot be merged (train it without lm_head)")
        if base not in weights:
            raise ParameterError("adapter", str(adapter_dir),
                                 message=f"the adapter adapts {base!r}, which the checkpoint does not have")
        w = weights[base]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: {name} "
                                  f"{tuple(a.shape)} and its lora_B {tuple(b.shape)} do not share a rank")
        key = module.removeprefix("base_model.model.")
        r_m = int(_pattern_value(rank_pattern, key, r))
        alpha_m = float(_pattern_value(alpha_pattern, key, alpha))
        if a.shape[0] != r_m:
            raise CheckpointError("adapter", str(adapter_dir), message=f"adapter {str(adapter_dir)!r}: {name} has rank "
                                  f"{a.shape[0]} but adapter_config.json gives {key} r={r_m} (r, rank_pattern)")
        scale = (alpha_m / (r_m**0.5) if cfg.get("use_rslora") else alpha_m / r_m) * lora_scale
        delta = b.float() @ a.float()
        if delta.shape != w.shape:
            raise ParameterError("adapter", str(adapter_dir),
                                 message=f"LoRA delta {tuple(delta.shape)} does not fit {base} {tuple(w.shape)}")
        weights[base] = (w.float() + scale * delta).to(w.dtype)
        merged.append(base)
    if not merged:
        raise ParameterError("adapter", str(adapter_dir), message=f"{adapter_dir} holds no LoRA weights")
    return merged

