"""Tensor parallelism: every rank runs the engine's model runner (nano-vllm's shape).

:func:`start_tensor_parallel` starts ``tensor_parallel_size - 1`` worker processes
(``torch.multiprocessing``, spawn), each loading its own shard of the checkpoint
(:func:`pasta_engine.models.loader.load_model` with ``tp_rank``/``tp_size``), and returns
:class:`TensorParallelModel`: rank 0's shard (a :class:`~pasta_engine.models.protocol.CausalLM`,
its forward the shard's own) and its handle on the other ranks. When the engine builds its model
runner it attaches it (:meth:`TensorParallelModel.attach_runner`): every worker builds the same
runner class with the same settings over its own shard (its KV-cache shard, its attention
backend) and every rank captures its CUDA graphs at the same time (the all-reduces are inside
them). Rank 0 keeps the scheduler, the interpreters, the block manager and the sampler; each
step its runner prepares the step's :class:`~pasta_engine.worker.forward.StepInputs` and hands
``execute`` to :meth:`TensorParallelModel.execute`, which broadcasts the inputs on the control
group; every rank then runs the same ``ModelRunner.execute`` (graph replay or plan, upload,
record positions, forward), the ranks summing each row-parallel projection with one all-reduce
(two per layer). Page ids are rank 0's block manager's, identical on every rank. The LM head is
replicated; rank 0 samples from its logits. (This package imports no engine module: the runner
class comes to the workers as an argument.)

Failure model: a rank whose part of a step raises (before or inside its forward) completes the
step's remaining all-reduces with zeros, so no rank waits forever; the ranks then exchange
one flag each, and rank 0 raises one :class:`TensorParallelStepError` naming every failed rank
and its error (the engine then frees the step's pages and ends its requests with ``error``;
the next step runs normally). A collective that fails (a peer died or timed out) or a worker
found dead before a step makes the model dead: that step and every later one raise
:class:`~pasta_engine.errors.EngineDeadError`. :meth:`TensorParallelModel.shutdown` (the
engine's ``shutdown``; also at garbage collection and interpreter exit) stops the workers and
leaves no process behind; a worker whose parent dies exits by itself. Spawn runs the main
script again in each worker: a script that starts the engine without the
``if __name__ == "__main__":`` guard (or one read from standard input) gets one error that says
so (:class:`MainGuardError`), not a worker's exit code.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ..errors import EngineDeadError, ParameterError
from ..layers.attention import AttentionBackend
from ..layers.kv_cache import KVCache
from ..models.protocol import CausalLM
from .parallel_state import DEVICE_TIMEOUT_S, CommError, ParallelGroup, destroy_parallel_group, init_parallel_group

__all__ = ["TensorParallelModel", "TensorParallelStepError", "InjectedFault", "MainGuardError", "start_tensor_parallel",
           "check_tensor_parallel"]

logger = logging.getLogger(__name__)

#: seconds the workers get to start (import torch, join the group) before the engine gives up
START_TIMEOUT_S = 300
#: seconds :meth:`TensorParallelModel.shutdown` waits for a worker to exit before killing it
JOIN_TIMEOUT_S = 10


class TensorParallelStepError(RuntimeError):
    """A step failed on one or more ranks (all ranks ended it; the group is still usable).

    Attributes:
        failures: ``{rank: "ExceptionType: message"}`` for every rank whose part failed."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        super().__init__("the tensor-parallel step failed on " + "; ".join(
            f"rank {r}: {m}" for r, m in sorted(failures.items())))


class MainGuardError(RuntimeError):
    """Spawned workers cannot start: the main script starts the engine when it is imported (no
    ``if __name__ == "__main__":`` guard), or it was read from standard input."""


#: environment variable naming the file a spawned worker writes why it could not start
_REPORT_ENV = "PASTA_TP_START_REPORT"

_GUARD = 'if __name__ == "__main__":'


