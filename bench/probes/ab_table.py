#!/usr/bin/env python3
"""Side-by-side cuBLAS ratios of bench_gemm CSVs (one per variant): bench/probes/ab_table.py A.csv B.csv ...
(bench/probes/ab_gemm.sh runs it)"""
import csv, math, os, sys

runs = {os.path.basename(p)[:-4]: {(r["shape"], r["product"], int(r["M"])): float(r["ratio"])
                                   for r in csv.DictReader(open(p))} for p in sys.argv[1:]}
names = list(runs)
keys = sorted(set().union(*runs.values()), key=lambda k: (k[1], k[0], k[2]))
print("shape".ljust(30), "prod", "M".rjust(5), *(n[:9].rjust(9) for n in names))
for k in keys:
    print(k[0][:30].ljust(30), k[1].ljust(4), str(k[2]).rjust(5), *(f"{runs[n].get(k, float('nan')):9.3f}" for n in names))
for lo, hi in ((1, 128), (256, 512), (1024, 8192)):
    sel = [k for k in keys if lo <= k[2] <= hi]
    if not sel:
        continue
    gm = [math.exp(sum(math.log(runs[n][k]) for k in sel if k in runs[n]) / max(1, sum(k in runs[n] for k in sel))) for n in names]
    worst = [min(runs[n][k] for k in sel if k in runs[n]) for n in names]
    print(f"geomean M {lo}..{hi}".ljust(41), *(f"{g:9.3f}" for g in gm))
    print(f"worst   M {lo}..{hi}".ljust(41), *(f"{w:9.3f}" for w in worst))
