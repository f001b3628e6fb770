#!/usr/bin/env python3
"""One attention shape, samebits then torch's default SDPA, a few calls each: the program an Nsight
Compute run profiles (bench/probes/profile_attention.sh), where bench_attention's tables time.

    python3 bench/probes/attention_once.py BUILD_DIR prefill S B [--heads 32,8,128] [--calls 4] [--hook NAME=V]
    python3 bench/probes/attention_once.py BUILD_DIR decode B C ...

Causal prefill of B packed sequences of S tokens, or a decode of B sequences (one token each) against C
cached keys each; bf16. samebits is called through samebits._core.raw.attention_forward; torch gets the
same tensors as [B, H, S, D] views with enable_gqa=True (its default dispatch: cuDNN on Hopper).
"""
import argparse
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # bench/: timing.samebits_from
from timing import samebits_from  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("kind", choices=["prefill", "decode"])
    ap.add_argument("a", type=int, help="prefill: S; decode: B")
    ap.add_argument("b", type=int, help="prefill: B; decode: C")
    ap.add_argument("--heads", default="32,8,128", help="Hq,Hkv,D")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--hook", action="append", default=[], help="a samebits._core._set_tuning hook, NAME=VALUE")
    args = ap.parse_args()
    samebits = samebits_from(args.build)
    for h in args.hook:
        name, value = h.split("=", 1)
        samebits._core._set_tuning(name, int(value))
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    dt = torch.bfloat16
    if args.kind == "prefill":
        S, B = args.a, args.b
        q = torch.randn(B * S, hq, d, device="cuda", dtype=dt)
        k, v = (torch.randn(B * S, hkv, d, device="cuda", dtype=dt) for _ in range(2))
        rows = [x for b in range(B) for x in (b * S, S, b * S, S)]
        qt, kt, vt = (t.view(B, S, -1, d).transpose(1, 2) for t in (q, k, v))
        causal = True
    else:
        B, C = args.a, args.b
        q = torch.randn(B, hq, d, device="cuda", dtype=dt)
        k, v = (torch.randn(B * C, hkv, d, device="cuda", dtype=dt) for _ in range(2))
        rows = [x for b in range(B) for x in (b, 1, b * C, C)]
        qt = q.view(B, 1, hq, d).transpose(1, 2)
        kt, vt = (t.view(B, C, hkv, d).transpose(1, 2) for t in (k, v))
        causal = False
    table = torch.tensor(rows, dtype=torch.int32).view(-1, 4)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[0], hq, device="cuda")

    def desc(t):
        return samebits.torch._desc(t, "attention_once", "tensor")
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(args.calls):
        samebits._core.raw.attention_forward(desc(q), desc(k), desc(v), desc(table), desc(o), desc(lse), stream=stream)
    torch.cuda.synchronize()
    for _ in range(args.calls):
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
    torch.cuda.synchronize()
    print(f"attention_once: {args.kind} {args.a} × {args.b}, heads {hq} / {hkv} × {d}: {args.calls} calls each")


if __name__ == "__main__":
    sys.exit(main())
