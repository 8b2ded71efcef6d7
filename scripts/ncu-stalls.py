#!/usr/bin/env python3
"""Summarises a `gpu-run.sh profile-source` SASS page (src-NAME.csv): warp stall samples per code region,
a region ending at each memory access, barrier or exit, and the hottest instructions with their main stalls.
Usage: python3 scripts/ncu-stalls.py src-NAME.csv [share of samples an instruction needs to be listed, 0.01]"""
import csv
import re
import sys

LANDMARK = re.compile(r"BAR|SYNCS|LDG|STG|ATOMG|RED|EXIT|UTMA|UBLK|ATOMS|UCGABAR|STAS")


def main():
    path, share = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    rows = list(csv.reader(lines[start:]))
    header, data = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    source, samples = header.index("Source"), header.index("Warp Stall Sampling (All Samples)")
    executed = header.index("Instructions Executed")
    stalls = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    count = [float(r[samples] or 0) for r in data]
    total = sum(count) or 1.0
    print(f"{total:.0f} samples, {len(data)} instructions\n\nregions (first-last instruction: samples, share -> the instruction that ends it)")
    region, first = 0.0, 0
    for n, r in enumerate(data):
        region += count[n]
        if LANDMARK.search(r[source]):
            if region > 0:
                print(f"{first:5d}-{n:5d} {region:7.0f} {100 * region / total:5.1f}%  -> {r[source].strip()[:70]}")
            region, first = 0.0, n + 1
    print("\nhottest instructions (index, samples, share, executed, source, two main stall reasons)")
    for n, r in enumerate(data):
        if count[n] >= share * total:
            top = sorted(((float(r[i] or 0), header[i][6:]) for i in stalls), reverse=True)[:2]
            reasons = " ".join(f"{name}:{v:.0f}" for v, name in top)
            print(f"{n:5d} {count[n]:6.0f} {100 * count[n] / total:4.1f}% ex={r[executed]:>6} {r[source].strip()[:60]:60s} {reasons}")


if __name__ == "__main__":
    main()
