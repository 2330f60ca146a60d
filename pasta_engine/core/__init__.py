"""The engine's core, plain Python (no torch): a request's life and the decisions of each step.

:mod:`~pasta_engine.core.request` (a request's state), :mod:`~pasta_engine.core.outputs` (what the engine hands back),
:mod:`~pasta_engine.core.interpreter` (one request's threads: forks, joins, caps, positions),
:mod:`~pasta_engine.core.scheduler` (which threads run each step, and admission and
preemption), :mod:`~pasta_engine.core.batch` (the scheduler's contract with the interpreter and
the model runner), :mod:`~pasta_engine.core.block_manager` (paged KV with shared, spliced views),
:mod:`~pasta_engine.core.render` (the response's texts and the step outputs) and
:mod:`~pasta_engine.core.replay` (a trace as forced tokens). The front
(:mod:`pasta_engine.engine`) drives it; the worker (:mod:`pasta_engine.worker`) runs its batches.
"""
