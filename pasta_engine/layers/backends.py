"""Attention backends by name: ``attention_backend="torch" | "triton"`` or a registered one."""

from __future__ import annotations

from ..errors import ParameterError
from .attention import AttentionBackend, TorchAttention

__all__ = ["get_backend", "register_backend"]

_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def register_backend(name: str, cls: type[AttentionBackend]) -> None:
    """Make ``cls`` available as ``attention_backend=name``."""
    _BACKENDS[name] = cls


def get_backend(name: str | AttentionBackend) -> AttentionBackend:
    """An attention backend by name: ``"torch"`` (reference) or ``"triton"`` (the kernels of
    :mod:`pasta_engine.triton_kernels`; under Triton's interpreter on a CPU), or the instance
    given.

    Raises ParameterError naming the known backends."""
    if isinstance(name, AttentionBackend):
        return name
    if name == "triton" and name not in _BACKENDS:
        from .triton_attention import TritonAttention  # imports triton: only when asked for

        register_backend("triton", TritonAttention)
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ParameterError("attention_backend", name, f"one of {sorted({*_BACKENDS, 'triton'})} or a backend instance")
    return _BACKENDS[name]()
