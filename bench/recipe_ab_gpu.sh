#!/usr/bin/env bash
# The nano-vllm recipe (bench/e2e_gpu.py --only c, no HF baseline) of a base commit and of
# the working tree in turn on one GPU, same call (the tree's bench script drives both
# sides' engine code): base, tree, base, tree for seed 0, then the tree for each extra
# seed. Each run is a fresh process; results land in OUT/<label>/.
#
#     OUT=/tmp/out bash bench/recipe_ab_gpu.sh BASE_COMMIT [EXTRA_SEED ...]
set -euo pipefail
base_commit=$1; shift
out=${OUT:?set OUT}
tree=$PWD
source bench/device_env.sh  # NCCL/NVLS settings, the carried wheels into /tmp/site
base=/tmp/kvpilot-base
rm -rf "$base"
git worktree add --detach "$base" "$base_commit" >/dev/null 2>&1 || {
    git worktree prune; git worktree add --detach "$base" "$base_commit"; }
run() {  # engine-code dir, label, seed
    (cd "$1" && PYTHONPATH="$1/operator:$1/engine:$1/kernels:$1/cli:/tmp/site" \
        python3 "$tree/bench/e2e_gpu.py" --out "$out/$2" --only c --hf-requests 0 --seed "$3" \
        | grep -E '^\| c\)' || true)
}
for round in 1 2; do
    echo "base $base_commit round $round:"; run "$base" "base-$round" 0
    echo "tree round $round:"; run "$tree" "tree-$round" 0
done
for seed in "$@"; do
    echo "tree seed $seed:"; run "$tree" "tree-seed$seed" "$seed"
done
git worktree remove --force "$base"
