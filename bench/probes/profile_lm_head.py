#!/usr/bin/env python3
"""Per-kernel times of one fused LM-head forward + backward and the bare GEMM (torch.profiler / CUPTI),
for tuning (bench/probes/power_lm_head.py times sustained loops with the SM clock alongside).

    python3 bench/probes/profile_lm_head.py BUILD_DIR [V]
"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/
from raw_ops import RawOps  # noqa: E402
from timing import samebits_from  # noqa: E402


def main():
    sb = RawOps(samebits_from(sys.argv[1]))
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

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))


if __name__ == "__main__":
    sys.exit(main())
