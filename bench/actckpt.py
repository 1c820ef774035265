# PyTorch side of bench/actckpt: torchvision's ResNet-50 with torch.utils.checkpoint over its blocks or stages; prints step ms, peak activation MiB.
# usage: actckpt.py POLICY THREADS STEPS BATCH SIZE LAYOUT   (POLICY none|stages|blocks; non-reentrant checkpoint)
# Peak activation memory: the CPU allocator's allocations and frees during one step, from the profiler's memory
# events (profile_memory=True), summed in time order; the step starts holding only parameters, gradients, momentum
# and the batch. Step time comes from steps run without the profiler.
import sys, time
import torch
import torchvision
from torch.utils.checkpoint import checkpoint
from torch.profiler import profile, ProfilerActivity

policy, threads, steps, batch, size, layout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    int(sys.argv[5]), sys.argv[6]
torch.set_num_threads(threads)
torch.manual_seed(0)
model = torchvision.models.resnet50()


class Ckpt(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return checkpoint(self.m, x, use_reentrant=False)


if policy == 'blocks':
    for name in ('layer1', 'layer2', 'layer3', 'layer4'):
        layer = getattr(model, name)
        for i in range(len(layer)):
            layer[i] = Ckpt(layer[i])
elif policy == 'stages':
    for name in ('layer1', 'layer2', 'layer3', 'layer4'):
        setattr(model, name, Ckpt(getattr(model, name)))
fmt = torch.channels_last if layout == 'nhwc' else torch.contiguous_format
model = model.to(memory_format=fmt)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
crit = torch.nn.CrossEntropyLoss()
x = torch.randn(batch, 3, size, size).contiguous(memory_format=fmt)
y = torch.randint(0, 1000, (batch,))


def step():
    opt.zero_grad(set_to_none=False)
    loss = crit(model(x), y)
    loss.backward()
    opt.step()


for _ in range(2):
    step()
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    step()
mem = [(e.start_us(), i, e.nbytes()) for i, e in enumerate(prof.profiler.kineto_results.events()) if e.name() == '[memory]']
live = peak = 0
for _, _, n in sorted(mem):
    live += n
    peak = max(peak, live)
t0, c0 = time.perf_counter(), time.process_time()
for _ in range(steps):
    step()
ms = 1000 * (time.perf_counter() - t0) / steps
cpu_ms = 1000 * (time.process_time() - c0) / steps
print('ms\t%.1f\tcpu_ms\t%.1f\tpeak_mb\t%.1f' % (ms, cpu_ms, peak / 2 ** 20))
