"""samebits.hf.patch on a GPU (skipped elsewhere): a transformers model whose own modules run samebits'
ops in the chain's order gives the chain's logprobs bit for bit — alone, in a batch, under
activation checkpointing — and gradients close to the chain's, while it stays an nn.Module."""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers")

import samebits  # noqa: E402
import samebits.hf  # noqa: E402
import samebits.torch as sbt  # noqa: E402
from tiny_models import DEV, bits, llama3, qwen3  # noqa: E402

SEQS = [17, 64, 5, 130, 2]


def model_of(arch, tied=False):
    torch.manual_seed(5)
    if arch == "qwen3":
        return qwen3(transformers, vocab=4096, hidden=512, mlp=1024, heads=8, kv_heads=2, head_dim=64, tied=tied)
    return llama3(transformers, vocab=4096, hidden=512, mlp=1024, heads=8, kv_heads=2, head_dim=64)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("arch, tied", [("qwen3", False), ("qwen3", True), ("llama", False)])
def test_patched_logprobs_are_the_chains_bit_for_bit_alone_and_in_a_batch(arch, tied):
    model = model_of(arch, tied)
    seqs = [torch.randint(0, 4096, (n,)).tolist() for n in SEQS]
    with torch.no_grad():
        want = samebits.hf.Scorer(model).token_logprobs(seqs)
    assert samebits.hf.patch(model) is model
    assert isinstance(model, torch.nn.Module)
    with torch.no_grad():
        batch = model.token_logprobs(seqs)
        alone = [model.token_logprobs([s])[0] for s in seqs]
    for i, s in enumerate(seqs):
        assert batch[i].shape == (len(s) - 1,)
        assert torch.equal(bits(batch[i]), bits(want[i])), f"sequence {i} in the batch"
        assert torch.equal(bits(alone[i]), bits(want[i])), f"sequence {i} alone"


def test_patched_gradients_are_the_same_under_activation_checkpointing_and_close_to_the_chains():
    model = model_of("qwen3")
    seqs = [torch.randint(0, 4096, (n,)).tolist() for n in SEQS]
    adv = (1.0, -0.5, 2.0, 0.25, 3.0)
    scorer = samebits.hf.Scorer(model)
    sum(a * lp.sum() for a, lp in zip(adv, scorer.token_logprobs(seqs))).backward()
    chain = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    samebits.hf.patch(model)
    model.train()

    def grads():
        model.zero_grad(set_to_none=True)
        logps = model.token_logprobs(seqs)
        sum(a * lp.sum() for a, lp in zip(adv, logps)).backward()
        return torch.cat([x.detach() for x in logps]), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_logp, plain = grads()
    # torch's own activation checkpointing on every layer: the layer's forward runs again in the
    # backward (counted), and every bit is the same.
    from torch.distributed._composable import checkpoint
    calls = [0]
    layer0 = model.model.layers[0]
    patched_forward = layer0.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return patched_forward(*args, **kwargs)

    layer0.forward = counted
    for layer in model.model.layers:
        checkpoint(layer)
    ckpt_logp, ckpt = grads()
    assert calls[0] == 2, f"layer 0's forward ran {calls[0]} times (checkpointing reruns it once in the backward)"
    assert torch.equal(bits(ckpt_logp), bits(plain_logp))
    for n in plain:
        assert torch.equal(bits(ckpt[n]), bits(plain[n])), n
    worst = max(rel(plain[n].float(), chain[n]) for n in chain)
    print(f"patched model: worst weight-gradient rel. L2 against the chain's backward: {worst:.3g}")
    assert worst < 0.05


def test_patch_refuses_what_the_chain_does_not_take():
    model = model_of("qwen3")
    model.config.attention_bias = True
    with pytest.raises(samebits.Error, match="attention_bias"):
        samebits.hf.patch(model)
    model.config.attention_bias = False
    samebits.hf.patch(model)
    with pytest.raises(samebits.Error, match="lengths sum"):
        model(torch.arange(10, device=DEV), [4, 5])
    with pytest.raises(samebits.Error, match="at least one token"):
        model(torch.arange(4, device=DEV), [4, 0])
    with pytest.raises(samebits.Error, match="input_ids"):
        model(torch.ones(3, device=DEV), [3])
    for bad in (10**6, 2**40, -1):  # outside the vocab; outside int32 (named by the embedding, without a read-back here)
        with pytest.raises(samebits.Error, match="ids"):  # ids on a GPU: by a later op, or check_ids()
            model(torch.tensor([3, bad, 5], device=DEV), [3])
            sbt.check_ids()
        if DEV == "cuda":  # ids in host memory for a GPU model: checked there
            with pytest.raises(samebits.Error, match=f"value {bad} at index 1"):
                model(torch.tensor([3, bad, 5]), [3])
    with pytest.raises(samebits.Error, match="no sequences"):
        model.token_logprobs([])


def test_patched_model_under_fsdp2_gives_the_unsharded_bits(tmp_path):
    """FSDP2 (fully_shard on every decoder layer and the root) on one rank: the hooks unshard the
    parameters around each module's forward and backward, the patched forwards read them as the
    model's own — the logprobs and the gradients are the unsharded model's bit for bit. (Two ranks:
    tests/torch/fsdp_two_ranks.py under torchrun, on a 2-GPU machine.)"""
    import datetime

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    from torch.distributed.fsdp import fully_shard

    model = samebits.hf.patch(model_of("qwen3"))
    seqs = [torch.randint(0, 4096, (n,)).tolist() for n in SEQS]
    adv = (1.0, -0.5, 2.0, 0.25, 3.0)

    def run():
        model.zero_grad(set_to_none=True)
        logps = model.token_logprobs(seqs)
        sum(a * lp.sum() for a, lp in zip(adv, logps)).backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n] = g.detach().clone()
        return torch.cat([x.detach() for x in logps]), grads

    want_logp, want = run()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        got_logp, got = run()
    finally:
        dist.destroy_process_group()
    assert torch.equal(bits(got_logp), bits(want_logp))
    for n in want:
        assert torch.equal(bits(got[n]), bits(want[n])), n


