"""samebits.torch on a GPU (torch ≥ 2.4 with CUDA; skipped elsewhere): raw-bit invariance through
the torch API, gradients against an fp64 reference, torch.compile, errors, and a Hugging Face
Qwen3 model under enable()."""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import samebits  # noqa: E402
import samebits.torch as sbt  # noqa: E402

DEV = "cuda"


def bits(t):
    return t.detach().contiguous().view(torch.uint8).cpu()


def qwen3(transformers, vocab, hidden, mlp, heads, kv_heads, head_dim, tied):
    """A random 2-layer transformers Qwen3 model in bf16, made on the GPU."""
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                   max_position_embeddings=512, tie_word_embeddings=tied)
    with torch.device(DEV):
        return transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_linear_rows_have_the_same_bits_whatever_the_batch():
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(2048, 4096, device=DEV, generator=g).bfloat16()
    w = torch.randn(4096, 4096, device=DEV, generator=g).bfloat16() / 64
    y = sbt.linear(x, w)
    for rows in ((5, 6), (0, 1), (17, 49), (2047, 2048)):
        part = sbt.linear(x[rows[0]:rows[1]].contiguous(), w)
        assert torch.equal(bits(part), bits(y[rows[0]:rows[1]])), rows
    stock = x @ w.T
    differs = sum(not torch.equal(bits(x[i:i + n] @ w.T), bits(stock[i:i + n])) for i, n in ((0, 1), (5, 1), (17, 32)))
    print(f"stock torch (cuBLAS): of 3 row slices computed alone, {differs} differ from the same rows in the batch")


def test_gradients_against_fp64():
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(33, 256, device=DEV, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(128, 256, device=DEV, generator=g) / 16).bfloat16().requires_grad_()
    b = torch.randn(128, device=DEV, generator=g).bfloat16().requires_grad_()
    nw = (1 + 0.1 * torch.randn(128, device=DEV, generator=g)).bfloat16().requires_grad_()
    t = torch.randint(0, 128, (33,), device=DEV, generator=g)
    logp, ent = sbt.token_logprobs(sbt.rms_norm(sbt.linear(x, w, b), nw).float() * 4, t)
    (logp.sum() + 0.5 * ent.sum()).backward()
    xd, wd, bd, nd = (v.detach().double().requires_grad_() for v in (x, w, b, nw))
    h = xd @ wd.T + bd
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nd * 4
    lp = torch.log_softmax(h, -1)
    ref = lp.gather(1, t[:, None])[:, 0].sum() + 0.5 * (-(lp.exp() * lp).sum(-1)).sum()
    ref.backward()
    for got, want, name in ((x.grad, xd.grad, "x"), (w.grad, wd.grad, "w"), (b.grad, bd.grad, "b"), (nw.grad, nd.grad, "norm")):
        assert rel(got, want) < 0.05, name  # bf16 activations between the ops
    assert rel(logp, lp.gather(1, t[:, None])[:, 0]) < 0.02


def test_fp32_logprob_gradcheck():
    g = torch.Generator(device=DEV).manual_seed(2)
    logits = torch.randn(4, 50, device=DEV, generator=g, dtype=torch.float32).requires_grad_()
    t = torch.randint(0, 50, (4,), device=DEV, generator=g)
    f = lambda z: sbt.token_logprobs(z, t)[0].double()  # noqa: E731
    eps = 1e-2
    base = f(logits).sum()
    base.backward()
    num = torch.zeros_like(logits)
    with torch.no_grad():
        for i in range(4):
            for j in range(0, 50, 7):
                d = torch.zeros_like(logits)
                d[i, j] = eps
                num[i, j] = (f(logits + d).sum() - f(logits - d).sum()) / (2 * eps)
    mask = num != 0
    assert (logits.grad[mask] - num[mask]).abs().max().item() < 2e-3