def _check_main_guard() -> None:
    """Refuse, before any process starts, what spawn cannot run (raises :class:`MainGuardError`):
    in a spawned worker that is running the main script again (no guard), write the reason for
    rank 0 and exit quietly; in rank 0, a main script read from standard input (``python -``),
    which a worker cannot run again."""
    main = sys.modules.get("__main__")
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # a spawned child running the main script
        main = sys.modules.get("__mp_main__", main)
        report = os.environ.get(_REPORT_ENV)
        if report:
            with open(report, "w") as f:
                f.write(f"tensor parallelism starts its worker processes with spawn, which runs the main script "
                        f"({getattr(main, '__file__', '?')}) again in each of them; this script starts the engine "
                        f"as it runs, so every worker would start another: put the code that starts the engine "
                        f"under `{_GUARD}`")
        raise SystemExit(1)  # rank 0 reports it, once
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is None and path is not None and not os.path.isfile(path):
        raise MainGuardError(f"tensor parallelism starts its worker processes with spawn, which runs the main script "
                             f"again in each of them, but this one was read from {os.path.basename(path)} (python -): "
                             f"save it as a .py file and put the code that starts the engine under `{_GUARD}`")


class InjectedFault(RuntimeError):
    """The error :meth:`TensorParallelModel.fail_next_step` makes a rank raise (tests)."""


def check_tensor_parallel(model: Any, size: int) -> None:
    """Refuse, before any process starts, a checkpoint that ``size`` ranks cannot split: reads
    only its config (``model``: None for the embedded model, a folder or a ``.gguf`` file).
    Raises ParameterError naming ``tensor_parallel_size`` and the head counts (see
    :func:`pasta_engine.models.sharding.shard_config`), the loader's errors for a bad path."""
    from transformers import AutoConfig

    from ..models.config import ModelConfig
    from ..models.loader import resolve_model_path
    from ..models.sharding import shard_config

    path, gguf = resolve_model_path(model)
    hf = AutoConfig.from_pretrained(path, **({"gguf_file": gguf} if gguf else {}))
    shard_config(ModelConfig.from_hf(hf), size)