def test_patched_model_under_fsdp2_on_two_ranks():
    """The two-rank check (tests/torch/fsdp_two_ranks.py) under torchrun: the chain's logprobs on every
    rank, gradients bitwise the same run to run and near the single-GPU ones. Needs two GPUs."""
    import os
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (a 2-GPU machine)")
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(here, "fsdp_two_ranks.py")], capture_output=True, text=True, timeout=600)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


@pytest.mark.parametrize("arch, tied", [("qwen3", False), ("qwen3", True), ("llama", False)])
def test_main_grad_chains_micro_batches_bit_for_bit(arch, tied):
    """patch(model, main_grad=True): every parameter gets an fp32 `main_grad` (Megatron / Transformer
    Engine's convention) that each backward accumulates into, segment by segment as the chain's
    gradients do, and `.grad` stays None — so a step's gradient bits do not depend on how its
    sequences are split into micro-batches (at sequence boundaries), packed together or not."""
    torch.manual_seed(9)
    seqs = [torch.randint(0, 4096, (n,)).tolist() for n in (17, 64, 5, 130, 2, 33, 90, 8)]
    adv = [1.0, -0.5, 2.0, 0.25, 3.0, -1.0, 0.5, 1.5]

    def run(groups):
        model = samebits.hf.patch(model_of(arch, tied), main_grad=True)
        for g in groups:
            logps = model.token_logprobs([seqs[i] for i in g])
            sum(adv[i] * lp.sum() for i, lp in zip(g, logps)).backward()
        assert all(p.grad is None for p in model.parameters()), "main_grad, not .grad"
        samebits.hf.reduce_main_grad(model)  # a tied model's LM-head part added in
        return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}

    whole = run([range(8)])
    assert all(g.dtype == torch.float32 and g.abs().sum() > 0 for g in whole.values())
    for split in ([range(3), range(3, 8)], [[0], [1, 2, 3, 4, 5, 6, 7]], [[i] for i in range(8)]):
        parts = run(split)
        for n in whole:
            assert torch.equal(bits(parts[n]), bits(whole[n])), f"{n}: split {split}"
    # the same step with the plain .grad: close (bf16 rounding of each micro-batch's gradient apart)
    model = samebits.hf.patch(model_of(arch, tied))
    logps = model.token_logprobs(seqs)
    sum(a * lp.sum() for a, lp in zip(adv, logps)).backward()
    for n, p in model.named_parameters():
        assert rel(p.grad.float(), whole[n]) < 0.02, n


def test_main_grad_is_refused_where_it_cannot_hold():
    from samebits.torch import _common
    if _common._ext is not None:
        import samebits.torch as sbt
        x = torch.randn(4, 64, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(32, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        with pytest.raises(samebits.Error, match="main_grad"):  # not the weight's shape
            sbt.linear(x, w, main_grad=torch.zeros(64, 32, device=DEV))
        with pytest.raises(samebits.Error, match="main_grad"):  # not fp32
            sbt.linear(x, w, main_grad=torch.zeros(32, 64, device=DEV, dtype=torch.bfloat16))


@pytest.mark.parametrize("main_grad", [False, True])
def test_kept_logits_change_no_bit_of_a_training_step(main_grad):
    """patch(model, keep_logits_bytes=...): the LM head's backward runs three vocab GEMMs for the rows
    whose logits the forward kept — the logprobs and every gradient keep their bits, whatever the
    budget (all rows, the first sequences, none)."""
    torch.manual_seed(10)
    seqs = [torch.randint(0, 4096, (n,)).tolist() for n in (17, 64, 5, 30)]
    adv = [1.0, -0.5, 2.0, 0.25]

    def step(budget):
        model = samebits.hf.patch(model_of("qwen3"), main_grad=main_grad, keep_logits_bytes=budget)
        logps = model.token_logprobs(seqs)
        sum(a * lp.sum() for a, lp in zip(adv, logps)).backward()
        grads = {n: (p.main_grad if main_grad else p.grad).detach().clone() for n, p in model.named_parameters()}
        return [lp.detach() for lp in logps], grads

    vocab = model_of("qwen3").lm_head.weight.shape[0]
    want_lp, want = step(0)
    for budget in (1 << 34, vocab * 6 * 90, vocab * 6 * 20):
        lp, got = step(budget)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(lp, want_lp)), f"logprobs, budget {budget}"
        for n in want:
            assert torch.equal(bits(got[n]), bits(want[n])), f"{n}: budget {budget}"


def test_ids_in_host_memory_give_the_device_ids_bits():
    """Ids handed over in host memory are checked there (the embedding and the LM head then skip their
    own checks and the stream synchronisations they cost): the same logprobs and gradients as ids
    already on the device."""
    torch.manual_seed(11)
    ids = torch.randint(0, 4096, (60,))
    out = []
    for where in ("cpu", DEV):
        model = samebits.hf.patch(model_of("qwen3"))
        logp, _ = model(ids.to(where), [25, 35])
        logp.sum().backward()
        out.append([logp.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*out):
        assert torch.equal(bits(a), bits(b))
