"""samebits.torch on a GPU (torch ≥ 2.4 with CUDA; skipped elsewhere): raw-bit invariance through
the torch API, gradients against an fp64 reference, torch.compile, errors, and a Hugging Face
Qwen3 model under enable()."""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import samebits  # noqa: E402
import samebits.torch as sbt  # noqa: E402
from tiny_models import DEV, bits, llama3, qwen3  # noqa: E402


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
        h = sbt.rms_norm(sbt.linear(x, w), nw)
        q = h.reshape(16, 4, 64)
        return sbt.swiglu(sbt.attention(q, q, q, [7, 9]), q)

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
        sbt.check_ids()  # ids on a GPU: checked without waiting, raised here at the latest
    assert words in str(e.value).lower()


def test_attention_rows_alone_equal_the_pack_and_match_fp64():
    g = torch.Generator(device=DEV).manual_seed(4)
    lengths = [37, 5, 130, 64]
    t, hq, hkv, d = sum(lengths), 8, 2, 128
    q, k, v = (torch.randn(t, h, d, device=DEV, generator=g).bfloat16().requires_grad_() for h in (hq, hkv, hkv))
    out = sbt.attention(q, k, v, lengths)
    dout = torch.randn(out.shape, device=DEV, generator=g).bfloat16()
    out.backward(dout)
    at = 0
    for n in lengths:
        rows = slice(at, at + n)
        qs, ks, vs = (x.detach()[rows].clone().requires_grad_() for x in (q, k, v))
        alone = sbt.attention(qs, ks, vs, [n])
        alone.backward(dout[rows])
        assert torch.equal(bits(alone), bits(out[rows])), n
        for got, whole in ((qs.grad, q.grad), (ks.grad, k.grad), (vs.grad, v.grad)):
            assert torch.equal(bits(got), bits(whole[rows])), n
        # fp64 reference: causal softmax attention with GQA.
        qd, kd, vd = (x.detach()[rows].double().requires_grad_() for x in (q, k, v))
        kr, vr = (x.repeat_interleave(hq // hkv, dim=1) for x in (kd, vd))
        s = torch.einsum("qhd,khd->hqk", qd, kr) / d ** 0.5
        s = s.masked_fill(torch.ones(n, n, device=DEV, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vr)
        ref.backward(dout[rows].double())
        assert rel(out[rows], ref) < 1e-2
        for got, want in ((q.grad[rows], qd.grad), (k.grad[rows], kd.grad), (v.grad[rows], vd.grad)):
            assert rel(got, want) < 2e-2
        at += n


def test_swiglu_and_embedding_match_fp64():
    g = torch.Generator(device=DEV).manual_seed(5)
    gate, up = (torch.randn(65, 300, device=DEV, generator=g).bfloat16().requires_grad_() for _ in range(2))
    y = sbt.swiglu(gate, up)
    dy = torch.randn(y.shape, device=DEV, generator=g).bfloat16()
    y.backward(dy)
    gd, ud = (x.detach().double().requires_grad_() for x in (gate, up))
    ref = torch.nn.functional.silu(gd) * ud
    ref.backward(dy.double())
    assert rel(y, ref) < 4e-3 and rel(gate.grad, gd.grad) < 4e-3 and rel(up.grad, ud.grad) < 4e-3
    table = torch.randn(50, 64, device=DEV, generator=g).bfloat16().requires_grad_()
    ids = torch.randint(0, 50, (3, 40), device=DEV, generator=g)  # int64, repeated ids
    e = sbt.embedding(ids, table)
    assert torch.equal(bits(e), bits(table.detach()[ids]))
    de = torch.randn(e.shape, device=DEV, generator=g).bfloat16()
    e.backward(de)
    want = torch.zeros(50, 64, dtype=torch.float64, device=DEV).index_add_(0, ids.reshape(-1), de.reshape(-1, 64).double())
    assert rel(table.grad, want) < 4e-3
    with pytest.raises(samebits.Error, match="outside|range"):
        sbt.embedding(torch.tensor([3, 50], device=DEV), table)
        sbt.check_ids()
    with pytest.raises(samebits.Error, match="value 8589934592 at index 0"):  # int64 ids read as they are
        sbt.embedding(torch.tensor([2**33], device=DEV), table)
        sbt.check_ids()


def test_rope_qk_norm_and_lm_head_rows_alone_equal_the_batch_and_match_fp64():
    g = torch.Generator(device=DEV).manual_seed(7)
    t, h, d = 300, 8, 128
    x = torch.randn(t, h, d, device=DEV, generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(d, device=DEV, generator=g)).bfloat16().requires_grad_()
    pos = torch.randint(0, 40000, (t,), device=DEV, generator=g)
    fused = sbt.qk_norm(x, w, 1e-6, pos)
    assert torch.equal(bits(fused), bits(sbt.rope(sbt.qk_norm(x, w, 1e-6), pos)))  # one pass = the two ops
    assert torch.equal(bits(sbt.qk_norm(x[5:9].contiguous(), w, 1e-6, pos[5:9])), bits(fused[5:9]))
    dy = torch.randn(fused.shape, device=DEV, generator=g).bfloat16()
    fused.backward(dy)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    inv = (1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64, device=DEV) / d)).float()
    ang = (pos.float()[:, None] * inv[None]).double()
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    ref = n * cos + torch.cat([-n[..., d // 2:], n[..., :d // 2]], -1) * sin
    ref.backward(dy.double())
    assert rel(fused, ref) < 1e-2 and rel(x.grad, xd.grad) < 2e-2 and rel(w.grad, wd.grad) < 2e-2

    hidden = torch.randn(257, 512, device=DEV, generator=g).bfloat16().requires_grad_()
    head = (torch.randn(40000, 512, device=DEV, generator=g) / 24).bfloat16().requires_grad_()
    tgt = torch.randint(0, 40000, (257,), device=DEV, generator=g)
    logp, ent = sbt.lm_head_logprobs(hidden, head, tgt)
    one, _ = sbt.lm_head_logprobs(hidden[100:101].contiguous(), head, tgt[100:101])
    assert torch.equal(bits(one), bits(logp[100:101]))
    (logp.sum() + 0.1 * ent.sum()).backward()
    hd, wd = hidden.detach().double().requires_grad_(), head.detach().double().requires_grad_()
    lp = torch.log_softmax(hd @ wd.T, -1)
    want = lp.gather(1, tgt[:, None])[:, 0]
    (want.sum() + 0.1 * (-(lp.exp() * lp).sum(-1)).sum()).backward()
    assert (logp.double() - want).abs().max().item() < 2e-3
    assert rel(hidden.grad, hd.grad) < 2e-2 and rel(head.grad, wd.grad) < 2e-2


def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit():
    g = torch.Generator(device=DEV).manual_seed(8)
    x, r = (torch.randn(70, 4096, device=DEV, generator=g).bfloat16().requires_grad_() for _ in range(2))
    w = (1 + 0.1 * torch.randn(4096, device=DEV, generator=g)).bfloat16().requires_grad_()
    y, s = sbt.add_rms_norm(x, r, w)
    assert torch.equal(bits(s), bits(x.detach() + r.detach()))  # fp32 add rounded once = torch's bf16 add
    assert torch.equal(bits(y), bits(sbt.rms_norm(x.detach() + r.detach(), w.detach())))
    dy, ds = (torch.randn(70, 4096, device=DEV, generator=g).bfloat16() for _ in range(2))
    torch.autograd.backward((y, s), (dy, ds))
    assert torch.equal(bits(x.grad), bits(r.grad))
    sd, wd = (x.detach().double() + r.detach().double()).requires_grad_(), w.detach().double().requires_grad_()
    yd = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    torch.autograd.backward((yd, sd), (dy.double(), ds.double()))
    assert rel(x.grad, sd.grad) < 2e-2 and rel(w.grad, wd.grad) < 2e-2


def test_enable_routes_attention_norms_and_reductions():
    g = torch.Generator(device=DEV).manual_seed(6)
    b, h, s, d = 4, 8, 96, 64
    q, k, v = (torch.randn(b, h, s, d, device=DEV, generator=g).bfloat16().requires_grad_() for _ in range(3))
    with sbt.enable():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    packed = [x.detach().transpose(1, 2).reshape(b * s, h, d).requires_grad_() for x in (q, k, v)]
    ref = sbt.attention(*packed, [s] * b)
    ref.sum().backward()
    assert torch.equal(bits(out.transpose(1, 2).reshape(b * s, h, d)), bits(ref))
    assert torch.equal(bits(q.grad.transpose(1, 2).reshape(b * s, h, d)), bits(packed[0].grad))
    with sbt.enable(), pytest.raises(samebits.Error, match="mask"):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, s, dtype=torch.bool, device=DEV))
    with sbt.enable(strict=False):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, s, dtype=torch.bool, device=DEV))
    # Per-row mean / sum and log_softmax's backward: a row alone = the row in a batch of 512.
    x = torch.randn(512, 4096, device=DEV, generator=g).requires_grad_()
    w = torch.randn(512, 4096, device=DEV, generator=g)
    with sbt.enable():
        m_all, s_all = x.pow(2).mean(-1, keepdim=True), torch.sum(x, dim=-1)
        m_one, s_one = x[3:4].pow(2).mean(-1, keepdim=True), torch.sum(x[3:4], dim=-1)
        lp = torch.log_softmax(x, -1)
        (lp * w).sum().backward()
        g_all = x.grad.clone()
        x.grad = None
        (torch.log_softmax(x[3:4], -1) * w[3:4]).sum().backward()
    assert torch.equal(bits(m_all[3:4]), bits(m_one)) and torch.equal(bits(s_all[3:4]), bits(s_one))
    assert torch.equal(bits(g_all[3:4]), bits(x.grad[3:4]))
    xd = x.detach().double()
    assert rel(m_all, xd.pow(2).mean(-1, keepdim=True)) < 1e-6 and rel(s_all, xd.sum(-1)) < 1e-5
    # The three matmuls of a linear layer, each on its samebits GEMM (no transposed copies).
    xs = torch.randn(300, 512, device=DEV, generator=g).bfloat16()
    ws = (torch.randn(256, 512, device=DEV, generator=g) / 16).bfloat16()
    dys = torch.randn(300, 256, device=DEV, generator=g).bfloat16()
    with sbt.enable():
        fwd, dx, dw = xs @ ws.T, dys @ ws, dys.T @ xs
        fwd1, dx1 = xs[7:8] @ ws.T, dys[7:8] @ ws
    for got, want in ((fwd, xs.double() @ ws.double().T), (dx, dys.double() @ ws.double()),
                      (dw, dys.double().T @ xs.double())):
        assert rel(got, want) < 1e-2
    assert torch.equal(bits(fwd1), bits(fwd[7:8])) and torch.equal(bits(dx1), bits(dx[7:8]))
    # softmax and its backward (last dim): a row alone = the row in the batch; bmm: K = 1 is the
    # exact product (= stock), K > 1 is refused under strict.
    x.grad = None
    with sbt.enable():
        (torch.softmax(x, -1) * w).sum().backward()
        sm_all, g_sm = torch.softmax(x.detach(), -1), x.grad.clone()
        x.grad = None
        (torch.softmax(x[3:4], -1) * w[3:4]).sum().backward()
        sm_one = torch.softmax(x.detach()[3:4], -1)
    assert torch.equal(bits(sm_all[3:4]), bits(sm_one)) and torch.equal(bits(g_sm[3:4]), bits(x.grad[3:4]))
    assert rel(sm_all, torch.softmax(x.detach().double(), -1)) < 1e-6
    ang_a, ang_b = torch.randn(2, 64, 1, device=DEV, generator=g), torch.randn(2, 1, 96, device=DEV, generator=g)
    stock_angles = ang_a @ ang_b
    with sbt.enable():
        assert torch.equal(bits(ang_a @ ang_b), bits(stock_angles))
        with pytest.raises(samebits.Error, match="bmm"):
            torch.randn(2, 8, 16, device=DEV).bfloat16() @ torch.randn(2, 16, 4, device=DEV).bfloat16()
    with sbt.enable(strict=False):
        torch.randn(2, 8, 16, device=DEV).bfloat16() @ torch.randn(2, 16, 4, device=DEV).bfloat16()
    # F.rms_norm → samebits.torch.rms_norm
    hx = torch.randn(10, 256, device=DEV, generator=g).bfloat16()
    hw = torch.randn(256, device=DEV, generator=g).bfloat16()
    with sbt.enable():
        routed = torch.nn.functional.rms_norm(hx, (256,), hw, 1e-6)
    assert torch.equal(bits(routed), bits(sbt.rms_norm(hx, hw, 1e-6)))


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

    def embed_grad(batch):  # d(Σ logp of sequence 0)/d(its input embeddings): a per-sequence gradient
        emb = model.get_input_embeddings()(batch).detach().requires_grad_()
        logits = model(inputs_embeds=emb).logits[:1, :-1]
        torch.log_softmax(logits.float(), -1).gather(-1, batch[:1, 1:, None]).sum().backward()
        return emb.grad[:1]

    stock = torch.equal(bits(embed_grad(ids[:1])), bits(embed_grad(ids)))
    with sbt.enable():
        ga, gb = embed_grad(ids[:1]), embed_grad(ids)
    print(f"gradient of sequence 0's logprobs w.r.t. its input embeddings, alone vs in the batch of 32: "
          f"stock bitwise equal {stock}; enable() bitwise equal {torch.equal(bits(ga), bits(gb))}, "
          f"max |diff| {(ga.float() - gb.float()).abs().max().item():.3g}")
    assert torch.equal(bits(ga), bits(gb))


