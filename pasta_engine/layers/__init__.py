"""Layers: attention (metadata, the torch reference, the Triton and FlexAttention backends,
registered by name in ``backends.py``, the optional CUDA extension's ops), rotary embeddings
and the sampler. They know nothing of the engine."""
