#!/usr/bin/python3
"""torchvision side of bench/loader: ImageFolder + RandomResizedCrop(224) + flip + normalise through
torch.utils.data.DataLoader with the same worker count; and `check`, which compares dlua's pixels
with torchvision's (Pillow) for the same crops.
usage: loader.py run ROOT WORKERS BATCH EPOCHS      -> prints img/s<TAB>best<TAB>CPU s/img (main + workers, best epoch)
       loader.py check DUMP                          -> max/mean pixel difference
Needs Debian's python3-torchvision (apt-get install python3-torchvision)."""
import os
import sys
import time

try:
    import torch
    import torchvision
    from torchvision import transforms
    import torchvision.transforms.functional as F
except ImportError:
    sys.exit("bench/loader.py: needs Debian's python3-torchvision (apt-get install python3-torchvision)")

mode = sys.argv[1]
if mode == 'run':
    root, workers, batch, epochs = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    tf = transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = torchvision.datasets.ImageFolder(root, transform=tf)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                         persistent_workers=workers > 0)
    def cpu_now():
        # This process plus its (persistent) worker processes, from /proc: workers are not
        # reaped children until the end, so os.times() alone would miss them.
        t = os.times()
        total = t.user + t.system
        for w in getattr(getattr(loader, '_iterator', None), '_workers', None) or []:
            try:
                with open(f'/proc/{w.pid}/stat') as f:
                    fields = f.read().rsplit(')', 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')
            except (OSError, IndexError, ValueError):
                pass
        return total

    best, best_cpu = 0.0, float('inf')
    for epoch in range(epochs):
        t0, c0, n = time.perf_counter(), cpu_now(), 0
        for x, y in loader:
            n += x.shape[0]
        best = max(best, n / (time.perf_counter() - t0))
        # The first epoch starts the workers (imports included): counted only when alone.
        if epoch > 0 or epochs == 1 or workers == 0:
            best_cpu = min(best_cpu, (cpu_now() - c0) / n)
    print(f'img/s\t{best:.1f}\t{best_cpu:.6f}')
elif mode == 'check':
    import numpy as np
    from PIL import Image
    dump = sys.argv[2]
    raw = np.fromfile(dump, dtype=np.uint8).reshape(-1, 2, 224, 224, 3)
    rows = [line.rstrip('\n').split('\t') for line in open(dump + '.txt')]
    center = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224)])
    worst = {'center': 0, 'rrc': 0}
    total = {'center': 0.0, 'rrc': 0.0}
    exact = {'center': 0, 'rrc': 0}
    for k, (path, top, left, h, w) in enumerate(rows):
        img = Image.open(path).convert('RGB')
        ref = {'center': np.asarray(center(img)),
               'rrc': np.asarray(F.resized_crop(img, int(top), int(left), int(h), int(w), [224, 224]))}
        for j, name in enumerate(('center', 'rrc')):
            d = np.abs(raw[k, j].astype(np.int16) - ref[name].astype(np.int16))
            worst[name] = max(worst[name], int(d.max()))
            total[name] += float(d.mean())
            exact[name] += int((d == 0).all())
    n = len(rows)
    for name in ('center', 'rrc'):
        print(f'{name}\timages {n}\tmax |diff| {worst[name]}\tmean |diff| {total[name] / n:.4f}\t'
              f'identical images {exact[name]}/{n}')
else:
    sys.exit(__doc__)
