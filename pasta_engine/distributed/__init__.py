"""Tensor parallelism over ``torch.distributed`` (gloo on CPUs, NCCL on GPUs).

``EngineConfig.tensor_parallel_size = N`` (CLI ``--tensor-parallel-size N``) makes
:meth:`pasta_engine.Engine.from_pretrained` start ``N - 1`` worker processes and shard the model
Megatron-style across the ``N`` ranks (:mod:`pasta_engine.models.sharding`): rank 0 runs the
scheduler, the interpreters, the block manager and sampling, and broadcasts each step's inputs;
every rank runs its shard of the forward over its own KV-cache shard
(:mod:`pasta_engine.distributed.executor`). Imports no engine module: the engine reaches it
through the model it returns (a :class:`~pasta_engine.models.protocol.CausalLM`) and one hook
of the model runner.
"""

from .executor import InjectedFault, TensorParallelModel, TensorParallelStepError, start_tensor_parallel

__all__ = ["TensorParallelModel", "TensorParallelStepError", "InjectedFault", "start_tensor_parallel"]
