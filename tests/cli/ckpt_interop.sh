#!/usr/bin/env bash
# dlua.ckpt and PyTorch: a torchvision ResNet-18 saved by the safetensors package loads strictly into models/resnet.lua and gives torchvision's logits; dlua's files load with safetensors (and into torchvision), their checksums agree with zlib.
# usage: ckpt_interop.sh path/to/dlua build-dir [arch]   (arch: resnet18 by default; resnet50 works, slower)
set -u
DLUA=$(readlink -f "${1:?usage: ckpt_interop.sh path/to/dlua build-dir [arch]}")
BUILD=$(readlink -f "${2:?usage: ckpt_interop.sh path/to/dlua build-dir [arch]}")
arch=${3:-resnet18}
here=$(cd "$(dirname "$0")" && pwd)
py=${DLUA_TEST_PYTHON:-/usr/bin/python3}  # another interpreter only to test the skip
if ! [ -x $py ] || ! $py -c 'import torch, torchvision' 2>/dev/null; then
  echo "skip - $py cannot import torch and torchvision (apt-get install python3-torch python3-torchvision)"
  exit 0
fi
# safetensors from PyPI, in a venv that sees Debian's torch
venv="$BUILD/ckpt-pyvenv"
if ! "$venv/bin/python" -c 'import safetensors.torch' 2>/dev/null; then
  rm -rf "$venv"
  if ! $py -m venv --system-site-packages "$venv" >/dev/null 2>&1; then
    echo "skip - cannot make a venv with $py (apt-get install python3-venv)"
    exit 0
  fi
  if ! timeout 300 "$venv/bin/pip" install -q safetensors >"$BUILD/ckpt-pyvenv.log" 2>&1; then
    echo "skip - pip cannot install safetensors (no network?): $(tail -1 "$BUILD/ckpt-pyvenv.log")"
    rm -rf "$venv"
    exit 0
  fi
fi
work=$(mktemp -d /tmp/dlua-ckpt-interop.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail=0
out=$("$venv/bin/python" "$here/ckpt_interop.py" make "$work" "$arch" 2>&1) || { echo "FAIL - the torchvision fixture: $out"; exit 1; }
out=$(cd "$here/../.." && "$DLUA" "$here/ckpt_interop.lua" "$work" "$arch" 2>&1); rc=$?
if [ $rc = 0 ]; then echo "ok   - $out" | head -1; else echo "FAIL - torchvision's $arch into dlua"; echo "$out" | sed 's/^/       /'; fail=1; fi
if [ $rc = 0 ]; then
  out=$("$venv/bin/python" "$here/ckpt_interop.py" check "$work" "$arch" 2>&1)
  if [ $? = 0 ]; then echo "ok   - $out"; else echo "FAIL - dlua's files in PyTorch"; echo "$out" | sed 's/^/       /'; fail=1; fi
fi
exit $fail
