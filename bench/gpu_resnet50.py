"""PyTorch side of the GPU benchmark in tests/gpu/run.sh: ResNet-50 training img/s (eager AMP bf16 or
f16, channels-last, synthetic data, SGD momentum 0.9, weight decay 1e-4) and torch.matmul TFLOP/s at
8192^3 bf16. Prints `img/s<TAB>value` or `tflops<TAB>value`.

    python3 bench/gpu_resnet50.py resnet50 [bfloat16|float16|float32] [batch] [steps]
    python3 bench/gpu_resnet50.py gemm

torchvision's resnet50 when it is installed, else the same v1.5 layout defined here."""
import sys
import time

import torch
import torch.nn as nn


class Bottleneck(nn.Module):
    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)  # v1.5: stride on the 3x3
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != planes * 4:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes * 4, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes * 4))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += self.downsample(x) if self.downsample is not None else x
        return self.relu(out)


def resnet50():
    try:
        import torchvision
        return torchvision.models.resnet50()
    except ImportError:
        pass
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    c = 64
    for i, (planes, blocks) in enumerate(zip([64, 128, 256, 512], [3, 4, 6, 3])):
        for j in range(blocks):
            layers.append(Bottleneck(c, planes, 2 if (i > 0 and j == 0) else 1))
            c = planes * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 1000)]
    return nn.Sequential(*layers)


def bench_resnet50(dtype, batch, steps):
    torch.backends.cudnn.benchmark = True
    model = resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    crit = nn.CrossEntropyLoss()
    x = torch.randn(batch, 3, 224, 224, device='cuda').to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device='cuda')
    amp = dtype in ('bfloat16', 'float16')
    scaler = torch.amp.GradScaler('cuda', enabled=dtype == 'float16')

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast('cuda', dtype=getattr(torch, dtype), enabled=amp):
            loss = crit(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    print('img/s\t%.1f' % (steps * batch / (time.perf_counter() - t0)))
    print('peak_mib\t%.0f' % (torch.cuda.max_memory_allocated() / 2 ** 20))


def bench_gemm():
    n = 8192
    a = torch.randn(n, n, device='cuda', dtype=torch.bfloat16)
    b = torch.randn(n, n, device='cuda', dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / reps * 1e3
    print('tflops\t%.1f' % (2 * n ** 3 / ms / 1e9))


if __name__ == '__main__':
    what = sys.argv[1] if len(sys.argv) > 1 else 'resnet50'
    if what == 'gemm':
        bench_gemm()
    else:
        bench_resnet50(sys.argv[2] if len(sys.argv) > 2 else 'bfloat16',
                       int(sys.argv[3]) if len(sys.argv) > 3 else 128,
                       int(sys.argv[4]) if len(sys.argv) > 4 else 50)
