"""How many CPU threads the compiled kernels use, chosen in one place.

`--threads N` (an explicit count) wins, then an explicit $TVM_NUM_THREADS, then every core this
process may run on (`os.sched_getaffinity`). TVM's own default is a guess (half the cores on some
machines, one on a 2-vCPU VM), so kiln always sets the count.

TVM keeps one worker pool per calling thread, sized from $TVM_NUM_THREADS when that thread first
runs a parallel kernel, and `runtime.config_threadpool` can only resize a pool within the size it
was made with. So the count goes into the environment (every pool made later, e.g. in the
server's engine thread, gets it) and into the calling thread's pool; fewer threads than cores
are not bound to cores (set_threads). The setting is for the whole process: a later LLM without
`threads` keeps the count an earlier one set. A thread whose pool already exists cannot grow past
that pool's size (TVM's limit).
"""
from __future__ import annotations

import os

from kiln.errors import KilnError

from .tvm_bridge import configure_threadpool

_BIG_CORES = 1      # TVM's ThreadGroup::AffinityMode kBig: the default mode of its pools


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def resolve_threads(threads: int | None = None) -> int:
    """The thread count to use: `threads`, else $TVM_NUM_THREADS, else available_cores()."""
    if threads is None:
        env = os.environ.get("TVM_NUM_THREADS", "").strip()
        if not env:
            return available_cores()
        try:
            threads = int(env)
        except ValueError:
            raise KilnError(f"TVM_NUM_THREADS={env!r} is not a number of threads") from None
    if threads < 1:
        raise KilnError(f"the thread count must be at least 1, not {threads}")
    return threads


def set_threads(threads: int | None = None) -> int:
    """Make TVM's kernels use resolve_threads(threads) threads from now on; return the count."""
    n = resolve_threads(threads)
    os.environ["TVM_NUM_THREADS"] = str(n)
    if n < available_cores():
        # TVM binds a pool's threads, the calling one too, to the first n cores: every process
        # using fewer threads than cores would crowd the same ones (and the children it starts
        # inherit the binding), so placement is left to the OS (unless TVM_BIND_THREADS says)
        os.environ.setdefault("TVM_BIND_THREADS", "0")
    configure_threadpool(_BIG_CORES, n)
    return n


def describe_threads(n: int) -> str:
    """'1 thread', '2 threads': how the CLI and the server report the count."""
    return f"{n} thread{'s' * (n != 1)}"
