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
    ap.add_argument("--dump", type=int, default=0,
                    help="also list the first DUMP kernels of one step in order: start, duration, gap (µs)")
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
        for _ in range(3):  # the bucket's graph captured (and replayed) before the profiler starts
            engine.step()
        fam, top, api, wall = bench_chain.kernel_profile(engine.step, warm=True)
        mode = "eager" if args.eager else (f"graphs ({engine.graph_steps} steps replayed"
                                           f"{'; off: ' + engine.graphs_off_reason if engine.graphs_off_reason else ''})")
        print(f"## B={B} C={C}, {mode}: wall {wall:.2f} ms, kernels {sum(v[0] for v in fam.values()):.2f} ms")
        for f, (ms, n) in sorted(fam.items(), key=lambda kv: -kv[1][0]):
            print(f"  family {f}: {ms:.2f} ms ({n} launches)")
        for ms, n, k in top:
            print(f"  kernel {ms:.2f} ms x{n}: {k[:140]}")
        for ms, n, k in api:
            print(f"  host {ms:.2f} ms x{n}: {k}")
        timeline(engine, 3, args.dump)
        del engine


def timeline(engine, steps, dump=0):
    """Where the GPU waits, from the profiler's timeline of `steps` consecutive steps run back to back
    (no synchronisation between them: with overlap_steps a step is launched while the one before it
    runs): the kernels' busy time (their union) against their span, and the gaps between kernels —
    those over 20 µs are the GPU waiting for the host (bookkeeping, staging, the graph launch)."""
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
    if not kernels:
        print("  timeline: no kernels recorded")
        return
    busy, gaps, end = 0.0, [], kernels[0][0]
    for a, b in kernels:
        if a > end:
            gaps.append(a - end)
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    span = end - kernels[0][0]
    if dump:
        named = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                       if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))
        t0, prev_end = named[0][0], named[0][0]
        print("  start µs | duration µs | gap to the previous kernel's end µs | kernel")
        for a, b, name in named[:dump]:
            print(f"  {a - t0:9.1f} | {b - a:8.1f} | {a - prev_end:+7.1f} | {name[:90]}")
            prev_end = max(prev_end, b)
    long_gaps = sorted((g for g in gaps if g > 20.0), reverse=True)
    print(f"  timeline of {steps} steps back to back: wall {wall:.2f} ms ({wall / steps:.2f} a step); kernels span "
          f"{span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms ({busy / steps / 1e3:.2f} a step); gaps {sum(gaps) / 1e3:.2f} ms "
          f"in {len(gaps)}, of which {len(long_gaps)} over 20 µs hold {sum(long_gaps) / 1e3:.2f} ms (largest "
          f"{', '.join(f'{g:.0f}' for g in long_gaps[:6])} µs)")


if __name__ == "__main__":
    main()
