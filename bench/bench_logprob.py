#!/usr/bin/env python3
"""samebits' CUDA logprob and embedding against torch, in one process on one card.

    python3 bench/bench_logprob.py BUILD_DIR [--md OUT.md] [--quick]

Calls samebits through samebits._core.raw on torch's tensors and current stream (bench/raw_ops.py).
Each sample times samebits and then torch with CUDA events, alternately, after warm-up
(bench/timing.py: alternate); the table gives medians. Inputs are random (never zeros) and rotate
over several buffers past the L2 size.
"""
import argparse
import sys

import torch
import torch.nn.functional as F

from raw_ops import IGNORE, RawOps
from timing import alternate, emit, samebits_from


def bench_logprob(sb, T, V, reps, rows):
    dev = "cuda"
    bufs = 2  # 2 x 2.5 GB: each sample reads logits that are not in L2
    logits = [torch.randn(T, V, device=dev, dtype=torch.bfloat16) * 3 for _ in range(bufs)]
    targets = torch.randint(0, V, (T,), device=dev, dtype=torch.int32)
    targets[torch.rand(T, device=dev) < 0.05] = IGNORE
    mask = (torch.rand(T, device=dev) > 0.1).to(torch.uint8)
    logp = torch.empty(T, device=dev, dtype=torch.float32)
    ent = torch.empty_like(logp)
    lse = torch.empty_like(logp)
    tl = targets.long()
    dlogp = torch.randn(T, device=dev)
    dlogits = torch.empty(T, V, device=dev, dtype=torch.bfloat16)

    def ours_fwd(i):
        sb.logprob_forward(logits[i % bufs], targets, mask, logp, ent, lse)

    def torch_logsoftmax(i):
        torch.log_softmax(logits[i % bufs].float(), -1).gather(1, tl.clamp(min=0)[:, None])

    def torch_ce(i):
        F.cross_entropy(logits[i % bufs], tl, reduction="none", ignore_index=IGNORE)

    f_ours, f_ls, f_ce = alternate([ours_fwd, torch_logsoftmax, torch_ce], reps)
    rows.append((f"logprob forward {T} x {V}", f_ours, f"{T * V * 2 / f_ours / 1e9:.2f}",
                 f"log_softmax fp32 + gather {f_ls:.3f} ms ({f_ls / f_ours:.2f}x); F.cross_entropy {f_ce:.3f} ms "
                 f"({f_ce / f_ours:.2f}x)"))

    # Backward from the saved lse, bf16 dlogits: one read and one write of T x V.
    sb.logprob_forward(logits[0], targets, mask, logp, ent, lse)
    x = [l.detach().requires_grad_(True) for l in logits]
    losses = [F.cross_entropy(xi, tl, reduction="none", ignore_index=IGNORE) for xi in x]

    def ours_bwd(i):
        sb.logprob_backward(logits[i % bufs], targets, mask, lse, dlogp, None, dlogits)

    def torch_bwd(i):
        torch.autograd.grad(losses[i % bufs], x[i % bufs], grad_outputs=dlogp, retain_graph=True)

    b_ours, b_torch = alternate([ours_bwd, torch_bwd], reps)
    rows.append((f"logprob backward {T} x {V} (saved lse, bf16 dlogits)", b_ours,
                 f"{T * V * 4 / b_ours / 1e9:.2f}", f"F.cross_entropy backward {b_torch:.3f} ms ({b_torch / b_ours:.2f}x)"))

    def ours_both(i):
        ours_fwd(i)
        ours_bwd(i)

    def torch_both(i):
        xi = x[i % bufs]
        loss = F.cross_entropy(xi, tl, reduction="none", ignore_index=IGNORE)
        torch.autograd.grad(loss, xi, grad_outputs=dlogp)

    fb_ours, fb_torch = alternate([ours_both, torch_both], reps)
    rows.append((f"logprob forward + backward {T} x {V}", fb_ours, "",
                 f"F.cross_entropy forward + backward {fb_torch:.3f} ms ({fb_torch / fb_ours:.2f}x)"))

    # Numerics on the same inputs: samebits and torch's fp32 path against fp64, on the first rows.
    n = 512
    sb.logprob_forward(logits[0], targets, mask, logp, ent, lse)
    ref64 = torch.log_softmax(logits[0][:n].double(), -1).gather(1, tl[:n].clamp(min=0)[:, None])[:, 0]
    t32 = torch.log_softmax(logits[0][:n].float(), -1).gather(1, tl[:n].clamp(min=0)[:, None])[:, 0]
    active = (mask[:n] != 0) & (targets[:n] != IGNORE)
    ours_err = (logp[:n].double() - ref64)[active].abs().max().item()
    torch_err = (t32.double() - ref64)[active].abs().max().item()
    diff = (logp[:n] - t32)[active].abs().max().item()
    numerics = (f"V = {V}, first {n} rows, active tokens: max |samebits - fp64| = {ours_err:.2e}, "
                f"max |torch fp32 log_softmax - fp64| = {torch_err:.2e}, max |samebits - torch fp32| = {diff:.2e}")
    del logits, x, losses, dlogits
    torch.cuda.empty_cache()
    return numerics


