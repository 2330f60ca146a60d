"""Attention backends by name: the one registry ``attention_backend=`` and the CLI's
``--attention-backend`` read.

A backend is one class implementing :class:`~pasta_engine.layers.attention.AttentionBackend`
(one file: see :mod:`pasta_engine.layers.flex_attention`), registered here by name with the
module that defines it, imported only when the backend is first asked for (``triton`` imports
triton, which on a machine without a GPU must be switched to its interpreter first).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import ParameterError
from .attention import AttentionBackend

__all__ = ["BackendInfo", "backend_names", "backend_info", "get_backend", "graph_backend_names", "register_backend"]


@dataclass(frozen=True)
class BackendInfo:
    """One registered backend.

    Attributes:
        name: what ``attention_backend=`` takes.
        target: ``"module:Class"`` (imported on first use) or the class itself.
        summary: one line for help texts.
        cuda_graphs: whether its instances run inside CUDA graphs (``supports_cuda_graphs``),
            known without importing it."""

    name: str
    target: str | type[AttentionBackend]
    summary: str
    cuda_graphs: bool = False

    def load(self) -> type[AttentionBackend]:
        """The backend class (imports its module the first time)."""
        if isinstance(self.target, str):
            module, _, cls = self.target.partition(":")
            return getattr(importlib.import_module(module), cls)
        return self.target


_REGISTRY: dict[str, BackendInfo] = {}


def register_backend(name: str, cls: type[AttentionBackend] | str, summary: str = "",
                     cuda_graphs: bool | None = None) -> None:
    """Make ``cls`` (a class, or ``"module:Class"`` imported when first asked for) available as
    ``attention_backend=name``; ``summary`` is its line in help texts; ``cuda_graphs`` defaults
    to the class's ``supports_cuda_graphs`` (False for a class not imported yet)."""
    if cuda_graphs is None:
        cuda_graphs = bool(getattr(cls, "supports_cuda_graphs", False))
    _REGISTRY[name] = BackendInfo(name, cls, summary or name, cuda_graphs)


register_backend("torch", "pasta_engine.layers.reference_attention:TorchAttention",
                 "the reference (each view gathered, scaled_dot_product_attention with masks)")
register_backend("triton", "pasta_engine.layers.triton_attention:TritonAttention",
                 "tree decode, extend and fused RoPE/KV-write kernels (Triton's interpreter on a CPU)",
                 cuda_graphs=True)
register_backend("flex", "pasta_engine.layers.flex_attention:FlexAttention",
                 "torch's flex_attention, block mask built from the step's tree of views (eager on a CPU)")


def backend_names() -> list[str]:
    """The registered names, in registration order (``torch`` first)."""
    return list(_REGISTRY)


def graph_backend_names() -> list[str]:
    """The registered backends whose instances run inside CUDA graphs."""
    return [n for n, info in _REGISTRY.items() if info.cuda_graphs]


def backend_info(name: str) -> BackendInfo:
    """The registry entry of ``name``. Raises ParameterError naming the known backends."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ParameterError("attention_backend", name, f"one of {backend_names()} or a backend instance")
    return _REGISTRY[name]


def get_backend(name: str | AttentionBackend) -> AttentionBackend:
    """An attention backend by registered name (a new instance with default options), or the
    instance given.

    Raises ParameterError naming the known backends."""
    if isinstance(name, AttentionBackend):
        return name
    return backend_info(name).load()()
