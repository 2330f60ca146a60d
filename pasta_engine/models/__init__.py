"""Models: every architecture's traits in one table (:mod:`.config`), the seam the engine uses
(:class:`~.protocol.CausalLM`), the Llama-family forward that runs every supported architecture
(:mod:`.llama`), checkpoint loading (:mod:`.loader`) and LoRA adapters (:mod:`.adapter`).
They know nothing of the engine."""

from .config import ARCHITECTURES, SUPPORTED_ARCHITECTURES, Architecture, ModelConfig
from .llama import LlamaModel
from .loader import EMBEDDED_MODEL, embedded_model_dir, load_model, resolve_model_path
from .protocol import CausalLM

__all__ = ["ModelConfig", "Architecture", "ARCHITECTURES", "CausalLM", "LlamaModel", "SUPPORTED_ARCHITECTURES",
           "load_model", "resolve_model_path", "embedded_model_dir", "EMBEDDED_MODEL"]
