"""What the SFT and BoNBoN stages share: the base model and its LoRA wrapper, adapter export
(half-precision safetensors plus a manifest), checkpoints, the loss curve, the schedule."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = [
    "LoraSettings",
    "load_base",
    "load_tokenizer",
    "load_config",
    "wrap_lora",
    "init_token_rows",
    "export_adapter",
    "LossCurve",
    "lr_lambda",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_state",
    "read_row_log",
    "git_commit",
    "machine",
    "base_manifest",
]

#: The linear layers LoRA adapts in a Llama-family model.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA rank ``r``, scale numerator ``alpha`` (the update is ``alpha / r * B A``), dropout on
    the adapter's input, and the adapted modules."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    targets: tuple[str, ...] = LORA_TARGETS


def load_base(model: str | os.PathLike | None, dtype: torch.dtype = torch.float32,
              device: str | torch.device | None = None) -> tuple[Any, Any, Path]:
    """``(transformers model, tokenizer, checkpoint folder)`` of a Llama-family checkpoint (None:
    the embedded SmolLM2-135M-Instruct's cached safetensors copy), its weights in ``dtype``.

    ``device``: None or a CPU keeps the weights in host memory (today's path); a CUDA device
    loads them straight onto that GPU (transformers' ``device_map``, through accelerate), so an
    8B model never needs a host copy. Raises FileNotFoundError for a bad path."""
    from transformers import AutoModelForCausalLM

    from ..models.loader import resolve_model_path

    path, gguf = resolve_model_path(model)
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    if device is not None and torch.device(device).type == "cuda":
        dev = torch.device(device)
        kwargs["device_map"] = {"": f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    return hf, load_tokenizer(model), path


def load_config(model: str | os.PathLike | None) -> Any:
    """The ``transformers`` config of checkpoint ``model`` (None: the embedded
    SmolLM2-135M-Instruct), without its weights: what the memory estimate reads
    (:meth:`pasta_engine.train.scale.ModelShape.from_config`). Raises FileNotFoundError for a bad
    path."""
    from transformers import AutoConfig

    from ..models.loader import resolve_model_path

    path, gguf = resolve_model_path(model)
    return AutoConfig.from_pretrained(path, **({"gguf_file": gguf} if gguf else {}))


def load_tokenizer(model: str | os.PathLike | None) -> Any:
    """The ``transformers`` tokenizer of checkpoint ``model`` (None: the embedded
    SmolLM2-135M-Instruct), without loading its weights. Raises FileNotFoundError for a bad path."""
    from transformers import AutoTokenizer

    from ..models.loader import resolve_model_path

    path, gguf = resolve_model_path(model)
    return AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf} if gguf else {}))


def init_token_rows(model: Any, tokenizer: Any, ids: Sequence[int], texts: Sequence[str]) -> None:
    """Set the input-embedding row of each new token ``ids[i]`` to the mean of the rows of the
    tokens its text ``texts[i]`` had before (in place; deterministic, and a start the model
    already reads as that text: Hewitt 2021, "Initializing new word embeddings for pretrained
    language models"; an untied LM head's rows likewise). The tokens of the text are found with :func:`encode_text` (which never
    yields the new special tokens)."""
    from ..lang.tokenization import encode_text

    mats = [model.get_input_embeddings().weight]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not mats[0]:  # an untied LM head: its rows too
        mats.append(head.weight)
    with torch.no_grad():
        for tid, text in zip(ids, texts):
            old = torch.tensor(encode_text(tokenizer, text))
            for w in mats:
                w[tid] = w[old].mean(dim=0)


def wrap_lora(model: Any, settings: LoraSettings = LoraSettings(), adapter: str | os.PathLike | None = None,
              tokenizer: Any = None, tag_tokens: bool = False) -> Any:
    """``model`` wrapped by peft with a trainable LoRA adapter: fresh (``settings``), or the
    adapter saved in folder ``adapter`` (trainable, to continue from; ``settings`` unused).

    Added tokens: an ``adapter`` whose manifest lists ``added_tokens`` gives ``tokenizer`` those
    tokens and the model the rows for them first. A fresh adapter with ``tag_tokens`` adds the
    PASTA-LANG pieces (:func:`~pasta_engine.lang.grammar.add_tag_tokens`) to ``tokenizer`` (in
    place), grows the embedding to ``len(tokenizer)`` rows, starts each new row at the mean of its
    text's token rows (:func:`init_token_rows`) and trains those rows with the adapter (peft's
    ``trainable_token_indices``; with tied embeddings the LM head shares them). An ``adapter``
    without added tokens continued with ``tag_tokens`` (a plain writer's adapter, taught the
    tags next) gets the same new rows and a fresh adapter of its own shape (``r``, ``lora_alpha``,
    ``lora_dropout``, ``target_modules`` of its ``adapter_config.json``) holding its LoRA weights.

    Raises ValueError when added tokens are asked for without a ``tokenizer``, when ``tag_tokens``
    is asked of an ``adapter`` that has added tokens already, or when such an adapter has a
    per-module rank or alpha (``rank_pattern``/``alpha_pattern``) or LoRA weights the fresh
    adapter has no place for."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from ..lang.grammar import TAG_PIECES, add_tag_tokens
    from ..models.adapter import added_tokens, read_manifest
    from ..models.loader import add_adapter_tokens

    if adapter is not None:
        if added_tokens(read_manifest(adapter)):
            if tag_tokens:
                raise ValueError(f"adapter {adapter} has added tokens already: continue it without tag_tokens")
            if tokenizer is None:
                raise ValueError(f"adapter {adapter} added tokens: wrap_lora needs the tokenizer")
            add_adapter_tokens(tokenizer, adapter)
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        if not tag_tokens:
            return PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
        return _continue_with_tag_tokens(model, Path(adapter), tokenizer)
    extra: dict[str, Any] = {}
    if tag_tokens:
        if tokenizer is None:
            raise ValueError("tag_tokens=True needs the tokenizer")
        rows = model.get_input_embeddings().weight.shape[0]
        tags = add_tag_tokens(tokenizer)
        new = [(i, p) for i, p in zip(tags.ids, TAG_PIECES) if i >= rows]
        if new:
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
            init_token_rows(model, tokenizer, [i for i, _ in new], [p for _, p in new])
            rows_new = [i for i, _ in new]
            tied = model.get_output_embeddings() is None or (
                model.get_output_embeddings().weight is model.get_input_embeddings().weight)
            # tied: the LM head is the embedding (peft keeps the tie); untied: train its rows too
            extra["trainable_token_indices"] = rows_new if tied else {"embed_tokens": rows_new, "lm_head": rows_new}
    cfg = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                     target_modules=list(settings.targets), bias="none", task_type="CAUSAL_LM", **extra)
    return get_peft_model(model, cfg)


def _continue_with_tag_tokens(model: Any, adapter: Path, tokenizer: Any) -> Any:
    """:func:`wrap_lora` of a tokenless ``adapter`` with ``tag_tokens``: a fresh adapter of its
    shape with the PASTA-LANG pieces as tokens, loaded with its LoRA weights (every one placed:
    ValueError otherwise)."""
    from safetensors.torch import load_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"adapter {adapter} has a per-module rank or alpha (rank_pattern/alpha_pattern): "
                         "continuing it with tag tokens takes one r and lora_alpha")
    targets = cfg["target_modules"]
    shape = LoraSettings(r=int(cfg["r"]), alpha=cfg["lora_alpha"], dropout=float(cfg.get("lora_dropout", 0.0)),
                         targets=tuple(sorted(targets) if isinstance(targets, (list, set)) else (targets,)))
    wrapped = wrap_lora(model, shape, tokenizer=tokenizer, tag_tokens=True)
    weights = load_file(adapter / "adapter_model.safetensors")  # peft's names, without the adapter's name
    params = {n.replace(".default.", "."): p for n, p in wrapped.named_parameters() if "lora_" in n}
    missing, unexpected = sorted(params.keys() - weights.keys()), sorted(weights.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"adapter {adapter}'s weights do not fit a fresh adapter of its shape "
                         f"(unexpected {unexpected[:3]}, missing {missing[:3]})")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.dtype))
    return wrapped


