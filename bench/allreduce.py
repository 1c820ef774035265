#!/usr/bin/python3
"""PyTorch side of bench/allreduce: one collective (all_reduce SUM by default) over gloo on float32 tensors of
each size; N ranks started by torch.multiprocessing.spawn (Debian's torchrun 1.13 fails under this Python).
usage: allreduce.py <ranks> <sizes in bytes, comma-separated> <repeats> [all_reduce|all_gather|broadcast]
(torch 1.13's gloo has no reduce_scatter: that op prints nothing)
Rank 0 prints `bytes<TAB>seconds<TAB>busbw GB/s` per size; seconds = median over repeats of the slowest rank."""
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

nproc, sizes, repeats = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3])
op = sys.argv[4] if len(sys.argv) > 4 else "all_reduce"
FACTOR = {"all_reduce": 2 * (nproc - 1) / nproc, "all_gather": (nproc - 1) / nproc, "broadcast": 1.0}


def reps(nbytes):  # the same schedule as allreduce.lua
    if nbytes >= 256 * 2**20:
        return max(3, repeats // 6)
    if nbytes >= 64 * 2**20:
        return max(3, repeats // 3)
    if nbytes >= 16 * 2**20:
        return max(5, repeats // 2)
    return repeats


def worker(rank, port):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=nproc)
    n = dist.get_world_size()
    for nbytes in sizes:
        one_size(nbytes, n, rank)
    dist.destroy_process_group()


def collective(nbytes, n):
    t = torch.ones(nbytes // 4)
    parts = list(t.narrow(0, q * (nbytes // 4 // n), nbytes // 4 // n) for q in range(n))
    mine = torch.ones(nbytes // 4 // n)
    if op == "all_gather":
        return lambda: dist.all_gather(parts, mine)
    if op == "broadcast":
        return lambda: dist.broadcast(t, 0)
    return lambda: dist.all_reduce(t, dist.ReduceOp.SUM)


def one_size(nbytes, n, rank):
    run = collective(nbytes, n)
    k = reps(nbytes)
    for _ in range(1 if nbytes >= 64 * 2**20 else 3):
        run()
    times = []
    dist.barrier()
    for _ in range(k):  # back to back, as nccl-tests time them (no barrier between repeats)
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    all_t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(all_t, dist.ReduceOp.MAX)
    med = statistics.median(all_t.tolist())
    if rank == 0:
        print("%d\t%.6g\t%.4f" % (nbytes, med, FACTOR[op] * nbytes / med / 1e9), flush=True)
    dist.barrier()


if __name__ == "__main__":
    if op not in FACTOR:
        sys.exit(0)  # torch's gloo has no such collective: no lines, the table says n/a
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=nproc)
