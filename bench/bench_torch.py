#!/usr/bin/env python3
"""What the Python doors cost: a transformers Qwen3 model scored and trained three ways, in one
process on one card, on the same weights and token batches.

    PYTHONPATH=BUILD/python python3 bench/bench_torch.py [--layers 2] [--md OUT.md]

 * stock: transformers (SDPA attention, bf16), logits → fp32 log_softmax → gather, as RL trainers
   score rollouts; forward + backward: the gradient of the summed logprobs into every .grad;
 * enable(): the same code under samebits.torch.enable() (matmuls, attention, norms' reductions and
   log_softmax routed to samebits, forward and backward);
 * samebits.hf: Scorer.token_logprobs (the samebits model chain on the module's weights, read in
   place), and its backward into the same .grad.
Shape: Qwen3-8B's width (hidden 4096, 32 / 8 heads of 128, MLP 12288, vocab 151936, untied),
--layers layers, random weights. Batches of uniform length (the shape enable() covers; the chain
packs, so ragged batches would favour it further). Each step is timed with CUDA events around the
whole call (host work included), 2 warm-up steps, the median of --reps, rotating over 3 different
token batches (bench/timing.py: event_median); a row alone of any result is never timed.
"""
import argparse

import torch
import transformers

import samebits.hf
import samebits.torch as sbt
from timing import event_median as timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--md")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                   num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                                   head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    scorer = samebits.hf.Scorer(model)
    card = torch.cuda.get_device_name()
    rows = []
    for b, s in ((1, 512), (8, 512), (4, 2048)):
        batches = [torch.randint(0, cfg.vocab_size, (b, s), device="cuda") for _ in range(3)]
        lists = {id(x): x.tolist() for x in batches}

        def score(ids):
            logits = model(input_ids=ids).logits[:, :-1]
            return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]

        def fwd(ids):
            with torch.no_grad():
                return score(ids)

        def fwd_bwd(ids):
            model.zero_grad(set_to_none=True)
            score(ids).sum().backward()

        def fwd_on(ids):
            with sbt.enable():
                return fwd(ids)

        def fwd_bwd_on(ids):
            with sbt.enable():
                fwd_bwd(ids)

        def hf_fwd(ids):
            with torch.no_grad():
                return scorer.token_logprobs(lists[id(ids)])

        def hf_fwd_bwd(ids):
            model.zero_grad(set_to_none=True)
            sum(lp.sum() for lp in scorer.token_logprobs(lists[id(ids)])).backward()

        t = {name: timed(fn, batches, args.reps) for name, fn in
             (("fwd", fwd), ("fwd_on", fwd_on), ("hf_fwd", hf_fwd),
              ("fb", fwd_bwd), ("fb_on", fwd_bwd_on), ("hf_fb", hf_fwd_bwd))}
        rows.append((b, s, t))
        print(f"{b} x {s}: forward stock {t['fwd']:.2f} ms, enable() {t['fwd_on']:.2f} ms "
              f"({t['fwd_on'] / t['fwd']:.2f}x), samebits.hf {t['hf_fwd']:.2f} ms ({t['hf_fwd'] / t['fwd']:.2f}x); "
              f"forward + backward stock {t['fb']:.2f} ms, enable() {t['fb_on']:.2f} ms "
              f"({t['fb_on'] / t['fb']:.2f}x), samebits.hf {t['hf_fb']:.2f} ms ({t['hf_fb'] / t['fb']:.2f}x)",
              flush=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        with sbt.enable():
            pass
    end.record()
    end.synchronize()
    enter = start.elapsed_time(end) / 20
    print(f"entering and leaving enable(): {enter:.3f} ms", flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"# The Python doors against stock transformers — {card}\n\n"
                    f"`bench/bench_torch.py --layers {args.layers}`: transformers {transformers.__version__}, "
                    f"torch {torch.__version__}; Qwen3-8B width, {args.layers} layers, vocab 151936, bf16, random "
                    "weights; milliseconds per step (CUDA events around the whole call, median of "
                    f"{args.reps}, 3 rotating token batches). Ratio = time / stock time (below 1: faster).\n\n"
                    "| batch | forward: stock | enable() | ratio | samebits.hf | ratio "
                    "| fwd + bwd: stock | enable() | ratio | samebits.hf | ratio |\n"
                    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
            for b, s, t in rows:
                f.write(f"| {b} × {s} | {t['fwd']:.2f} | {t['fwd_on']:.2f} | {t['fwd_on'] / t['fwd']:.2f} "
                        f"| {t['hf_fwd']:.2f} | {t['hf_fwd'] / t['fwd']:.2f} | {t['fb']:.2f} | {t['fb_on']:.2f} "
                        f"| {t['fb_on'] / t['fb']:.2f} | {t['hf_fb']:.2f} | {t['hf_fb'] / t['fb']:.2f} |\n")
            f.write(f"\nEntering and leaving `enable()` (registering and removing its aten kernels): {enter:.3f} ms, "
                    "included in every enable() step above.\n")


if __name__ == "__main__":
    main()
