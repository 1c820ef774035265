"""ResNet-20 in PyTorch, the same layout as models/resnet.lua's resnet20 (1 input channel, 10 classes),
for the side-by-side benches (bench/fmnist_cpu.py, bench/ddp_cpu.py)."""
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.downsample(x) if self.downsample is not None else x
        return self.relu(out)


def resnet20():
    layers, c = [nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)], 16
    for i, planes in enumerate([16, 32, 64]):
        for j in range(3):
            layers.append(Block(c, planes, 2 if (i > 0 and j == 0) else 1))
            c = planes
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
    return nn.Sequential(*layers)
