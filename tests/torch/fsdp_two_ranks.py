"""samebits.hf.patch under FSDP2 on two ranks (torchrun --nproc_per_node=2; run by
test_patch.py::test_patched_model_under_fsdp2_on_two_ranks where two GPUs are visible).

Every rank makes the same random Qwen3 model and the same sequences, scores its half of them before
sharding (samebits.hf.Scorer: the C++ chain, single GPU), then shards the patched model with
fully_shard (every decoder layer and the root) and checks: (a) its logprobs are the chain's bit for
bit; (b) a training step's gradients are bitwise the same run to run, and within fp32 rounding of
the single-GPU gradient of the whole batch (the relative L2 is printed). Exit status 0: all held."""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samebits.hf  # noqa: E402
from tiny_models import bits, qwen3  # noqa: E402


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(5)
    model = qwen3(transformers, vocab=4096, hidden=512, mlp=1024, heads=8, kv_heads=2, head_dim=64, tied=False)
    seqs = [torch.randint(0, 4096, (n,)).tolist() for n in (17, 64, 5, 130, 2, 33, 90, 8)]
    adv = [1.0, -0.5, 2.0, 0.25, 3.0, -1.0, 0.5, 1.5]
    mine = list(range(rank, len(seqs), world))
    with torch.no_grad():
        want = samebits.hf.Scorer(model).token_logprobs([seqs[i] for i in mine])
    samebits.hf.patch(model)
    model.train()

    def step(indices):
        model.zero_grad(set_to_none=True)
        logps = model.token_logprobs([seqs[i] for i in indices])
        sum(adv[i] * lp.sum() for i, lp in zip(indices, logps)).backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n] = g.detach().float().clone()
        return logps, grads

    _, single = step(list(range(len(seqs))))  # the whole batch on one GPU, before sharding
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    logps, first = step(mine)
    _, second = step(mine)
    failures = []
    for i, (got, ref) in enumerate(zip(logps, want)):
        if not torch.equal(bits(got.detach()), bits(ref)):
            failures.append(f"rank {rank}: sequence {mine[i]}: logprobs differ from the chain's")
    for n in first:
        if not torch.equal(bits(first[n]), bits(second[n])):
            failures.append(f"rank {rank}: {n}: gradient differs run to run")
    # FSDP2 averages the ranks' gradients: world × that is the whole batch's sum.
    worst = max(((first[n] * world - single[n]).norm() / single[n].norm()).item() for n in single)
    if rank == 0:
        print(f"FSDP2 on {world} ranks: logprobs = the chain's bit for bit: {not failures}; worst weight-gradient "
              f"rel. L2 against the single-GPU gradient of the whole batch: {worst:.3g}", flush=True)
    if worst > 0.05:
        failures.append(f"rank {rank}: gradient rel. L2 {worst:.3g} against the single-GPU one")
    dist.destroy_process_group()
    for f in failures:
        print(f, file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
