#!/usr/bin/env python3
"""A training step of a Qwen3-8B-shaped model under FSDP2 + activation checkpointing: samebits.hf.patch
against stock transformers (issue 29, point 4 (c); with --check, also (a) and (b) at this size).

    PYTHONPATH=BUILD/python torchrun --standalone --nproc_per_node=2 bench/bench_fsdp_step.py \\
        [--layers 36] [--seqs 4] [--tokens 2048] [--optim sgd] [--reps 7] [--check] [--out OUT.md]

(`python3 bench/bench_fsdp_step.py ...` without torchrun runs as world size 1, labelled so, its table
fsdp-step-<card>-1gpu.md: one GPU holds the whole fp32 state, 8 bytes a parameter with SGD — about
--layers 12 at most on an 80 GB card.)

The model: transformers' Qwen3ForCausalLM at Qwen3-8B's shape (hidden 4096, 32 / 8 heads of 128,
QK-norm, MLP 12288, vocab 151936, untied, RoPE θ 1e6), --layers decoder layers (36: all of Qwen3-8B,
8.19 B parameters), random weights drawn in bf16 from a seeded generator (normal, std 0.02; norms
1) — the same bits in both arms and on every rank — then held as fp32 (the values are bf16's, so
the bf16 copies FSDP2 gathers are exactly the drawn weights).

Two arms, one after the other in the same process (each its own model instance, built the same
way; the first is freed before the second is built), under the same settings:
 * FSDP2: fully_shard on every decoder layer and on the root (reshard after forward: FSDP2's
   default), MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 sharded parameters,
   gradients and optimizer state, bf16 compute, fp32 reduce-scatter;
 * activation checkpointing on every decoder layer: torch.distributed._composable.checkpoint,
   applied before fully_shard (as torch's own FSDP2 tests compose them);
 * stock: the transformers model (SDPA attention, use_cache=False), logits [B, S, V] in bf16, then
   log_softmax in fp32 gathered at the next tokens — as RL trainers score rollouts;
   samebits: samebits.hf.patch(model), model(ids, lengths) over the packed rows (the LM head fused
   with the selected logprob: no logits matrix);
 * the loss: Σ advantage(sequence) · logp(token) over every scored token (a policy-gradient
   loss), advantages drawn per sequence; each rank its own --seqs × --tokens random token ids
   (3 batches, rotated), the same in both arms;
 * a step: zero_grad + forward + backward + optimizer step (--optim: sgd, the default — plain SGD
   keeps no state; adamw — two fp32 moments more, 8 bytes a parameter over the ranks: fits two
   H200s, not two H100s at 36 layers; none — forward + backward only).
Timing: CUDA events on each rank around the whole step (host work included) and after the
backward (FSDP2 has waited for the last reduce-scatter there), 2 warm-up steps, then --reps steps,
each behind a barrier and a device synchronisation (the ranks start together); per rank the median.
Reported: rank 0's median and the largest median over the ranks, the ratio samebits / stock of
each (issue 29's goal: ≤ 0.9), tokens a second over all ranks, each arm's peak memory.

--check (samebits arm, before its timed steps; issue 29 point 4 (a), (b) at this size):
 (a) on every rank, the sharded patched model's logprobs of its first batch against the
     single-GPU chain's on the same weights (samebits.hf.Scorer on the unsharded bf16 model,
     before sharding): bit for bit;
 (b) two forward + backward passes on the same batch and weights, no optimizer step between:
     every rank's gradient shard (fp32, after the reduce-scatter) bitwise the same (the shards
     partition the gradient: comparing them is comparing full_tensor()s, without a full fp32 copy
     a rank); and world × the FSDP2 gradient (FSDP2 averages the ranks') against the patched
     model's gradient of every rank's first batch at once on one GPU (rank 0, unsharded bf16
     weights, checkpointing on; bf16 gradients, rounded once an op call as the ops do): the worst
     relative L2 over the parameters, bound 0.05 (test_patch's).
 Exit status 1 if any fails. Costs: rank 0 holds the bf16 model, its bf16 gradients and the whole
 batch's checkpointed activations for the single-GPU pass (about 50 GB at the defaults on two
 ranks), then the gradients on the host (16 GB), and each rank its first pass's fp32 shards on the
 host (16 GB at 36 layers on two ranks).

Memory, per GPU, two ranks, 36 layers, 4 × 2048 tokens a rank, SGD (the defaults; estimated from
the sizes, printed at the start with the arguments given): fp32 parameters + gradients 32.8 GB
sharded, the root's bf16 parameters gathered for the whole step 2.5 GB (embedding + LM head),
checkpointed layer inputs 2.4 GB (stock) / 4.8 GB (samebits: a layer's input is the pair (down,
x_mid)), one layer's recompute ~2.4 GB, and stock's logits path ~17 GB (bf16 logits, the fp32
copy, log_softmax's output, its gradient) — about 55 GiB stock, 46 GiB samebits. 8 × 2048 a rank
doubles the logits path (~76 GiB stock: too close to an H100's 80 GB); AdamW adds 32.8 GB.

Run status: written on a machine without a GPU or torch; compiles (python3 -m py_compile), NOT run.
"""
import argparse
import datetime
import gc
import os
import statistics
import sys
import time