@pytest.mark.parametrize("arch, tied", [("qwen3", False), ("qwen3", True), ("llama", False)])
def test_hf_scorer_token_logprobs_backward_is_the_chains_gradient(tmp_path, arch, tied):
    """The acceptance's "gradients equal the C++ chain's bit for bit on the same weights": a loss over
    samebits.hf's differentiable logprobs puts the chain's gradients into the transformers model's
    .grad; the reference is the C++ chain on the same weights loaded from the model's checkpoint."""
    transformers = pytest.importorskip("transformers")
    import samebits.hf
    torch.manual_seed(2)
    if arch == "qwen3":
        model = qwen3(transformers, vocab=4096, hidden=512, mlp=1024, heads=8, kv_heads=2, head_dim=64, tied=tied)
    else:
        model = llama3(transformers, vocab=4096, hidden=512, mlp=1024, heads=8, kv_heads=2, head_dim=64)
    seqs = [torch.randint(0, 4096, (n,)).tolist() for n in (17, 64, 5, 130)]
    scorer = samebits.hf.Scorer(model)
    assert scorer.in_place and scorer.model.device == "cuda"
    logps = scorer.token_logprobs(seqs)
    assert [len(x) for x in logps] == [len(q) - 1 for q in seqs]
    with torch.no_grad():  # close to transformers' own bf16 logprobs on the same weights
        ids = torch.tensor([seqs[3]], device=DEV)
        theirs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    assert (logps[3].detach() - theirs).abs().max().item() < 0.1
    adv = [torch.full((len(q) - 1,), a, device=DEV) for q, a in zip(seqs, (1.0, -0.5, 2.0, 0.25))]
    sum((a * lp).sum() for a, lp in zip(adv, logps)).backward()
    model.save_pretrained(tmp_path)
    chain = samebits.Chain(samebits.Model.load(str(tmp_path)), "cuda")
    kept = chain.forward(seqs)
    assert torch.equal(bits(torch.cat(logps)), bits(torch.from_numpy(kept.logp).float().to(DEV)))
    want = chain.backward(kept, torch.cat(adv).double().cpu().numpy())
    for name, p in model.named_parameters():
        ref = torch.from_numpy(want.host(name)).to(DEV)
        assert torch.equal(bits(scorer.last_grads[name]), bits(ref)), name
        assert torch.equal(bits(p.grad), bits(ref.to(p.dtype))), name
    # transformers' own autograd on the same loss, stock and under enable(): its arithmetic is not
    # the chain's (bf16 roundings in other places), so the same gradient up to bf16 rounding.
    def transformers_grads():
        model.zero_grad(set_to_none=True)
        total = 0.0
        for q, a in zip(seqs, (1.0, -0.5, 2.0, 0.25)):
            ids = torch.tensor([q], device=DEV)
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
            total = total + a * lp.sum()
        total.backward()
        return {n: p.grad.float() for n, p in model.named_parameters()}

    stock = transformers_grads()
    with sbt.enable():
        routed = transformers_grads()
    chain_g = {n: torch.from_numpy(want.host(n)).to(DEV) for n, _ in model.named_parameters()}
    worst = {k: max(rel(g[n], chain_g[n]) for n in chain_g) for k, g in (("stock", stock), ("enable()", routed))}
    print(f"{arch}{' tied' if tied else ''}: worst weight-gradient rel. L2 against the chain's: "
          f"stock transformers {worst['stock']:.3g}, under enable() {worst['enable()']:.3g}")
    assert worst["enable()"] < 0.05
    model.zero_grad(set_to_none=True)
    # In place: an optimizer-style update of the module's tensors is what the next call reads.
    alone = scorer.token_logprobs([seqs[1]])[0]
    assert torch.equal(bits(alone), bits(logps[1]))
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    after = scorer.token_logprobs([seqs[1]])[0]
    assert not torch.equal(bits(after), bits(alone))
    assert torch.equal(bits(after), bits(samebits.hf.Scorer(model).token_logprobs([seqs[1]])[0]))
    pending = scorer.token_logprobs([seqs[0]])[0]
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    with pytest.raises(samebits.Error, match="between the forward"):
        pending.sum().backward()
    # A copy (the CPU backend on a GPU model) refuses to score after the weights moved on, and a
    # replaced parameter is refused by the in-place scorer: never a stale answer.
    copy = samebits.hf.Scorer(model, backend="cpu")
    assert not copy.in_place
    with torch.no_grad():
        model.model.norm.weight.mul_(0.5)
    with pytest.raises(samebits.Error, match="changed"):
        copy.logprobs([seqs[0]])
    model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight.detach().clone())
    with pytest.raises(samebits.Error, match="replaced"):
        scorer.token_logprobs([seqs[0]])


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
