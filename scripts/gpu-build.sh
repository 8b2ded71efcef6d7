#!/usr/bin/env bash
# Builds the CUDA test and bench binaries on this (GPU-less) machine and packs them, stripped and xz'd,
# into .gpu/ (git-ignored) for the device machine: run there with `bash scripts/gpu-run.sh`.
# Needs nvcc 13.0: eval "$(scripts/install-cuda-toolchain.sh)" first. CUDA_COMPUTE_CAP (default 90)
# picks the arch of candle's own kernels; glm5's kernels are always built for sm_90 and sm_120.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
rm -rf .gpu && mkdir -p .gpu
cargo test --release --features cuda --workspace --no-run  # shows any compile error
cargo test --release --features cuda --workspace --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
wanted = {"sparse_mla_cuda", "dsa_indexer_cuda", "moe_cuda", "rms_norm_cuda", "model_cuda", "multi_gpu", "fp8_nvfp4_cuda", "iq_matmul_cuda", "gguf_cuda"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in wanted:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do cp "$exe" ".gpu/$name"; done
cargo build --release --features cuda --workspace --bins
cp "${CARGO_TARGET_DIR:-target}/release/glm5-bench" .gpu/
for f in .gpu/*; do strip "$f"; xz -T0 -6 "$f"; done
# The kernels' fatbins (of the newest build: the out folder's own mtime does not change on rebuilds), for cuobjdump there.
cp "$(dirname "$(ls -t "${CARGO_TARGET_DIR:-target}"/release/build/glm5-kernels-*/out/sparse_mla.fatbin | head -1)")"/*.fatbin .gpu/
ls -la .gpu
