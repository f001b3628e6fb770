#!/usr/bin/env python3
"""Sustained loops of the fused LM-head forward and of the bare GEMM, with the SM clock and power
sampled alongside (is the fused op's gap work or clock?).

    python3 bench/probes/power_lm_head.py BUILD_DIR

samebits is called through samebits._core.raw on preallocated tensors (bench/raw_ops.py).
"""
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/
from raw_ops import RawOps  # noqa: E402
from timing import samebits_from  # noqa: E402


def main():
    sb = RawOps(samebits_from(sys.argv[1]))
    T, K, V, dev = 8192, 4096, 151936, "cuda"
    hidden = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    weight = (torch.randn(V, K, device=dev) * (3.0 / K ** 0.5)).to(torch.bfloat16)
    targets = torch.randint(0, V, (T,), device=dev, dtype=torch.int32)
    mask = torch.ones(T, device=dev, dtype=torch.uint8)
    logp, ent, lse = torch.empty(T, device=dev), torch.empty(T, device=dev), torch.empty(T, device=dev)
    logits = torch.empty(T, V, device=dev, dtype=torch.bfloat16)
    calls = {"fused": lambda: sb.lm_head_forward(hidden, weight, targets, mask, logp, None, lse),
             "fused+H": lambda: sb.lm_head_forward(hidden, weight, targets, mask, logp, ent, lse),
             "gemm": lambda: sb.linear_forward(hidden, weight, logits),
             "cublas": lambda: torch.mm(hidden, weight.t(), out=logits)}
    for rnd in range(2):
        for name, f in calls.items():
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                    "-lms", "100"], stdout=subprocess.PIPE, text=True)
            time.sleep(0.3)
            times = []
            for _ in range(40):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                f()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            smi.terminate()
            samples = [tuple(float(x) for x in line.split(",")) for line in smi.communicate()[0].split("\n") if line]
            busy = [s for s in samples if s[1] > 200]
            clk = sum(s[0] for s in busy) / max(len(busy), 1)
            pw = sum(s[1] for s in busy) / max(len(busy), 1)
            times.sort()
            print(f"round {rnd} {name:7s} median {times[20]:.3f} ms  min {times[0]:.3f}  clock {clk:.0f} MHz  power {pw:.0f} W")


if __name__ == "__main__":
    sys.exit(main())
