"""bench/compress's PyTorch side: torch 1.13's DDP communication hooks (allreduce, fp16_compress_hook,
bf16_compress_hook, powerSGD_hook) over a model's gradient buckets on N gloo ranks, called the way DDP calls them
(a bucket object with buffer(), gradients(), index(), is_last()); random gradients, R timed rounds.
Prints RESULT lines like bench/compress.lua's. usage: compress.py MODEL SPECS REPEAT RANKS THREADS"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(name):
    torch.manual_seed(1)
    if name == 'resnet18':
        return resnet18()
    from resnet20_torch import resnet20
    return resnet20()


def resnet18():
    """torchvision's resnet18 (1000 classes) layer for layer: only the gradient shapes matter here, and Debian's
    python3-torchvision may be missing."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, c, stride):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, c, 3, stride, 1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
            self.downsample = (nn.Sequential(nn.Conv2d(cin, c, 1, stride, bias=False), nn.BatchNorm2d(c))
                               if stride != 1 or cin != c else None)

    layers, c = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)], 64
    for i, planes in enumerate([64, 128, 256, 512]):
        for j in range(2):
            layers.append(Block(c, planes, 2 if (i > 0 and j == 0) else 1))
            c = planes
    layers.append(nn.Linear(512, 1000))
    return nn.Sequential(*layers)


class Bucket:
    """What DDP hands a hook: a flat buffer and per-parameter views of it."""

    def __init__(self, index, params, last):
        n = sum(p.numel() for p in params)
        self._buf = torch.empty(n)
        self._grads, off = [], 0
        for p in params:
            self._grads.append(self._buf[off:off + p.numel()].view_as(p))
            off += p.numel()
        self._index, self._last, self._params = index, last, params

    def buffer(self): return self._buf
    def set_buffer(self, b): self._buf = b
    def gradients(self): return self._grads
    def parameters(self): return self._params
    def index(self): return self._index
    def is_last(self): return self._last


def buckets_of(model):
    """DDP's plan: parameters in reverse order, the first bucket 1 MB, then 25 MB."""
    params = [p for p in model.parameters()][::-1]
    out, cur, size, cap = [], [], 0, 1 << 20
    for p in params:
        cur.append(p)
        size += p.numel() * 4
        if size >= cap:
            out.append(cur)
            cur, size, cap = [], 0, 25 << 20
    if cur:
        out.append(cur)
    return [Bucket(i, ps_, i == len(out) - 1) for i, ps_ in enumerate(out)]


COUNT = {'bytes': 0, 'calls': 0}
_real_all_reduce = dist.all_reduce


def counting_all_reduce(t, *a, **k):
    COUNT['bytes'] += t.numel() * t.element_size()
    COUNT['calls'] += 1
    return _real_all_reduce(t, *a, **k)


def hook_of(spec):
    if spec == 'none':
        return None, dh.allreduce_hook
    if spec == 'fp16':
        return None, dh.fp16_compress_hook
    if spec == 'bf16':
        return None, dh.bf16_compress_hook
    if spec.startswith('powersgd:'):
        st = ps.PowerSGDState(process_group=None, matrix_approximation_rank=int(spec.split(':')[1]),
                              start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        return st, ps.powerSGD_hook
    raise SystemExit('bench/compress.py: no torch hook for ' + spec)


def run(rank, world, name, specs, repeat, threads, port):
    torch.set_num_threads(threads)
    os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'] = '127.0.0.1', str(port)
    dist.init_process_group('gloo', rank=rank, world_size=world)
    dist.all_reduce = counting_all_reduce  # the hooks call dist.all_reduce: count what they hand over
    model = build(name)
    g = torch.Generator().manual_seed(7 + rank)
    for spec in specs:
        state, hook = hook_of(spec)
        bs = buckets_of(model)
        sources = [torch.randn(b.buffer().numel(), generator=g) * 1e-2 for b in bs]
        dense = sum(b.buffer().numel() for b in bs) * 4

        def one_round():
            for b, s in zip(bs, sources):
                b.set_buffer(b._buf)
                b._buf.copy_(s)
            if state is not None:
                # powerSGD_hook issues its Q all-reduce from a gloo callback thread: with several buckets in flight
                # the ranks' collective orders race (gloo aborts on a size mismatch), so one bucket at a time
                for b in bs:
                    hook(state, b).wait()
                return
            futs = [hook(state, b) for b in bs]
            for f in futs:
                f.wait()

        for _ in range(4):  # PowerSGD starts at its 2nd iteration; buffers and Q made
            one_round()
        COUNT['bytes'] = COUNT['calls'] = 0
        times = torch.zeros(repeat, dtype=torch.float64)
        for r in range(repeat):
            dist.barrier()
            t0 = time.perf_counter()
            one_round()
            times[r] = time.perf_counter() - t0
        b, calls = COUNT['bytes'] / repeat, COUNT['calls'] / repeat
        _real_all_reduce(times, op=dist.ReduceOp.MAX)
        med = times.sort().values[(repeat - 1) // 2].item()
        if rank == 0:
            print('RESULT %s %s %d %d %d %.3f -' % (name, spec, dense, b, calls, med * 1e3), flush=True)
    dist.destroy_process_group()


if __name__ == '__main__':
    name, specs, repeat, world, threads = sys.argv[1], sys.argv[2].split(','), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    port = 29000 + os.getpid() % 1000
    mp.spawn(run, args=(world, name, specs, repeat, threads, port), nprocs=world, join=True)
