"""Learning PASTA-LANG (docs/DESIGN.md section 8; Jin et al., ICML 2025, section 4): the training
forward that sees every token as the engine's replay does, SFT and BoNBoN finetuning with LoRA.
A tool on top of the engine: the engine never imports it."""

from .forward import forward_logprobs, layout_for, pasta_logprobs
from .layout import PastaLayout, pasta_layout

__all__ = ["pasta_logprobs", "forward_logprobs", "layout_for", "PastaLayout", "pasta_layout"]
