#!/usr/bin/python3
"""PyTorch side of bench/amp: ResNet-20 (bench/resnet20_torch.py, the layout of models/resnet.lua) or
torchvision's ResNet-50 training steps in float32 or under torch.autocast('cpu', torch.bfloat16), channels-last
or NCHW; prints `img/s<TAB>v<TAB>mean_img_s<TAB>v<TAB>cpu_ms<TAB>v<TAB>peak_mb<TAB>v` (the fastest
step's and all steps' img/s, CPU time per step) (peak: the profiler's allocator events, None if absent).
usage: amp.py PRECISION(f32|bf16) THREADS STEPS BATCH FORMAT(nhwc|nchw) [MODEL SIZE]"""
import sys
import time

import torch
import torch.nn as nn

prec, threads, steps, batch, fmt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
model_name = sys.argv[6] if len(sys.argv) > 6 else "resnet20"
size = int(sys.argv[7]) if len(sys.argv) > 7 else 28
torch.set_num_threads(threads)
torch.manual_seed(0)

from resnet20_torch import resnet20  # noqa: E402 (bench/, next to this script)

if model_name == "resnet50":
    import torchvision

    model = torchvision.models.resnet50(num_classes=100)
    x = torch.randn(batch, 3, size, size)
else:
    model = resnet20()
    x = torch.randn(batch, 1, size, size)
mf = torch.channels_last if fmt == "nhwc" else torch.contiguous_format
model = model.to(memory_format=mf)
x = x.to(memory_format=mf)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
crit = nn.CrossEntropyLoss()
y = torch.randint(0, 10, (batch,))
lowp = prec == "bf16"


def step():
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=lowp):
        loss = crit(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


for _ in range(3):
    step()  # warm-up: primitive creation, allocator
best, t_all, c_all = float("inf"), time.perf_counter(), time.process_time()
for _ in range(steps):
    t0 = time.perf_counter()
    step()
    best = min(best, time.perf_counter() - t0)
mean, cpu = (time.perf_counter() - t_all) / steps, (time.process_time() - c_all) / steps
peak = None
try:  # one profiled step for the peak (outside the timing)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    cur = top = 0
    for ev in sorted(prof.profiler.function_events, key=lambda e: e.time_range.start):
        cur += ev.cpu_memory_usage if ev.cpu_memory_usage else 0
        top = max(top, cur)
    peak = "%.1f" % (top / 2**20)
except Exception:  # noqa: BLE001 (a profiler without memory events: say None)
    pass
print("img/s\t%.1f\tmean_img_s\t%.1f\tcpu_ms\t%.1f\tpeak_mb\t%s" % (batch / best, batch / mean, cpu * 1e3, peak))
