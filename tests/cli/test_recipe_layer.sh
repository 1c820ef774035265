#!/usr/bin/env bash
# dlua.recipe from the command line: recipes/custom_loop.lua (a hand-written loop on the trainer) on 1 and 2 ranks.
# usage: test_recipe_layer.sh path/to/dlua
set -u
DLUA=$(readlink -f "${1:?usage: test_recipe_layer.sh path/to/dlua}")
cd "$(dirname "$0")/../.."
passed=0
failed=0
check() { # name, condition-result, detail
  if [ "$2" = 0 ]; then passed=$((passed + 1)); echo "ok   - $1"; else failed=$((failed + 1)); echo "FAIL - $1"; echo "$3" | sed 's/^/       /'; fi
}
fake=$(mktemp -d)
trap 'rm -rf "$fake"' EXIT
"$DLUA" tests/data/fake_fashion_mnist.lua "$fake" 512 100
export DLUA_FASHION_MNIST_ROOT=$fake CUDA_VISIBLE_DEVICES=

out=$(timeout 120 "$DLUA" recipes/custom_loop.lua --steps 6 --batch 32 --threads 1 2>&1); rc=$?
[ $rc = 0 ] && [ "$(grep -c '^step ' <<<"$out")" -ge 2 ] && grep -q "suggested lr" <<<"$out" \
  && grep -q "step   1  lr 1.000e-05" <<<"$out"
check "custom_loop: the lr range test runs on the trainer, from --lr-min up, and names an lr" $? "rc=$rc: $out"

out=$(timeout 180 "$DLUA" --nproc 2 recipes/custom_loop.lua --steps 4 --batch 16 --threads 1 2>&1); rc=$?
[ $rc = 0 ] && grep -q "on 2 rank(s)" <<<"$out" && grep -q "suggested lr" <<<"$out" && ! grep -q '^\[1\]' <<<"$out"
check "custom_loop under --nproc 2: DDP through the trainer, rank 0 alone prints" $? "rc=$rc: $out"

echo "$passed passed, $failed failed"
[ $failed = 0 ]
