#!/usr/bin/env python3
"""Generation on samebits (samebits.Engine, CUDA backend) with a Qwen3-8B-shaped model.

    python3 bench/bench_generate.py BUILD_DIR [--decode] [--rollout] [--quick] [--layers 36] [--out OUT.md]

Two parts (both unless one is named):
 * --decode: the decode step against its bandwidth bound. For batch B in 1, 8, 64, 256 and context
   C in 1024, 4096 (a case whose KV cache does not fit the GPU's free memory is skipped and says
   so): B prompts of C random tokens are submitted to one engine (Engine.submit), stepped until
   every request is decoding (a step that draws B tokens: every request drew in it), then N decode
   steps are timed together (wall clock from a device synchronisation to one after the N-th step,
   divided by N: with overlap_steps, the default, a step returns once it is launched and the step
   before it is applied, so steps are only measured back to back), three ways: CUDA graphs with
   overlapped steps (the default), graphs with every step waiting for its draws
   (overlap_steps=False), and eager steps (cuda_graphs=False).
   bound = (weight bytes read + B × C × layers × 2 × kv_heads × head_dim × 2 bytes of KV) / copy
   bandwidth, the bandwidth measured in this process (a device-to-device torch copy, bytes read +
   written, median of 20). The weight bytes read are every weight's but the embedding table's, of
   which a step gathers B rows. (Until session 17 the whole table counted, 1.24 GB more: a bound
   7-8% more lenient.)
 * --rollout: a GRPO-like rollout: P prompts × L random tokens, n samples each, N new tokens,
   temperature 1, no stop token (random weights: every sample runs to N). samebits.Engine
   (max_slots and the KV pool sized from the free memory so that no request is preempted) against
   transformers' generate on the same module (do_sample, temperature 1, top_k 0, top_p 1,
   num_return_sequences n, SDPA attention, as many prompts a call as the free memory allows),
   generated tokens/s of each (prefill included) and their ratio, against the workload's roofline
   (the formula is printed with the numbers). Then every prompt + completion is rescored by the
   trainer's chain (samebits.hf.Scorer.logprobs, float64) and compared with the engine's reported
   logprobs: max |Δ| over every generated token must be exactly 0 (bitwise equal); the script
   exits 1 otherwise.

The model is transformers' Qwen3ForCausalLM with Qwen3-8B's shape (hidden 4096, 32 / 8 heads of
128, MLP 12288, vocab 151936, untied, RoPE θ 1e6), --layers layers (36: all of Qwen3-8B), made on
the GPU in bf16 with random weights (normal, std 0.02; norms 1); samebits reads the same tensors in
place (samebits.hf.model_of), so both sides run one copy of the weights. Markdown goes to stdout
and to --out (default docs/bench/generate-<card>.md, card h100 / h200 from the device's name).

Run status: written on a machine without a GPU, torch or transformers; NOT run on a GPU yet. It
compiles (python3 -m py_compile, pyflakes clean); decode_case (the submit / step loop and its
all-decoding test), roofline and rescore ran on the CPU backend with the built-in model under
Debian's torch 1.13 (CUDA synchronisation stubbed out); the model building, the bandwidth and
memory measurements, the CUDA engine and transformers' generate are read from their sources, not
run. On the first GPU run check: the engine's first CUDA run (docs/engine.md lists it as untested);
the time of the default invocation (~6 min on an H100 is the aim, estimated, not measured: use
--quick, or --prompts / --new-tokens, to scale down); the memory reserves (--reserve-gib);
transformers' generate arguments on the installed version.
"""
import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import transformers

from timing import card_slug, emit, event_median, samebits_from

GIB = 1 << 30
PAGE = 64  # the engine's KV page, in tokens


def qwen3_8b(layers):
    """transformers' Qwen3 at Qwen3-8B's shape with `layers` layers, bf16 on the GPU, random weights."""
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                   num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                   head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16 at once: no fp32 copy of 8B weights
    try:
        with torch.device("cuda"):
            model = transformers.Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    with torch.no_grad():  # whatever transformers' own init did: the same distribution every version
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # the RMSNorm weights
            else:
                p.normal_(0.0, 0.02)
    model.config._attn_implementation = "sdpa"
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # no stop: every sample runs to max_new_tokens
    model.generation_config.bos_token_id = None
    return model.eval()


