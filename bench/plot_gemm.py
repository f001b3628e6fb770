#!/usr/bin/python3
"""Plots samebits / cuBLAS throughput ratios across M from bench_gemm's CSV, and prints the summary.

Usage: bench/plot_gemm.py GEMM.csv OUT.png "card name"   (Debian's python3-matplotlib)
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = list(csv.DictReader(open(sys.argv[1])))
card = sys.argv[3] if len(sys.argv) > 3 else ""
products = ["forward", "dX", "dW"]
fig, axes = plt.subplots(1, 3, figsize=(16, 5), sharey=True)
for ax, product in zip(axes, products):
    shapes = sorted({r["shape"] for r in rows if r["product"] == product})
    for shape in shapes:
        pts = [(int(r["M"]), float(r["ratio"])) for r in rows if r["product"] == product and r["shape"] == shape]
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=shape)
    ax.axhline(0.95, color="k", ls="--", lw=1)
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_title(f"{product}")
    ax.set_xlabel("M (tokens)")
    ax.grid(True, alpha=0.3)
axes[0].set_ylabel("samebits / cuBLAS throughput (same run)")
axes[0].legend(fontsize=7, loc="lower right")
fig.suptitle(f"samebits batch-invariant GEMM vs cuBLAS, bf16 — {card} (dashed: the 0.95 goal)")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)

for product in products:
    big = [r for r in rows if r["product"] == product and int(r["M"]) >= 1024]
    if not big:
        continue
    worst = min(big, key=lambda r: float(r["ratio"]))
    mean = sum(float(r["ratio"]) for r in big) / len(big)
    below = sum(float(r["ratio"]) < 0.95 for r in big)
    print(f"| {product} | {mean:.3f} | {float(worst['ratio']):.3f} ({worst['shape']}, M={worst['M']}) | {below} of {len(big)} |")
