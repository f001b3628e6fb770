"""What every benchmark shares: finding the samebits package of a build, timing, and writing tables.

    import timing                                  # bench/ is on sys.path when a bench/*.py runs
    samebits = timing.samebits_from(BUILD_DIR)     # BUILD_DIR/python/samebits
    ours, theirs = timing.alternate([f, g], reps)  # medians (ms) of CUDA-event times, alternating
    timing.emit(lines, md)                         # print a table, and write it to md when given
    timing.card_slug()                             # "h100", "h200": a table's file name (gpu if none matches)

Three ways to time, each the one its benchmarks' committed tables were made with:
 * alternate: kernels (bench_logprob, bench_lm_head, bench_norm, bench_attention): CUDA events
   around each call, every sample behind an L2 flush and a ~1 ms GPU spin, contenders alternating;
 * wall_median: whole steps with the host's work included (bench_chain): perf_counter around the
   call and a device synchronisation;
 * event_median: whole steps on rotating batches (bench_torch): CUDA events around the call.
And loop_us: a Python op path's host time, a loop of calls (bench_op_overhead, bench_record_overhead).
"""
import os
import re
import statistics
import sys
import time

import torch

LEAD_CYCLES = 2_000_000  # ~1 ms of GPU spin ahead of each sample
_FLUSH = []


def samebits_from(build):
    """The samebits package built in BUILD_DIR (BUILD_DIR/python put first on sys.path)."""
    path = os.path.join(os.path.abspath(build), "python")
    if not os.path.isfile(os.path.join(path, "samebits", "__init__.py")):
        raise SystemExit(f"{path}/samebits not found: configure {build} with pybind11 found (the Python extension "
                         "builds when it is) and build it")
    sys.path.insert(0, path)
    import samebits
    import samebits.torch  # noqa: F401  (the descriptors of torch tensors, raw_ops)
    return samebits


def card_slug():
    """The current device's name as docs/bench/ names tables: h100, h200 (gpu if no model number)."""
    m = re.search(r"[A-Z]\d{2,3}", torch.cuda.get_device_name())
    return m.group(0).lower() if m else "gpu"


def _l2_flush_buffer():
    """256 MB written before every sample (as triton.testing.do_bench does): L2 (50 MiB) then holds
    only dirty lines of it, so every sample starts from the same state, as a kernel does behind
    another that wrote its output: inputs not cached, and write-backs to pay. Without it a kernel's
    time depended on which callable ran before it (up to 9% at 100 µs); a read-only flush instead
    leaves L2 clean and hides up to 50 MiB of the kernel's own write-back (add: 3.2 TB/s, above a
    copy's 3.1)."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(64 << 20, device="cuda", dtype=torch.int32))
    return _FLUSH[0]


def alternate(fns, reps, warm=3):
    """Median milliseconds of each callable fn(i), timed alternately sample by sample (in an order
    rotated every sample), each sample after an L2 flush.

    Each sample starts behind a ~1 ms spin kernel (torch.cuda._sleep), so the host has queued the
    callable's launches before the GPU reaches the start event: the events then time the GPU's work,
    not the host's launch latency (tens of µs through Python, which would dominate kernels of ~100 µs)."""
    for i in range(warm):
        for f in fns:
            f(i)
    flush = _l2_flush_buffer()
    times = [[] for _ in fns]
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
    for i in range(reps):
        for j in range(len(fns)):  # each sample in a rotated order, so no callable always goes first
            k = (i + j) % len(fns)
            f = fns[k]
            s, e = ev[k]
            flush.zero_()  # the same L2 state for every sample, whatever ran before it
            torch.cuda._sleep(LEAD_CYCLES)
            s.record()
            f(i)
            e.record()
            e.synchronize()
            times[k].append(s.elapsed_time(e))
    return [statistics.median(t) for t in times]


def wall_median(fn, reps, warm=1):
    """Median seconds of fn(), host work included: perf_counter around the call and a device
    synchronisation, after `warm` untimed calls."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def event_median(fn, batches, reps):
    """Median milliseconds of fn(batch) over `reps` calls rotating over `batches`, CUDA events around
    the whole call (host work included), after 2 untimed calls."""
    for i in range(2):
        fn(batches[i % len(batches)])
    times = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(batches[r % len(batches)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def emit(lines, md=None):
    """Prints a generated table and writes it to `md` when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if md:
        with open(md, "w") as f:
            f.write(text)


def kernel_ms(fn, reps=5):
    """Median-free GPU kernel time of one fn() call, ms: the profiler's device time of every kernel
    the calls launched, summed over `reps` calls and divided by them (after one unprofiled call).
    What the GPU spent, without the host's launch latency or its Python."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            total_us += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return total_us / reps / 1e3


def loop_us(fn, calls, sync=None, clock=time.perf_counter):
    """Host time of one fn() call, µs: `calls` calls back to back with no synchronisation inside the
    loop, the loop's time (clock: perf_counter, or process_time for this process's CPU time) over
    the calls; `sync` (default: the CUDA device's) after a warm-up call and after the loop."""
    sync = sync or torch.cuda.synchronize
    fn()
    sync()
    t0 = clock()
    for _ in range(calls):
        fn()
    sync()
    return (clock() - t0) / calls * 1e6


def host_us(fn, reps=30):
    """Median host time of one fn() call, µs: perf_counter around the call while a spin kernel keeps
    the GPU busy ahead of it, so no call waits on the GPU — the Python op path's own cost."""
    fn()
    torch.cuda.synchronize()
    times = []
    torch.cuda._sleep(LEAD_CYCLES * 20)  # ~20 ms of GPU work ahead of the calls
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6
