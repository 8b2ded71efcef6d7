#!/usr/bin/env python3
"""Counts one tile's instructions in a wgmma kernel's loop: from each `WARPGROUP.DEPBAR` (the wait for a tile's
wgmma) to the next, the count and the most frequent opcodes. Static counts: rarely taken paths (a tile-row
lookup every 32 tiles, warp 0's copy issue) count as if always taken, so compare variants, not kernels. A check
of a variant's per-tile work before device time is spent on it (a rough guide, not a prediction). Needs
cuobjdump on PATH
(PyPI: `pip download --no-deps nvidia-cuda-cuobjdump`, then unzip its bin/ into the toolchain's).
Usage: nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -cubin kernels/src/dsa_indexer_sm90.cu -o /tmp/x.cubin
       python3 scripts/sass-tile.py /tmp/x.cubin dsa_scores_fp8_wgmma_g4_d128"""
import collections
import re
import subprocess
import sys


def main():
    cubin, kernel = sys.argv[1], sys.argv[2]
    sass = subprocess.run(["cuobjdump", "-sass", "-fun", kernel, cubin], capture_output=True, text=True,
                          check=True).stdout
    opcodes = []
    for line in sass.splitlines():
        instruction = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if instruction:
            opcodes.append(instruction.group(1))
    waits = [i for i, op in enumerate(opcodes) if op.startswith("WARPGROUP.DEPBAR")]
    if len(waits) < 2:
        sys.exit(f"{kernel}: fewer than two wgmma waits, no tile to count")
    for start, end in zip(waits, waits[1:]):
        counts = collections.Counter(op.split(".")[0] for op in opcodes[start:end])
        common = " ".join(f"{op}:{n}" for op, n in counts.most_common(12))
        print(f"{end - start:5d} instructions  {common}")


if __name__ == "__main__":
    main()
