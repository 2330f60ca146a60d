"""Models: checkpoint shapes and architecture options (:mod:`.config`), the Llama-family forward
that runs every supported architecture (:mod:`.llama`) and checkpoint loading (:mod:`.loader`).
They know nothing of the engine."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import LlamaModel
from .loader import EMBEDDED_MODEL, embedded_model_dir, load_model, resolve_model_path

__all__ = ["ModelConfig", "LlamaModel", "SUPPORTED_ARCHITECTURES", "load_model", "resolve_model_path",
           "embedded_model_dir", "EMBEDDED_MODEL"]
