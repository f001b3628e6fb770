"""GRPO on a small Qwen3 whose rollouts and training see the same bits (samebits.hf; issue 29).

    PYTHONPATH=build/python python3 examples/grpo_loop.py                              # one GPU, beside stock
    PYTHONPATH=build/python torchrun --nproc_per_node=2 examples/grpo_loop.py --fsdp   # two GPUs, FSDP2

Each step: random prompts, n rollouts each from samebits.hf.Generator (samebits.Engine on the
model's own weights); a toy reward (the share of generated tokens in the first 1/16 of the vocab)
and advantages normalised within each prompt's group; the rollouts scored by the model patched with
samebits.hf.patch (its own modules run samebits' ops), a PPO-clipped policy-gradient loss, backward,
AdamW updating the weights in place — and the next step's rollouts sample from the updated weights.

Each step's line gives max |Δlogp| over every generated token: the logprob the rollout reported for
it against the one the training forward computes. With samebits it is 0, every token, every step
(the script exits 1 otherwise): the importance ratio of the on-policy step is exactly 1. On one GPU
the same loop also runs on stock transformers from the same initial weights (--no-compare skips
it): `generate` samples with a KV cache, the training forward reruns the whole sequence batched, and
their logprobs differ, so its ratio is not 1 even on policy.

The model: a random Qwen3 made from a config (nothing downloaded; --vocab, --layers), or --model DIR
(a Hugging Face Qwen3 / Llama checkpoint), in bf16 on the GPU. No stop token: every rollout runs to
--new-tokens, so a step's rollouts stack into [rollouts, new tokens].
"""
import argparse
import copy
import os
import sys
import time

import torch
import transformers

import samebits
import samebits.hf


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face Qwen3 / Llama checkpoint directory (default: a random Qwen3)")
    p.add_argument("--vocab", type=int, default=8192, help="the random model's vocab")
    p.add_argument("--layers", type=int, default=6, help="the random model's decoder layers")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="prompts a step (over all ranks)")
    p.add_argument("--n", type=int, default=8, help="samples a prompt (the GRPO group)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens a prompt (random ids)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens a rollout")
    p.add_argument("--lr", type=float, default=2e-4, help="AdamW's learning rate")
    p.add_argument("--clip", type=float, default=0.2, help="the PPO clip range of the ratio")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over the ranks of torchrun (one GPU each)")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="run the same loop on stock transformers beside it (default: on with one GPU; not with --fsdp)")
    args = p.parse_args()
    if args.compare is None:
        args.compare = not args.fsdp
    if args.fsdp and args.compare:
        p.error("--compare runs on one GPU: not with --fsdp")
    if args.n < 2:
        p.error("--n: a GRPO group needs at least 2 samples")
    if not torch.cuda.is_available() or not samebits.cuda_available():
        sys.exit("grpo_loop.py: needs a CUDA GPU and samebits built with its CUDA backend")
    return args


def build_model(args):
    """The policy, in bf16 on the current GPU: --model DIR, or a random Qwen3 (the same weights on
    every rank: the seed is set before)."""
    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda()
    config = transformers.Qwen3Config(vocab_size=args.vocab, hidden_size=512, intermediate_size=1536,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)
    with torch.device("cuda"):
        return transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)


def step_seed(args, step):
    return (args.seed << 32) + step * args.prompts


def prompts_of(args, step, vocab):
    """The step's prompts, [prompts, prompt-len] random ids on the GPU: the same on every rank."""
    g = torch.Generator().manual_seed(step_seed(args, step))
    return torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g).cuda()


