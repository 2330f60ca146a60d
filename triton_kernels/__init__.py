"""Triton kernels of pasta-engine, imported as ``pasta_engine.triton_kernels``.

This folder is mapped onto that package name by pyproject.toml; never import it as a
top-level ``triton_kernels`` (the name collides with other projects' packages).
"""
