#!/usr/bin/python3
"""PyTorch side of bench/tensor: prints `name<TAB>value` lines (GB/s or GFLOP/s)."""
import sys
import time

import torch

threads = int(sys.argv[1])
n = int(sys.argv[2])
sizes = [int(s) for s in sys.argv[3].split(",")]
torch.set_num_threads(threads)
torch.manual_seed(0)


def best(fn, reps):
    fn()  # warm-up: first touch of pages, caches
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


a = torch.rand(n)
b = torch.rand(n)
c = torch.rand(n)
print("add\t%.3f" % (3 * 4 * n / best(lambda: a + b, 5) / 1e9))
print("add_\t%.3f" % (3 * 4 * n / best(lambda: a.add_(b, alpha=1e-9), 5) / 1e9))
print("fma\t%.3f" % (4 * 4 * n / best(lambda: a.addcmul_(b, c, value=1e-9), 5) / 1e9))
print("sum\t%.3f" % (4 * n / best(lambda: a.sum(), 5) / 1e9))
del a, b, c
for s in sizes:
    x = torch.rand(s, s)
    y = torch.rand(s, s)
    reps = 3 if s >= 2048 else 10
    print("sgemm%d\t%.3f" % (s, 2 * s ** 3 / best(lambda: torch.mm(x, y), reps) / 1e9))