def rewards_of(tokens, vocab):
    """The toy reward of each rollout ([rollouts, T] tokens): the share of its tokens below vocab / 16."""
    return (tokens < vocab // 16).float().mean(1)


def train_step(opt, new, old, rewards, args):
    """GRPO: advantages normalised within each prompt's group of n samples; a PPO-clipped token-mean
    loss on the ratio new / old (new: the training forward's logprobs [rollouts, T], differentiable;
    old: those the rollouts reported); backward; one optimizer step, which updates the parameters in
    place (AdamW's foreach / fused kernels write into the parameters' own memory)."""
    r = rewards.view(-1, args.n)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    ratio = torch.exp(new - old)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def samebits_step(gen, model, opt, prompts, first, args, step):
    """One GRPO step on samebits: rollouts of `prompts` ([k, P]; global prompt indices first, first + 1,
    ...) from the Generator `gen`, scored and trained on by the patched `model`. Returns the rollouts'
    rewards, max |Δlogp| between the rollouts' logprobs and the trainer's (a 0-d tensor) and the
    number of generated tokens."""
    vocab = model.config.vocab_size
    # One SamplingParams a prompt: the engine's randoms are keyed by (seed, sample, position), so
    # each prompt gets its own seed (its global index: the same draws whichever rank runs it).
    params = [samebits.SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens,
                                      seed=step_seed(args, step) + first + i) for i in range(len(prompts))]
    rollouts = [r for rs in gen.generate(prompts, params) for r in rs]
    failed = [r.error for r in rollouts if r.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"grpo_loop.py: a rollout failed: {failed[0]}")
    tokens = torch.stack([r.tokens for r in rollouts])
    old = torch.stack([r.logprobs for r in rollouts])
    # token_logprobs(sequence)[i] scores token i + 1: the completion's tokens are entries P - 1 on.
    P = prompts.shape[1]
    new = torch.stack([lp[P - 1:] for lp in model.token_logprobs([r.sequence for r in rollouts])])
    delta = (new.detach() - old).abs().max()
    rewards = rewards_of(tokens, vocab)
    train_step(opt, new, old, rewards, args)
    return rewards, delta, tokens.numel()


def stock_step(model, opt, prompts, args, step):
    """The same step on stock transformers: `generate` (sampling at temperature 1, no top-k / top-p),
    the rollout's logprobs from the logits generate computed, the training forward over the whole
    sequences. Returns the rewards, max |Δlogp| between the two (a 0-d tensor), generated tokens."""
    P, vocab = prompts.shape[1], model.config.vocab_size
    ids = prompts.repeat_interleave(args.n, 0)  # prompt-major, as the Generator's samples
    torch.cuda.manual_seed(step_seed(args, step))
    # min_new_tokens: a checkpoint's EOS is never drawn, so every rollout is new-tokens long, as on
    # the samebits side (the logprobs below come from the raw logits, before that processor).
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                         top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[:, P:]
    old = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    logits = model(input_ids=out.sequences, use_cache=False).logits[:, P - 1:-1]
    new = logits.float().log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    delta = (new.detach() - old).abs().max()
    rewards = rewards_of(tokens, vocab)
    train_step(opt, new, old, rewards, args)
    return rewards, delta, tokens.numel()


