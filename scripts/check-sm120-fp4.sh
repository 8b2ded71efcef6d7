#!/usr/bin/env bash
# Checks the fatbin of kernels/src/nvfp4_mma_sm120a.cu (the NVFP4 W4A4 GEMM of nvfp4_matmul's prefill rows on
# sm_120) without a GPU: it must hold sm_120a SASS and nothing else, its four kernels, and the block-scaled FP4
# tensor-core MMA (mma ... kind::mxf4nvf4.block_scale.scale_vec::4X ... ue4m3, which the assembler turns into
# OMMA.SF ... E2M1.E2M1.UE4M3.4X) in both GEMM kernels. Prints what it finds; exits non-zero on a miss.
#
# Usage:   scripts/check-sm120-fp4.sh [FATBIN]
#          (default: the newest nvfp4_mma_sm120a.fatbin under $CARGO_TARGET_DIR or target/, from a
#          `cargo build --release --features cuda` of the workspace)
# Env:     CUOBJDUMP_PREFIX  where cuobjdump and nvdisasm are unpacked from PyPI when not on PATH
#                            (default $HOME/.local/cuda-cuobjdump; nothing is installed into the system)
#          PYTHON            python with pip (default python3)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
FATBIN=${1:-$(ls -t "$TARGET"/release/build/glm5-kernels-*/out/nvfp4_mma_sm120a.fatbin \
  "$TARGET"/debug/build/glm5-kernels-*/out/nvfp4_mma_sm120a.fatbin 2>/dev/null | head -1 || true)}
if [[ -z $FATBIN || ! -f $FATBIN ]]; then
  echo "no nvfp4_mma_sm120a.fatbin under $TARGET: build with --features cuda first, or pass the fatbin's path" >&2
  exit 1
fi

# cuobjdump (and the nvdisasm it runs for -sass) from PyPI into a private prefix. The CUDA 13.0 versions are
# not on PyPI; 13.2 reads 13.0's fatbins.
if ! command -v cuobjdump >/dev/null || ! command -v nvdisasm >/dev/null; then
  PREFIX=${CUOBJDUMP_PREFIX:-$HOME/.local/cuda-cuobjdump}
  BIN=$PREFIX/nvidia/cu13/bin
  if [[ ! -x $BIN/cuobjdump || ! -x $BIN/nvdisasm ]]; then
    echo "[check-sm120-fp4] unpacking cuobjdump and nvdisasm 13.2.51 from PyPI into $PREFIX" >&2
    tmp=$(mktemp -d)
    "${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp" \
      nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.2.51 >&2
    mkdir -p "$PREFIX"
    for wheel in "$tmp"/*.whl; do "${PYTHON:-python3}" -m zipfile -e "$wheel" "$PREFIX"; done
    chmod +x "$BIN"/*
    rm -rf "$tmp"
  fi
  export PATH=$BIN:$PATH
fi

echo "fatbin: $FATBIN"
echo "cuobjdump: $(command -v cuobjdump) ($(cuobjdump --version | tail -1))"
fail=0

elves=$(cuobjdump --list-elf "$FATBIN")
ptx=$(cuobjdump --list-ptx "$FATBIN" 2>&1 || true)
echo "$elves"
if ! grep -q 'sm_120a\.cubin' <<<"$elves"; then
  echo "FAIL: no sm_120a SASS in the fatbin"
  fail=1
fi
if grep -v 'sm_120a\.cubin' <<<"$elves" | grep -q cubin; then
  echo "FAIL: SASS for another architecture in the fatbin (it must be sm_120a only)"
  fail=1
fi
if grep -q '\.ptx' <<<"$ptx"; then
  echo "FAIL: PTX in the fatbin (sm_120a code must not be JIT-compiled for another GPU)"
  fail=1
fi

sass=$(cuobjdump -sass "$FATBIN")
for kernel in nvfp4_quantize_rows_f32 nvfp4_quantize_rows_bf16 nvfp4_mma_f32 nvfp4_mma_bf16; do
  if ! grep -q "Function : $kernel\$" <<<"$sass"; then
    echo "FAIL: kernel $kernel is not in the fatbin"
    fail=1
  fi
done

# Block-scaled FP4 MMA instructions per function (OMMA.SF = the FP4 MMA with scale factors).
per_function=$(awk '
  /Function :/ { fn = $3 }
  /OMMA\.SF\./ {
    for (i = 1; i <= NF; i++) if ($i ~ /^OMMA\.SF\./) { count[fn "\t" $i]++ }
  }
  END { for (key in count) print key "\t" count[key] }' <<<"$sass" | sort)
echo "block-scaled FP4 MMA instructions (function, instruction, count):"
if [[ -n $per_function ]]; then
  echo "$per_function" | sed 's/^/  /'
else
  echo "  none"
fi
for kernel in nvfp4_mma_f32 nvfp4_mma_bf16; do
  if ! grep -P "^$kernel\tOMMA\.SF\.16864\.F32\.E2M1\.E2M1\.UE4M3\.4X\t" <<<"$per_function" >/dev/null; then
    echo "FAIL: $kernel has no OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X (m16n8k64, e2m1 x e2m1, ue4m3 scales per 16)"
    fail=1
  fi
done
# The FP4 MMA must not have been emulated or split into other MMA kinds.
others=$(grep -oE '\b[A-Z]*MMA\.[A-Z0-9.]+' <<<"$sass" | grep -v '^OMMA\.SF\.' | sort | uniq -c || true)
if [[ -n $others ]]; then
  echo "other MMA instructions:"
  echo "$others" | sed 's/^/  /'
fi

if [[ $fail == 0 ]]; then
  echo "OK: sm_120a SASS only, with the block-scaled FP4 MMA in both GEMM kernels"
fi
exit $fail
