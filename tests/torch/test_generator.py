"""samebits.hf.Generator on a GPU (torch with CUDA, transformers, samebits built with CUDA; skipped
elsewhere): rollouts from a transformers model whose logprobs are Scorer.token_logprobs of prompt +
completion bit for bit (Qwen3 untied and tied, Llama-3), padded prompt batches, an optimizer's
in-place step read by the next generate, and stale weights refused."""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers")

import samebits  # noqa: E402
import samebits.hf  # noqa: E402
from tiny_models import DEV, bits, llama3, qwen3  # noqa: E402

if not samebits.cuda_available():
    pytest.skip("samebits was built without the CUDA backend", allow_module_level=True)

VOCAB = 4096


def tiny(arch, tied=False, seed=3):
    torch.manual_seed(seed)
    if arch == "qwen3":
        return qwen3(transformers, vocab=VOCAB, hidden=256, mlp=512, heads=4, kv_heads=2, head_dim=64, tied=tied)
    return llama3(transformers, vocab=VOCAB, hidden=256, mlp=512, heads=4, kv_heads=2, head_dim=64)


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def same(a, b):
    """Two generate() results, bit for bit: every rollout's prompt, tokens and logprobs."""
    assert [len(x) for x in a] == [len(x) for x in b]
    return all(torch.equal(x.prompt, y.prompt) and torch.equal(x.tokens, y.tokens)
               and torch.equal(bits(x.logprobs), bits(y.logprobs)) and x.finish_reason == y.finish_reason
               for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def assert_the_trainers_logprobs(model, ps, out):
    """Every rollout's logprobs = Scorer(model).token_logprobs of prompt + completion, bit for bit
    (entry i of token_logprobs scores token i + 1: the completion's are entries len(prompt) - 1 on)."""
    full = [p + r.tokens.tolist() for p, rs in zip(ps, out) for r in rs]
    want = samebits.hf.Scorer(model).token_logprobs(full)
    k = 0
    for p, rs in zip(ps, out):
        for r in rs:
            ref = want[k][len(p) - 1:]
            assert torch.equal(bits(r.logprobs), bits(ref)), (k, (r.logprobs - ref).abs().max().item())
            k += 1


@pytest.mark.parametrize("arch, tied", [("qwen3", False), ("qwen3", True), ("llama", False)])
def test_rollout_logprobs_are_the_scorers_token_logprobs_bit_for_bit(arch, tied):
    model = tiny(arch, tied)
    ps = prompts(6, seed=1)
    gen = samebits.hf.Generator(model, max_slots=16, max_context=256)
    assert gen.in_place and gen.model.device == "cuda"
    out = gen.generate(ps, n=2, temperature=1.0, top_p=0.95, max_new_tokens=12, seed=7)
    assert [len(rs) for rs in out] == [2] * 6
    for p, rs in zip(ps, out):
        for j, r in enumerate(rs):
            assert (r.sample, r.finish_reason, r.error) == (j, "length", "")
            assert r.tokens.dtype == torch.long and r.tokens.shape == (12,) and r.tokens.device.type == "cuda"
            assert r.logprobs.dtype == torch.float32 and r.logprobs.shape == (12,)
            assert r.prompt.tolist() == p and r.sequence.tolist() == p + r.tokens.tolist()
            assert bool((r.logprobs <= 0).all())
    assert not torch.equal(out[0][0].tokens, out[0][1].tokens)  # two samples, two draws
    assert_the_trainers_logprobs(model, ps, out)
    # the same request again: the same bits (the engine holds nothing over from the last call)
    assert same(out, gen.generate(ps, samebits.SamplingParams(n=2, temperature=1.0, top_p=0.95, max_new_tokens=12,
                                                              seed=7)))


def test_a_padded_batch_with_its_attention_mask_is_its_prompts():
    model = tiny("qwen3")
    gen = samebits.hf.Generator(model, max_slots=8, max_context=128)
    ps = prompts(4, seed=2)
    params = samebits.SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=3)
    want = gen.generate(ps, params)
    S = max(map(len, ps)) + 2
    for side in ("left", "right"):
        ids = torch.zeros(len(ps), S, dtype=torch.long, device=DEV)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(ps):
            at = slice(S - len(p), S) if side == "left" else slice(0, len(p))
            ids[i, at] = torch.tensor(p, device=DEV)
            mask[i, at] = 1
        assert same(gen.generate(ids, params, attention_mask=mask), want), side
    assert same(gen.generate([torch.tensor(p) for p in ps], params), want)
    mask[0] = 0
    mask[0, 0] = mask[0, 2] = 1  # a hole between two tokens
    with pytest.raises(samebits.Error, match="padding between"):
        gen.generate(ids, params, attention_mask=mask)
    with pytest.raises(samebits.Error, match="not both"):
        gen.generate(ps, params, n=2)
    bad = gen.generate([ps[0], [], [VOCAB + 5]], n=1, max_new_tokens=3)  # bad prompts fail alone
    assert [r.finish_reason for rs in bad for r in rs] == ["length", "error", "error"]
    assert "is empty" in bad[1][0].error and bad[1][0].tokens.numel() == 0 == bad[1][0].logprobs.numel()


def test_an_optimizer_step_in_place_is_what_the_next_generate_reads():
    model = tiny("qwen3", seed=4)
    gen = samebits.hf.Generator(model, max_slots=8, max_context=128)
    ps = prompts(3, seed=4)
    params = samebits.SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=9)
    before = gen.generate(ps, params)
    # One RL step: the rollouts scored by the Scorer, a policy-gradient loss, SGD updating in place.
    logps = samebits.hf.Scorer(model).token_logprobs([r.sequence.tolist() for rs in before for r in rs])
    advantages = (1.0, -1.0, 0.5, -0.5, 2.0, -2.0)
    (-sum(a * lp.sum() for a, lp in zip(advantages, logps))).backward()
    old = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.05).step()
    assert all(p.data_ptr() == old[n][0] for n, p in model.named_parameters())  # in place
    assert sum(not torch.equal(p.detach(), old[n][1]) for n, p in model.named_parameters()) > 0
    after = gen.generate(ps, params)
    assert not same(after, before)
    assert same(after, samebits.hf.Generator(model, max_slots=8, max_context=128).generate(ps, params))
    assert_the_trainers_logprobs(model, ps, after)


def test_stale_weights_are_refused():
    model = tiny("qwen3", seed=5)
    ps = prompts(2, seed=5)
    copy = samebits.hf.Generator(model, backend="cpu", max_slots=4, max_context=64)  # a GPU model on the CPU: a copy
    assert not copy.in_place
    gen = samebits.hf.Generator(model, max_slots=4, max_context=64)
    copy.generate(ps, max_new_tokens=2)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    with pytest.raises(samebits.Error, match="changed since the Generator copied"):
        copy.generate(ps, max_new_tokens=2)
    gen.generate(ps, max_new_tokens=2)  # in place: the update is read
    model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight.detach().clone())
    with pytest.raises(samebits.Error, match="replaced since the Generator was made"):
        gen.generate(ps, max_new_tokens=2)