def copy_bandwidth():
    """Bytes read + written per second by a device-to-device copy of 1 GiB, median of 20."""
    src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = event_median(lambda _: dst.copy_(src), [None], 20)
    return 2 * GIB / (ms / 1e3)  # the buffers go with the frame (Memory.free gives them back)


class Memory:
    """The GPU's free memory as both allocators see it, after each gives back what it caches."""

    def __init__(self, core):
        self.core = core

    def free(self):
        self.core.device_memory_release("cuda")
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    def activation_bytes_per_row(self, scorer, rows=1024):
        """samebits' device bytes per row of a forward (its every activation, kept for a backward:
        what one engine step holds, per row), measured on one `rows`-token forward."""
        self.free()
        base = self.core.device_memory_in_use("cuda")
        self.core.device_memory_peak("cuda", True)
        scorer.logprobs([[0] * rows])
        per_row = (self.core.device_memory_peak("cuda", False) - base) / rows
        self.free()
        return per_row


def kv_bytes_per_token(cfg):
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # keys + values, bf16


def weight_bytes(model, rows=0):
    """The weight bytes a step of `rows` tokens reads: every weight but the input embedding table, of
    which it gathers `rows` rows."""
    emb = model.get_input_embeddings().weight
    others = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)
    return others + rows * emb.shape[1] * emb.element_size()


def random_prompts(count, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


# ---------------------------------------------------------------------------------------- decode
def decode_case(samebits, sb_model, cfg, B, C, steps, mbt, reserve, memory, temperature, graphs, overlap=True):
    """One (B, C) case: the mean of `steps` back-to-back decode steps in seconds, or a string saying
    why it was skipped; decode steps replayed from CUDA graphs or run eagerly, overlapped or not."""
    warm = 2
    prefill_steps = math.ceil(B * C / max(1, mbt - B)) + 2  # an upper bound: decode rows share each step's budget
    max_new = prefill_steps + warm + steps + 8  # the first request decodes while the others prefill
    context = C + max_new
    pages = B * math.ceil(context / PAGE)
    kv = pages * PAGE * kv_bytes_per_token(cfg)
    free = memory.free()
    if kv + reserve > free:
        return (f"skipped: its KV cache ({B} × {context} tokens, {kv / GIB:.1f} GiB) and the step's reserve "
                f"({reserve / GIB:.1f} GiB) do not fit the free {free / GIB:.1f} GiB")
    engine = samebits.Engine(sb_model, "cuda", max_slots=B, max_batch_tokens=mbt, max_context=context,
                             page_size=PAGE, kv_pages=pages, cuda_graphs=graphs, overlap_steps=overlap)
    for i, p in enumerate(random_prompts(B, C, cfg.vocab_size, seed=1000 + B + C)):
        engine.submit(p, samebits.SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=i))
    t0, last, n = time.perf_counter(), engine.generated, 0
    while True:  # prefill: until a step draws B tokens (every request drew in it: all decode from now on)
        if not engine.step():
            raise SystemExit(f"decode B={B} C={C}: the engine ran out of work during the prefill")
        n += 1
        drew, last = engine.generated - last, engine.generated
        if drew == B:
            break
        if n > 4 * prefill_steps:
            raise SystemExit(f"decode B={B} C={C}: not every request decodes after {n} steps")
    prefill_s = time.perf_counter() - t0
    def run_steps(count):
        nonlocal last
        for _ in range(count):
            engine.step()
            drew, last = engine.generated - last, engine.generated
            if drew != B:
                raise SystemExit(f"decode B={B} C={C}: a timed step drew {drew} tokens, not {B}")

    run_steps(warm)
    graph_steps, overlapped = engine.graph_steps, engine.overlapped_steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_steps(steps)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    if graphs and engine.graph_steps - graph_steps < steps:
        raise SystemExit(f"decode B={B} C={C}: {engine.graph_steps - graph_steps} of the timed steps replayed a graph")
    if overlap and engine.overlapped_steps - overlapped < steps:
        raise SystemExit(f"decode B={B} C={C}: {engine.overlapped_steps - overlapped} of the timed steps overlapped")
    how = ('graphs' if graphs else 'eager') + ('' if overlap else ', steps waited')
    print(f"decode B={B} C={C} ({how}): prefill {n} steps in {prefill_s:.1f} s; {steps} steps, "
          f"{step_s * 1e3:.2f} ms a step", flush=True)
    del engine
    return step_s


