#!/usr/bin/env python3
"""Every kernel of one decode step, from `ncu --csv --metrics gpu__time_duration.sum` over a window of a
`glm5-bench e2e` run (scripts/gpu-run.sh step-profile): the step is the span between two launches of the
window's longest kernel (lm_head, the largest matrix) of least kernel time, listed in order, then summed by
kernel name."""
import csv
import re
import sys
from collections import Counter, OrderedDict


def rows(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "ns")
        value = float(r["Metric Value"].replace(",", ""))
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, 1e-3)
        yield int(r["ID"]), r["Kernel Name"], value * scale


def short(name):
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"<.*", "", name)
    return name[:60]


def main(path):
    kernels = sorted(rows(path))
    if not kernels:
        sys.exit("no kernel rows in " + path)
    longest = max(kernels, key=lambda k: k[2])[1]
    marks = [i for i, k in enumerate(kernels) if k[1] == longest]
    if len(marks) < 2:
        common = Counter(short(k[1]) for k in kernels).most_common(5)
        sys.exit(
            f"fewer than two launches of the longest kernel ({short(longest)}) in the window of {len(kernels)} "
            f"(most launched: {common}): move it (SKIP) past the prefills that fill the caches"
        )
    # Of the window's complete spans, the one of least kernel time: a decode step (the short prefills that
    # fill the caches end with the same lm_head launch but take longer).
    spans = [kernels[a + 1 : b + 1] for a, b in zip(marks, marks[1:])]
    step = min(spans, key=lambda span: sum(k[2] for k in span))
    total = sum(k[2] for k in step)
    print(
        f"one step: {len(step)} kernels, {total:.1f} us of kernel time (ends with {short(longest)}; "
        f"the least of the window's {len(spans)} complete spans)"
    )
    for i, (_, name, us) in enumerate(step):
        print(f"{i:4d} {us:9.2f}  {short(name)}")
    by_name = OrderedDict()
    for _, name, us in step:
        n, t = by_name.get(short(name), (0, 0.0))
        by_name[short(name)] = (n + 1, t + us)
    print("\nby kernel: launches, us, share")
    for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{n:5d} {t:9.1f} {100 * t / total:5.1f}%  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
