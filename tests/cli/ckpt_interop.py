# PyTorch's side of tests/cli/ckpt_interop.sh: torchvision ResNet fixtures written with the safetensors package, and dlua's files read back with it.
#   python ckpt_interop.py make DIR ARCH     -> DIR/tv.safetensors (state dict), DIR/io.safetensors (input, logits)
#   python ckpt_interop.py check DIR ARCH    <- DIR/dlua_model.safetensors, DIR/dlua_io.safetensors, DIR/dtypes.safetensors, DIR/ckpt
import json
import os
import sys
import zlib

import torch
import torchvision
from safetensors.torch import load_file, save_file


def model(arch):
    return getattr(torchvision.models, arch)(weights=None)


def make(d, arch):
    torch.manual_seed(0)
    m = model(arch)
    # running statistics that are not the defaults, so evaluation uses them for real
    for mod in m.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.2, 0.2)
            mod.running_var.uniform_(0.5, 1.5)
            mod.weight.data.uniform_(0.5, 1.5)
            mod.bias.data.uniform_(-0.2, 0.2)
            mod.num_batches_tracked.fill_(7)
    m.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        y = m(x)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, os.path.join(d, "tv.safetensors"), metadata={"from": "torchvision"})
    save_file({"x": x, "logits": y}, os.path.join(d, "io.safetensors"))
    print("made %s: %d tensors" % (arch, len(m.state_dict())))


def check_crcs(path):
    """dlua's per-tensor CRC32s against zlib's over the bytes, the file parsed here by hand (not by safetensors)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 64 == 0, "%s: data starts at byte %d, not a multiple of 64" % (path, 8 + n)
    header = json.loads(raw[8:8 + n])
    crcs = json.loads(header["__metadata__"]["dlua.crc32"])
    names = [k for k in header if k != "__metadata__"]
    assert set(crcs) == set(names), (path, sorted(set(crcs) ^ set(names)))
    for k in names:
        b, e = header[k]["data_offsets"]
        got = "%08x" % (zlib.crc32(raw[8 + n + b:8 + n + e]) & 0xFFFFFFFF)
        assert got == crcs[k], "%s: tensor %s crc32 %s, the file says %s" % (path, k, got, crcs[k])
        size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "U8": 1, "BOOL": 1}[header[k]["dtype"]]
        assert b % size == 0, "%s: tensor %s at data byte %d is not aligned to %d" % (path, k, b, size)
    return len(crcs)


def check(d, arch):
    # the model file dlua wrote loads into torchvision strictly and gives dlua's logits
    sd = load_file(os.path.join(d, "dlua_model.safetensors"))
    m = model(arch)
    m.load_state_dict(sd, strict=True)
    m.eval()
    io = load_file(os.path.join(d, "dlua_io.safetensors"))
    with torch.no_grad():
        y = m(io["x"])
    err = (y - io["logits"]).abs().max().item()
    scale = 1 + io["logits"].abs().max().item()
    assert err <= 2e-4 * scale, "torchvision on dlua's weights: logits differ from dlua's by %g (scale %g)" % (err, scale)
    n = check_crcs(os.path.join(d, "dlua_model.safetensors"))
    # every dtype dlua has: values recomputed here from the formula dlua used
    dt = load_file(os.path.join(d, "dtypes.safetensors"))
    base = torch.arange(24, dtype=torch.float64).view(2, 3, 4) - 11.5
    want = {"f32": base.float(), "f64": base, "f16": base.half(), "bf16": base.bfloat16(),
            "i32": base.floor().int(), "i64": base.floor().long() * 1000000007, "u8": (base + 12).floor().to(torch.uint8),
            "b": base > 0, "t": base.float().transpose(0, 2).contiguous(), "cl": base.float().view(1, 2, 3, 4).contiguous()}
    for k, w in want.items():
        assert dt[k].dtype == w.dtype, "%s: dtype %s, expected %s" % (k, dt[k].dtype, w.dtype)
        assert dt[k].shape == w.shape, "%s: shape %s, expected %s" % (k, tuple(dt[k].shape), tuple(w.shape))
        assert torch.equal(dt[k], w), "%s: values differ" % k
    check_crcs(os.path.join(d, "dtypes.safetensors"))
    # a whole dlua checkpoint: its model file is a plain state dict as well
    ck = os.path.join(d, "ckpt")
    step = open(os.path.join(ck, "latest")).read().strip()
    msd = load_file(os.path.join(ck, step, "model.safetensors"))
    model(arch).load_state_dict(msd, strict=True)
    print("python: dlua's %s loads into torchvision (logits within %.2g), %d checksums agree with zlib, %d dtypes match"
          % (arch, err, n, len(want)))


if __name__ == "__main__":
    {"make": make, "check": check}[sys.argv[1]](sys.argv[2], sys.argv[3])
