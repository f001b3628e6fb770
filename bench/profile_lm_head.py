#!/usr/bin/env python3
"""Per-kernel times of one fused LM-head forward + backward (torch.profiler / CUPTI), for tuning.

    python3 bench/profile_lm_head.py BUILD_DIR [V]
"""
import subprocess
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench_logprob import IGNORE, Samebits


def main():
    sb = Samebits(sys.argv[1])
    V = int(sys.argv[2]) if len(sys.argv) > 2 else 151936
    T, K, dev = 8192, 4096, "cuda"
    hidden = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    weight = (torch.randn(V, K, device=dev) * (3.0 / K ** 0.5)).to(torch.bfloat16)
    targets = torch.randint(0, V, (T,), device=dev, dtype=torch.int32)
    mask = torch.ones(T, device=dev, dtype=torch.uint8)
    logp, ent, lse = (torch.empty(T, device=dev) for _ in range(3))
    dlogp = torch.randn(T, device=dev)
    dhidden = torch.empty(T, K, device=dev, dtype=torch.bfloat16)
    dweight = torch.zeros(V, K, device=dev)
    logits = torch.empty(T, V, device=dev, dtype=torch.bfloat16)

    def step():
        sb.lm_head_forward(hidden, weight, targets, mask, logp, ent, lse)
        sb.lm_head_backward(hidden, weight, targets, mask, lse, dlogp, None, dhidden, dweight)
        sb.linear_forward(hidden, weight, logits)

    def both():
        sb.lm_head_forward(hidden, weight, targets, mask, logp, ent, lse)
        sb.lm_head_backward(hidden, weight, targets, mask, lse, dlogp, None, dhidden, dweight)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))
    # Sustained: forward + backward back to back, each timed with events, clocks sampled alongside.
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader",
                            "-lms", "250"], stdout=subprocess.PIPE, text=True)
    times = []
    for i in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        both()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    smi.terminate()
    print("sustained fwd+bwd ms:", " ".join(f"{t:.1f}" for t in times))
    print("clocks/power:", " | ".join(smi.communicate()[0].split("\n")[:16]))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            both()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=90))


if __name__ == "__main__":
    sys.exit(main())