def start_tensor_parallel(model: Any, device: torch.device, dtype: torch.dtype, adapter: Any,
                          with_tokenizer: bool, size: int, step_timeout_s: float = DEVICE_TIMEOUT_S,
                          lora_scale: float = 1.0) -> tuple["TensorParallelModel", Any, Any]:
    """Start ranks ``1 .. size - 1`` and load rank 0's shard here.

    Args:
        model: None (the embedded model), a checkpoint folder or a ``.gguf`` file.
        device: rank 0's device (CUDA: rank ``r`` runs on device index ``device.index + r``);
            dtype: the weights' and KV cache's.
        adapter: a LoRA adapter folder merged on every rank, or None; lora_scale: its merge scale.
        with_tokenizer: load the checkpoint's tokenizer (rank 0 only).
        size: ``tensor_parallel_size`` (>= 2).
        step_timeout_s: how long a step's collectives wait for a rank (seconds): a hung worker
            then makes the engine dead (EngineDeadError) instead of blocking ``step()``.

    Returns ``(model, tokenizer, hf_config)`` as :func:`~pasta_engine.models.loader.load_model`
    does, the model a :class:`TensorParallelModel`. Raises MainGuardError (a main script that
    spawn cannot run again: no ``if __name__ == "__main__":`` guard, or read from standard
    input), ParameterError (a size the heads or the CUDA devices do not allow), EngineDeadError
    (a worker that died while starting), and any rank's load error (the first, with every worker
    stopped)."""
    from ..models.loader import load_model, resolve_model_path

    _check_main_guard()
    check_tensor_parallel(model, size)
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed default process group (another "
                           "tensor-parallel engine not shut down, or torchrun): one tensor-parallel engine per process")
    base = device.index or 0
    if device.type == "cuda" and torch.cuda.device_count() < base + size:
        raise ParameterError("tensor_parallel_size", size, message=(
            f"tensor_parallel_size={size} needs CUDA devices {base}..{base + size - 1}, but "
            f"{torch.cuda.device_count()} are visible"))
    path, gguf = resolve_model_path(model)  # converts the embedded model once, before the workers read it
    source = str(path / gguf) if gguf else str(path)
    rendezvous = tempfile.mkdtemp(prefix="pasta-tp-")
    init_method = f"file://{os.path.join(rendezvous, 'store')}"
    ctx = torch.multiprocessing.get_context("spawn")
    ready = [ctx.Event() for _ in range(size)]
    load = dict(model=source if model is not None else None, dtype=dtype,
                adapter=str(adapter) if adapter is not None else None, lora_scale=lora_scale)
    procs = []
    report = os.path.join(rendezvous, "start-report")
    before = os.environ.get(_REPORT_ENV)
    os.environ[_REPORT_ENV] = report  # a worker that cannot start says why there (see _check_main_guard)
    try:
        for r in range(1, size):
            dev = torch.device("cuda", base + r) if device.type == "cuda" else torch.device("cpu")
            p = ctx.Process(target=_worker_main, name=f"pasta-tp-rank{r}", daemon=True,
                            args=(r, size, init_method, str(dev), load, torch.get_num_threads(), ready[r],
                                  step_timeout_s))
            p.start()
            procs.append(p)
    finally:
        if before is None:
            os.environ.pop(_REPORT_ENV, None)
        else:
            os.environ[_REPORT_ENV] = before
    handle = _Handle()
    reaper = weakref.finalize(handle, _reap, procs, rendezvous)  # also at exit, whatever happens below
    group = None
    try:
        _wait_started(procs, ready[1:], report)
        group = init_parallel_group(0, size, init_method, device, step_timeout_s)
        error: BaseException | None = None
        try:
            shard, tok, hf_cfg = load_model(model, device=device, dtype=dtype, adapter=adapter,
                                            with_tokenizer=with_tokenizer, tp_rank=0, tp_size=size,
                                            lora_scale=lora_scale)
        except Exception as e:  # noqa: BLE001  (reported after the workers say how their loads went)
            error = e
        # a worker hung while loading fails the start within START_TIMEOUT_S, not the control
        # group's month
        failed = group.failed_ranks(error is not None, timeout_s=START_TIMEOUT_S)
        if failed:
            messages = group.gather_to_rank0(None if error is None else _describe(error), timeout_s=START_TIMEOUT_S)
            if error is not None:
                raise error
            raise RuntimeError("a tensor-parallel worker could not load its shard: "
                               + "; ".join(f"rank {r}: {messages[r]}" for r in failed))
    except BaseException:
        _stop(procs, None)
        if group is not None:
            destroy_parallel_group()
        reaper()
        raise
    tp = TensorParallelModel(shard, group, procs, reaper)
    tp.step_timeout_s = step_timeout_s
    tp._handle = handle  # the reaper runs when the model is collected
    return tp, tok, hf_cfg


class _Handle:
    """What the workers' reaper is tied to (a :class:`TensorParallelModel` holds it)."""


