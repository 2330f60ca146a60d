"""Tensor parallelism over ``torch.distributed`` (gloo on CPUs, NCCL on GPUs).

``EngineConfig.tensor_parallel_size = N`` (CLI ``--tensor-parallel-size N``) makes
:meth:`pasta_engine.Engine.from_pretrained` start ``N - 1`` worker processes and shard the model
Megatron-style across the ``N`` ranks (:mod:`pasta_engine.models.sharding`): rank 0 runs the
scheduler, the interpreters, the block manager and sampling, and broadcasts each step's inputs;
every rank runs the same model runner's ``execute`` (CUDA graphs included) over its own shard
and KV-cache shard (:mod:`pasta_engine.distributed.executor`). Imports no engine module: the
engine reaches it through the model it returns (a :class:`~pasta_engine.models.protocol.CausalLM`
that attaches to the engine's model runner), and the runner class reaches the workers as an
argument.
"""

from .executor import (InjectedFault, MainGuardError, TensorParallelModel, TensorParallelStepError,
                       start_tensor_parallel)

__all__ = ["TensorParallelModel", "TensorParallelStepError", "InjectedFault", "MainGuardError", "start_tensor_parallel"]
