#!/usr/bin/python3
"""PyTorch side of bench/ddp_cpu: DistributedDataParallel (gloo) ResNet-20 (same layout as models/resnet.lua) training
steps on random Fashion-MNIST-shaped batches; N ranks started by torch.multiprocessing.spawn (Debian's torchrun 1.13
fails under this Python). usage: ddp_cpu.py <ranks> <steps> <batch per rank> <nchw|nhwc> [resnet20|resnet18] (resnet18:
torchvision's, on 3x32x32); prints `img/s<TAB>value`
(all ranks together)."""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

nproc, steps, batch, fmt = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
which = sys.argv[5] if len(sys.argv) > 5 else "resnet20"


from resnet20_torch import resnet20  # noqa: E402 (bench/, next to this script)


def worker(rank, port):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=nproc)
    torch.manual_seed(0)
    mf = torch.channels_last if fmt == "nhwc" else torch.contiguous_format
    if which == "resnet18":
        import torchvision

        net, c, hw = torchvision.models.resnet18(num_classes=10), 3, 32
    else:
        net, c, hw = resnet20(), 1, 28
    model = DistributedDataParallel(net.to(memory_format=mf))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    crit = nn.CrossEntropyLoss()
    torch.manual_seed(1 + rank)  # each rank its own data
    x = torch.randn(batch, c, hw, hw).to(memory_format=mf)
    y = torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(3):
        step()  # warm-up: primitive creation, allocator, connections
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, dist.ReduceOp.MAX)  # the job's pace is its slowest rank's
    if rank == 0:
        print("img/s\t%.1f" % (nproc * steps * batch / elapsed.item()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=nproc)