class TensorParallelModel:
    """Rank 0's shard, and its handle on the other ranks (see the module docstring). A
    :class:`~pasta_engine.models.protocol.CausalLM` whose forward is the shard's: the engine's
    model runner drives it as any model, and :meth:`attach_runner` makes every rank run that
    runner.

    Attributes:
        shard: rank 0's decoder (a ``LlamaModel`` over the rank's slices).
        config: the per-rank :class:`~pasta_engine.models.config.ModelConfig`
            (:func:`~pasta_engine.models.sharding.shard_config`: heads and intermediate size
            divided by the size; ``vocab_size`` whole), so the model runner sizes its KV-cache
            shard and attention backend by it; device, dtype: rank 0's.
        size: ranks in all; group: the :class:`~pasta_engine.distributed.parallel_state.ParallelGroup`.
        runner: rank 0's model runner, once attached.
        dead: None, or why the model is dead (every step then raises EngineDeadError)."""

    step_timeout_s: float = DEVICE_TIMEOUT_S  # how long rank 0 waits for the workers in a step (seconds)

    def __init__(self, shard: CausalLM, group: ParallelGroup, procs: list, reaper: weakref.finalize):
        self.shard = shard
        self.config = shard.config
        self.device = shard.device
        self.dtype = shard.dtype
        self.group = group
        self.size = group.size
        self.procs = procs
        self.runner: Any = None
        self.dead: str | None = None
        self._reaper = reaper
        self._fault: dict[int, int] = {}

    @property
    def weight_bytes(self) -> int:
        """Bytes of rank 0's weights (each rank reads its own shard once per forward)."""
        return self.shard.weight_bytes

    def projection_weights(self) -> list[torch.Tensor]:
        """Rank 0's ``[out, in]`` projection slices (for the CPU GEMM chooser)."""
        return self.shard.projection_weights()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                kv_cache: KVCache, backend: AttentionBackend, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's shard's forward (:meth:`pasta_engine.models.protocol.CausalLM.forward`: float32
        logits ``[S, vocab]``, full since the LM head is replicated). Only inside
        :meth:`execute` (or graph capture) are its all-reduces in step with the other ranks."""
        return self.shard.forward(input_ids, positions, slot_mapping, kv_cache, backend, logits_indices)

    # ------------------------------------------------------------------ the engine's hooks

    def attach_runner(self, runner: Any) -> None:
        """Called once by the engine with its model runner: every worker builds ``type(runner)``
        with the same settings (the KV budget as rank 0 resolved it, so every rank has the same
        pages) over its own shard, then every rank captures its CUDA graphs (when the runner
        wants them) at the same time; the runner's steps then run through :meth:`execute`.
        Raises ParameterError for a backend given as an instance, and the first error of a
        rank that could not build its runner or capture (the engine is then dead)."""
        backend = runner.backend.name
        if not isinstance(backend, str) or not isinstance(runner.config.attention_backend, str):
            raise ParameterError("attention_backend", backend, "a registered backend name with tensor_parallel_size > 1")
        config = dataclasses.replace(runner.config, kv_cache_bytes=runner.kv_cache_bytes)
        self._send(("init", type(runner), config))
        error: BaseException | None = None
        try:
            with _reducing(self.shard, self.group):
                runner.capture_graphs()
        except Exception as e:  # noqa: BLE001  (reported with the workers' status)
            error = e
        failed = self._exchange(error)
        if failed:
            self._die(str(failed))
            raise failed
        self.runner = runner
        runner.executor = self.execute

    def execute(self, execute: Callable[[Any], torch.Tensor], inputs: Any) -> torch.Tensor:
        """Run one step on every rank: broadcast ``inputs`` (the runner's ``StepInputs``; one
        broadcast on the control group), run ``execute(inputs)`` here as every worker runs its
        runner's, with the all-reduces guarded, then exchange the ranks' status. Returns rank
        0's logits (float32 ``[S, vocab]``).

        Raises TensorParallelStepError when any rank's part failed (every rank has ended the
        step), EngineDeadError when a worker has died or the group is broken. A
        KeyboardInterrupt in the middle of the step stops the workers and leaves the engine dead
        (the ranks are out of step), then propagates."""
        self._check_alive()
        fault, self._fault = self._fault, {}
        try:
            self._send(("step", inputs, fault))
            out, failures = _guarded_forward(self.shard, self.group, fault.get(0),
                                             lambda: self.runner.forward_rows(inputs), lambda: execute(inputs),
                                             timeout_s=self.step_timeout_s)
        except CommError as e:
            self._die(str(e))
            raise EngineDeadError(f"tensor-parallel engine is dead: {e}") from e
        except KeyboardInterrupt:
            # the workers wait in this step's collectives: a stop message would never match them, so
            # shutdown must not send one (it hung past 120 s); the ranks are out of step for good
            self._die("a KeyboardInterrupt stopped rank 0 in the middle of a step")
            raise
        if failures:
            raise failures
        return out

    def fail_next_step(self, rank: int, after_reduces: int = 1) -> None:
        """Testing aid: make rank ``rank`` raise :class:`InjectedFault` in the next step's
        forward, after its first ``after_reduces`` all-reduces (0: before any)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in 0..{self.size - 1}")
        self._fault[rank] = after_reduces

    def shutdown(self) -> None:
        """Stop every worker (a stop message, then terminate/kill what has not exited after
        :data:`JOIN_TIMEOUT_S` seconds) and leave the process group; idempotent. Afterwards
        every step raises EngineDeadError."""
        if self._reaper.alive or self.dead is None:
            stopped = False
            if self.dead is None:
                try:
                    if all(p.is_alive() for p in self.procs):
                        self.group.broadcast(("stop",), timeout_s=min(self.step_timeout_s, JOIN_TIMEOUT_S))
                        stopped = True
                except CommError:
                    pass
                self.dead = "shut down"
            _stop(self.procs, JOIN_TIMEOUT_S if stopped else 0)
            destroy_parallel_group()
            self._reaper()

    # ------------------------------------------------------------------ internals

    def _send(self, msg: tuple) -> None:
        try:
            self.group.broadcast(msg, timeout_s=self.step_timeout_s)
        except CommError as e:
            self._die(str(e))
            raise EngineDeadError(f"tensor-parallel engine is dead: {e}") from e

    def _exchange(self, error: BaseException | None) -> BaseException | None:
        """The ranks' status after a phase: None when all succeeded, else the error to raise."""
        try:
            failed = self.group.failed_ranks(error is not None, timeout_s=self.step_timeout_s)
            if not failed:
                return None
            messages = self.group.gather_to_rank0(None if error is None else _describe(error))
        except CommError as e:
            self._die(str(e))
            return EngineDeadError(f"tensor-parallel engine is dead: {e}")
        return TensorParallelStepError({r: messages[r] for r in failed})

    def _check_alive(self) -> None:
        if self.dead is None:
            gone = [r for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
            if gone:
                self._die(f"worker rank(s) {gone} exited (exit codes "
                          f"{[self.procs[r - 1].exitcode for r in gone]})")
        if self.dead is not None:
            raise EngineDeadError(f"tensor-parallel engine is dead: {self.dead}")

    def _die(self, why: str) -> None:
        """Mark the model dead and stop what is left of the workers (no message: the group is broken)."""
        if self.dead is None:
            self.dead = why
            logger.error("tensor-parallel engine is dead: %s", why)
        _stop(self.procs, 0)


@contextmanager
def _reducing(model: Any, group: ParallelGroup) -> Iterator[None]:
    """The model's row-parallel all-reduces go to ``group`` while inside (graph capture: the
    captured all-reduces replay with the graphs)."""
    model.row_parallel_reduce = group.all_reduce
    try:
        yield
    finally:
        model.row_parallel_reduce = None


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _guarded_forward(model: Any, group: ParallelGroup, fault_after: int | None, rows: Callable[[], int],
                     run: Callable[[], torch.Tensor | None],
                     timeout_s: float | None = None) -> tuple[Any, TensorParallelStepError | None]:
    """Run one rank's forward with the row-parallel all-reduces on ``group``; if it raises,
    complete the all-reduces the other ranks will still make (``2 * num_layers`` per forward)
    with zeros ``[rows(), hidden]`` (the step's rows: its graph bucket when graphed), then
    exchange the ranks' status, waiting at most ``timeout_s`` seconds for the others (rank 0:
    the step timeout, so a worker hung after its all-reduces fails the step in time; None: the
    control group's timeout, for a worker).

    Returns ``(result, None)`` or ``(None, error)`` on rank 0 (the error naming every failed
    rank), ``(result, None)`` / ``(None, None)`` on the workers. Raises CommError when a
    collective fails (the group is then unusable)."""
    expected = 2 * model.config.num_layers
    done = [0]

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if fault_after is not None and done[0] == fault_after:
            raise InjectedFault(f"injected fault on rank {group.rank} after {done[0]} all-reduces")
        group.all_reduce(x)
        done[0] += 1
        return x

    model.row_parallel_reduce = reduce
    error: BaseException | None = None
    out = None
    try:
        out = run()
    except CommError:
        raise
    except Exception as e:  # noqa: BLE001  (reported by the status exchange below)
        error = e
        pad = torch.zeros(rows(), model.config.hidden_size, dtype=model.dtype, device=model.device)
        for _ in range(expected - done[0]):
            group.all_reduce(pad.zero_())
    finally:
        model.row_parallel_reduce = None
    failed = group.failed_ranks(error is not None, timeout_s=timeout_s)
    if not failed:
        return out, None
    messages = group.gather_to_rank0(None if error is None else _describe(error), timeout_s=timeout_s)
    if group.rank != 0:
        return None, None
    err = TensorParallelStepError({r: messages[r] for r in failed})
    if error is not None:
        err.__cause__ = error
    return None, err


def _wait_started(procs: list, ready: list, report: str) -> None:
    """Wait until every worker has started (imported torch, about to join the group); raise
    MainGuardError for one that exited saying why in the ``report`` file (the main script has
    no guard), EngineDeadError for another that exited first, RuntimeError after
    :data:`START_TIMEOUT_S`."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for r, (p, ev) in enumerate(zip(procs, ready), start=1):
        while not ev.wait(0.1):
            if not p.is_alive():
                if os.path.exists(report):
                    with open(report) as f:
                        raise MainGuardError(f.read()) from None
                raise EngineDeadError(f"tensor-parallel worker rank {r} exited while starting (exit code {p.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel worker rank {r} did not start within {START_TIMEOUT_S} s")


def _stop(procs: list, timeout: float | None) -> None:
    """Make sure every worker process has exited: wait up to ``timeout`` seconds for a clean
    exit (None: none), then SIGTERM, then SIGKILL."""
    if timeout:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _reap(procs: list, rendezvous: str) -> None:
    """Garbage collection / interpreter exit (or the end of :meth:`TensorParallelModel.shutdown`):
    no worker may outlive the engine, and the process is free to start another one."""
    _stop(procs, None)
    destroy_parallel_group()
    shutil.rmtree(rendezvous, ignore_errors=True)


# ---------------------------------------------------------------------------- worker side


def _watch_parent() -> None:
    """Exit this worker as soon as its parent (rank 0) is gone (even killed by SIGKILL)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    while parent is not None and parent.is_alive():
        time.sleep(0.5)
    os._exit(3)


def _worker_main(rank: int, size: int, init_method: str, device: str, load: dict, threads: int, ready: Any,
                 step_timeout_s: float = DEVICE_TIMEOUT_S) -> None:
    """One worker rank: join the group, load the shard, then serve steps until ``("stop",)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C (the whole group gets it) is rank 0's: it stops us
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 -PGID`: where each rank waits
    threading.Thread(target=_watch_parent, daemon=True, name="pasta-tp-parent-watch").start()
    torch.set_num_threads(max(1, threads))
    dev = torch.device(device)
    ready.set()
    try:
        group = init_parallel_group(rank, size, init_method, dev, step_timeout_s)
    except Exception:  # noqa: BLE001
        logger.exception("tensor-parallel rank %d could not join the group", rank)
        os._exit(2)
    try:
        _serve(group, dev, load)
    except CommError as e:  # rank 0 is gone or the group broke: nothing to report to
        logger.error("tensor-parallel rank %d: %s", rank, e)
    finally:
        destroy_parallel_group()


def _serve(group: ParallelGroup, device: torch.device, load: dict) -> None:
    from ..models.loader import load_model

    error: BaseException | None = None
    model = None
    try:
        model, _, _ = load_model(load["model"], device=device, dtype=load["dtype"], adapter=load["adapter"],
                                 with_tokenizer=False, tp_rank=group.rank, tp_size=group.size,
                                 lora_scale=load.get("lora_scale", 1.0))
    except Exception as e:  # noqa: BLE001  (reported to rank 0)
        error = e
    if group.failed_ranks(error is not None):
        group.gather_to_rank0(None if error is None else _describe(error))
        return
    runner = None
    while True:
        msg = group.broadcast()
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "init":  # the same runner as rank 0's, over this rank's shard; graphs captured together
            _, runner_cls, config = msg
            error = None
            try:
                runner = runner_cls(model, config)
                with _reducing(model, group):
                    runner.capture_graphs()
            except Exception as e:  # noqa: BLE001
                error = e
            if group.failed_ranks(error is not None):
                group.gather_to_rank0(None if error is None else _describe(error))
            continue
        _, inputs, fault = msg
        if runner is None:
            raise RuntimeError("a step before the runner was attached")
        _guarded_forward(model, group, fault.get(group.rank), lambda: runner.forward_rows(inputs),
                         lambda: runner.execute(inputs))
