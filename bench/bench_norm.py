#!/usr/bin/env python3
"""samebits' CUDA RMSNorm, SwiGLU, residual add and RoPE against torch, in one process on one card.

    python3 bench/bench_norm.py BUILD_DIR [--md OUT.md]

Effective bandwidth counts each tensor the op must read or write once (bf16 activations, a bf16
weight, fp32 rstd and dweight). Every sample times samebits and torch alternately with CUDA events
after warm-up (bench/timing.py: alternate); medians. samebits is called through samebits._core.raw
on preallocated tensors (bench/raw_ops.py). Inputs are random and rotate over three buffers
of 64 MiB or more, past the 50 MiB L2. The dweight chain's share of the backward comes from the
kernel times of one call (torch.profiler / CUPTI).
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from raw_ops import RawOps
from timing import alternate, emit, samebits_from

EPS = 1e-6  # torch's side; samebits' calls keep the library's default, the same 1e-6


def row(name, ours, theirs, nbytes, target=None):
    bw = nbytes / (ours * 1e-3) / 1e12
    tbw = nbytes / (theirs * 1e-3) / 1e12
    verdict = "" if target is None else (f" (target ≥ {target}: **{'met' if bw >= target else 'not met'}**)")
    return (f"| {name} | {ours * 1e3:.1f} µs | {bw:.2f} TB/s{verdict} | {theirs * 1e3:.1f} µs, {tbw:.2f} TB/s | "
            f"**{theirs / ours:.2f}×** |")


def bench_rmsnorm(sb, T, H, reps, out):
    dev, bf = "cuda", torch.bfloat16
    xs = [torch.randn(T, H, device=dev, dtype=bf) for _ in range(3)]
    dys = [torch.randn(T, H, device=dev, dtype=bf) for _ in range(3)]
    w = (torch.rand(H, device=dev) + 0.5).to(bf)
    y, dx = torch.empty(T, H, device=dev, dtype=bf), torch.empty(T, H, device=dev, dtype=bf)
    rstd, dw = torch.empty(T, device=dev), torch.zeros(H, device=dev)

    def ours_fwd(i):
        sb.rmsnorm_forward(xs[i % 3], w, y, rstd)

    def torch_fwd(i):
        F.rms_norm(xs[i % 3], (H,), w, EPS)

    f_ours, f_torch, f_any = alternate([ours_fwd, torch_fwd, sb.tuned({"norm_any_dtype": 1}, ours_fwd)], reps)
    out.append(row(f"RMSNorm forward {T} × {H}", f_ours, f_torch, 2 * T * H * 2 + H * 2 + T * 4, 2.6) +
               f" (the bf16 instance) run-time-dtype instance: {f_any * 1e3:.1f} µs")

    sb.rmsnorm_forward(xs[0], w, y, rstd)
    leaves = [x.detach().requires_grad_() for x in xs]
    wl = w.detach().requires_grad_()

    def ours_bwd(i):
        sb.rmsnorm_backward(dys[i % 3], xs[i % 3], w, rstd, dx, dw)

    def torch_bwd(i):
        yy = F.rms_norm(leaves[i % 3], (H,), wl, EPS)
        torch.autograd.grad(yy, (leaves[i % 3], wl), dys[i % 3])

    b_ours, b_torch, b_any = alternate([ours_bwd, torch_bwd, sb.tuned({"norm_any_dtype": 1}, ours_bwd)], reps)
    out.append(row(f"RMSNorm backward (dx + dweight) {T} × {H}", b_ours, b_torch, 3 * T * H * 2 + T * 4 + H * (2 + 8),
                   2.2) + f" run-time-dtype instance: {b_any * 1e3:.1f} µs; torch: forward + backward")
    # The dweight chain's share: kernel times of one backward.
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours_bwd(0)
        torch.cuda.synchronize()
    main = chain = 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if "chain_partials" in e.key:
            chain += t
        elif "rmsnorm_backward_kernel" in e.key:
            main += t
    if main > 0:
        out.append(f"| ↳ dweight chain (ranges of 16 chunks, then the ranges in order) | {chain:.1f} µs | "
                   f"{100 * chain / (main + chain):.1f}% of the backward's kernel time (target ≤ 5%: "
                   f"**{'met' if chain <= 0.05 * (main + chain) else 'not met'}**); the chunk partials are written "
                   f"by the main kernel ({main:.1f} µs) | | |")


def bench_elementwise(sb, reps, out):
    dev, bf = "cuda", torch.bfloat16
    T, I, H = 8192, 12288, 4096
    gs = [torch.randn(T, I, device=dev, dtype=bf) for _ in range(3)]
    us = [torch.randn(T, I, device=dev, dtype=bf) for _ in range(3)]
    y = torch.empty(T, I, device=dev, dtype=bf)
    n = T * I

    def ours(i):
        sb.swiglu_forward(gs[i % 3], us[i % 3], y)

    def theirs(i):
        F.silu(gs[i % 3]) * us[i % 3]

    a, b = alternate([ours, theirs], reps)
    out.append(row(f"SiLU·mul forward {T} × {I}", a, b, 3 * n * 2, 2.6))
    dg, du = torch.empty_like(y), torch.empty_like(y)
    dys = [torch.randn(T, I, device=dev, dtype=bf) for _ in range(3)]

    def ours_b(i):
        sb.swiglu_backward(dys[i % 3], gs[i % 3], us[i % 3], dg, du)

    def theirs_b(i):
        g, u = gs[i % 3], us[i % 3]
        s = torch.sigmoid(g)
        dys[i % 3] * g * s, dys[i % 3] * u * (s * (1 + g * (1 - s)))

    a, b = alternate([ours_b, theirs_b], reps)
    out.append(row(f"SiLU·mul backward {T} × {I}", a, b, 5 * n * 2) + " torch: eager formula")
    xa = [torch.randn(T, H, device=dev, dtype=bf) for _ in range(3)]
    xb = [torch.randn(T, H, device=dev, dtype=bf) for _ in range(3)]
    ya = torch.empty(T, H, device=dev, dtype=bf)

    def ours_add(i):
        sb.residual_add(xa[i % 3], xb[i % 3], ya)

    def theirs_add(i):
        torch.add(xa[i % 3], xb[i % 3], out=ya)

    a, b = alternate([ours_add, theirs_add], reps)
    out.append(row(f"residual add {T} × {H}", a, b, 3 * T * H * 2, 2.6))

    def copy(i):  # the ceiling: a device-to-device copy of one operand (read + write)
        ya.copy_(xa[i % 3])

    c, = alternate([copy], reps)
    out.append(f"| ceiling: torch copy {T} × {H} (read + write) | | {2 * T * H * 2 / (c * 1e-3) / 1e12:.2f} TB/s | "
               f"{c * 1e3:.1f} µs | |")


def bench_rope(sb, reps, out):
    dev, bf = "cuda", torch.bfloat16
    T, heads, D = 8192, 32, 128
    qs = [torch.randn(T, heads, D, device=dev, dtype=bf) for _ in range(3)]
    y = torch.empty_like(qs[0])
    pos = torch.arange(T, device=dev, dtype=torch.int32) % 2048
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    ang = pos.float()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(bf)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(bf)[:, None, :]

    def ours(i):
        sb.rope(qs[i % 3], pos, y)

    def theirs(i):  # Hugging Face's apply_rotary_pos_emb with cos / sin made beforehand
        q = qs[i % 3]
        rot = torch.cat((-q[..., D // 2:], q[..., : D // 2]), -1)
        q * cos + rot * sin

    a, b = alternate([ours, theirs], reps)
    out.append(row(f"RoPE forward q {T} × {heads} × {D} (cos / sin made in the kernel)", a, b, 2 * T * heads * D * 2) +
               " torch: HF rotate_half with cos / sin precomputed (not timed)")


def bench_qk_norm_rope(sb, reps, out):
    """Qwen3-8B's q (32 heads) and k (8 heads), head_dim 128: QK-norm then RoPE, forward and backward,
    fused (one pass) against samebits' two kernels and torch eager (F.rms_norm over head_dim, then
    HF's rotate_half with cos / sin made beforehand; backward: autograd of that)."""
    dev, bf = "cuda", torch.bfloat16
    T, D = 8192, 128
    heads = {"q": 32, "k": 8}
    pos = torch.arange(T, device=dev, dtype=torch.int32) % 2048
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    ang = pos.float()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(bf)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(bf)[:, None, :]
    t = {n: dict(x=[torch.randn(T, h, D, device=dev, dtype=bf) for _ in range(3)],
                 dy=[torch.randn(T, h, D, device=dev, dtype=bf) for _ in range(3)],
                 w=torch.rand(D, device=dev, dtype=bf) + 0.5, y=torch.empty(T, h, D, device=dev, dtype=bf),
                 tmp=torch.empty(T, h, D, device=dev, dtype=bf), tmp32=torch.empty(T, h, D, device=dev),
                 rstd=torch.empty(T, h, device=dev), dx=torch.empty(T, h, D, device=dev, dtype=bf),
                 dw=torch.zeros(D, device=dev)) for n, h in heads.items()}

    def fused(i):
        for n, h in heads.items():
            a = t[n]
            sb.qk_norm_forward(a["x"][i % 3], a["w"], a["rstd"], a["y"], pos)

    def unfused(i):
        for n, h in heads.items():
            a = t[n]
            sb.qk_norm_forward(a["x"][i % 3], a["w"], a["rstd"], a["tmp"])
            sb.rope(a["tmp"], pos, a["y"])

    def torch_fwd(x, w):
        n = F.rms_norm(x, (D,), w, EPS)
        return n * cos + torch.cat((-n[..., D // 2:], n[..., : D // 2]), -1) * sin

    def theirs(i):
        for n in heads:
            torch_fwd(t[n]["x"][i % 3], t[n]["w"])

    fwd_bytes = 2 * T * sum(heads.values()) * D * 2
    a, b, c = alternate([fused, unfused, theirs], reps)
    out.append(row(f"QK-norm + RoPE forward, q and k {T} × (32 + 8) × {D}, fused", a, c, fwd_bytes) +
                   f" unfused (QK-norm, then RoPE): {b * 1e3:.1f} µs, {b / a:.2f}× the fused")

    def fused_bwd(i):
        for n, h in heads.items():
            a = t[n]
            sb.qk_norm_backward(a["dy"][i % 3], a["x"][i % 3], a["w"], a["rstd"], a["dx"], a["dw"], pos)

    def unfused_bwd(i):
        for n, h in heads.items():
            a = t[n]
            sb.rope(a["dy"][i % 3], pos, a["tmp32"], inverse=True)
            sb.qk_norm_backward(a["tmp32"], a["x"][i % 3], a["w"], a["rstd"], a["dx"], a["dw"])

    leaves = {n: [x.detach().requires_grad_() for x in t[n]["x"]] for n in heads}
    wl = {n: t[n]["w"].detach().requires_grad_() for n in heads}
    outs = {n: [torch_fwd(x, wl[n]) for x in leaves[n]] for n in heads}

    def theirs_bwd(i):
        for n in heads:
            torch.autograd.grad(outs[n][i % 3], [leaves[n][i % 3], wl[n]], t[n]["dy"][i % 3], retain_graph=True)

    bwd_bytes = 3 * T * sum(heads.values()) * D * 2
    a, b, c = alternate([fused_bwd, unfused_bwd, theirs_bwd], reps)
    out.append(row(f"QK-norm + RoPE backward (dx, dweight), q and k, fused", a, c, bwd_bytes) +
                   f" unfused (RoPE backward into fp32, then QK-norm backward): {b * 1e3:.1f} µs, {b / a:.2f}× the fused")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--md")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--only", choices=["qk"], help="only the QK-norm + RoPE rows (a quick A/B)")
    args = ap.parse_args()
    sb = RawOps(samebits_from(args.build))
    name = torch.cuda.get_device_name()
    out = [f"# Norm, RoPE and elementwise kernels: samebits vs torch on {name}", "",
           "Generated by `python3 bench/bench_norm.py BUILD_DIR --md ...` "
           f"(torch {torch.__version__}); do not edit by hand. Medians of CUDA-event times, samebits and torch "
           "timed alternately in one process in a rotating order, each sample after a 256 MB L2 flush (written, as "
           "triton's do_bench does) and behind a 1 ms GPU spin so that the host's launch latency is not timed. "
           "Effective bandwidth counts "
           "each tensor read or written once. Targets from issue 6.", "",
           "| op (bf16) | samebits | effective bandwidth | torch | torch / samebits |", "| --- | --- | --- | --- | --- |"]
    if args.only is None:
        for T in (8192, 16384):
            bench_rmsnorm(sb, T, 4096, args.reps, out)
        bench_elementwise(sb, args.reps, out)
        bench_rope(sb, args.reps, out)
    bench_qk_norm_rope(sb, args.reps, out)
    emit(out, args.md)


if __name__ == "__main__":
    sys.exit(main())
