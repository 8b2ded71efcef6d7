#!/usr/bin/env bash
# Packs a variant for a same-run comparison on the GPU machine: builds glm5-bench and the kernel test
# binaries TESTS (default: sparse_mla_cuda dsa_indexer_cuda) at git ref REF (a branch or commit; the working
# tree must be clean, and is put back where it was) and adds them to .gpu/ as glm5-bench-NAME and TEST-NAME
# (xz'd). Run after scripts/gpu-build.sh, which empties .gpu/. On the GPU machine:
# `bash scripts/gpu-run.sh variants`. The device tool carries at most 64 MiB: each binary adds ~6-7 MB; drop
# .gpu/model_cuda.xz and .gpu/multi_gpu.xz when packing several.
# Usage: bash scripts/gpu-variant.sh NAME REF [TESTS]   (e.g. ... v8s my-branch sparse_mla_cuda)
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: gpu-variant.sh NAME REF}
ref=${2:?usage: gpu-variant.sh NAME REF}
tests=${3:-sparse_mla_cuda dsa_indexer_cuda}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
[ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "gpu-variant.sh: commit or stash first" >&2; exit 1; }
back=$(git symbolic-ref --short -q HEAD || git rev-parse HEAD)
git checkout -q "$ref"
trap 'git checkout -q "$back"' EXIT
mkdir -p .gpu
cargo build --release --features cuda -p glm5-bench
cp "${CARGO_TARGET_DIR:-target}/release/glm5-bench" ".gpu/glm5-bench-$name"
cargo test --release --features cuda -p glm5-ops $(printf -- '--test %s ' $tests) --no-run \
  --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
' | while read -r test exe; do cp "$exe" ".gpu/$test-$name"; done
for f in ".gpu/glm5-bench-$name" $(printf -- ".gpu/%s-$name " $tests); do
  strip "$f"; xz -T0 -6 -f "$f"
done
ls -la .gpu/*-"$name".xz