def bench_embedding(sb, T, V, H, id_range, reps, rows):
    dev = "cuda"
    bufs = 3
    ids = [torch.randint(0, id_range, (T,), device=dev, dtype=torch.int32) for _ in range(bufs)]
    dys = [torch.randn(T, H, device=dev, dtype=torch.bfloat16) for _ in range(bufs)]
    mask = torch.ones(T, device=dev, dtype=torch.uint8)
    dtable = torch.zeros(V, H, device=dev, dtype=torch.float32)
    table = torch.randn(V, H, device=dev, dtype=torch.bfloat16)
    y = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    idl = [i.long() for i in ids]

    def ours_bwd(i):
        sb.embedding_backward(ids[i % bufs], dys[i % bufs], mask, dtable)

    def torch_bwd(i):
        torch.ops.aten.embedding_dense_backward(dys[i % bufs], idl[i % bufs], V, -1, False)

    torch.use_deterministic_algorithms(True)
    try:
        o, t = alternate([ours_bwd, torch_bwd], reps)
    finally:
        torch.use_deterministic_algorithms(False)
    label = f"embedding backward {T} tokens, V = {V}, H = {H}, ids < {id_range}"
    rows.append((label, o, "", f"torch deterministic embedding_dense_backward {t:.3f} ms ({t / o:.2f}x)"))

    def ours_fwd(i):
        sb.embedding_forward(ids[i % bufs], table, y)

    def torch_fwd(i):
        F.embedding(idl[i % bufs], table)

    o, t = alternate([ours_fwd, torch_fwd], reps)
    rows.append((f"embedding forward {T} tokens, H = {H}", o, f"{T * H * 4 / o / 1e9:.2f}",
                 f"F.embedding {t:.3f} ms ({t / o:.2f}x)"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--md")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sb = RawOps(samebits_from(args.build))
    reps = 5 if args.quick else 20
    rows, notes = [], []
    for V in (151936, 128256):
        notes.append(bench_logprob(sb, 8192, V, reps, rows))
    for id_range in (151936, 100):
        bench_embedding(sb, 8192, 151936, 4096, id_range, reps, rows)
    name = torch.cuda.get_device_name()
    out = [f"# Logprob and embedding: samebits vs torch on {name}", "",
           f"Generated by `python3 bench/bench_logprob.py build-gpu --md ...` (torch {torch.__version__}); do not edit by hand.",
           "Medians of CUDA-event times, samebits and torch timed alternately; samebits' calls include its",
           "device-side id range check (a small kernel and a stream synchronisation). TB/s: bytes of logits",
           "read (forward) or read + written (backward), or embedding rows read + written, per second.", "",
           "| workload | samebits ms | samebits TB/s | torch (ratio = torch time / samebits time) |",
           "| --- | --- | --- | --- |"]
    out += [f"| {w} | {ms:.3f} | {tb} | {cmp} |" for w, ms, tb, cmp in rows]
    out += ["", "Numerics (logprob forward, same inputs):", ""] + [f"- {n}" for n in notes]
    emit(out, args.md)


if __name__ == "__main__":
    sys.exit(main())
