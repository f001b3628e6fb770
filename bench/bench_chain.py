#!/usr/bin/env python3
"""The whole chain end to end: samebits (CUDA backend) against stock PyTorch — Hugging Face
transformers with SDPA attention, bf16 — in one process on one card, on the same weights.

    python3 bench/bench_chain.py BUILD_DIR [--layers 4] [--md OUT.md]

The model is Qwen3-8B's shape (hidden 4096, 32 / 8 heads of 128, MLP 12288, vocab 151936, untied)
with --layers layers and random weights, written by `samebits export-model --shape qwen3-8b` and
loaded by both sides from that directory.
 * prefill: the selected logprob of every token of a batch (samebits: the chain's forward;
   transformers: logits → fp32 log_softmax → gather, as RL trainers score rollouts), tokens/s;
 * forward + backward: the gradient of the summed logprobs with respect to every weight
   (samebits: fp32 accumulators; transformers: .grad of the bf16 parameters), tokens/s;
 * decode: one token per sequence against a KV cache after a 512-token prompt, B = 1, 8, 64,
   wall-clock per step (each side's host work included), median of 32 steps.
 * batch mixes: 16k tokens as 32 × 512, 16 × 1024, 4 × 4096, and two RL-like mixes of lengths
   (packed for samebits, right-padded with an attention mask for transformers); --plot draws
   tokens/s against the mix;
 * decode baselines: transformers is timed with torch's own SDPA choice and with cuDNN attention
   excluded (torch 2.11's default rebuilt a cuDNN graph at every new key length, ~40 ms a step);
   the faster is reported. --profile adds a kernel-time breakdown of one forward + backward.
Peak memory beyond the weights: torch.cuda.max_memory_allocated for transformers, samebits' pool
high-water mark (samebits._core.device_memory_peak) for samebits; both minus what was allocated
before the phase. The two allocators share the card: before each phase the other side's cached,
unused memory goes back to the device (torch.cuda.empty_cache, samebits._core.device_memory_release),
so neither runs squeezed. samebits runs through its Python package: samebits.Model / samebits.Chain
(logprobs, forward + backward, kv_cache + step).
"""
import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import transformers

from timing import emit, samebits_from
from timing import wall_median as timed


class Samebits:
    """The model chain on the CUDA backend (samebits.Chain over samebits.Model.load(model_dir)), with
    the gradient accumulators and the KV cache the benchmark's phases keep between calls."""

    def __init__(self, samebits, model_dir):
        self.core = samebits._core
        self.model = samebits.Model.load(model_dir)
        self.chain = samebits.Chain(self.model, "cuda")
        self.grads = self.kv = None
        self.logp = None

    def forward(self, seqs):
        """Scores every token of the packed sequences (kept: the last call's logprobs, per sequence)."""
        self.logp = self.chain.logprobs(seqs)

    def forward_backward(self, seqs, dlogp):
        """Forward + backward of L = sum of logp over the scored tokens (dlogp: ones, one per scored
        token); the weight gradients add into the kept fp32 accumulators (made by the first call)."""
        self.grads = self.chain.backward(self.chain.forward(seqs), dlogp, self.grads)

    def drop_grads(self):
        self.grads = None

    def release(self):
        """samebits' unused pooled memory back to the device, so torch's allocator is not squeezed."""
        self.core.device_memory_release("cuda")

    def in_use(self):
        return self.core.device_memory_in_use("cuda")

    def peak(self, reset):
        return self.core.device_memory_peak("cuda", reset)

    def cache(self, slots, capacity):
        """A KV cache of `slots` sequences of up to `capacity` tokens (the previous one freed first)."""
        self.kv = None
        self.kv = self.chain.kv_cache(slots, capacity)

    def step(self, seqs):
        """One step against the cache: sequence i (slot i) appends its tokens after those its slot holds."""
        self.chain.step(self.kv, seqs)

    def close(self):
        self.kv = self.grads = self.logp = None
        del self.chain
        del self.model