def timed(fn, *args):
    """fn(*args) and the seconds it took on the GPU."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def generator(model, args, prompts):
    """A Generator on `model`'s weights with a slot for every rollout of `prompts` prompts and a
    context of prompt + new tokens (the KV cache: no bigger than a step needs)."""
    return samebits.hf.Generator(model, max_slots=prompts * args.n, max_context=args.prompt_len + args.new_tokens)


def one_gpu(args):
    torch.manual_seed(args.seed)
    model = build_model(args)
    stock = copy.deepcopy(model) if args.compare else None  # the same initial weights, left stock
    samebits.hf.patch(model)
    # Built once, for every step: on the GPU the engine reads the module's parameters in place
    # (samebits.hf.model_of: views of their memory), so the optimizer's in-place update is what the
    # next generate() samples from. (A replaced parameter is refused with samebits.Error, never read
    # stale; and a stale read would show here as a nonzero max |Δlogp| from the second step on.)
    gen = generator(model, args, args.prompts)
    opt = optimizer(model, args)
    stock_opt = optimizer(stock, args) if args.compare else None
    vocab = model.config.vocab_size
    print(f"GRPO, one GPU: {args.prompts} prompts x {args.n} samples, {args.prompt_len} + {args.new_tokens} tokens, "
          f"vocab {vocab}, {model.config.num_hidden_layers} layers", flush=True)
    failed = False
    for step in range(args.steps):
        prompts = prompts_of(args, step, vocab)
        (rewards, delta, tokens), sec = timed(samebits_step, gen, model, opt, prompts, 0, args, step)
        failed |= bool(delta != 0)
        line = (f"step {step:3d}  samebits: reward {rewards.mean().item():.4f}  max|dlogp| {delta.item():.3g}  "
                f"{tokens} tokens  {sec:.2f} s")
        if args.compare:
            (rewards, delta, tokens), sec = timed(stock_step, stock, stock_opt, prompts, args, step)
            line += (f"  |  stock: reward {rewards.mean().item():.4f}  max|dlogp| {delta.item():.3g}  "
                     f"{tokens} tokens  {sec:.2f} s")
        print(line, flush=True)
    return failed


@torch.no_grad()
def refresh(rollout_model, model):
    """The trainer's updated weights into the rollout model, in place: each sharded parameter
    all-gathered (DTensor.full_tensor) and written over the rollout copy's parameter, whose memory
    the Generator reads (so it is built once)."""
    params = dict(rollout_model.named_parameters())
    for name, p in model.named_parameters():
        params[name].copy_(p.full_tensor())


def fsdp(args):
    """FSDP2: the patched model sharded over the ranks (fully_shard on every decoder layer and the
    root), each rank taking its share of the step's prompts. The engine reads whole weights, and a
    sharded model holds none outside a forward: every rank keeps a plain unsharded copy for its
    Generator, refreshed after each optimizer step. The cost: one full bf16 copy of the model per
    rank beside the shards, and a step's all-gather of every weight (the traffic of one FSDP
    forward's unsharding)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if "LOCAL_RANK" not in os.environ:
        sys.exit("grpo_loop.py --fsdp: run it under torchrun (torchrun --nproc_per_node=2 examples/grpo_loop.py ...)")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.prompts % world:
        sys.exit(f"grpo_loop.py: --prompts {args.prompts} does not split over {world} ranks")
    k = args.prompts // world
    torch.manual_seed(args.seed)
    model = build_model(args)  # the same weights on every rank
    rollout_model = copy.deepcopy(model).requires_grad_(False)
    gen = generator(rollout_model, args, k)
    samebits.hf.patch(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = optimizer(model, args)
    vocab = model.config.vocab_size
    if rank == 0:
        print(f"GRPO, FSDP2 on {world} ranks: {args.prompts} prompts x {args.n} samples ({k} prompts a rank), "
              f"{args.prompt_len} + {args.new_tokens} tokens, vocab {vocab}, {model.config.num_hidden_layers} layers",
              flush=True)
    failed = False
    for step in range(args.steps):
        mine = prompts_of(args, step, vocab)[rank * k:(rank + 1) * k]
        # FSDP2 averages the ranks' gradients: with every rollout new-tokens long, the mean of the
        # ranks' token-mean losses is the token mean over every rank's rollouts.
        (rewards, delta, tokens), sec = timed(samebits_step, gen, model, opt, mine, rank * k, args, step)
        _, refresh_sec = timed(refresh, rollout_model, model)
        dist.all_reduce(delta, op=dist.ReduceOp.MAX)  # every rank's rollouts against its trainer's logprobs
        total = torch.stack([rewards.sum(), torch.tensor(float(tokens), device=rewards.device)])
        dist.all_reduce(total)
        failed |= bool(delta != 0)
        if rank == 0:
            print(f"step {step:3d}  samebits: reward {total[0].item() / (args.prompts * args.n):.4f}  "
                  f"max|dlogp| {delta.item():.3g} (all ranks)  {int(total[1].item())} tokens  {sec:.2f} s  "
                  f"(+ {refresh_sec:.3f} s gathering the weights for the Generator)", flush=True)
    dist.destroy_process_group()
    return failed


def main():
    args = parse_args()
    failed = fsdp(args) if args.fsdp else one_gpu(args)
    if failed:
        print("grpo_loop.py: a rollout's logprobs differed from the trainer's (max |dlogp| != 0)", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
