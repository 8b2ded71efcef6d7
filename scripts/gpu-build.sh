#!/usr/bin/env bash
# Builds the CUDA test and bench binaries on this (GPU-less) machine and packs them, stripped and xz'd,
# into .gpu/ (git-ignored; GPU_DIR=.gpu-NAME picks another such folder) for the device machine: run there with
# `bash scripts/gpu-run.sh` (given the same GPU_DIR).
# `scripts/gpu-build.sh [NAME...]` packs only the named test binaries, `glm5-bench` and/or `fatbins` (default:
# all of them). The device call carries at most 64 MiB with the tracked files (~20 MB): about four test
# binaries and the bench per call, so split a run's steps over calls that each pack what they need.
# Needs nvcc 13.0: eval "$(scripts/install-cuda-toolchain.sh)" first. CUDA_COMPUTE_CAP (default 90)
# picks the arch of candle's own kernels; glm5's kernels are always built for sm_90 and sm_120.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_DIR=${GPU_DIR:-.gpu}
case $GPU_DIR in .gpu*) ;; *) echo "GPU_DIR must be .gpu or .gpu-NAME (git-ignored), not $GPU_DIR" >&2; exit 2 ;; esac
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
rm -rf "$GPU_DIR" && mkdir -p "$GPU_DIR"
cargo test --release --features cuda --workspace --no-run  # shows any compile error
cargo test --release --features cuda --workspace --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
wanted = {"sparse_mla_cuda", "dsa_indexer_cuda", "moe_cuda", "rms_norm_cuda", "model_cuda", "multi_gpu", "fp8_nvfp4_cuda", "gguf_matmul_cuda", "gguf_cuda"}
asked = set(sys.argv[1:])
if asked:
    wanted &= asked
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in wanted:
        print(m["target"]["name"], m["executable"])
' "$@" | while read -r name exe; do cp "$exe" "$GPU_DIR/$name"; done
wants() { [ $# -eq 0 ] && return 0; for a in "${@:2}"; do [ "$a" = "$1" ] && return 0; done; return 1; }
cargo build --release --features cuda --workspace --bins
if [ $# -eq 0 ] || wants glm5-bench "$@"; then cp "${CARGO_TARGET_DIR:-target}/release/glm5-bench" "$GPU_DIR"/; fi
for f in "$GPU_DIR"/*; do strip "$f"; xz -T0 -9e "$f"; done
# The kernels' fatbins (of the newest build: the out folder's own mtime does not change on rebuilds), for cuobjdump there.
if [ $# -eq 0 ] || wants fatbins "$@"; then
  cp "$(dirname "$(ls -t "${CARGO_TARGET_DIR:-target}"/release/build/glm5-kernels-*/out/sparse_mla.fatbin | head -1)")"/*.fatbin "$GPU_DIR"/
fi
ls -la "$GPU_DIR"
echo "packed: $(du -cb "$GPU_DIR"/* | tail -1 | cut -f1) bytes; tracked files: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes; a call carries 67108864 at most"