def export_adapter(peft_model: Any, out: Path, manifest: dict[str, Any]) -> Path:
    """Save the adapter in peft's format with float16 tensors (half the bytes of float32; the
    engine merges in float32) and ``manifest.json``. Returns ``out``."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out), save_embedding_layers=False)  # added rows: trainable_token_indices
    st = out / "adapter_model.safetensors"
    tensors = {k: v.to(torch.float16).contiguous() for k, v in load_file(st).items()}
    save_file(tensors, st)
    manifest = {**manifest, "adapter_bytes": st.stat().st_size}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def lr_lambda(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` optimizer steps, then cosine decay to 10% at ``total``."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


@dataclass
class LossCurve:
    """Per optimizer step: the step, examples seen, mean loss, learning rate, elapsed seconds,
    and any extra values (as JSON-ready dicts)."""

    points: list[dict[str, Any]] = field(default_factory=list)

    def add(self, **point: Any) -> None:
        """Append one point (e.g. ``step``, ``loss`` in nats/token, ``lr``, ``tokens``, ``elapsed_s``)."""
        self.points.append(point)

    def save(self, out: Path, title: str) -> None:
        """Write ``loss.json`` and ``loss.png`` into ``out``."""
        (out / "loss.json").write_text(json.dumps(self.points, indent=1) + "\n")
        if not self.points:
            return
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            return
        fig = Figure(figsize=(7, 4), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        xs = [p["step"] for p in self.points]
        ax.plot(xs, [p["loss"] for p in self.points], lw=1, label="loss (per optimizer step)")
        k = max(1, len(xs) // 20)
        if len(xs) > k:
            smooth = [sum(p["loss"] for p in self.points[max(0, i - k + 1): i + 1]) / min(k, i + 1) for i in range(len(xs))]
            ax.plot(xs, smooth, lw=2, label=f"running mean of {k}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        fig.savefig(out / "loss.png", dpi=110)


def save_checkpoint(out: Path, peft_model: Any, optimizer: Any, scheduler: Any, state: dict[str, Any]) -> None:
    """Write a resumable checkpoint into ``out/checkpoint`` (adapter, optimizer, schedule and
    ``state``: the trainer's counters, e.g. ``{"step": optimizer steps done, "elapsed_s": training
    seconds so far}``), replacing the previous one so that a kill at any instant leaves one whole
    checkpoint to resume from: the new one is written whole into ``checkpoint.tmp``, the previous
    one is renamed ``checkpoint.old``, the new one renamed into place, and only then is the old
    one deleted (:func:`_finish_checkpoint_swap` completes a swap a kill interrupted). ``trainer.pt``
    holds only tensors and plain Python types (the RNG state as a tensor), so
    :func:`load_checkpoint` reads it with ``torch.load(weights_only=True)``."""
    import shutil

    _finish_checkpoint_swap(out)
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    if tmp.exists():  # a save a kill broke off: never whole, never resumed from
        shutil.rmtree(tmp)
    peft_model.save_pretrained(str(tmp / "adapter"), save_embedding_layers=False)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "state": state,
                "torch_rng": torch.get_rng_state(),
                # the CUDA generators too: dropout on a GPU draws from them
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None},
               tmp / "trainer.pt")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def _checkpoint_dir(out: Path) -> Path:
    """The folder holding ``out``'s latest whole checkpoint (read only: every rank may ask):
    ``checkpoint``; with none but a ``checkpoint.old``, a kill interrupted :func:`save_checkpoint`
    after the new checkpoint was written whole into ``checkpoint.tmp`` (the old one is moved
    aside only then), so that one (the old one when it is somehow missing)."""
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    if not final.exists() and old.exists():
        return tmp if (tmp / "trainer.pt").exists() else old
    return final


def _finish_checkpoint_swap(out: Path) -> None:
    """Complete the swap of :func:`save_checkpoint` that a kill interrupted (rank 0, which alone
    writes): the latest whole checkpoint (:func:`_checkpoint_dir`) moves into place, and a
    ``checkpoint.old`` beside a ``checkpoint`` (the previous one, not yet deleted) goes."""
    import shutil

    final, old = out / "checkpoint", out / "checkpoint.old"
    latest = _checkpoint_dir(out)
    if latest != final:
        latest.rename(final)
    if final.exists() and old.exists():
        shutil.rmtree(old)


def checkpoint_state(out: Path) -> dict[str, Any] | None:
    """The ``state`` of ``out/checkpoint`` (the trainer's counters and its run's fingerprint),
    read without any model, so that a resume can be refused before the weights load; None when
    there is no checkpoint. Raises CheckpointError as :func:`load_checkpoint` does."""
    blob = _read_trainer(out)
    return None if blob is None else blob["state"]


def _read_trainer(out: Path) -> dict[str, Any] | None:
    """The latest whole checkpoint's ``trainer.pt`` (:func:`_checkpoint_dir`) read with
    ``weights_only=True`` (None when absent). Raises CheckpointError (param ``resume``) naming
    the file when it cannot be read that way."""
    from ..errors import CheckpointError

    path = _checkpoint_dir(out) / "trainer.pt"
    if not path.exists():
        return None
    try:  # tensors and plain types only: a trainer.pt from elsewhere cannot run code when it is read
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (pickle, zip and OS errors: the file cannot be resumed from)
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise CheckpointError("resume", str(path), message=f"cannot resume from {path}: "
                              f"{first[:200]} (only tensors and plain types are read)") from None


def load_checkpoint(out: Path, peft_model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any] | None:
    """Restore ``out/checkpoint`` into the model, optimizer and schedule; returns its state, or
    None when there is no checkpoint. Where a kill interrupted :func:`save_checkpoint`, the
    latest whole checkpoint is read (:func:`_checkpoint_dir`); the next save moves it into place."""
    blob = _read_trainer(out)
    if blob is None:
        return None
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    ck = _checkpoint_dir(out)
    set_peft_model_state_dict(peft_model, load_file(ck / "adapter" / "adapter_model.safetensors"))
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    if blob.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(blob["cuda_rng"])
    return blob["state"]


def git_commit() -> str | None:
    """The repository's HEAD commit (None outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine(device: str | torch.device | None = None) -> dict[str, Any]:
    """Where training ran: ``device`` (default: cuda when torch sees a GPU, else cpu), its name
    (GPU, or CPU model and threads), torch version, platform, time."""
    from ..tools.bench import device_name

    dev = str(device) if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return {"device": dev, "device_name": device_name(dev), "torch_version": torch.__version__,
            "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def base_manifest(model: str | os.PathLike | None, command: str) -> dict[str, Any]:
    """The manifest fields every adapter gets: the base model, the name and SHA-256 of its file
    when it is one file (the embedded model's GGUF or a ``.gguf`` path; the engine checks the hash
    before merging onto a file of that kind), the command, the commit."""
    from ..models.adapter import file_sha256
    from ..models.loader import EMBEDDED_MODEL, embedded_gguf_path

    out: dict[str, Any] = {"base_model": str(model) if model is not None else EMBEDDED_MODEL, "commands": [command],
                           "commit": git_commit()}
    gguf = embedded_gguf_path() if model is None else Path(model).expanduser()
    if model is None or (gguf.is_file() and gguf.suffix == ".gguf"):  # a one-file base model: its hash is checked
        out.update(base_model_file=gguf.name, base_model_sha256=file_sha256(gguf))
    return out


def read_row_log(path: Path, text: str, is_row: Callable[[Any], bool], what: str,
                 fix: str) -> tuple[list[tuple[dict[str, Any], str]], bool]:
    """The whole rows of an append-only JSONL log (``text``, read from ``path``), each with its
    line, in file order, and whether the file must be written back from them before a row
    appends cleanly: its last line was cut off part-way by an interrupted run (the row in
    flight, left out: the caller redoes it) or its last row lacks its line end.

    Args:
        path: the log (named in the error).
        text: its text (a caller may pass a decompressed copy).
        is_row: whether a parsed line is one of the log's rows.
        what: what a row is, for the error ("an answer row (an object with an 'instruction')").
        fix: how to go on, for the error.

    Raises ValueError naming the file and line when a line other than the last is not a row
    (the file was edited, or two runs wrote it: nothing an interrupted run leaves)."""
    rows: list[tuple[dict[str, Any], str]] = []
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if not is_row(r):
                raise ValueError(f"not {what}")
        except ValueError as e:
            if i != last:
                raise ValueError(f"{path}: line {i + 1} is not a JSON row ({e}), and it is not the last line (the one "
                                 f"an interrupted run was writing): {fix}") from None
            return rows, True
        rows.append((r, line))
    return rows, bool(text) and not text.endswith("\n")


def differing_keys(kept: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The keys of ``now`` that ``kept`` (a resumed run's record) holds with another value, in
    ``now``'s order. A key ``kept`` lacks (a record written by an older version) is not compared,
    so an old run resumes as before. The one rule of the resume records of ``train answers``,
    ``train chunks`` and ``train bonbon`` rounds."""
    return [k for k in now if k in kept and kept[k] != now[k]]


def check_resume_record(out: Path, record: dict[str, Any], holds: str, new_out: str) -> None:
    """Refuse to resume ``out`` when ``out/sampling.json`` (the flags its rows were made under)
    differs from ``record`` in a key both have: a resume reuses the rows, so they would mix two
    runs. A folder from before ``sampling.json`` resumes as before. ``holds`` says what the rows
    are ("answers sampled"), ``new_out`` the advice ("answer into a new --out"). Raises
    ParameterError naming the first flag that differs (every one in the message)."""
    from ..errors import ParameterError

    path = out / "sampling.json"
    if not path.exists():
        return
    kept = json.loads(path.read_text(encoding="utf-8"))
    differ = differing_keys(kept, record)
    if differ:
        shown = "; ".join(f"--{k.replace('_', '-')} {kept[k]!r} then, {record[k]!r} now" for k in differ)
        raise ParameterError("--" + differ[0].replace("_", "-"), record[differ[0]], message=(
            f"{out} holds {holds} under other flags ({shown}): rerun with the same flags to go on from them, "
            f"or {new_out}"))
