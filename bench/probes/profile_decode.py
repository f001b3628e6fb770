#!/usr/bin/env python3
"""Where a decode step of the Qwen3-8B-shaped engine goes: one step under torch.profiler, per case.

    python3 bench/probes/profile_decode.py BUILD_DIR [--layers 36] [--cases 1x1024,64x1024] [--eager]

Prints, per (B, C): the step's wall time, its kernel time by family, the top kernels and the top
CUDA host calls (the gap between wall and kernels is the host's). A probe, not a benchmark."""
import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_chain  # noqa: E402
import bench_generate as bg  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--cases", default="1x1024,64x1024")
    ap.add_argument("--eager", action="store_true", help="every step eager (default: decode steps replay CUDA graphs)")
    args = ap.parse_args()
    samebits = bg.samebits_from(args.build)
    import samebits.hf  # noqa: F401
    hf = bg.qwen3_8b(args.layers)
    sb_model = samebits.hf.model_of(hf, "cuda")
    cfg = hf.config
    for case in args.cases.split(","):
        B, C = (int(x) for x in case.split("x"))
        context = C + 64
        engine = samebits.Engine(sb_model, "cuda", max_slots=B, max_batch_tokens=2048, max_context=context,
                                 page_size=bg.PAGE, kv_pages=B * math.ceil(context / bg.PAGE),
                                 cuda_graphs=not args.eager)
        for i, p in enumerate(bg.random_prompts(B, C, cfg.vocab_size, seed=7 + B)):
            engine.submit(p, samebits.SamplingParams(temperature=1.0, max_new_tokens=60, seed=i))
        last = engine.generated
        while True:
            engine.step()
            drew, last = engine.generated - last, engine.generated
            if drew == B:
                break
        fam, top, api, wall = bench_chain.kernel_profile(engine.step, warm=True)
        mode = "eager" if args.eager else f"graphs ({engine.graph_steps} steps replayed)"
        print(f"## B={B} C={C}, {mode}: wall {wall:.2f} ms, kernels {sum(v[0] for v in fam.values()):.2f} ms")
        for f, (ms, n) in sorted(fam.items(), key=lambda kv: -kv[1][0]):
            print(f"  family {f}: {ms:.2f} ms ({n} launches)")
        for ms, n, k in top:
            print(f"  kernel {ms:.2f} ms x{n}: {k[:140]}")
        for ms, n, k in api:
            print(f"  host {ms:.2f} ms x{n}: {k}")
        timeline(engine, 3)
        del engine


def timeline(engine, steps):
    """Where the GPU waits, from the profiler's timeline of `steps` consecutive steps: the kernels'
    busy time (their union), the gaps between consecutive kernels inside a step (launch latency,
    dependencies), and the GPU idle between steps (the host's part: bookkeeping, staging, the
    launch), and how long after the graph launch call begins its first kernel starts."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch = bench_chain.torch
    engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))
    launches = sorted(e.time_range.start for e in events if e.name in ("cudaGraphLaunch", "cuGraphLaunch"))
    if not kernels or len(launches) != steps:
        print(f"  timeline: {len(kernels)} kernels, {len(launches)} graph launches for {steps} steps: not a graph "
              "step each, no breakdown")
        return
    per_step = []  # (first start, last end, busy, gaps, gaps over 2 µs, first start − launch) a step, µs
    for i, launch in enumerate(launches):
        until = launches[i + 1] if i + 1 < steps else float("inf")
        ks = [k for k in kernels if launch <= k[0] < until]
        if not ks:
            print(f"  timeline: no kernel after graph launch {i}")
            return
        busy, gaps, big, end = 0.0, 0.0, 0, ks[0][0]
        for a, b in ks:
            gaps += max(0.0, a - end)
            big += a - end > 2.0
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        per_step.append((ks[0][0], end, busy, gaps, big, ks[0][0] - launch))
    between = [per_step[i + 1][0] - per_step[i][1] for i in range(steps - 1)]
    print(f"  timeline of {steps} graph steps, wall {wall:.2f} ms: a step's kernels span "
          f"{', '.join(f'{(b - a) / 1e3:.2f}' for a, b, *_ in per_step)} ms, busy "
          f"{', '.join(f'{x[2] / 1e3:.2f}' for x in per_step)} ms, gaps between kernels "
          f"{', '.join(f'{x[3] / 1e3:.2f} ({x[4]} over 2 µs)' for x in per_step)} ms; GPU idle between steps "
          f"{', '.join(f'{x / 1e3:.2f}' for x in between)} ms; first kernel "
          f"{', '.join(f'{x[5]:.0f}' for x in per_step)} µs after its graph launch call began")



if __name__ == "__main__":
    main()
