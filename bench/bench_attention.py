#!/usr/bin/env python3
"""samebits' CUDA attention against torch SDPA — its default dispatch as the baseline, each backend
forced beside it — in one process on one card.

    python3 bench/bench_attention.py BUILD_DIR [--md OUT.md]

Heads: Qwen3-8B's (32 query, 8 key/value, head_dim 128), 16 / 8 × 128 and 32 / 8 × 64, bf16.
 * Causal prefill, 16k tokens a batch as B sequences of S tokens. TFLOP/s count the causal half of
   the score and value products (4·S²·D·Hq/2 a sequence).
 * Decode: B sequences, one new token each, against a KV cache of C keys each; the KV read
   bandwidth counts every key and value byte once (B·C·Hkv·D·2·2 bytes).
Timing: bench/timing.py: alternate (CUDA events, L2 flush, medians). samebits is called through
samebits._core.raw (attention_forward, attention_forward_paged, attention_backward) on preallocated
tensors; the sequence and block tables are host int32 tensors made outside the timed calls.
"""
import argparse
import sys

import torch
import torch.nn.functional as F

from timing import alternate, emit, host_us, kernel_ms, samebits_from


class Rows(list):
    """The table's lines, each result row also printed as soon as it is measured (a run cut short keeps them)."""

    def append(self, line):
        print(line, file=sys.stderr, flush=True)
        super().append(line)

    def __add__(self, other):
        return Rows(list(self) + list(other))

    def __iadd__(self, other):
        self.extend(other)
        return self


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--md")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", choices=["prefill", "backward", "decode", "paged"], help="one table alone")
    ap.add_argument("--quick", action="store_true", help="one shape a table")
    ap.add_argument("--ab", metavar="HOOK=VALUE[,HOOK=VALUE...]",
                    help="prefill and decode tables: samebits again with tuning hooks set (samebits._core._set_tuning, "
                         "e.g. narrow_decode=1, or persistent_prefill=1,attention_overlap=1), in the same alternation "
                         "as the other contenders")
    args = ap.parse_args()
    samebits = samebits_from(args.build)
    raw = samebits._core.raw
    hooks = [(h.split("=", 1)[0], int(h.split("=", 1)[1])) for h in args.ab.split(",")] if args.ab else []

    def with_hook(fn):
        """fn with the --ab hooks set for the call's life (read when the call plans its work)."""
        def call(i):
            before = [(name, samebits._core._set_tuning(name, value)) for name, value in hooks]
            try:
                return fn(i)
            finally:
                for name, value in reversed(before):
                    samebits._core._set_tuning(name, value)
        return call

    def ab_cell(times, a, o, o_ab, scale, unit, fmt):
        """The --ab column: the call with the hook set, its time against the plain call's, and whether its bits
        are the plain call's ("" without --ab)."""
        if o_ab is None:
            return ""
        same = torch.equal(o.view(torch.uint8), o_ab.view(torch.uint8))
        return (f" {times[1] * scale:{fmt}} {unit} ({times[1] / a:.2f}× samebits; "
                f"{'same bits' if same else 'BITS DIFFER'}) |")

    def desc(t):
        return samebits.torch._desc(t, "bench_attention", "tensor")

    name = torch.cuda.get_device_name()
    B_ = torch.nn.attention.SDPBackend

    def sdpa_contenders(qt, kt, vt, causal):
        """torch's contenders, each a callable(i) -> out [B, Hq, S, D]: the default dispatch (what a
        user gets: torch picks the backend) on GQA views and on K / V repeated to Hq heads (repeated
        outside the timing: transformers repeats them where SDPA's GQA path is not taken), then each
        backend forced. A backend that refuses the shapes is left out."""
        g = qt.shape[1] // kt.shape[1]
        big = kt.numel() * g * kt.element_size() > (4 << 30)  # decode at large B × C: no repeated copy
        kr, vr = (None, None) if big else (kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1))
        def plain(k, v, gqa):
            return lambda i: F.scaled_dot_product_attention(qt, k, v, is_causal=causal, enable_gqa=gqa)
        def forced(backend, k, v, gqa):
            def call(i):
                with torch.nn.attention.sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, k, v, is_causal=causal, enable_gqa=gqa)
            return call
        cands = {"default": plain(kt, vt, True)}
        if kr is not None:
            cands["default, K/V repeated"] = plain(kr, vr, False)
        cands["flash"] = forced(B_.FLASH_ATTENTION, kt, vt, True)
        if kr is not None:
            cands["cuDNN"] = forced(B_.CUDNN_ATTENTION, kr, vr, False)
        cands["efficient"] = forced(B_.EFFICIENT_ATTENTION, kt, vt, True)
        ok = {}
        for label, fn in cands.items():
            try:
                fn(0)
                ok[label] = fn
            except RuntimeError:
                pass
        return ok

    def baseline(times):
        """The default's best time (GQA views or K / V repeated: the faster of what a user gets)."""
        return min(t for label, t in times.items() if label.startswith("default"))

    def others(times, scale=1.0, unit="ms", fmt=".2f"):
        return "; ".join(f"{label} {t * scale:{fmt}} {unit}" for label, t in times.items())

    def wanted(name):  # a table the run makes (--only: one alone, the others not even headed)
        return args.only in (None, name)

    heads = [(32, 8, 128), (16, 8, 128), (32, 8, 64)]
    out = Rows() + [f"# Attention: samebits vs torch SDPA (its default backend, and each forced) on {name}", "",
           "Generated by `python3 bench/bench_attention.py BUILD_DIR --md ...` "
           f"(torch {torch.__version__}); do not edit by hand. bf16; medians of CUDA-event times, all contenders "
           "alternating in one process, after an L2 flush. The ratio's baseline is torch's default dispatch "
           "(`F.scaled_dot_product_attention` with no backend forced; on GQA views with enable_gqa=True and on K / V "
           "repeated to the query heads — the faster of the two), as issue 30 asks; the forced backends are listed "
           "beside it. Throughput ratio: > 1 means samebits is faster."]
    if wanted("prefill"):
        out += ["", "Causal prefill: B sequences of S tokens (TFLOP/s count the causal half of the score and value "
                "products, 4·S²·D·Hq/2 a sequence).", "",
                "| Hq / Hkv, D | S × B | samebits | torch default (best) | samebits / default throughput | "
                "torch, each | max abs diff of out |" + (f" samebits, `{args.ab}` |" if hooks else ""),
                "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if hooks else "")]
    def host_ints(values, cols):  # made once, outside the timed calls (large block tables take milliseconds)
        return torch.tensor(values, dtype=torch.int32).view(-1, cols)

    def run(q, k, v, table, o, lse, pages=None, page_size=0):
        """Attention forward; table: host int32 [B, 4] {q_row, q_len, k_row, k_len}; with pages (host int32
        [B, pages]) k / v are a pool of pages of page_size rows."""
        stream = torch.cuda.current_stream().cuda_stream
        if pages is None:
            raw.attention_forward(desc(q), desc(k), desc(v), desc(table), desc(o), desc(lse), stream=stream)
        else:
            raw.attention_forward_paged(desc(q), desc(k), desc(v), desc(table), desc(o), desc(lse), desc(pages),
                                        page_size=page_size, stream=stream)

    def time_against(q, k, v, table, o, lse, theirs):
        """samebits (and, with --ab, samebits with the hook set, into its own output) alternating with torch's
        contenders: every time, samebits', torch's by label, and the --ab call's output (None without --ab)."""
        mine = [lambda i: run(q, k, v, table, o, lse)]
        o_ab = None
        if hooks:
            o_ab = torch.empty_like(o)
            mine.append(with_hook(lambda i: run(q, k, v, table, o_ab, lse)))
        times = alternate(mine + list(theirs.values()), args.reps)
        return times, times[0], dict(zip(theirs, times[len(mine):])), o_ab

    def prefill_inputs(S, B, hq, hkv, d):
        q = torch.randn(B * S, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B * S, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B * S, hkv, d, device="cuda", dtype=torch.bfloat16)
        return q, k, v

    shapes = [(1024, 16), (2048, 8), (4096, 4), (8192, 2), (16384, 1), (32768, 1)]
    for hq, hkv, d in heads if wanted("prefill") else ():
        for S, B in shapes if not args.quick else [(4096, 4)]:
            q, k, v = prefill_inputs(S, B, hq, hkv, d)
            o = torch.empty_like(q)
            lse = torch.empty(B * S, hq, device="cuda")
            qt, kt, vt = (t.view(B, S, -1, d).transpose(1, 2) for t in (q, k, v))
            table = host_ints([x for b in range(B) for x in (b * S, S, b * S, S)], 4)
            theirs = sdpa_contenders(qt, kt, vt, True)
            times, a, tt, o_ab = time_against(q, k, v, table, o, lse, theirs)
            base = baseline(tt)
            diff = (o.view(B, S, hq, d).transpose(1, 2).float() - theirs["default"](0).float()).abs().max().item()
            flops = 4 * S * S * d * hq / 2 * B
            out.append(f"| {hq} / {hkv}, {d} | {S} × {B} | {a:.2f} ms, {flops / a / 1e9:.0f} TFLOP/s | {base:.2f} ms, "
                       f"{flops / base / 1e9:.0f} TFLOP/s | **{base / a:.2f}×** | {others(tt)} | {diff:.3g} |"
                       + ab_cell(times, a, o, o_ab, 1, "ms", ".2f"))
            del q, k, v, o, qt, kt, vt, theirs

    if wanted("backward"):
        out += ["", "Causal backward (dq, dk, dv from out, lse and dout): samebits' backward against "
                "torch.autograd.grad of each torch forward's output (its backward kernels alone are timed: the "
                "forward runs outside the timed region). TFLOP/s count 2.5× the forward's work (five causal "
                "products).", "",
                "| Hq / Hkv, D | S × B | samebits | torch default (best) backward | samebits / default throughput | "
                "torch, each | max abs diff of dq, dk, dv |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
    for hq, hkv, d in heads[:1] if wanted("backward") else ():
        for S, B in [(2048, 8), (4096, 4), (8192, 2)] if not args.quick else [(4096, 4)]:
            q, k, v = prefill_inputs(S, B, hq, hkv, d)
            g = torch.randn(B * S, hq, d, device="cuda", dtype=torch.bfloat16)
            o = torch.empty_like(q)
            lse = torch.empty(B * S, hq, device="cuda")
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            seqs = host_ints([x for b in range(B) for x in (b * S, S, b * S, S)], 4)
            run(q, k, v, seqs, o, lse)

            def ours_bwd(i):
                raw.attention_backward(desc(q), desc(k), desc(v), desc(seqs), desc(o), desc(lse), desc(g), desc(dq),
                                       desc(dk), desc(dv), stream=torch.cuda.current_stream().cuda_stream)

            qt, kt, vt = (t.view(B, S, -1, d).transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
            gt = g.view(B, S, hq, d).transpose(1, 2)
            refs = {label: fn(0) for label, fn in sdpa_contenders(qt, kt, vt, True).items()}

            def backward_of(ref):
                return lambda i: torch.autograd.grad(ref, (qt, kt, vt), gt, retain_graph=True)
            times = alternate([ours_bwd] + [backward_of(r) for r in refs.values()], args.reps)
            a, tt = times[0], dict(zip(refs, times[1:]))
            base = baseline(tt)
            rq, rk, rv = backward_of(refs["default"])(0)
            diff = max((dq.view(B, S, hq, d).transpose(1, 2).float() - rq.float()).abs().max().item(),
                       (dk.view(B, S, hkv, d).transpose(1, 2).float() - rk.float()).abs().max().item(),
                       (dv.view(B, S, hkv, d).transpose(1, 2).float() - rv.float()).abs().max().item())
            flops = 2.5 * 4 * S * S * d * hq / 2 * B
            out.append(f"| {hq} / {hkv}, {d} | {S} × {B} | {a:.2f} ms, {flops / a / 1e9:.0f} TFLOP/s | {base:.2f} ms, "
                       f"{flops / base / 1e9:.0f} TFLOP/s | **{base / a:.2f}×** | {others(tt)} | {diff:.3g} |")
            del refs, qt, kt, vt, q, k, v, g, dq, dk, dv

    hq, hkv, d = heads[0]
    if wanted("decode"):
        out += ["", f"Decode: B sequences, one new token each, against C cached keys each (bf16, Hq = {hq}, "
                f"Hkv = {hkv}, D = {d}); torch gets q [B, Hq, 1, D] and the same cache as [B, Hkv, C, D] views (and "
                "repeated to Hq heads where that copy stays under 4 GiB), is_causal=False. KV GB/s: key and value "
                "bytes read once over the time.", "",
                "| B | C | samebits | torch default (best) | samebits / default time | torch, each | "
                "max abs diff of out |" + (f" samebits, `{args.ab}` |" if hooks else ""),
                "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if hooks else "")]
    for B in (1, 8, 64, 256) if wanted("decode") else ():
        for C in (1024, 4000, 4096, 16384, 32768) if not args.quick else (4096,):  # 4000: a partly filled key block
            if B * C > 64 * 32768:
                continue
            q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(B * C, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(B * C, hkv, d, device="cuda", dtype=torch.bfloat16)
            o = torch.empty_like(q)
            lse = torch.empty(B, hq, device="cuda")
            qt = q.view(B, 1, hq, d).transpose(1, 2)
            kt, vt = (t.view(B, C, hkv, d).transpose(1, 2) for t in (k, v))
            table = host_ints([x for b in range(B) for x in (b, 1, b * C, C)], 4)
            theirs = sdpa_contenders(qt, kt, vt, False)
            times, a, tt, o_ab = time_against(q, k, v, table, o, lse, theirs)
            base = baseline(tt)
            diff = (o.float() - theirs["default"](0).view(B, hq, d).float()).abs().max().item()
            gb = B * C * hkv * d * 2 * 2 / 1e9
            out.append(f"| {B} | {C} | {a * 1e3:.1f} µs, {gb / a * 1e3:.0f} GB/s | {base * 1e3:.1f} µs, "
                       f"{gb / base * 1e3:.0f} GB/s | **{a / base:.2f}×** | {others(tt, 1e3, 'µs', '.1f')} | {diff:.3g} |"
                       + ab_cell(times, a, o, o_ab, 1e3, "µs", ".1f"))
            del q, k, v, o, kt, vt, theirs
    if wanted("prefill"):
        out += ["", "Kernel time against the Python call's host time (issue 30 goal 5: a kernel gap and a host gap "
                "kept apart): `samebits.torch.attention` (the op users call: packed rows and lengths) and "
                "`F.scaled_dot_product_attention` (default dispatch, GQA views), forward, Hq 32 / Hkv 8, D 128. "
                "Kernel: the profiler's device time of every kernel one call launches (mean of 5 calls); host: the "
                "median perf_counter time of a call while the GPU is busy ahead of it.", "",
                "| S × B | samebits.torch kernel | torch kernel | kernel ratio (samebits / torch) | "
                "samebits.torch host | torch host |",
                "| --- | --- | --- | --- | --- | --- |"]
    for S, B in ((1024, 16), (8192, 2)) if wanted("prefill") else ():
        hq, hkv, d = heads[0]
        q, k, v = prefill_inputs(S, B, hq, hkv, d)
        qt, kt, vt = (t.view(B, S, -1, d).transpose(1, 2) for t in (q, k, v))
        lengths = [S] * B

        def ours_op():
            return samebits.torch.attention(q, k, v, lengths)

        def theirs_op():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

        ko, kt_ = kernel_ms(ours_op), kernel_ms(theirs_op)
        ho, ht = host_us(ours_op), host_us(theirs_op)
        out.append(f"| {S} × {B} | {ko:.3f} ms | {kt_:.3f} ms | **{ko / kt_:.2f}×** | {ho:.1f} µs | {ht:.1f} µs |")
        del q, k, v, qt, kt, vt

    if wanted("paged"):
        out += ["", "Decode from a paged KV cache: the same caches cut into pages of P rows and shuffled over the pool "
                "(torch.randperm, seed 0); samebits paged against samebits contiguous and SDPA (contiguous) in the "
                "same run. The outputs are bitwise those of the contiguous cache (tested in CudaAttention).", "",
                "| B | C | P | samebits paged | samebits contiguous | torch default | paged / default time |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
    gen = torch.Generator().manual_seed(0)
    for B in (8, 64) if wanted("paged") else ():
        for C in (4096, 32768):
            q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(B * C, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(B * C, hkv, d, device="cuda", dtype=torch.bfloat16)
            o, o2 = torch.empty_like(q), torch.empty_like(q)
            lse = torch.empty(B, hq, device="cuda")
            qt = q.view(B, 1, hq, d).transpose(1, 2)
            kt, vt = (t.view(B, C, hkv, d).transpose(1, 2) for t in (k, v))
            table = [x for b in range(B) for x in (b, 1, b * C, C)]
            for P in (16, 128):
                perm = torch.randperm(B * C // P, generator=gen)
                inv = torch.empty_like(perm)
                inv[perm] = torch.arange(perm.numel())
                pool_k = k.view(-1, P, hkv, d)[inv.cuda()].reshape(B * C, hkv, d)  # page j of the cache at perm[j]
                pool_v = v.view(-1, P, hkv, d)[inv.cuda()].reshape(B * C, hkv, d)
                pages = host_ints(perm.tolist(), C // P)  # [B, C / P]: row b lists sequence b's pages
                paged_table = host_ints([x for b in range(B) for x in (b, 1, 0, C)], 4)
                contiguous_table = host_ints(table, 4)

                def theirs(i):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=False, enable_gqa=True)

                a, c, b = alternate([lambda i: run(q, pool_k, pool_v, paged_table, o, lse, pages, P),
                                     lambda i: run(q, k, v, contiguous_table, o2, lse), theirs], args.reps)
                same = torch.equal(o, o2)
                out.append(f"| {B} | {C} | {P} | {a * 1e3:.1f} µs | {c * 1e3:.1f} µs | {b * 1e3:.1f} µs | "
                           f"**{a / b:.2f}×**{'' if same else ' (bits differ!)'} |")
                del pool_k, pool_v
            del q, k, v, kt, vt
    emit(out, args.md)


if __name__ == "__main__":
    sys.exit(main())
