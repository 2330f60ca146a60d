"""The CPU thread policy: how many torch threads an engine on the CPU uses (no torch import here).

``Engine.from_pretrained(threads="auto")`` (the default) and the CLI's ``--threads auto`` apply
:func:`cpu_threads`: a thread count above the cores other work leaves free makes every step wait
at torch's barriers for a thread another process holds (on a 2-core machine with other work
running, 2 threads ran about 10x slower per step than 1: bench/results/cpu_threads.json).
"""

from __future__ import annotations

import math
import os

from ..errors import ParameterError

__all__ = ["AUTO_THREADS_MAX", "AUTO_THREADS_POLICY", "MAX_THREADS", "busy_cores", "cpu_threads", "check_threads"]

#: The most threads ``--threads auto`` gives.
AUTO_THREADS_MAX = 4
#: The most threads ``threads=N`` (``--threads N``) may ask for: far above any machine's cores,
#: far below what torch's ``set_num_threads`` (a C int) overflows on.
MAX_THREADS = 4096
AUTO_THREADS_POLICY = (f"the cores this process may use that other work leaves free (the larger of the 1-minute load "
                       f"average and the processes running now), at most {AUTO_THREADS_MAX}, at least 1")


def busy_cores() -> float:
    """How many cores other work holds: the larger of the 1-minute load average and the
    runnable tasks right now less this one (``/proc/loadavg``; the load average alone lags a
    process that just started by about a minute). 0 where neither can be read."""
    load = 0.0
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        load = max(load, running - 1)
    except (OSError, ValueError, IndexError):
        pass
    return load


def cpu_threads(flag: str | int = "auto") -> int:
    """Torch's CPU thread count for ``threads`` (``--threads``): N as given, or for ``"auto"``
    :data:`AUTO_THREADS_POLICY`: ``max(1, min(AUTO_THREADS_MAX, floor(cores - busy)))`` with
    ``cores`` the CPUs this process may run on and ``busy`` :func:`busy_cores`, read once when
    the engine is built. A thread count above the free cores makes every step wait at torch's
    barriers for a thread another process holds: on a 2-core machine with other work running, 2
    threads ran about 10x slower per step than 1 (bench/results/cpu_threads.json); one thread
    too few costs at most the parallel part of a step."""
    if flag != "auto":
        return int(flag)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(AUTO_THREADS_MAX, math.floor(cores - busy_cores())))


def check_threads(threads: object) -> None:
    """Refuse a ``threads`` value that is not ``"auto"``, None or an integer from 1 to
    :data:`MAX_THREADS` (ParameterError naming ``threads``)."""
    if threads is None or threads == "auto":
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ParameterError("threads", threads, "'auto' (the default: the cores other work leaves free, at most "
                             f"{AUTO_THREADS_MAX}), None (leave torch's setting alone), or an integer from 1 to "
                             f"{MAX_THREADS}")