def decode_part(samebits, sb_model, hf, args, bw, memory, per_row):
    cfg = hf.config
    kvb = kv_bytes_per_token(cfg)
    rows, notes = [], []
    for C in args.contexts:
        for B in args.batches:
            reserve = int(per_row * max(args.max_batch_tokens, B) * 1.1) + int(args.reserve_gib * GIB)
            # The default engine always; the other two unless --graphs-only (quick A/B runs).
            modes = ((True, True),) if args.graphs_only else ((True, True), (True, False), (False, True))
            t, waited, eager = (list(decode_case(samebits, sb_model, cfg, B, C, args.steps, args.max_batch_tokens,
                                                 reserve, memory, args.temperature, graphs, overlap)
                                     for graphs, overlap in modes) + [None, None])[:3]
            if isinstance(t, str):
                print(f"decode B={B} C={C}: {t}", flush=True)
                notes.append(f"- B = {B}, C = {C}: {t}.")
                continue
            bound = (weight_bytes(hf, B) + B * C * kvb) / bw
            ms = lambda x: "–" if x is None else f"{x * 1e3:.2f}"  # noqa: E731
            pct = lambda x: "–" if x is None else f"{100 * bound / x:.0f}%"  # noqa: E731
            rows.append(f"| {B} | {C} | {ms(t)} | {ms(waited)} | {ms(eager)} | {bound * 1e3:.2f} | "
                        f"{pct(t)} | {pct(waited)} | {pct(eager)} | {B / t:,.0f} |")
            print(rows[-1], flush=True)
            if args.ab:  # the same case again in this process with a tuning hook set (A/B of a kernel choice)
                hook, value = args.ab.split("=")
                before = samebits._core._set_tuning(hook, int(value))
                try:
                    t_b = decode_case(samebits, sb_model, cfg, B, C, args.steps, args.max_batch_tokens, reserve,
                                      memory, args.temperature, True, True)
                finally:
                    samebits._core._set_tuning(hook, before)
                if not isinstance(t_b, str):
                    notes.append(f"- B = {B}, C = {C}, `{args.ab}` (`samebits._core._set_tuning`): {ms(t_b)} ms a step, "
                                 f"{pct(t_b)} of the bound, against {ms(t)} ms without it in the same process.")
                    print(notes[-1], flush=True)
    out = ["## Decode step", "",
           f"B prompts of C random tokens submitted to one engine (`Engine.submit`), stepped until every request "
           f"decodes, then {args.steps} decode steps back to back (wall clock from a device synchronisation to one "
           f"after the last, over {args.steps}), each step one CUDA graph replay launched while the step before it "
           f"runs (`cuda_graphs=True`, `overlap_steps=True`: the defaults); in engines of their own, graph replays "
           f"each waiting for its draws before the next step is prepared (`overlap_steps=False`), and eager steps "
           f"(`cuda_graphs=False`); temperature {args.temperature}, `max_batch_tokens` {args.max_batch_tokens}, pages of "
           f"{PAGE} tokens. bound = (weights read {weight_bytes(hf) / 1e9:.2f} GB + B embedding rows + B × C × "
           f"{cfg.num_hidden_layers} layers × 2 × {cfg.num_key_value_heads} kv heads × {cfg.head_dim} × 2 bytes of "
           f"KV) / {bw / 1e12:.2f} TB/s (the measured copy bandwidth): every weight but the input embedding table, "
           "of which a step gathers B rows. (Until session 17 the whole table counted, 1.24 GB more: a bound 7-8% "
           "more lenient.)", "",
           "| B | C | step ms (graphs) | step ms (graphs, steps waited) | step ms (eager) | bound ms | % of bound "
           "(graphs) | % of bound (steps waited) | % of bound (eager) | tokens/s (graphs) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + rows
    return out + ([""] + notes if notes else [])


# ---------------------------------------------------------------------------------------- rollout
def roofline(P, L, n, N, W, kvb, kv_tokens, bw):
    """The workload's memory roofline: (decode steps × W + every generated token's KV reads) / bw,
    steps = N × ceil(P / requests the KV pool holds at once at full length). Returns (seconds,
    steps, requests at once, KV bytes read)."""
    footprint = (L // PAGE) * PAGE + n * math.ceil((L % PAGE + N) / PAGE) * PAGE  # the prompt's full pages shared
    at_once = max(1, min(P, kv_tokens // footprint))
    steps = N * math.ceil(P / at_once)
    kv_read = P * n * kvb * (N * L + N * (N - 1) / 2)  # token t of a sample reads L + t keys and values
    return (steps * W + kv_read) / bw, steps, at_once, kv_read


def rescore(scorer, prompts, completions, per_row, memory, reserve):
    """max |Δ| between every generated token's reported logprob and the trainer's (Scorer.logprobs of
    prompt + completion, float64), and how many of them are not bitwise equal."""
    seqs = [(p, c) for p, cs in zip(prompts, completions) for c in cs]
    budget = max(1, int((memory.free() - reserve) / (per_row * 1.2)))
    worst, unequal, total, at = 0.0, 0, 0, 0
    while at < len(seqs):
        part, tokens = [], 0
        while at < len(seqs) and (not part or tokens + len(seqs[at][0]) + len(seqs[at][1].tokens) <= budget):
            part.append(seqs[at])
            tokens += len(seqs[at][0]) + len(seqs[at][1].tokens)
            at += 1
        scored = scorer.logprobs([p + list(c.tokens) for p, c in part])
        for (p, c), lp in zip(part, scored):
            want, got = lp[len(p):], np.asarray(c.logprobs)
            total += len(got)
            unequal += int(np.count_nonzero(want.view(np.uint64) != got.view(np.uint64)))
            d = np.abs(want - got)
            worst = max(worst, float(np.nanmax(d)) if len(d) else 0.0, math.inf if np.isnan(d).any() else 0.0)
    return worst, unequal, total


def rollout_part(samebits, sb_model, hf, args, bw, memory, per_row):
    cfg = hf.config
    P, L, n, N = args.prompts, args.prompt_len, args.n, args.new_tokens
    W, kvb = weight_bytes(hf), kv_bytes_per_token(cfg)
    prompts = random_prompts(P, L, cfg.vocab_size, seed=7)
    total = P * n * N
    # samebits: a KV pool from the free memory, and as many slots as hold full-length requests in it.
    reserve = int(per_row * args.max_batch_tokens * 1.1) + int(args.reserve_gib * GIB)
    free = memory.free()
    pages = int((free - reserve) // (PAGE * kvb))
    roof_s, roof_steps, at_once, kv_read = roofline(P, L, n, N, W, kvb, pages * PAGE, bw)
    if pages * PAGE < n * (L + N):
        raise SystemExit(f"rollout: the free memory ({free / GIB:.1f} GiB) holds {pages} KV pages, less than one "
                         f"request's {n} samples of {L + N} tokens")
    engine = samebits.Engine(sb_model, "cuda", max_slots=at_once * n, max_batch_tokens=args.max_batch_tokens,
                             max_context=L + N, page_size=PAGE, kv_pages=pages)
    params = samebits.SamplingParams(n=n, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=N, seed=11)
    print(f"rollout: samebits, {P} × {L} tokens, n {n}, {N} new; {at_once * n} slots, KV pool {pages} pages "
          f"({pages * PAGE * kvb / GIB:.1f} GiB)", flush=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    sb_s = time.perf_counter() - t0
    sb_tokens = sum(len(c.tokens) for cs in out for c in cs)
    errors = [c.error for cs in out for c in cs if c.finish_reason == "error"]
    if errors:
        raise SystemExit(f"rollout: {len(errors)} requests failed, the first: {errors[0]}")
    sb_steps, sb_preempted = engine.steps, engine.preemptions
    del engine
    print(f"rollout: samebits {sb_tokens} tokens in {sb_s:.1f} s ({sb_tokens / sb_s:,.0f} tokens/s, {sb_steps} steps, "
          f"{sb_preempted} preemptions)", flush=True)

    # The trainer's logprobs of every prompt + completion, against the rollout's.
    scorer = samebits.hf.Scorer(hf, "cuda")
    worst, unequal, checked = rescore(scorer, prompts, out, per_row, memory, int(args.reserve_gib * GIB))
    del scorer
    print(f"rollout: rollout vs trainer logprobs over {checked} generated tokens: max |Δ| {worst:.3g}, "
          f"{unequal} not bitwise equal", flush=True)
    del out

    # transformers' generate on the same module, as many prompts a call as its KV cache and prefill fit.
    free = memory.free()
    per_row_hf = (L + N) * kvb * 1.3 + L * (3 * cfg.intermediate_size + 6 * cfg.hidden_size) * 2 + 3 * cfg.vocab_size * 4
    per_call = args.hf_batch or max(1, min(P, int((free - args.reserve_gib * GIB) / per_row_hf) // n))
    hf_tokens, hf_s, done, calls = 0, 0.0, 0, 0
    while done < P and (calls == 0 or hf_s <= args.hf_budget_s):
        ids = torch.tensor(prompts[done:done + per_call], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            seqs = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, num_return_sequences=n, max_new_tokens=N, pad_token_id=0,
                               eos_token_id=None)
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            if per_call == 1:
                raise
            del ids
            per_call //= 2  # the estimate was short: half the prompts a call, that call again (not timed)
            print(f"rollout: transformers ran out of memory; {per_call} prompts a call from now on", flush=True)
            memory.free()
            continue
        hf_s += time.perf_counter() - t0
        hf_tokens += seqs.numel() - seqs.shape[0] * ids.shape[1]
        done += ids.shape[0]
        calls += 1
        print(f"rollout: transformers call {calls}: {ids.shape[0]} prompts × {n}, {hf_s:.1f} s so far", flush=True)
        del seqs, ids
    memory.free()
    sb_rate, hf_rate = sb_tokens / sb_s, hf_tokens / hf_s
    roof_rate = total / roof_s
    cut = "" if done == P else (f" (the first {done} of {P} prompts: calls stop after --hf-budget-s {args.hf_budget_s:g} s; "
                                "every call is alike, so its rate stands for all)")
    lines = ["## GRPO-like rollout", "",
             f"{P} prompts × {L} random tokens, n = {n} samples each, {N} new tokens (no stop token), temperature 1, "
             f"top-k 0, top-p 1: {total:,} generated tokens. Wall clock of the whole rollout, prefill included.", "",
             "| engine | batch | time s | generated tokens | tokens/s | % of roofline |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| samebits.Engine (cuda) | {at_once * n} slots ({at_once} prompts × {n}), KV pool "
             f"{pages * PAGE * kvb / GIB:.1f} GiB, {sb_steps} steps, {sb_preempted} preemptions | {sb_s:.1f} | "
             f"{sb_tokens:,} | {sb_rate:,.0f} | {100 * sb_rate / roof_rate:.0f}% |",
             f"| transformers generate ({hf.config._attn_implementation}) | {per_call} prompts × {n} a call{cut} | "
             f"{hf_s:.1f} | {hf_tokens:,} | {hf_rate:,.0f} | {100 * hf_rate / roof_rate:.0f}% |",
             f"| roofline | | {roof_s:.1f} | {total:,} | {roof_rate:,.0f} | 100% |", "",
             f"**samebits / transformers tokens/s: {sb_rate / hf_rate:.2f}×.**", "",
             f"Roofline = (decode steps × weight bytes + KV bytes read) / copy bandwidth = ({roof_steps:,} × "
             f"{W / 1e9:.2f} GB + {kv_read / 1e9:,.0f} GB) / {bw / 1e12:.2f} TB/s = {roof_s:.1f} s. Decode steps = N × "
             f"⌈P / requests at once⌉ = {N} × ⌈{P} / {at_once}⌉, requests at once = what samebits' KV pool holds at full "
             f"length, a prompt's full pages shared by its samples ({L // PAGE * PAGE} + {n} × "
             f"{math.ceil((L % PAGE + N) / PAGE) * PAGE} tokens a request). KV bytes read = P × n × (N × L + N(N − 1)/2) "
             f"× {kvb:,} bytes a token (every generated token reads its context's keys and values once). The prefill "
             "(compute-bound) is left out: the bound is lenient by its time.", "",
             f"Rollout vs trainer: every prompt + completion rescored by `samebits.hf.Scorer.logprobs` (float64): max "
             f"|Δ| over {checked:,} generated tokens = **{worst:.3g}**, {unequal} not bitwise equal "
             f"({'PASS' if worst == 0 and unequal == 0 else 'FAIL'})."]
    return lines, worst == 0 and unequal == 0 and checked == sb_tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--decode", action="store_true", help="run the decode-step part (default: both parts)")
    ap.add_argument("--rollout", action="store_true", help="run the rollout part (default: both parts)")
    ap.add_argument("--quick", action="store_true",
                    help="a small run: decode B 1, 8, 64 at C 1024, 16 steps; rollout 16 × 256, n 4, 256 new")
    ap.add_argument("--layers", type=int, default=36, help="layers of the Qwen3-8B-shaped model (36: all)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], help="decode B values (1,8,64,256)")
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], help="decode C values (1024,4096)")
    ap.add_argument("--steps", type=int, help="timed decode steps a case (32)")
    ap.add_argument("--temperature", type=float, default=1.0, help="the decode part's sampling temperature")
    ap.add_argument("--graphs-only", action="store_true",
                    help="decode: only the default engine (graphs, overlapped steps), not the waited and eager ones")
    ap.add_argument("--ab", metavar="HOOK=VALUE",
                    help="decode: each case again with samebits._core._set_tuning(HOOK, VALUE) (e.g. fused_swiglu=1)")
    ap.add_argument("--prompts", type=int, help="rollout prompts P (64)")
    ap.add_argument("--prompt-len", type=int, help="rollout prompt length L (512)")
    ap.add_argument("-n", type=int, help="rollout samples a prompt (8)")
    ap.add_argument("--new-tokens", type=int, help="rollout new tokens N (1024)")
    ap.add_argument("--max-batch-tokens", type=int, default=2048, help="the engine's step budget (rows)")
    ap.add_argument("--hf-batch", type=int, help="transformers: prompts a generate call (default: what memory fits)")
    ap.add_argument("--hf-budget-s", type=float, default=150.0,
                    help="transformers: start no new generate call after this many seconds (its rate is reported)")
    ap.add_argument("--reserve-gib", type=float, default=3.0, help="GPU memory kept out of the KV budgets")
    ap.add_argument("--out", help="markdown file (default docs/bench/generate-<card>.md)")
    args = ap.parse_args()
    quick = args.quick
    defaults = dict(batches=[1, 8, 64] if quick else [1, 8, 64, 256], contexts=[1024] if quick else [1024, 4096],
                    steps=16 if quick else 32, prompts=16 if quick else 64, prompt_len=256 if quick else 512,
                    n=4 if quick else 8, new_tokens=256 if quick else 1024)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    both = not args.decode and not args.rollout
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate: no CUDA device")
    samebits = samebits_from(args.build)
    import samebits.hf  # noqa: F401  (the transformers door)
    if not samebits.cuda_available():
        raise SystemExit("bench_generate: this samebits build has no CUDA backend")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_path = args.out or os.path.join(repo, "docs", "bench", f"generate-{card_slug()}.md")
    torch.manual_seed(0)
    t_start = time.perf_counter()
    hf = qwen3_8b(args.layers)
    cfg = hf.config
    sb_model = samebits.hf.model_of(hf, "cuda")  # the module's tensors, read in place
    memory = Memory(samebits._core)
    bw = copy_bandwidth()
    per_row = memory.activation_bytes_per_row(samebits.hf.Scorer(hf, "cuda"))
    name = torch.cuda.get_device_name()
    print(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s; weights {weight_bytes(hf) / GIB:.1f} GiB; samebits holds "
          f"{per_row / 2**20:.2f} MiB a row of a step; free {memory.free() / GIB:.1f} GiB", flush=True)
    cmd = "python3 bench/bench_generate.py BUILD" + (" --quick" if quick else "") + \
        ("" if args.layers == 36 else f" --layers {args.layers}") + \
        ("" if both else (" --decode" if args.decode else "") + (" --rollout" if args.rollout else ""))
    md = [f"# Generation: samebits.Engine on {name}", "",
          f"Generated by `{cmd}` (torch {torch.__version__}, transformers {transformers.__version__}); do not edit by "
          f"hand. Qwen3-8B's shape with {args.layers} layers (hidden {cfg.hidden_size}, {cfg.num_attention_heads} / "
          f"{cfg.num_key_value_heads} heads × {cfg.head_dim}, MLP {cfg.intermediate_size}, vocab {cfg.vocab_size}), "
          f"random bf16 weights ({weight_bytes(hf) / 1e9:.2f} GB) made by transformers on the GPU; samebits reads the "
          f"same tensors in place. Copy bandwidth {bw / 1e12:.2f} TB/s (a device-to-device copy of 1 GiB, bytes read "
          "+ written, median of 20). The engine draws on the device (`Chain::sample_rows`: no logits to the host).", ""]
    ok = True
    if both or args.decode:
        md += decode_part(samebits, sb_model, hf, args, bw, memory, per_row) + [""]
    if both or args.rollout:
        lines, ok = rollout_part(samebits, sb_model, hf, args, bw, memory, per_row)
        md += lines + [""]
    md.append(f"Total time of the run: {time.perf_counter() - t_start:.0f} s.")
    emit(md, out_path)
    if not ok:
        print("bench_generate: the rollout's logprobs are NOT the trainer's bit for bit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
