#!/usr/bin/env python3
"""Host time a call that records a backward adds, op by op, on samebits' C++ dispatcher ops
(python/samebits/torch/_torch_ops.cpp: the autograd node, the saved tensors, the history).

    python3 bench/bench_record_overhead.py [--lib BUILD/python/samebits/torch/_torch_ops.so]
                                           [--calls 10000] [--device cpu]

Each op runs on tiny tensors `--calls` times back to back in three modes: no_grad (nothing recorded),
recording (inputs that require grad, grad mode on) and recording + backward (torch.autograd.backward
of the outputs with ready-made gradients). A mode's time is the median of 5 rounds (perf_counter,
one device synchronisation a round; an op's three modes alternate round by round, as the machine's
load moves); "adds", the median of the rounds' recording − no_grad: the node, the saved tensors and
what only a backward needs (rstd, lse). The library is loaded by path (torch.ops.load_library), so two builds of it can
be timed with the same torch, one process each, without samebits.torch's Python modules (whose
custom_op torch 1.13 lacks). OMP_NUM_THREADS=1 steadies the CPU's numbers.
"""
import argparse
import os
import statistics
import time

import torch

from timing import loop_us  # bench/ is on sys.path when this file runs


def cases(E, dev, grad):
    T, H, I, V, Hq, Hkv, D = 4, 64, 128, 256, 4, 2, 16
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_(grad)

    x, r, nw, w = t(T, H), t(T, H), t(H), t(I, H)
    gate, up = t(T, I), t(T, I)
    logits, targets = t(T, V), torch.randint(0, V, (T,), generator=g).to(dev, torch.int32)
    q, k, v = t(T, Hq, D), t(T, Hkv, D), t(T, Hkv, D)
    table, ids = t(V, H), torch.randint(0, V, (T,), generator=g).to(dev, torch.int32)
    qn, positions = t(D), torch.arange(T, dtype=torch.int32).to(dev)
    head = t(V, H)
    return [
        ("rms_norm", lambda: E.rms_norm(x, nw, 1e-6)),
        ("add_rms_norm", lambda: E.add_rms_norm(x, r, nw, 1e-6)),
        ("linear", lambda: E.linear(x, w, None)),
        ("swiglu", lambda: E.swiglu(gate, up)),
        ("token_logprobs", lambda: E.token_logprobs(logits, targets)),
        ("attention", lambda: E.attention(q, k, v, [T], 0.0)),
        ("embedding", lambda: E.embedding(ids, table)),
        ("qk_norm", lambda: E.qk_norm(q, qn, 1e-6, positions, 1e4, [])),
        ("lm_head_logprobs", lambda: E.lm_head_logprobs(x, head, targets)),
    ]


def with_backward(fn):
    """fn's call, then the backward of all its outputs (gradients made once, outside the loop)."""
    out = fn()
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    grads = [torch.ones_like(o) for o in outs]

    def step():
        o = fn()
        torch.autograd.backward(list(o) if isinstance(o, (tuple, list)) else [o], grads)
    return step


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--lib", default=os.path.join(here, "..", "build", "python", "samebits", "torch", "_torch_ops.so"))
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=("wall", "process"), default="wall",
                    help="process: this process's CPU time (time.process_time), steadier on a loaded machine")
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.ops.load_library(args.lib)
    E = torch.ops.samebits_ext
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    modes = {}
    for op, _ in cases(E, args.device, False):
        rounds = {m: [] for m in ("no_grad", "recording", "recording + backward")}
        for _ in range(args.rounds):
            for mode in rounds:
                grad = mode != "no_grad"
                with torch.enable_grad() if grad else torch.no_grad():
                    fn = dict(cases(E, args.device, grad))[op]
                    if mode.endswith("backward"):
                        fn = with_backward(fn)
                    rounds[mode].append(loop_us(fn, args.calls, sync, clock))
        for mode, times in rounds.items():
            modes[op, mode] = statistics.median(times)
        modes[op, "adds"] = statistics.median(b - a for a, b in zip(rounds["no_grad"], rounds["recording"]))
    print(f"torch {torch.__version__}, {args.device}, {args.calls} calls a round, median of {args.rounds} rounds, "
          f"{args.clock} clock; µs a call")
    print("| op | no_grad | recording | adds | recording + backward |")
    print("| --- | --- | --- | --- | --- |")
    for op, _ in cases(E, args.device, False):
        a, b, d, c = (modes[op, m] for m in ("no_grad", "recording", "adds", "recording + backward"))
        print(f"| {op} | {a:.2f} | {b:.2f} | {d:.2f} | {c:.2f} |")


if __name__ == "__main__":
    main()