class TorchDecoder:
    """The same model as plain PyTorch (cuBLAS + SDPA, preallocated KV cache), on transformers'
    parameters: the decode baseline with no framework overhead but eager PyTorch's own."""

    def __init__(self, hf, batch, capacity):
        self.cfg, self.m = hf.config, hf.model
        self.head = hf.lm_head.weight
        c = self.cfg
        shape = (batch, c.num_key_value_heads, capacity, c.head_dim)
        self.k = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(c.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(c.num_hidden_layers)]
        theta = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, c.head_dim, 2, device="cuda", dtype=torch.float32) / c.head_dim))

    @staticmethod
    def rms(x, w, eps):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def rope(self, x, pos):  # x [B, H, T, D]
        ang = pos[:, None].float() * self.inv_freq[None, :]
        cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin

    @torch.no_grad()
    def step(self, ids, pos0):
        c, (B, T) = self.cfg, ids.shape
        eps, D = c.rms_norm_eps, c.head_dim
        pos = torch.arange(pos0, pos0 + T, device="cuda")
        x = self.m.embed_tokens(ids)
        for i, layer in enumerate(self.m.layers):
            a = layer.self_attn
            h = self.rms(x, layer.input_layernorm.weight, eps)
            q = (h @ a.q_proj.weight.T).view(B, T, -1, D)
            k = (h @ a.k_proj.weight.T).view(B, T, -1, D)
            v = (h @ a.v_proj.weight.T).view(B, T, -1, D)
            q = self.rope(self.rms(q, a.q_norm.weight, eps).transpose(1, 2), pos)
            k = self.rope(self.rms(k, a.k_norm.weight, eps).transpose(1, 2), pos)
            self.k[i][:, :, pos0:pos0 + T] = k
            self.v[i][:, :, pos0:pos0 + T] = v.transpose(1, 2)
            o = torch.nn.functional.scaled_dot_product_attention(
                q, self.k[i][:, :, :pos0 + T], self.v[i][:, :, :pos0 + T], is_causal=T > 1, enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(B, T, -1) @ a.o_proj.weight.T
            h = self.rms(x, layer.post_attention_layernorm.weight, eps)
            mlp = layer.mlp
            x = x + (torch.nn.functional.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        return self.rms(x[:, -1], self.m.norm.weight, eps) @ self.head.T


KERNEL_FAMILIES = (  # (family, substrings of kernel names), first match wins
    ("attention", ("attention", "flash", "fmha", "sdpa", "Attention")),
    ("GEMM (weight gradients)", ("wgrad", "weight_grad", "combine_units", "sum_rows", "bias_grad")),
    ("GEMM", ("gemm", "Gemm", "sm90_xmma", "cutlass", "nvjet", "ampere", "wgmma")),
    ("LM head / logprob", ("logprob", "log_softmax", "softmax", "chain_partials", "gather", "scatter", "nll")),
    ("norms / RoPE", ("norm", "rope", "rsqrt")),
    ("copies / fills", ("copy", "Copy", "fill", "Fill", "memset", "Memset", "memcpy", "Memcpy")),
)


def kernel_profile(fn, warm=True):
    """One call of fn under torch.profiler (after one unprofiled call when `warm`): GPU kernel time
    by family {family: (ms, launches)}, the top kernels, the top CUDA runtime / driver calls by host
    time, and the call's wall time."""
    from torch.profiler import ProfilerActivity, profile
    if warm:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    fam, top, api = {}, [], []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if e.key.startswith("cu") and e.self_cpu_time_total > 0:
            api.append((e.self_cpu_time_total / 1e3, e.count, e.key))
        if t <= 0 or e.key.startswith("cu") or e.key.startswith("aten::") or e.key.startswith("autograd::"):
            continue
        f = next((f for f, keys in KERNEL_FAMILIES if any(k in e.key for k in keys)), "elementwise / other")
        ms, n = fam.get(f, (0.0, 0))
        fam[f] = (ms + t / 1e3, n + e.count)
        top.append((t / 1e3, e.count, e.key))
    return fam, sorted(top, reverse=True)[:12], sorted(api, reverse=True)[:8], wall * 1e3


def print_step_profile(label, fn, warm=True):
    """One decode step profiled, in a line: wall and kernel time, top host calls and kernels."""
    fam, top, api, wall = kernel_profile(fn, warm)
    print(f"{label}: wall {wall:.2f} ms, kernels {sum(v[0] for v in fam.values()):.2f} ms; "
          f"top host calls {api[:4]}; top kernels {top[:4]}", flush=True)


def profile_rows(name_a, prof_a, name_b, prof_b):
    (fa, ta, aa, wa), (fb, tb, ab, wb) = prof_a, prof_b
    rows = [f"| kernel family | {name_a} ms (launches) | {name_b} ms (launches) | difference ms |",
            "| --- | --- | --- | --- |"]
    for f in [f for f, _ in KERNEL_FAMILIES] + ["elementwise / other"]:
        a, b = fa.get(f, (0.0, 0)), fb.get(f, (0.0, 0))
        if a[1] or b[1]:
            rows.append(f"| {f} | {a[0]:.1f} ({a[1]}) | {b[0]:.1f} ({b[1]}) | {a[0] - b[0]:+.1f} |")
    sa, sb_ = sum(v[0] for v in fa.values()), sum(v[0] for v in fb.values())
    rows.append(f"| **all kernels** | **{sa:.1f}** | **{sb_:.1f}** | **{sa - sb_:+.1f}** |")
    rows.append(f"| wall time of the profiled step | {wa:.1f} | {wb:.1f} | {wa - wb:+.1f} |")
    rows.append(f"| GPU not running kernels (wall − kernels) | {wa - sa:.1f} | {wb - sb_:.1f} | {(wa - sa) - (wb - sb_):+.1f} |")
    for name, top, api in ((name_a, ta, aa), (name_b, tb, ab)):
        rows += ["", f"Top kernels, {name}:", "", "| ms | launches | kernel |", "| --- | --- | --- |"]
        rows += [f"| {ms:.1f} | {n} | `{k[:110]}` |" for ms, n, k in top]
        rows += ["", f"Top CUDA runtime / driver calls by host time, {name}:", "", "| ms | calls | call |",
                 "| --- | --- | --- |"]
        rows += [f"| {ms:.1f} | {n} | `{k}` |" for ms, n, k in api]
    return rows


def draw(points, path, title):
    """Grouped bars: tokens/s of each side for each batch mix, prefill and forward + backward."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    x = range(len(points))
    for ax, (what, a, b) in zip(axes, (("prefill (scoring)", 1, 2), ("forward + backward", 3, 4))):
        ax.bar([i - 0.2 for i in x], [p[a] / 1e3 for p in points], 0.4, label="samebits")
        ax.bar([i + 0.2 for i in x], [p[b] / 1e3 for p in points], 0.4, label="transformers (SDPA)")
        for i, p in enumerate(points):
            ax.text(i - 0.2, p[a] / 1e3, f"{p[b] / p[a]:.2f}×", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x))
        ax.set_xticklabels([p[0].replace(": ", ":\n") for p in points], fontsize=8)
        ax.set_ylabel("thousand tokens / s")
        ax.set_title(what + " (label: samebits time / transformers time)", fontsize=9)
        ax.set_ylim(0, 1.12 * max(max(p[a], p[b]) for p in points) / 1e3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def used_bytes():
    free, total = torch.cuda.mem_get_info()
    return total - free


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--md")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model-dir", default="/tmp/samebits_e2e_model")
    ap.add_argument("--profile", action="store_true",
                    help="add a kernel-time breakdown of one forward + backward of each side (16 × 1024)")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--plot", help="write tokens/s against the batch mix to this PNG (needs matplotlib)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        subprocess.run([os.path.join(args.build, "samebits"), "export-model", args.model_dir, "--shape", "qwen3-8b",
                        "--layers", str(args.layers)], check=True)
    samebits = samebits_from(args.build)
    base = used_bytes()
    sb = Samebits(samebits, args.model_dir)
    sb_weights = used_bytes() - base
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16,
                                                           attn_implementation="sdpa").cuda()
    cfg = hf.config
    V = cfg.vocab_size
    name = torch.cuda.get_device_name()
    out = [f"# The whole chain: samebits vs transformers (SDPA) on {name}", "",
           f"Generated by `python3 bench/bench_chain.py BUILD --layers {args.layers}` (torch {torch.__version__}, "
           f"transformers {transformers.__version__}); do not edit by hand. Qwen3-8B's shape with {args.layers} layers "
           f"(hidden {cfg.hidden_size}, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads × {cfg.head_dim}, "
           f"MLP {cfg.intermediate_size}, vocab {V}), bf16, the same random weights on both sides. "
           "Wall-clock medians with the host work of each side included. samebits weights on the device: "
           f"{sb_weights / 2**30:.1f} GiB.", ""]

    def hf_logp(ids, mask, grad):
        """Selected logprobs of every next token (transformers: logits → fp32 log_softmax → gather);
        `mask` [B, S] marks the real tokens of a right-padded batch (None: no padding)."""
        logits = hf(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        if mask is not None:
            lp = lp * mask[:, 1:]
        if grad:
            lp.sum().backward()
        return lp

    rows_p, rows_fb, rows_prof, plot = [], [], [], []
    gen = torch.Generator().manual_seed(1)
    mixes = [("32 × 512", [512] * 32), ("16 × 1024", [1024] * 16), ("4 × 4096", [4096] * 4),
             ("RL mix: 4 of 1024 … 4096", [4096, 3072, 2048, 1024]),
             ("RL mix: 16 of 256 … 1024", sorted(torch.randint(256, 1025, (16,), generator=gen).tolist(), reverse=True))]
    for label, seq_lens in ([] if args.decode_only else mixes):
        B, S, T = len(seq_lens), max(seq_lens), sum(seq_lens)
        ids = torch.randint(0, V, (B, S), device="cuda")
        padded = any(n != S for n in seq_lens)
        mask = (torch.arange(S, device="cuda")[None, :] < torch.tensor(seq_lens, device="cuda")[:, None]).long() \
            if padded else None
        host = ids.tolist()
        seqs = [host[i][:n] for i, n in enumerate(seq_lens)]
        ones = np.ones(T - B)  # d(sum of logp)/d(logp): one per scored token (all but each sequence's last)
        # prefill (scoring)
        torch.cuda.empty_cache()
        u0 = sb.in_use()
        sb.peak(True)
        t_sb = timed(lambda: sb.forward(seqs), args.reps)
        m_sb = sb.peak(False) - u0
        sb.release()
        torch.cuda.reset_peak_memory_stats()
        m0 = torch.cuda.memory_allocated()
        with torch.no_grad():
            t_hf = timed(lambda: hf_logp(ids, mask, False), args.reps)
        m_hf = torch.cuda.max_memory_allocated() - m0
        with torch.no_grad():
            ref = hf_logp(ids[:1, :seq_lens[0]], None, False)[0].double().cpu()
        ours = torch.tensor(sb.logp[0][1:], dtype=torch.float64)  # entry i: log p(token i | tokens < i)
        diff = (ours - ref).abs().max().item()
        rows_p.append(f"| {label} | {T / t_sb:,.0f} tok/s ({t_sb * 1e3:.1f} ms) | {T / t_hf:,.0f} tok/s ({t_hf * 1e3:.1f} ms) | "
                      f"**{t_sb / t_hf:.2f}×** | {m_sb / 2**30:.1f} / {m_hf / 2**30:.1f} GiB | {diff:.3g} |")
        # forward + backward
        sb.drop_grads()  # the accumulators are made in the phase, as transformers' .grad are
        torch.cuda.empty_cache()
        u0 = sb.in_use()
        sb.peak(True)
        t_sb_fb = timed(lambda: sb.forward_backward(seqs, ones), max(3, args.reps - 2))
        m_sb = sb.peak(False) - u0
        sb.drop_grads()
        sb.release()
        torch.cuda.reset_peak_memory_stats()
        m0 = torch.cuda.memory_allocated()

        def hf_fb():
            hf.zero_grad(set_to_none=False)
            hf_logp(ids, mask, True)
        t_hf_fb = timed(hf_fb, max(3, args.reps - 2))
        m_hf = torch.cuda.max_memory_allocated() - m0
        if args.profile and label == "16 × 1024":
            p_hf = kernel_profile(hf_fb)
            hf.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            p_sb = kernel_profile(lambda: sb.forward_backward(seqs, ones))
            sb.drop_grads()
            sb.release()
            rows_prof = profile_rows("samebits", p_sb, "transformers", p_hf)
            print("\n".join(rows_prof), flush=True)
        hf.zero_grad(set_to_none=True)
        rows_fb.append(f"| {label} | {T / t_sb_fb:,.0f} tok/s ({t_sb_fb * 1e3:.1f} ms) | {T / t_hf_fb:,.0f} tok/s "
                       f"({t_hf_fb * 1e3:.1f} ms) | **{t_sb_fb / t_hf_fb:.2f}×** | {m_sb / 2**30:.1f} / {m_hf / 2**30:.1f} GiB |")
        plot.append((label, T / t_sb, T / t_hf, T / t_sb_fb, T / t_hf_fb))
        del ids, mask
        torch.cuda.empty_cache()
        print(rows_p[-1], rows_fb[-1], sep="\n", flush=True)

    rows_d = []
    prompt, steps = 512, 32
    for B in (() if args.no_decode else (1, 8, 64)):
        torch.cuda.empty_cache()
        ids = torch.randint(0, V, (B, prompt + steps), device="cuda")
        host = ids.tolist()
        sb.cache(B, prompt + steps + 1)
        sb.step([r[:prompt] for r in host])  # the prompts (slot i: sequence i)
        sb_times = []
        for t in range(steps):
            tok = [[r[prompt + t]] for r in host]  # one token a sequence, after the prompt + t its slot holds
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sb.step(tok)
            torch.cuda.synchronize()
            sb_times.append(time.perf_counter() - t0)
        if args.profile and B == 1:  # one more step (the cache has room for it)
            tok = [[r[-1]] for r in host]
            print_step_profile("samebits decode step", lambda: sb.step(tok), warm=False)
        sb.release()

        def hf_decode(backends):
            """transformers' decode steps, SDPA restricted to `backends` (None: torch's own choice)."""
            ctx = torch.nn.attention.sdpa_kernel(backends) if backends else contextlib.nullcontext()
            with torch.no_grad(), ctx:
                o = hf(input_ids=ids[:, :prompt], use_cache=True)
                pkv, times = o.past_key_values, []
                for t in range(steps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    o = hf(input_ids=ids[:, prompt + t:prompt + t + 1], past_key_values=pkv, use_cache=True)
                    pkv = o.past_key_values
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                if args.profile and B == 1:
                    print_step_profile(f"transformers decode step, SDPA {backends or 'default'}",
                                       lambda: hf(input_ids=ids[:, prompt:prompt + 1], past_key_values=pkv, use_cache=True))
            return statistics.median(times)
        SDP = torch.nn.attention.SDPBackend
        hf_default = hf_decode(None)
        hf_flash = hf_decode([SDP.FLASH_ATTENTION, SDP.EFFICIENT_ATTENTION, SDP.MATH])
        hf_times = [min(hf_default, hf_flash)]
        print(f"transformers decode B = {B}: {hf_default * 1e3:.2f} ms with torch's SDPA choice, "
              f"{hf_flash * 1e3:.2f} ms without cuDNN attention", flush=True)
        sdpa_ctx = torch.nn.attention.sdpa_kernel([SDP.FLASH_ATTENTION, SDP.EFFICIENT_ATTENTION, SDP.MATH])
        sdpa_ctx.__enter__()  # left below, after the plain decoder's last step
        plain = TorchDecoder(hf, B, prompt + steps)
        plain.step(ids[:, :prompt], 0)
        pt_times = []
        for t in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            plain.step(ids[:, prompt + t:prompt + t + 1], prompt + t)
            torch.cuda.synchronize()
            pt_times.append(time.perf_counter() - t0)
        if args.profile and B == 1:
            print_step_profile("plain PyTorch decode step",
                               lambda: plain.step(ids[:, prompt + steps - 1:prompt + steps], prompt + steps - 1))
        if B == 1:  # the plain model is the same model: its logits against transformers' at the last step
            with torch.no_grad():
                want = hf(input_ids=ids[:, :prompt + steps]).logits[0, -1].float()
            got = plain.step(ids[:, prompt + steps - 1:prompt + steps], prompt + steps - 1)[0].float()
            print(f"plain PyTorch vs transformers, last-step logits: max |diff| {(got - want).abs().max().item():.3g} "
                  f"(logits up to {want.abs().max().item():.3g})", flush=True)
        del plain
        sdpa_ctx.__exit__(None, None, None)
        a, b, c = statistics.median(sb_times), statistics.median(hf_times), statistics.median(pt_times)
        rows_d.append(f"| {B} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms | {c * 1e3:.2f} ms | **{a / b:.2f}×** / **{a / c:.2f}×** |")
        print(rows_d[-1], flush=True)
        torch.cuda.empty_cache()

    if args.plot:
        draw(plot, args.plot, f"samebits vs transformers (SDPA), Qwen3-8B shape, {args.layers} layers, {name}")
    out += ["Tokens/s count real tokens only. The RL mixes are packed for samebits (no padding) and right-padded "
            "with an attention mask for transformers (SDPA has no packed-sequence path).", ""]
    out += ["## Prefill (scoring every token)", "",
            "| batch | samebits | transformers | samebits time / transformers time | memory samebits / transformers | "
            "max \\|Δlogp\\| (first sequence) |", "| --- | --- | --- | --- | --- | --- |"] + rows_p
    out += ["", "## Forward + backward (gradient of the summed logprobs, every weight)", "",
            "| batch | samebits | transformers | samebits time / transformers time | memory samebits / transformers |",
            "| --- | --- | --- | --- | --- |"] + rows_fb
    if args.profile:
        out += ["", "## Where the forward + backward time goes (16 × 1024, one step, torch.profiler)", "",
                "GPU kernel time of one step of each side, by kernel family (launch gaps not included). Families "
                "are told apart by kernel name: the totals are exact, the split of transformers' time is "
                "approximate (cuDNN's attention kernels, for one, may not name themselves as attention)."]
        out += [""] + rows_prof
    if rows_d:
        out += ["", f"## Decode step ({prompt}-token prompts, median of {steps} steps)", "",
                "| B | samebits | transformers | plain PyTorch (cuBLAS + SDPA) | samebits / transformers / plain |",
                "| --- | --- | --- | --- | --- |"] + rows_d
    emit(out, args.md)
    sb.close()


if __name__ == "__main__":
    sys.exit(main())
