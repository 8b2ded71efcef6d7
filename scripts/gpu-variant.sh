#!/usr/bin/env bash
# Packs a variant for a same-run comparison on the GPU machine: builds glm5-bench and the kernel test binaries
# at git ref REF (a branch or commit; the working tree must be clean, and is put back where it was) and adds
# them to .gpu/ as glm5-bench-NAME, sparse_mla_cuda-NAME and dsa_indexer_cuda-NAME (xz'd). Run after
# scripts/gpu-build.sh, which empties .gpu/. On the GPU machine: `bash scripts/gpu-run.sh variants`.
# Usage: bash scripts/gpu-variant.sh NAME REF
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: gpu-variant.sh NAME REF}
ref=${2:?usage: gpu-variant.sh NAME REF}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
[ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "gpu-variant.sh: commit or stash first" >&2; exit 1; }
back=$(git symbolic-ref --short -q HEAD || git rev-parse HEAD)
git checkout -q "$ref"
trap 'git checkout -q "$back"' EXIT
mkdir -p .gpu
cargo build --release --features cuda --bin glm5-bench
cp target/release/glm5-bench ".gpu/glm5-bench-$name"
cargo test --release --features cuda -p glm5-ops --test sparse_mla_cuda --test dsa_indexer_cuda --no-run \
  --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
' | while read -r test exe; do cp "$exe" ".gpu/$test-$name"; done
for f in ".gpu/glm5-bench-$name" ".gpu/sparse_mla_cuda-$name" ".gpu/dsa_indexer_cuda-$name"; do
  strip "$f"; xz -T0 -6 -f "$f"
done
ls -la .gpu/*-"$name".xz
