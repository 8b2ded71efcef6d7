#!/usr/bin/env python3
"""Writes kernels/src/iq_grids.rs: the lookup tables of llama.cpp's i-quant formats (IQ1_S/M, IQ2_XXS/XS/S,
IQ3_XXS/S, IQ4_NL/XS), taken from gguf-py (the `gguf` package on PyPI, ggml's own Python reader), so the
Rust reference and the CUDA kernels (kernels/build.rs writes them into a header) use exactly ggml's values.

    python3 -m pip install gguf && python3 scripts/gen_iq_grids.py > kernels/src/iq_grids.rs
"""
import numpy as np
from gguf import quants

HEADER = """\
//! The lookup tables of llama.cpp's i-quant GGUF formats, exactly as ggml defines them (`ggml-common.h`; ggml
//! is MIT-licensed, Copyright (c) 2023-2024 The ggml authors). Written by `scripts/gen_iq_grids.py` from
//! gguf-py: do not edit. One source for the CPU reference (`glm5_ops::gguf_matmul`) and the CUDA kernels
//! (`kernels/build.rs` writes them into `glm5_iq_grids.h`).
//!
//! A grid entry packs 8 (u64) or 4 (u32) byte values, value `j` in byte `j` (little-endian): unsigned
//! magnitudes for IQ2/IQ3, two's-complement -1/0/1 for IQ1.
"""


def grid(cls):
    cls.init_grid()
    g = np.asarray(cls.grid).reshape(cls.grid_shape)
    return g


def packed(rows, signed):
    out = []
    for row in rows:
        v = 0
        for j, x in enumerate(row):
            b = int(round(float(x)))
            if signed:
                b &= 0xFF
            assert 0 <= b <= 0xFF
            v |= b << (8 * j)
        out.append(v)
    return out


def table(name, ty, values, per_line, width):
    lines = [f"pub const {name}: [{ty}; {len(values)}] = ["]
    for i in range(0, len(values), per_line):
        lines.append("    " + " ".join(f"0x{v:0{width}x}," for v in values[i:i + per_line]))
    lines.append("];")
    return "\n".join(lines)


def main():
    parts = [HEADER]
    kv = quants.IQ4_NL.kvalues
    parts.append("/// IQ4_NL / IQ4_XS: the 16 non-linear 4-bit values.\n"
                 f"pub const KVALUES_IQ4NL: [i8; 16] = [{', '.join(str(v) for v in kv)}];")
    ks = list(quants.IQ2_XXS.ksigns)
    parts.append("/// IQ2_XXS / IQ2_XS / IQ3_XXS: 7 stored sign bits -> 8 signs (bit j set: value j negative; the 8th\n"
                 "/// makes the count of negatives even).\n" + table("KSIGNS_IQ2XS", "u8", ks, 16, 2))
    for name, cls, ty, width, signed in [
        ("IQ2XXS_GRID", quants.IQ2_XXS, "u64", 16, False),
        ("IQ2XS_GRID", quants.IQ2_XS, "u64", 16, False),
        ("IQ2S_GRID", quants.IQ2_S, "u64", 16, False),
        ("IQ3XXS_GRID", quants.IQ3_XXS, "u32", 8, False),
        ("IQ3S_GRID", quants.IQ3_S, "u32", 8, False),
        ("IQ1S_GRID", quants.IQ1_S, "u64", 16, True),
    ]:
        values = packed(grid(cls), signed)
        parts.append(f"/// {cls.__name__}'s grid.\n" + table(name, ty, values, 4 if ty == "u64" else 8, width))
    print("\n\n".join(parts))


if __name__ == "__main__":
    main()
