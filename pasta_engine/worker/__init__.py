"""The worker: what runs a step's batch on the device (torch).

:mod:`~pasta_engine.worker.model_runner` (``prepare -> execute -> sample``: the scheduler's
:class:`~pasta_engine.core.batch.ScheduledBatch` in, sampled tokens out; the KV cache and the
attention backend), :mod:`~pasta_engine.worker.forward` (the one forward recipe: eager steps,
graph capture and every tensor-parallel rank), :mod:`~pasta_engine.worker.cuda_graphs` (decode
steps replayed from captured CUDA graphs) and :mod:`~pasta_engine.worker.cpu_threads` (torch's
thread count on a CPU). It imports models only through their protocol; tensor parallelism
(:mod:`pasta_engine.distributed`) runs the same runner on every rank.
"""
