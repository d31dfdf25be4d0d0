"""The machine's streaming-read bandwidth, as a decode roofline: the best rate of a multi-threaded
read of a buffer far larger than the caches (a TVM kernel summing it, one slice per thread, four
vector accumulators per thread so the adds never wait on each other).

    python bench/bandwidth.py [--threads 2] [--gib 1] [--repeats 7]
"""
from __future__ import annotations

import argparse
import os
import time

LANES = 32          # floats summed side by side per thread: four AVX2 registers


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 7) -> float:
    """Best GB/s (10^9 bytes) of `repeats` parallel reads of a `gib` GiB float32 buffer."""
    import numpy as np
    import tvm
    from tvm.script import tirx as T
    from kiln.runtime.threads import set_threads
    from kiln.targets.cpu import host_cpu_target
    set_threads(threads)
    n = int(gib * 2**30) // 4 // (threads * LANES) * threads * LANES
    per_task = n // threads

    @T.prim_func(s_tir=True)
    def read(a: T.Buffer((n,), "float32"), out: T.Buffer((threads, LANES), "float32")):
        for t in T.parallel(threads):
            for lane in T.vectorized(LANES):
                out[t, lane] = T.float32(0)
            for i in range(per_task // LANES):
                for lane in T.vectorized(LANES):
                    out[t, lane] = out[t, lane] + a[t * per_task + i * LANES + lane]

    kernel = tvm.compile(tvm.IRModule({"main": read}), target=host_cpu_target())
    a = tvm.runtime.tensor(np.ones(n, np.float32))
    out = tvm.runtime.tensor(np.zeros((threads, LANES), np.float32))
    kernel(a, out)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        kernel(a, out)
        best = min(best, time.perf_counter() - t0)
    assert abs(float(out.numpy().sum()) - n) <= n * 1e-6         # every element was read
    return n * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"{read_bandwidth(args.threads, args.gib, args.repeats):.1f} GB/s streaming read, {args.threads} threads")


if __name__ == "__main__":
    main()
