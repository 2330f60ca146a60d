"""Layers: attention (metadata, the torch reference and the Triton backend, the optional CUDA
extension's ops), rotary embeddings and the sampler. They know nothing of the engine."""
