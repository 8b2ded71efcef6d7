#!/usr/bin/env python3
"""Lists the loops of a cubin's kernels that hold memory loads: for every backward branch, the kernel, the loop's
address range, its instruction count and its global (LDG) and shared (LDS) loads. A short loop with a load whose
value the same iteration uses waits one memory latency per iteration (the compiler unrolls only compile-time trip
counts). Needs cuobjdump (and nvdisasm) on PATH.
Usage: nvcc -gencode arch=compute_90,code=sm_90 -O3 -std=c++17 -cubin kernels/src/X.cu -o /tmp/x.cubin
       python3 scripts/sass-loops.py /tmp/x.cubin [max instructions per loop, 200]"""
import re
import subprocess
import sys


def main():
    cubin, longest = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200
    sass = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    kernels, name = {}, None
    for line in sass.splitlines():
        header = re.match(r"\s+Function : (\S+)", line)
        if header:
            name = header.group(1)
            kernels[name] = []
            continue
        instruction = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if instruction and name:
            kernels[name].append((int(instruction.group(1), 16), instruction.group(2)))
    for name, code in kernels.items():
        for address, text in code:
            branch = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", text)
            if not branch or int(branch.group(1), 16) >= address:
                continue
            start = int(branch.group(1), 16)
            body = [t for a, t in code if start <= a <= address]
            global_loads = sum(bool(re.search(r"\bLDG", t)) for t in body)
            shared_loads = sum(bool(re.search(r"\bLDS\b|\bLDS\.", t)) for t in body)
            if (global_loads or shared_loads) and len(body) <= longest:
                print(f"{name} {start:#x}-{address:#x}: {len(body)} instructions, LDG {global_loads}, LDS {shared_loads}")


if __name__ == "__main__":
    main()