def test_torch_compile_traces_the_custom_ops():
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(16, 512, device=DEV, generator=g).bfloat16()
    w = torch.randn(256, 512, device=DEV, generator=g).bfloat16() / 20
    nw = torch.ones(256, device=DEV).bfloat16()

    def f(x):
        return sbt.rms_norm(sbt.linear(x, w), nw)

    eager = f(x)
    compiled = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(bits(eager), bits(compiled))


@pytest.mark.parametrize("call, words", [
    (lambda: sbt.linear(torch.zeros(4, 8, device=DEV).bfloat16().T, torch.zeros(2, 4, device=DEV).bfloat16()), "contiguous"),
    (lambda: sbt.linear(torch.zeros(4, 8, device=DEV, dtype=torch.float64), torch.zeros(2, 8, device=DEV).double()), "dtype"),
    (lambda: sbt.linear(torch.zeros(4, 8, device=DEV).bfloat16(), torch.zeros(2, 8).bfloat16()), "cpu"),
    (lambda: sbt.linear(torch.zeros(4, 8, device=DEV).bfloat16(), torch.zeros(2, 9, device=DEV).bfloat16()), "linear"),
    (lambda: sbt.token_logprobs(torch.zeros(2, 5, device=DEV), torch.tensor([0, 7], device=DEV)), "outside"),
])
def test_bad_input_is_a_python_exception(call, words):
    with pytest.raises(samebits.Error) as e:
        call()
    assert words in str(e.value).lower()


def test_hf_qwen3_logprobs_alone_and_in_a_batch_of_32():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # Qwen3-8B's width (hidden 4096, 32 / 8 heads of 128, MLP 12288), 2 layers; short sequences, so
    # the sequence alone is a small-M GEMM (where cuBLAS changes its reduction) and the batch a large one.
    model = qwen3(transformers, vocab=8192, hidden=4096, mlp=12288, heads=32, kv_heads=8, head_dim=128, tied=False)
    ids = torch.randint(0, 8192, (32, 16), device=DEV)

    def logp(batch):
        with torch.no_grad():
            logits = model(input_ids=batch).logits[:, :-1]
            return torch.log_softmax(logits.float(), -1).gather(-1, batch[:, 1:, None])[..., 0]

    stock_alone, stock_batch = logp(ids[:1]), logp(ids)[:1]
    with sbt.enable():
        alone, batch = logp(ids[:1]), logp(ids)[:1]
    print(f"stock torch: alone vs in a batch of 32: bitwise equal {torch.equal(bits(stock_alone), bits(stock_batch))}, "
          f"max |diff| {(stock_alone - stock_batch).abs().max().item():.3g}")
    print(f"samebits.torch.enable(): bitwise equal {torch.equal(bits(alone), bits(batch))}, "
          f"max |diff| {(alone - batch).abs().max().item():.3g}; vs stock max |diff| {(alone - stock_alone).abs().max().item():.3g}")
    assert torch.equal(bits(alone), bits(batch))
    assert (alone - stock_alone).abs().max().item() < 0.1


def test_hf_scorer_runs_the_chain_on_the_models_weights():
    transformers = pytest.importorskip("transformers")
    import samebits.hf
    torch.manual_seed(1)
    model = qwen3(transformers, vocab=4096, hidden=256, mlp=512, heads=4, kv_heads=2, head_dim=64, tied=True)
    seqs = [torch.randint(0, 4096, (n,)).tolist() for n in (9, 40, 3, 64)]
    scorer = samebits.hf.Scorer(model, backend="cuda")
    together = scorer.logprobs(seqs)
    for i, s in enumerate(seqs):
        assert together[i].tobytes() == scorer.logprobs([s])[0].tobytes()
    with torch.no_grad():
        ids = torch.tensor([seqs[1]], device=DEV)
        ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    assert abs(torch.from_numpy(together[1][1:]) - ref.double().cpu()).max().item() < 0.1
    g1, g4 = scorer.gradients(seqs, micro_batch=1), scorer.gradients(seqs, micro_batch=4)
    assert g1.keys() == {n for n, _ in model.named_parameters()}
    assert all(g1[n].tobytes() == g4[n].tobytes() for n in g1)
