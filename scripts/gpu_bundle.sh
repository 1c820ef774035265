#!/usr/bin/env bash
# Builds what tests/gpu/run.sh needs on a GPU machine without network, apt or a compiler for our C
# dependencies: bundle/dlua-gpu.tar.xz (at most 64 MiB), holding
#   dlua, tests/test_caching_alloc    built here with the CUDA backend (sm_80, sm_90 + PTX)
#   lib/                              the shared libraries they need that are not glibc (oneDNN, gloo, ...)
#   sys/                              this machine's glibc and dynamic loader, used only when the GPU
#                                     machine's own glibc is older than the binary needs
# The Lua tree is not in it: run.sh runs from the repository copy beside it. cuDNN, cuBLAS and NCCL are
# not in it either: they are loaded at run time from the CUDA toolkit or Python's nvidia/*/lib folders.
#   scripts/gpu_bundle.sh [build-dir]     (default build-gpu-bundle)
# Then: tar travels as bundle/ (the device tool's carry), and tests/gpu/run.sh unpacks it into build-gpu.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-gpu-bundle}
out=${DLUA_BUNDLE_OUT:-$root/bundle}  # DLUA_BUNDLE_OUT: elsewhere (tests)
limit=$((64 * 1024 * 1024))
cd "$root"
bash scripts/deps.sh >/dev/null
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
# No MPI in it: Open MPI loads its components from its own install path at MPI_Init, which a bundle cannot
# carry, and the GPU machine has no mpirun to start ranks with.
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DDLUA_CUDA=ON -DDLUA_MPI=OFF \
    -DCMAKE_CUDA_ARCHITECTURES="80-real;90" >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target dlua test_caching_alloc >/dev/null

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/tests" "$stage/lib" "$stage/sys"
strip -o "$stage/dlua" "$build/dlua"
strip -o "$stage/tests/test_caching_alloc" "$build/tests/test_caching_alloc"

# Every resolved dependency: glibc's own libraries to sys/, the rest to lib/.
is_glibc() {
  case "$(basename "$1")" in
    ld-linux*.so.* | libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | libresolv.so.* | libutil.so.*) return 0 ;;
  esac
  return 1
}
for bin in "$build/dlua" "$build/tests/test_caching_alloc"; do
  ldd "$bin" | awk '/=> \// {print $3} /^\t\/lib/ {print $1}' | while read -r lib; do
    dest=lib
    is_glibc "$lib" && dest=sys
    [ -e "$stage/$dest/$(basename "$lib")" ] || cp -L "$lib" "$stage/$dest/"
  done
done
# glibc's stubs that dlopen'd libraries (cuDNN, NCCL) may still name
cache=$(ldconfig -p)
for l in libpthread.so.0 libdl.so.2 librt.so.1; do
  p=$(awk -v n="$l" '$1 == n && /x86-64/ {print $NF; exit}' <<<"$cache")
  if [ -n "$p" ] && [ ! -e "$stage/sys/$l" ]; then cp -L "$p" "$stage/sys/"; fi
done
strip --strip-unneeded "$stage"/lib/*.so* 2>/dev/null || true
git -C "$root" rev-parse --short HEAD >"$stage/COMMIT" 2>/dev/null || echo unknown >"$stage/COMMIT"

mkdir -p "$out"
tmp=$out/dlua-gpu.tar.xz.part
tar -C "$stage" -cf - . | xz -T0 -6 >"$tmp"
size=$(stat -c %s "$tmp")
if [ "$size" -gt "$limit" ]; then
  rm -f "$tmp"
  echo "gpu_bundle: $size bytes, over the 64 MiB limit" >&2
  exit 1
fi
mv "$tmp" "$out/dlua-gpu.tar.xz"
echo "$out/dlua-gpu.tar.xz: $((size / 1024 / 1024)) MiB ($(ls "$stage/lib" | wc -l) libraries, glibc $(ldd --version | awk 'NR==1 {print $NF}'), commit $(cat "$stage/COMMIT"))"
