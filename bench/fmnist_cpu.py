#!/usr/bin/python3
"""PyTorch side of bench/fmnist_cpu: ResNet-20 (same layout as models/resnet.lua) training steps on
Fashion-MNIST-shaped batches; prints `img/s<TAB>value`."""
import sys
import time

import torch
import torch.nn as nn

threads, steps, batch, fmt = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
torch.manual_seed(0)


from resnet20_torch import resnet20  # noqa: E402 (bench/, next to this script)

model = resnet20()
mf = torch.channels_last if fmt == "nhwc" else torch.contiguous_format
model = model.to(memory_format=mf)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
crit = nn.CrossEntropyLoss()
x = torch.randn(batch, 1, 28, 28).to(memory_format=mf)
y = torch.randint(0, 10, (batch,))


def step():
    opt.zero_grad()
    loss = crit(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


for _ in range(3):
    step()  # warm-up: primitive creation, allocator
t0 = time.perf_counter()
for _ in range(steps):
    step()
print("img/s\t%.1f" % (steps * batch / (time.perf_counter() - t0)))