import torch
import torch.cuda.nccl
import torch.distributed as dist
import transformers
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from timing import card_slug, samebits_from

GIB = 1 << 30
WARM = 2
BATCHES = 3  # token batches a rank rotates over


def qwen3_8b_config(layers):
    return transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                    num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                    head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                                    rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=False)


def build(cfg, seed=1234):
    """The transformers model in bf16 on this rank's GPU, weights from a seeded generator (the same
    bits in both arms, whatever transformers' own init draws), rank 0's broadcast to the others (a
    CUDA generator's draws depend on the card's SM count: the ranks' cards need not match)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16 at once (the rotary inv_freq stays fp32)
    try:
        with torch.device("cuda"):
            model = transformers.Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    g = torch.Generator(device=torch.device("cuda", torch.cuda.current_device())).manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # the RMSNorm weights
            else:
                p.normal_(0.0, 0.02, generator=g)
            if dist.get_world_size() > 1:
                dist.broadcast(p, src=0)
    model.config._attn_implementation = "sdpa"
    return model


def param_counts(cfg):
    """(every parameter, the root's: embedding + LM head + final norm, one decoder layer's)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h + 2 * d
    root = 2 * cfg.vocab_size * h + h
    return root + cfg.num_hidden_layers * layer, root, layer


def estimate_bytes(cfg, tokens, world, optim, arm):
    """A rough per-GPU peak: what the sizes say, not a measurement (the allocator's caching, NCCL's
    buffers and the CUDA context come on top)."""
    n, root, layer = param_counts(cfg)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    state = {"adamw": 8, "sgd": 0, "none": 0}[optim]
    total = n * (4 + 4 + state) / world  # sharded fp32 parameters, gradients, optimizer state
    total += root * 2  # the root's bf16 parameters, gathered from the forward to the end of the backward
    total += layer * (2 * 2 + 2 + 4)  # two layers gathered (prefetch), one's bf16 gradient and its fp32 copy
    kept = 1 if arm == "stock" else 2  # checkpointed inputs a layer: hidden / (down, x_mid)
    total += cfg.num_hidden_layers * tokens * h * 2 * kept
    total += tokens * (6 * h + 4 * i) * 2 * 2  # one layer recomputed, and its gradients
    if arm == "stock":  # bf16 logits, fp32 copy, log_softmax's output, its gradient, the input's
        total += tokens * v * 14
    else:  # the LM head's and the embedding's fp32 weight-gradient accumulators
        total += 2 * v * h * 4
    return total


def prepare(model, samebits_arm, keep_logits_bytes=0):
    """What precedes sharding: samebits.hf.patch (the samebits arm; in place, before any hook; its LM
    head may keep logits for the backward, --keep-logits-mb), then torch's activation checkpointing on
    every decoder layer (both arms)."""
    if samebits_arm:
        import samebits.hf
        samebits.hf.patch(model, keep_logits_bytes=keep_logits_bytes)
    for layer in model.model.layers:
        checkpoint(layer)
    model.train()


