"""The tensor-parallel process group of one engine, over ``torch.distributed``.

Two groups, as vLLM has: the *device group* (NCCL on CUDA, gloo on a CPU) carries the forward's
all-reduces, with a bounded timeout; the *control group* (always gloo, CPU) carries each step's
inputs from rank 0 (:func:`torch.distributed.broadcast_object_list`), with a timeout long enough
for an engine to sit idle between requests. The engine owns the default process group of its
processes: one tensor-parallel engine per process at a time (a second one, or a process that
already has a default group, e.g. under ``torchrun``, is refused).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ParallelGroup", "init_parallel_group", "destroy_parallel_group", "CommError",
           "DEVICE_TIMEOUT_S", "CONTROL_TIMEOUT_S"]

#: seconds a forward's all-reduce may wait for the other ranks before the rank gives up (the
#: default of EngineConfig.tensor_parallel_step_timeout_s)
DEVICE_TIMEOUT_S = 120
#: seconds a worker waits for the next step (an idle engine sends none: a long time)
CONTROL_TIMEOUT_S = 30 * 24 * 3600


class CommError(RuntimeError):
    """A collective failed (a peer died or timed out): the group is unusable."""


@dataclass
class ParallelGroup:
    """One rank's view of the group.

    Attributes:
        rank: this process's rank (0 runs the scheduler and samples); size: ranks in all.
        device_group: the group the all-reduces run on (the default group).
        control_group: the gloo group the step inputs are broadcast on."""

    rank: int
    size: int
    device_group: Any
    control_group: Any

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (any shape and float dtype, on this rank's device) over the ranks, in place;
        returns ``x``. Raises :class:`CommError` when the collective fails."""
        try:
            dist.all_reduce(x, group=self.device_group)
        except Exception as e:  # noqa: BLE001  (gloo/NCCL raise RuntimeError subclasses of many kinds)
            raise CommError(f"all_reduce failed on rank {self.rank}: {type(e).__name__}: {e}") from e
        return x

    def broadcast(self, obj: Any = None, timeout_s: float | None = None) -> Any:
        """Rank 0 sends ``obj`` (picklable) to every rank; returns it on every rank (its pickled
        size, then its bytes, on the control group). ``timeout_s``: how long this rank waits for
        the others (None: the control group's timeout, for a worker that waits for the next
        step). Raises :class:`CommError` when the collective fails or times out (rank 0: a
        worker is gone or hung; a worker: rank 0 is gone)."""
        try:
            if self.rank == 0:
                data = pickle.dumps(obj)
                size = torch.tensor([len(data)], dtype=torch.int64)
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            else:
                size = torch.zeros(1, dtype=torch.int64)
            _wait(dist.broadcast(size, src=0, group=self.control_group, async_op=True), timeout_s)
            if self.rank != 0:
                payload = torch.empty(int(size.item()), dtype=torch.uint8)
            _wait(dist.broadcast(payload, src=0, group=self.control_group, async_op=True), timeout_s)
        except Exception as e:  # noqa: BLE001
            raise CommError(f"broadcast failed on rank {self.rank}: {type(e).__name__}: {e}") from e
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def failed_ranks(self, failed: bool, timeout_s: float | None = None) -> list[int]:
        """Every rank says whether its part of the step failed; returns the ranks that did, on
        every rank (one int32 ``[size]`` all-reduce on the control group, waiting at most
        ``timeout_s`` seconds; None: the group's timeout). Raises CommError."""
        flags = torch.zeros(self.size, dtype=torch.int32)
        flags[self.rank] = int(failed)
        try:
            _wait(dist.all_reduce(flags, group=self.control_group, async_op=True), timeout_s)
        except Exception as e:  # noqa: BLE001
            raise CommError(f"status exchange failed on rank {self.rank}: {type(e).__name__}: {e}") from e
        return [r for r, f in enumerate(flags.tolist()) if f]

    def gather_to_rank0(self, obj: Any, timeout_s: float | None = None) -> list[Any] | None:
        """Every rank's ``obj`` (picklable), in rank order, on rank 0 (None on the others): two
        all-gathers on the control group (each rank's pickled size, then the bytes padded to
        the largest), each waiting at most ``timeout_s`` seconds (None: the group's timeout;
        ``dist.gather_object`` takes none). Raises CommError."""
        data = pickle.dumps(obj)
        try:
            size = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
            _wait(dist.all_gather(sizes, size, group=self.control_group, async_op=True), timeout_s)
            n = max(int(x.item()) for x in sizes)
            mine = torch.zeros(n, dtype=torch.uint8)
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            parts = [torch.zeros(n, dtype=torch.uint8) for _ in range(self.size)]
            _wait(dist.all_gather(parts, mine, group=self.control_group, async_op=True), timeout_s)
        except Exception as e:  # noqa: BLE001
            raise CommError(f"gather failed on rank {self.rank}: {type(e).__name__}: {e}") from e
        if self.rank != 0:
            return None
        return [pickle.loads(p[: int(k.item())].numpy().tobytes()) for p, k in zip(parts, sizes)]


def _wait(work: Any, timeout_s: float | None) -> None:
    """Wait for an async collective, at most ``timeout_s`` seconds (None: its group's timeout);
    raises what the collective raises (a timeout included)."""
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout_s))


def init_parallel_group(rank: int, size: int, init_method: str, device: torch.device,
                        step_timeout_s: float = DEVICE_TIMEOUT_S) -> ParallelGroup:
    """Join the group: ``init_method`` is a ``torch.distributed`` URL every rank is given (the
    engine uses ``file://`` in a fresh temporary folder); ``device``: this rank's (CUDA: NCCL
    for the all-reduces, else gloo); ``step_timeout_s``: how long a collective of a step waits
    for the other ranks before it fails (seconds).

    Raises RuntimeError when this process already has a default process group (one
    tensor-parallel engine per process) or the rendezvous fails."""
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed default process group (another "
                           "tensor-parallel engine, or torchrun): one tensor-parallel engine per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=step_timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
    return ParallelGroup(rank, size, dist.group.WORLD, control)


def destroy_parallel_group() -> None:
    """Leave the group (this process's default group and its subgroups); never raises (the
    peers may be gone)."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (a dead peer: the group is gone either way)
        pass
