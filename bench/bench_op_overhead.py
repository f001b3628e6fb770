#!/usr/bin/env python3
"""Host time of a samebits.torch op call against the torch op it replaces (issue 29, point 3).

    PYTHONPATH=BUILD/python python3 bench/bench_op_overhead.py [--calls 2000] [--md OUT.md]

Each op runs on tiny tensors (a few rows: its kernels take a few µs, far less than the call's host
work), `--calls` times back to back with no synchronisation inside the loop; the host time of a call
is the loop's wall time (perf_counter, one device synchronisation at the end) over the calls. The
two sides alternate, five rounds, the median round is reported. Two modes: inference (inputs
without requires_grad, under no_grad) and training forward (inputs that require grad: autograd
records the call). The torch side is what a model calls without samebits (F.linear, F.rms_norm,
SDPA, …; a fused samebits op against the torch ops it fuses). Kernel time is not measured here:
bench_attention / bench_gemm / bench_logprob report it apart.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import samebits.torch as sbt


def host_us(fn, calls):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def cases(grad):
    dev, bf = "cuda", torch.bfloat16
    T, H, I, V, Hq, Hkv, D = 4, 256, 512, 1024, 4, 2, 64

    def t(*shape, dtype=bf):
        return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(grad and dtype.is_floating_point)

    x, r, w, nw = t(T, H), t(T, H), t(I, H), t(H)
    g, u = t(T, I), t(T, I)
    table, ids = t(V, H), torch.randint(0, V, (T,), device=dev, dtype=torch.int32)
    q, k, v = t(T, Hq, D), t(T, Hkv, D), t(T, Hkv, D)
    qs, ks, vs = (a.detach().transpose(0, 1).unsqueeze(0).requires_grad_(grad) for a in (q, k, v))
    logits, targets = t(T, V, dtype=torch.float32), torch.randint(0, V, (T,), device=dev)
    targets32 = targets.to(torch.int32)  # int64 ids are range-checked on the device first (a synchronisation)
    return [
        ("linear", lambda: sbt.linear(x, w), lambda: F.linear(x, w)),
        ("rms_norm", lambda: sbt.rms_norm(x, nw), lambda: F.rms_norm(x, (H,), nw, 1e-6)),
        ("add_rms_norm", lambda: sbt.add_rms_norm(x, r, nw), lambda: F.rms_norm(x + r, (H,), nw, 1e-6)),
        ("swiglu", lambda: sbt.swiglu(g, u), lambda: F.silu(g) * u),
        ("embedding", lambda: sbt.embedding(ids, table), lambda: F.embedding(ids, table)),
        ("attention", lambda: sbt.attention(q, k, v, [T]),
         lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)),
        ("token_logprobs", lambda: sbt.token_logprobs(logits, targets32),
         lambda: torch.log_softmax(logits, -1).gather(-1, targets[:, None])),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--md")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    lines = [f"Host time of one op call, µs (median of 5 rounds of {args.calls} calls back to back; {name}, "
             f"torch {torch.__version__})", "",
             "| op | mode | samebits.torch | torch | ratio |", "| --- | --- | --- | --- | --- |"]
    for grad in (False, True):
        mode = "training forward" if grad else "inference"
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx:
            for op, ours, theirs in cases(grad):
                a, b = [], []
                for _ in range(5):
                    a.append(host_us(ours, args.calls))
                    b.append(host_us(theirs, args.calls))
                sa, sb = statistics.median(a), statistics.median(b)
                lines.append(f"| {op} | {mode} | {sa:.1f} | {sb:.1f} | {sa / sb:.2f}× |")
                print(lines[-1], flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
