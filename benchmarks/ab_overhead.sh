#!/usr/bin/env bash
# Trainer overhead before and after a change, interleaved: REV's tree and this one take turns,
# each printing trainer/hand-written from its own benchmarks/trainer_overhead.py (a ratio
# measured side by side in one process, so machine load cancels out of each line).
#
#   benchmarks/ab_overhead.sh REV [runs=3] [strategies="hybrid dp"]
set -euo pipefail
rev=${1:?usage: benchmarks/ab_overhead.sh REV [runs] [strategies]}
runs=${2:-3}
strategies=${3:-hybrid dp}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
old=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$old" >/dev/null 2>&1 || true' EXIT
git -C "$here" worktree add --quiet --detach "$old" "$rev"
ln -s ../callbacks "$old/nnx_spmd_trainer/callbacks"  # the installed package maps it there
for strategy in $strategies; do
  for _ in $(seq "$runs"); do
    for side in before after; do
      tree=$here; [ "$side" = before ] && tree=$old
      ratio=$(cd "$tree" && PYTHONPATH=$tree "$python" benchmarks/trainer_overhead.py \
        --steps 100 --rounds 3 --strategy "$strategy" 2>/dev/null | grep ratio)
      echo "$side $strategy $ratio"
    done
  done
done
