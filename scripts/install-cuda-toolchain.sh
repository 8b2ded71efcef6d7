#!/usr/bin/env bash
# Install a CUDA 13.0 build toolchain (nvcc, headers, link libraries) from PyPI
# into a fixed prefix, on a machine with no GPU, no driver and no CUDA toolkit.
# Enough to build candle-core 0.11.1 with feature "cuda" (candle-kernels via
# cudaforge + cudarc 0.19 with dynamic-linking) and custom .cu kernels.
#
# Usage:   eval "$(scripts/install-cuda-toolchain.sh)"     (from the repository root)
#          (progress goes to stderr; stdout is only the `export` lines)
# Env:     CUDA_PYPI_PREFIX   install prefix         (default $HOME/.local/cuda-pypi)
#          CUDA_COMPUTE_CAP   arch for candle-kernels (default 90 -> sm_90a)
#          PYTHON             python with pip        (default python3)
#          FORCE=1            reinstall even if present
# Needs:   python3 + pip reaching PyPI, gcc/g++ (host compiler for nvcc).
set -euo pipefail

PREFIX=${CUDA_PYPI_PREFIX:-$HOME/.local/cuda-pypi}
PY=${PYTHON:-python3}
# Pinned to CUDA 13.0 (matches driver 580 / nvcc 13.0 on the H200 machines).
PKGS=(
  nvidia-cuda-nvcc==13.0.88     # bin/nvcc ptxas fatbinary nvlink cudafe++ bin2c
  nvidia-cuda-crt==13.0.88      # include/crt/*
  nvidia-nvvm==13.0.88          # nvvm/bin/cicc, libdevice, libnvvm
  nvidia-cuda-runtime==13.0.96  # include/cuda_runtime.h cuda.h cuda_bf16.h ..., lib/libcudart.so.13
  nvidia-cuda-cccl==13.0.85     # include/cccl (cub/thrust/libcu++; nvcc adds -isystem itself)
  nvidia-cublas==13.0.2.14      # lib/libcublas.so.13 libcublasLt.so.13 (link time only)
  nvidia-curand==10.4.0.35      # lib/libcurand.so.10                  (link time only)
  nvidia-cuda-nvrtc==13.0.88    # lib/libnvrtc.so.13                   (link time only)
)
SITE=$PREFIX/site
ROOT=$SITE/nvidia/cu13
log() { echo "[install-cuda-toolchain] $*" >&2; }

if [[ ! -x $ROOT/bin/nvcc || ! -e $ROOT/lib/libcublasLt.so.13 || ${FORCE:-0} == 1 ]]; then
  log "pip installing ${#PKGS[@]} wheels into $SITE (~1.2 GB unpacked)"
  rm -rf "$SITE"
  mkdir -p "$SITE"
  # ONE pip call: `pip --target` skips a top-level dir (nvidia/) that already
  # exists, so installing the wheels in two calls silently drops the second set.
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --quiet --disable-pip-version-check --no-deps \
      --target "$SITE" "${PKGS[@]}" >&2
else
  log "already installed in $ROOT (FORCE=1 to reinstall)"
fi

# Unversioned names for the linker (-lcudart -lcublas ...): the wheels ship only .so.N.
cd "$ROOT/lib"
for l in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
  ln -sfn "$l" "${l%.so.*}.so"
done

# libcuda.so link stub (no wheel ships one). SONAME libcuda.so.1 so that the
# binary loads the real driver library at run time. Never put it on LD_LIBRARY_PATH.
mkdir -p "$ROOT/lib/stubs"
if [[ ! -e $ROOT/lib/stubs/libcuda.so || ${FORCE:-0} == 1 ]]; then
  tmp=$(mktemp -d)
  {
    # every driver-API function name, after cuda.h's macro renaming (cuCtxCreate -> cuCtxCreate_v4 ...)
    gcc -E -P -x c -I"$ROOT/include" "$ROOT/include/cuda.h" \
      | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( \t'
    grep -ohE 'CUDAAPI[[:space:]]+cu[A-Z][A-Za-z0-9_]*' "$ROOT/include/cuda.h" | awk '{print $2}'
    printf '%s\n' cuProfilerInitialize cuProfilerStart cuProfilerStop   # cudaProfiler.h is not in the wheels
  } | sort -u | awk '{print "void " $1 "(void) {}"}' > "$tmp/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib/stubs/libcuda.so" "$tmp/libcuda_stub.c"
  log "libcuda stub: $(wc -l < "$tmp/libcuda_stub.c") symbols -> $ROOT/lib/stubs/libcuda.so"
  rm -rf "$tmp"
fi

"$ROOT/bin/nvcc" --version | tail -2 >&2

cat <<EOT
export CUDA_ROOT=$ROOT
export CUDA_HOME=$ROOT
export CUDA_PATH=$ROOT
export PATH=$ROOT/bin:\$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
EOT