def shard(model):
    """FSDP2 as both arms have it: fully_shard on every decoder layer, then the root; bf16 compute
    over the (fp32) sharded parameters, fp32 reduce-scatter. After checkpoint(), as torch's own
    FSDP2 tests compose the two."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def rank_data(cfg, args, rank):
    """A rank's token batches ([seqs, tokens] int64, on the GPU) and advantages ([seqs] fp32): its own
    (data parallel), the same in both arms, and made again by rank 0 for --check's whole batch."""
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, cfg.vocab_size, (args.seqs, args.tokens), generator=g).cuda()
               for _ in range(BATCHES)]
    return batches, torch.randn(args.seqs, generator=g).cuda()


def stock_loss(model, ids, adv):
    """Σ adv · logp with transformers' own logits: [B, S, V] bf16 → fp32 log_softmax → gather."""
    logits = model(input_ids=ids, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (logp * adv[:, None]).sum()


def samebits_loss(model, ids, adv):
    """The same loss through the patched model's packed door (logp 0 on each sequence's last row)."""
    logp, _ = model(ids.reshape(-1).to(torch.int32), [ids.shape[1]] * ids.shape[0])
    return (logp.view(ids.shape) * adv[:, None]).sum()


def bits(t):
    return t.detach().contiguous().view(torch.uint8)


def single_gpu_grads(model, ids, adv):
    """{name: gradient} (bf16, on the host) of the patched model, unsharded on this GPU (bf16 weights,
    checkpointing on), for the loss over every rank's batch at once."""
    model.zero_grad(set_to_none=True)
    samebits_loss(model, ids, adv).backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def check_samebits(model, ids, adv, want, single, world):
    """(a) the sharded patched model's logprobs = `want` (the single-GPU chain's) bit for bit; (b) the
    gradient shards of two identical forward + backward passes bit for bit, and (where `single` is
    given: rank 0) the worst relative L2 of world × the FSDP2 gradient (FSDP2 averages the ranks')
    against the single-GPU gradient of the whole batch. Returns this rank's (sequences that differ,
    gradient shards that differ, gradient shards, worst relative L2 or None)."""
    def once():
        model.zero_grad(set_to_none=True)
        logp, _ = model(ids.reshape(-1).to(torch.int32), [ids.shape[1]] * ids.shape[0])
        (logp.view(ids.shape) * adv[:, None]).sum().backward()
        return logp.detach().view(ids.shape)[:, :-1]

    def local(g):
        return g.to_local() if hasattr(g, "to_local") else g

    logp = once()
    bad_seqs = sum(not torch.equal(bits(logp[i]), bits(want[i])) for i in range(ids.shape[0]))
    worst = None
    for n, p in model.named_parameters():  # full_tensor() is a collective: every rank, the same order
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if single is not None:
            ref = single[n].to(full.device, torch.float32)
            rel = ((full * world - ref).norm() / ref.norm()).item()
            worst = rel if worst is None else max(worst, rel)
        del full
    # The first pass's shards on the host: a second fp32 copy would not fit beside the step.
    first = [local(p.grad).detach().cpu() for p in model.parameters()]
    once()
    bad_grads = sum(not torch.equal(bits(local(p.grad)), bits(f.to(p.grad.device)))
                    for p, f in zip(model.parameters(), first))
    model.zero_grad(set_to_none=True)
    return bad_seqs, bad_grads, len(first), worst


def run_arm(arm, cfg, batches, adv, args, rank, world):
    """Build, shard and time one arm; its numbers (rank-local) as a dict."""
    import samebits.hf  # imported by main (from --build's directory or PYTHONPATH's): a name here
    ours = arm == "samebits"
    t0 = time.perf_counter()
    model = build(cfg)
    want = single = None
    if ours and args.check:  # the single-GPU chain on the unsharded bf16 weights, this rank's batch
        with torch.no_grad():
            want = samebits.hf.Scorer(model).token_logprobs(batches[0].tolist())
        samebits._core.device_memory_release("cuda")
    prepare(model, ours, args.keep_logits_mb << 20)
    if ours and args.check:
        if rank == 0:  # the patched model's gradient of every rank's first batch at once, on one GPU
            everyone = [rank_data(cfg, args, r) for r in range(world)]
            ids, advs = torch.cat([b[0] for b, _ in everyone]), torch.cat([a for _, a in everyone])
            single = single_gpu_grads(model, ids, advs)
            del everyone, ids, advs
            torch.cuda.empty_cache()
        dist.barrier()
    model.float()  # fp32 master weights (exactly the bf16 values)
    shard(model)
    gc.collect()
    torch.cuda.empty_cache()
    if rank == 0:
        print(f"{arm}: built and sharded in {time.perf_counter() - t0:.1f} s", flush=True)
    out = {}
    if want is not None:
        out["check"] = check_samebits(model, batches[0], adv, want, single, world)
        del want, single
    loss_fn = stock_loss if arm == "stock" else samebits_loss
    opt = None
    if args.optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
    elif args.optim == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)

    def step(ids, after_backward=None):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, ids, adv)
        loss.backward()
        if after_backward is not None:
            after_backward.record()
        if opt is not None:
            opt.step()
        return loss.detach()

    torch.cuda.reset_peak_memory_stats()
    if ours:
        samebits._core.device_memory_peak("cuda", True)
    # The first warm-up step sees the drawn weights and batch 0 in both arms: its loss is the same
    # quantity, computed two ways (bf16 rounding apart).
    out["first_loss"] = step(batches[0]).item()
    for i in range(1, WARM):
        step(batches[i % len(batches)])
    fb, whole = [], []
    for r in range(args.reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        step(batches[r % len(batches)], mid)
        end.record()
        end.synchronize()
        fb.append(start.elapsed_time(mid))
        whole.append(start.elapsed_time(end))
    out["fb"], out["step"] = statistics.median(fb), statistics.median(whole)
    out["peak_alloc"] = torch.cuda.max_memory_allocated()
    out["peak_reserved"] = torch.cuda.max_memory_reserved()
    if ours:
        out["samebits_peak"] = samebits._core.device_memory_peak("cuda", False)
    del opt, model, step
    gc.collect()  # FSDP2's and checkpoint's states hold the modules in cycles
    torch.cuda.empty_cache()
    if ours:
        samebits._core.device_memory_release("cuda")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36, help="decoder layers (36: all of Qwen3-8B)")
    ap.add_argument("--seqs", type=int, default=4, help="sequences a rank a step")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a sequence")
    ap.add_argument("--optim", choices=("sgd", "adamw", "none"), default="sgd",
                    help="the step's optimizer (none: forward + backward only)")
    ap.add_argument("--reps", type=int, default=7, help="timed steps an arm (the median is reported)")
    ap.add_argument("--keep-logits-mb", type=int, default=0,
                    help="samebits arm: MiB its LM head may keep logits in for the backward (three vocab GEMMs "
                         "instead of four for those rows; the same bits)")
    ap.add_argument("--arms", default="stock,samebits", help="which arms, in this order (stock, samebits)")
    ap.add_argument("--check", action="store_true",
                    help="samebits arm: logprobs = the single-GPU chain's, gradients bitwise run to run")
    ap.add_argument("--build", help="a build directory whose python/samebits to import (default: PYTHONPATH's)")
    ap.add_argument("--out", help="markdown file (default docs/bench/fsdp-step-<card>.md; world size 1: "
                    "fsdp-step-<card>-1gpu.md)")
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ("stock", "samebits") for a in arms):
        raise SystemExit(f"bench_fsdp_step: --arms takes stock and / or samebits, not {args.arms!r}")
    if args.reps < 1 or args.seqs < 1 or args.tokens < 2:
        raise SystemExit("bench_fsdp_step: --reps, --seqs need at least 1, --tokens at least 2")
    if not torch.cuda.is_available():
        raise SystemExit("bench_fsdp_step: no CUDA device")
    if args.build:
        samebits_from(args.build)
    import samebits.hf  # noqa: F401  (fails here, before any GPU work, when the package is not found)

    # Without torchrun: one rank (the same code path, FSDP2 over a world of 1).
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "29517")):
        os.environ.setdefault(k, v)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=datetime.timedelta(minutes=10))
    cards = [None] * world
    dist.all_gather_object(cards, torch.cuda.get_device_name())

    cfg = qwen3_8b_config(args.layers)
    n_params = param_counts(cfg)[0]
    tokens = args.seqs * args.tokens  # a rank's
    if rank == 0:
        have = torch.cuda.get_device_properties(local).total_memory
        print(f"{world} × {cards[0]}; torch {torch.__version__}, transformers {transformers.__version__}; "
              f"Qwen3-8B shape, {args.layers} layers ({n_params / 1e9:.2f} B parameters); {args.seqs} × "
              f"{args.tokens} tokens a rank; optimizer {args.optim}", flush=True)
        for arm in arms:
            need = estimate_bytes(cfg, tokens, world, args.optim, arm)
            print(f"{arm}: estimated peak ≈ {need / GIB:.1f} GiB a GPU of {have / GIB:.1f} GiB", flush=True)
            if need > 0.95 * have:
                print(f"  warning: {arm} may not fit: fewer --layers, --seqs or --tokens, or --optim sgd / none",
                      flush=True)

    batches, adv = rank_data(cfg, args, rank)
    results = {}
    for arm in arms:
        mine = run_arm(arm, cfg, batches, adv, args, rank, world)
        every = [None] * world
        dist.all_gather_object(every, mine)
        results[arm] = every
        if rank == 0:
            r0 = every[0]
            print(f"{arm}: step {r0['step']:.1f} ms (rank 0; slowest rank's median "
                  f"{max(e['step'] for e in every):.1f} ms), forward + backward {r0['fb']:.1f} ms; first loss "
                  f"{r0['first_loss']:.6g}; peak allocated {max(e['peak_alloc'] for e in every) / GIB:.1f} GiB",
                  flush=True)

    failed = False
    check_line = None
    if "samebits" in results and args.check:
        bad_seqs = sum(e["check"][0] for e in results["samebits"])
        bad_grads = sum(e["check"][1] for e in results["samebits"])
        n_grads = sum(e["check"][2] for e in results["samebits"])
        worst = results["samebits"][0]["check"][3]
        failed = bool(bad_seqs or bad_grads) or not worst < 0.05  # test_patch's bound; NaN fails too
        check_line = (f"--check (samebits arm, {world} rank(s)): (a) logprobs = the single-GPU chain's "
                      f"(samebits.hf.Scorer, unsharded) bit for bit: {'yes' if not bad_seqs else 'NO'} "
                      f"({bad_seqs} of {world * args.seqs} sequences differ); (b) gradients bitwise the same run "
                      f"to run: {'yes' if not bad_grads else 'NO'} ({bad_grads} of {n_grads} gradient shards "
                      f"differ); worst relative L2, {world} × the FSDP2 gradient against the patched model's "
                      f"single-GPU gradient of all {world * args.seqs} sequences (bf16 weights, unsharded): "
                      f"{worst:.3g} (bound 0.05).")
    if rank == 0:
        md = table(args, cfg, world, cards, results, check_line)
        print("\n" + md, flush=True)
        out = args.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "bench",
                                       f"fsdp-step-{card_slug()}" + ("" if world > 1 else "-1gpu") + ".md")
        with open(out, "w") as f:
            f.write(md)
        print(f"written to {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


def table(args, cfg, world, cards, results, check_line):
    n_params = param_counts(cfg)[0]
    name = cards[0] if len(set(cards)) == 1 else " + ".join(cards)
    where = f"{world} × {name}" if world > 1 else f"1 × {name} (world size 1: no collective crosses GPUs)"
    given = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k, default in
             (("layers", 36), ("seqs", 4), ("tokens", 2048), ("optim", "sgd"), ("reps", 7), ("arms", "stock,samebits"),
              ("keep_logits_mb", 0))
             if getattr(args, k) != default] + (["--check"] if args.check else [])
    cmd = " ".join([f"torchrun --standalone --nproc_per_node={world}" if world > 1 else "python3",
                    "bench/bench_fsdp_step.py"] + given)
    step_what = {"sgd": "zero_grad + forward + backward + SGD step (no momentum: no optimizer state)",
                 "adamw": "zero_grad + forward + backward + AdamW step (fp32 moments)",
                 "none": "zero_grad + forward + backward (no optimizer step)"}[args.optim]
    nccl = torch.cuda.nccl.version()  # a tuple (major, minor, patch) in torch 2
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    lines = [f"# A training step under FSDP2 + activation checkpointing: samebits.hf.patch against stock "
             f"transformers — {where}", "",
             f"Generated by `{cmd}`; do not edit by hand. torch {torch.__version__}, transformers "
             f"{transformers.__version__}, NCCL {nccl}. Qwen3-8B's shape with {args.layers} layers "
             f"({n_params / 1e9:.2f} B parameters; hidden {cfg.hidden_size}, {cfg.num_attention_heads} / "
             f"{cfg.num_key_value_heads} heads × {cfg.head_dim}, QK-norm, MLP {cfg.intermediate_size}, vocab "
             f"{cfg.vocab_size}, untied), random weights. Both arms: FSDP2 `fully_shard` on every decoder layer and "
             "the root, `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` over fp32 sharded parameters, "
             "`torch.distributed._composable.checkpoint` on every decoder layer. A rank's batch: "
             f"{args.seqs} × {args.tokens} random tokens ({BATCHES} batches rotated), loss Σ advantage · logp over "
             "every scored token. Stock: transformers' logits (SDPA attention), fp32 log_softmax, gather; "
             "samebits: `samebits.hf.patch(model)`, `model(ids, lengths)` (packed rows, LM head fused with the "
             f"logprob). A step: {step_what}. Milliseconds, CUDA events on each rank around the whole step (host "
             f"work included), {WARM} warm-up steps, median of {args.reps}, every step behind a barrier; "
             "\"slowest rank\": the largest of the ranks' medians. Ratio: samebits / stock (issue 29's goal: "
             "≤ 0.9 a step).", "",
             "| arm | step, rank 0 | step, slowest rank | fwd + bwd, rank 0 | fwd + bwd, slowest rank "
             "| tokens/s (all ranks) | peak allocated / reserved (GiB, max over ranks) | first step's loss (rank 0) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    summary = {}
    for arm, every in results.items():
        r0 = every[0]
        slow_step, slow_fb = max(e["step"] for e in every), max(e["fb"] for e in every)
        summary[arm] = (r0["step"], slow_step, r0["fb"], slow_fb)
        tps = world * args.seqs * args.tokens / (slow_step / 1e3)
        peak = max(e["peak_alloc"] for e in every) / GIB
        reserved = max(e["peak_reserved"] for e in every) / GIB
        extra = ""
        if arm == "samebits":
            extra = f" (+ {max(e['samebits_peak'] for e in every) / GIB:.1f} samebits' own)"
        label = "stock transformers" if arm == "stock" else "samebits.hf.patch"
        lines.append(f"| {label} | {r0['step']:.1f} | {slow_step:.1f} | {r0['fb']:.1f} | {slow_fb:.1f} | {tps:,.0f} "
                     f"| {peak:.1f} / {reserved:.1f}{extra} | {r0['first_loss']:.6g} |")
    if len(summary) == 2:
        s, b = summary["samebits"], summary["stock"]
        lines.append(f"| ratio samebits / stock | {s[0] / b[0]:.3f} | {s[1] / b[1]:.3f} | {s[2] / b[2]:.3f} "
                     f"| {s[3] / b[3]:.3f} | | | |")
    lines.append("")
    lines.append("The first step's loss: both arms on the same weights and batch before any update (bf16 rounding "
                 "apart, the same quantity).")
    if check_line:
        lines += ["", check_line]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
