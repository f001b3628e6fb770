"""samebits.torch's C++ dispatcher ops (python/samebits/torch/_torch_ops.cpp) against the custom_op
path they stand in for: the same bits forward and backward, the same errors. Where the build made
them (torch present at configure time) they must load; elsewhere the module is skipped."""
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import samebits  # noqa: E402
import samebits.torch as sbt  # noqa: E402
from samebits.torch import _common, ops  # noqa: E402
from tiny_models import DEV, bits  # noqa: E402

LIB = os.path.join(os.path.dirname(_common.__file__), "_torch_ops.so")
if not os.path.exists(LIB):
    pytest.skip("built without torch's C++ dispatcher ops", allow_module_level=True)


def test_the_dispatcher_ops_load_where_they_were_built_and_the_ops_take_them():
    if os.environ.get("SAMEBITS_TORCH_OPS") == "0":
        pytest.skip("SAMEBITS_TORCH_OPS=0")
    assert _common._ext is not None, "the library was built for this torch but did not load"
    x = torch.randn(4, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)  # the CUDA GEMM's dtypes
    w = torch.randn(96, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    assert "RmsNorm" in sbt.rms_norm(x, w[0]).grad_fn.name()
    assert "Linear" in sbt.linear(x, w).grad_fn.name()


def test_compiled_autograd_takes_the_custom_op_path():
    """The dispatcher ops' hand-made autograd nodes have no compiled_args, which compiled autograd
    traces a backward through: with it on, a call takes the custom_op path (docs/python.md)."""
    dynamo = pytest.importorskip("torch._dynamo")
    if not hasattr(dynamo.config, "compiled_autograd"):
        pytest.skip("this torch has no compiled autograd setting")
    x = torch.randn(4, 64, device=DEV, requires_grad=True)
    w = torch.randn(64, device=DEV, requires_grad=True)
    assert sbt.rms_norm(x, w).grad_fn.name().startswith("samebits::") == (_common._ext is not None)
    with dynamo.config.patch(compiled_autograd=True):
        assert not ops._eager()
        assert not sbt.rms_norm(x, w).grad_fn.name().startswith("samebits::")
    assert ops._eager()


@pytest.mark.parametrize("device, dtype", [(DEV, torch.bfloat16), (DEV, torch.float32), ("cpu", torch.float32)])
def test_rms_norm_is_the_custom_op_bit_for_bit_forward_and_backward(device, dtype):
    g = torch.Generator(device="cpu").manual_seed(3)
    x0 = torch.randn(5, 7, 256, generator=g).to(device, dtype)
    w0 = torch.randn(256, generator=g).to(device, dtype)
    dy = torch.randn(5, 7, 256, generator=g).to(device, dtype)

    def run(fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w)
        y.backward(dy)
        return y.detach(), x.grad, w.grad

    # eps not the library's default (1e-6): a dropped eps would show
    ours = run(lambda x, w: _common._ext.rms_norm(x, w, 1e-3))
    theirs = run(lambda x, w: ops._rms_norm(x, w, 1e-3)[0])
    for a, b, what in zip(ours, theirs, ("y", "dx", "dweight")):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(bits(a), bits(b)), what
    with torch.no_grad():
        assert torch.equal(bits(sbt.rms_norm(x0, w0, 1e-3)), bits(theirs[0]))
    if device == DEV:  # on a side stream: the op runs on torch's current stream (the default one's handle is null)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            y = _common._ext.rms_norm(x0, w0, 1e-3)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(bits(y), bits(theirs[0]))


def test_rms_norm_errors_are_samebits_errors():
    with pytest.raises(samebits.Error, match="contiguous"):
        sbt.rms_norm(torch.randn(8, 64, device=DEV).t(), torch.ones(8, device=DEV))
    with pytest.raises(samebits.Error, match="dtype"):
        sbt.rms_norm(torch.randn(4, 64, device=DEV, dtype=torch.float64), torch.ones(64, device=DEV, dtype=torch.float64))
    with pytest.raises(samebits.Error):
        sbt.rms_norm(torch.randn(4, 64, device=DEV), torch.ones(32, device=DEV))  # the op's own shape check


@pytest.mark.parametrize("device, dtype, bias", [(DEV, torch.bfloat16, False), (DEV, torch.bfloat16, True),
                                                 ("cpu", torch.float32, True)])
def test_linear_is_the_custom_op_bit_for_bit_forward_and_backward(device, dtype, bias):
    g = torch.Generator(device="cpu").manual_seed(4)
    x0 = torch.randn(3, 11, 256, generator=g).to(device, dtype)
    w0 = torch.randn(384, 256, generator=g).to(device, dtype)
    b0 = torch.randn(384, generator=g).to(device, dtype) if bias else None
    dy = torch.randn(3, 11, 384, generator=g).to(device, dtype)

    def run(fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if bias else None
        y = fn(x, w, b)
        y.backward(dy)
        return (y.detach(), x.grad, w.grad) + ((b.grad,) if bias else ())

    ours = run(lambda x, w, b: _common._ext.linear(x, w, b))
    theirs = run(lambda x, w, b: ops._linear(x, w, b))
    for a, b, what in zip(ours, theirs, ("y", "dx", "dweight", "dbias")):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(bits(a), bits(b)), what


@pytest.mark.parametrize("device, dtype", [(DEV, torch.bfloat16), ("cpu", torch.float32)])
def test_add_rms_norm_and_swiglu_are_the_custom_ops_bit_for_bit(device, dtype):
    g = torch.Generator(device="cpu").manual_seed(5)
    x0, r0 = (torch.randn(9, 256, generator=g).to(device, dtype) for _ in range(2))
    w0 = torch.randn(256, generator=g).to(device, dtype)
    dy, ds = (torch.randn(9, 256, generator=g).to(device, dtype) for _ in range(2))

    def run_norm(fn, with_ds):
        x, r, w = (t.clone().requires_grad_() for t in (x0, r0, w0))
        y, s = fn(x, r, w)
        torch.autograd.backward([y, s] if with_ds else [y], [dy, ds] if with_ds else [dy])
        return y.detach(), s.detach(), x.grad, r.grad, w.grad

    for with_ds in (True, False):
        ours = run_norm(lambda x, r, w: _common._ext.add_rms_norm(x, r, w, 1e-3), with_ds)
        theirs = run_norm(lambda x, r, w: ops._add_rms_norm(x, r, w, 1e-3)[:2], with_ds)
        for a, b, what in zip(ours, theirs, ("y", "s", "dx", "dresidual", "dweight")):
            assert torch.equal(bits(a), bits(b)), f"add_rms_norm {what} (gradient on s: {with_ds})"

    def run_swiglu(fn):
        a, b = x0.clone().requires_grad_(), r0.clone().requires_grad_()
        y = fn(a, b)
        y.backward(dy)
        return y.detach(), a.grad, b.grad

    for p, q, what in zip(run_swiglu(_common._ext.swiglu), run_swiglu(ops._swiglu), ("y", "dgate", "dup")):
        assert torch.equal(bits(p), bits(q)), f"swiglu {what}"


@pytest.mark.parametrize("device, dtype", [(DEV, torch.bfloat16), ("cpu", torch.float32)])
def test_token_logprobs_attention_and_embedding_are_the_custom_ops_bit_for_bit(device, dtype):
    g = torch.Generator(device="cpu").manual_seed(6)
    # token_logprobs: int64 targets with an ignored one; gradients on logp alone and on both outputs
    logits0 = torch.randn(2, 7, 1000, generator=g).to(device, dtype)
    targets = torch.randint(0, 1000, (2, 7), generator=g).to(device)
    targets[1, 3] = -100
    dlogp, dent = (torch.randn(2, 7, generator=g).to(device) for _ in range(2))
    for with_entropy in (True, False):
        def run(fn):
            lg = logits0.clone().requires_grad_()
            lp, ent = fn(lg)
            torch.autograd.backward([lp, ent] if with_entropy else [lp], [dlogp, dent] if with_entropy else [dlogp])
            return lp.detach(), ent.detach(), lg.grad
        ours = run(lambda lg: _common._ext.token_logprobs(lg, targets))
        theirs = run(lambda lg: ops._token_logprobs(lg, targets)[:2])
        for a, b, what in zip(ours, theirs, ("logp", "entropy", "dlogits")):
            assert torch.equal(bits(a), bits(b)), f"token_logprobs {what} (gradient on entropy: {with_entropy})"
    # attention: three sequences packed, GQA 4 / 2
    lengths = [5, 130, 17]
    T = sum(lengths)
    q0 = torch.randn(T, 4, 64, generator=g).to(device, dtype)
    k0, v0 = (torch.randn(T, 2, 64, generator=g).to(device, dtype) for _ in range(2))
    dout = torch.randn(T, 4, 64, generator=g).to(device, dtype)

    def run_attention(fn):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = fn(q, k, v)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad
    ours = run_attention(lambda q, k, v: _common._ext.attention(q, k, v, lengths, 0.0))
    theirs = run_attention(lambda q, k, v: ops._attention(q, k, v, ops._seq_table(lengths), 0.0)[0])
    for a, b, what in zip(ours, theirs, ("out", "dq", "dk", "dv")):
        assert torch.equal(bits(a), bits(b)), f"attention {what}"
    # embedding: int64 and int32 ids, a repeated id (its gradient rows summed in token order)
    table0 = torch.randn(100, 64, generator=g).to(device, dtype)
    ids = torch.randint(0, 100, (3, 9), generator=g).to(device)
    ids[2, 4] = ids[0, 1]
    dy = torch.randn(3, 9, 64, generator=g).to(device, dtype)
    for idx in (ids, ids.int()):
        def run_embedding(fn):
            t = table0.clone().requires_grad_()
            y = fn(idx, t)
            y.backward(dy)
            return y.detach(), t.grad
        for a, b, what in zip(run_embedding(_common._ext.embedding), run_embedding(ops._embedding), ("y", "dtable")):
            assert torch.equal(bits(a), bits(b)), f"embedding {what} ({idx.dtype})"


def test_the_new_dispatcher_ops_name_bad_input_as_samebits_errors():
    table = torch.randn(50, 64, device=DEV, dtype=torch.bfloat16)
    # Ids on a GPU are checked without waiting: the error may come from check_ids() (or a later op).
    with pytest.raises(samebits.Error, match="value 50 at index 1"):  # outside the vocab (the op's own range check)
        sbt.embedding(torch.tensor([3, 50], device=DEV), table)
        sbt.check_ids()
    with pytest.raises(samebits.Error, match="ids.*value 1099511627776 at index 1"):  # int64 ids read as they are
        sbt.embedding(torch.tensor([3, 2**40], device=DEV), table)
        sbt.check_ids()
    with pytest.raises(samebits.Error, match="ids.*value 1099511627776 at index 0"):  # the same on the CPU
        sbt.embedding(torch.tensor([2**40]), table.cpu().float())
    with pytest.raises(samebits.Error, match="targets"):
        sbt.token_logprobs(torch.randn(2, 10, device=DEV), torch.tensor([1, 10], device=DEV))
        sbt.check_ids()
    q = torch.randn(8, 4, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(8, 2, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(samebits.Error, match="lengths"):
        sbt.attention(q, k, k, [9, -1])
    assert "Attention" in sbt.attention(q.requires_grad_(), k, k, [3, 5]).grad_fn.name()


def test_bad_input_to_a_call_that_records_a_backward_is_an_error():
    """The same refusals where an input wants a gradient (the op makes its C++ autograd node),
    main_grad's among them: an exception, and the process goes on."""
    bf = dict(device=DEV, dtype=torch.bfloat16)
    x = torch.randn(4, 64, **bf)
    with pytest.raises(samebits.Error, match="weight"):
        sbt.linear(x, torch.randn(32, 63, **bf, requires_grad=True))
    with pytest.raises(samebits.Error, match="weight"):
        sbt.rms_norm(torch.randn(4, 64, device=DEV, requires_grad=True), torch.ones(32, device=DEV))
    if _common._ext is not None:
        w = torch.randn(32, 64, **bf, requires_grad=True)
        with pytest.raises(samebits.Error, match="main_grad"):
            sbt.linear(x, w, main_grad=torch.zeros(64, 32, device=DEV))
        with pytest.raises(samebits.Error, match="segments"):
            sbt.linear(x, w, main_grad=torch.zeros(32, 64, device=DEV), segments=[2, -1])
    y = sbt.linear(x, torch.randn(32, 64, **bf, requires_grad=True))
    y.sum().backward()  # and the next call records and runs its backward


def test_lm_head_logprobs_with_logits_kept_are_the_recomputes_bits():
    """keep_logits_bytes (the three-GEMM mode: the forward's fp32 logits kept for the backward): the
    same logp, dhidden and dweight bits whatever the budget — all rows, none, or (segments given)
    the rows of the first sequences that fit."""
    if _common._ext is None:
        pytest.skip("the C++ dispatcher ops are not built for this torch")
    g = torch.Generator(device="cpu").manual_seed(12)
    hidden0 = torch.randn(40, 128, generator=g).to(DEV, torch.bfloat16)
    weight0 = torch.randn(4096, 128, generator=g).to(DEV, torch.bfloat16)
    targets = torch.randint(0, 4096, (40,), generator=g).to(DEV)
    targets[[9, 24, 39]] = -100
    dlogp = torch.randn(40, generator=g).to(DEV)
    lengths = [10, 15, 15]

    def run(budget, segments):
        h, w = hidden0.clone().requires_grad_(), weight0.clone()
        mg = torch.zeros(w.shape, device=DEV)
        w.requires_grad_()
        lp, _ = sbt.lm_head_logprobs(h, w, targets, main_grad=mg, segments=segments, keep_logits_bytes=budget)
        (lp * dlogp).sum().backward()
        return lp.detach(), h.grad, mg
    per_row = 4096 * 6
    for segments in (None, lengths):
        want = run(0, segments)
        for budget in (per_row * 40, per_row * 12, per_row * 25 + 7, 1):
            for a, b, what in zip(run(budget, segments), want, ("logp", "dhidden", "dweight")):
                assert torch.equal(bits(a), bits(b)), f"{what}: budget {budget} bytes, segments {segments}"


@pytest.mark.skipif(DEV != "cuda", reason="the GPU's memory")
def test_a_frozen_lm_head_computes_no_weight_gradient_on_either_path():
    """A frozen LM head (weight.requires_grad False, as in LoRA or a frozen-head RL run): the backward
    gives the trained head's dhidden bits without the weight gradient — no fp32 accumulator of the
    vocab × hidden weight, no weight-gradient GEMM — on the dispatcher op and the custom_op path.
    (Before, both made the accumulator and ran the GEMM, then dropped the result.)"""
    g = torch.Generator(device="cpu").manual_seed(21)
    T, H, V = 256, 1024, 32000
    hidden0 = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    weight0 = (torch.randn(V, H, generator=g) * 0.03).to(DEV, torch.bfloat16)
    targets = torch.randint(0, V, (T,), generator=g).to(DEV)
    accumulator = V * H * 4  # 131 MB

    def run(fn, frozen):
        h, w = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_(not frozen)
        lp, _ = fn(h, w)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        lp.sum().backward()
        torch.cuda.synchronize()
        return h.grad, w.grad, torch.cuda.max_memory_allocated() - before

    paths = {"custom_op": lambda h, w: ops._lm_head_logprobs(h, w, targets)[:2]}
    if _common._ext is not None:
        paths["dispatcher op"] = lambda h, w: _common._ext.lm_head_logprobs(h, w, targets)
    for name, fn in paths.items():
        dh, dw, peak = run(fn, frozen=False)
        dh_frozen, dw_frozen, peak_frozen = run(fn, frozen=True)
        assert dw is not None and dw_frozen is None, name
        assert torch.equal(bits(dh_frozen), bits(dh)), f"{name}: dhidden of a frozen head"
        assert peak - peak_frozen >= accumulator, f"{name}: {peak_frozen} bytes at the peak, trained {peak}"


def test_samebits_device_memory_comes_from_torchs_caching_allocator():
    """With the dispatcher library loaded, an engine's KV cache (and every samebits allocation outside
    its own graph captures) is torch's memory: torch.cuda.memory_allocated() sees it, and it goes back to
    torch's cache when the engine is gone, which torch.cuda.empty_cache() releases."""
    if _common._ext is None or os.environ.get("SAMEBITS_TORCH_ALLOCATOR") == "0":
        pytest.skip("the dispatcher library (and with it torch's allocator) is not loaded")
    import gc

    transformers = pytest.importorskip("transformers")
    import samebits.hf
    from tiny_models import qwen3

    model = qwen3(transformers, vocab=512, hidden=256, mlp=512, heads=4, kv_heads=2, head_dim=64, tied=False)
    # K and V of 1024 pages of 16 rows, 2 heads of 64, bf16: 4 MB a tensor, each its own block of torch's
    # large pool (small ones share 2 MB segments with other tensors, which empty_cache() cannot release)
    kv_bytes = model.config.num_hidden_layers * 2 * (1024 * 16) * 2 * 64 * 2
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gen = samebits.hf.Generator(model, kv_pages=1024, page_size=16)
    held = torch.cuda.memory_allocated() - before
    assert held >= kv_bytes, f"torch sees {held} bytes more, the KV cache alone is {kv_bytes}"
    assert samebits._core.device_memory_in_use("cuda") >= kv_bytes
    for graphs in (True, False):  # decode graphs captured on samebits' own pool, eager steps on torch's
        g = samebits.hf.Generator(model, kv_pages=1024, page_size=16, cuda_graphs=graphs)
        rollouts = g.generate([[1, 2, 3], [4, 5]], n=2, max_new_tokens=6, seed=3)
        assert all(r.finish_reason == "length" for rs in rollouts for r in rs), [r.error for rs in rollouts for r in rs]
        assert (g.engine.captured_graphs > 0) == graphs
        del g
    del gen, rollouts
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < kv_bytes, "the KV cache went back to torch's cache"
    # torch holds those blocks (filed under the engines' streams): its empty_cache() releases them
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    assert reserved - torch.cuda.memory_reserved() >= kv_bytes, "torch's cache held samebits' freed memory"


def test_outputs_of_the_dispatcher_ops_take_in_place_updates():
    """The ops' outputs take in-place updates, as the custom_op path's do: they are made at full shape,
    never views of a tensor made inside the op (which autograd may refuse to update in place)."""
    E = _common._ext
    x = torch.randn(2, 3, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    lg = torch.randn(2, 3, 500, device=DEV, requires_grad=True)
    table = torch.randn(50, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 50, (2, 3), device=DEV)
    for name, y in {"rms_norm": E.rms_norm(x, w, 1e-5), "add_rms_norm": E.add_rms_norm(x, x.detach(), w, 1e-5)[0],
                    "swiglu": E.swiglu(x, x.detach()), "linear": E.linear(x, W, None),
                    "token_logprobs": E.token_logprobs(lg, torch.randint(0, 500, (2, 3), device=DEV))[0],
                    "embedding": E.embedding(ids, table)}.items():
        y.mul_(2).float().sum().backward()  # raised for views made inside the Function
        assert y.grad_fn is not None, name


@pytest.mark.parametrize("device, dtype", [(DEV, torch.bfloat16), ("cpu", torch.float32)])
def test_calls_that_record_no_backward_skip_autograd_and_give_the_same_bits(device, dtype):
    """Under no_grad (or with no input wanting a gradient) a dispatcher op runs alone — no autograd
    node, no rstd / lse kept — and gives the recording call's bits."""
    g = torch.Generator(device="cpu").manual_seed(7)
    x, r = (torch.randn(6, 256, generator=g).to(device, dtype) for _ in range(2))
    w = torch.randn(256, generator=g).to(device, dtype)
    W = torch.randn(320, 256, generator=g).to(device, dtype)
    logits = torch.randn(6, 900, generator=g).to(device, dtype)
    targets = torch.randint(0, 900, (6,), generator=g).to(device)
    q = torch.randn(9, 4, 64, generator=g).to(device, dtype)
    k, v = (torch.randn(9, 2, 64, generator=g).to(device, dtype) for _ in range(2))
    table = torch.randn(50, 64, generator=g).to(device, dtype)
    ids = torch.randint(0, 50, (2, 5), generator=g).to(device)
    E = _common._ext
    calls = {
        "rms_norm": lambda a, b: E.rms_norm(a, b, 1e-5),
        "add_rms_norm": lambda a, b: torch.cat(E.add_rms_norm(a, r, b, 1e-5)),
        "swiglu": lambda a, b: E.swiglu(a, x),
        "linear": lambda a, b: E.linear(a, W, None),
        "token_logprobs": lambda a, b: torch.cat(E.token_logprobs(logits + 0 * a.sum(), targets)),
        "attention": lambda a, b: E.attention(q + 0 * a.sum(), k, v, [4, 5], 0.0),
        "embedding": lambda a, b: E.embedding(ids, table + 0 * b.sum()),
    }
    for name, call in calls.items():
        recorded = call(x.clone().requires_grad_(), w.clone().requires_grad_())
        assert recorded.requires_grad, name
        with torch.no_grad():
            alone = call(x.clone().requires_grad_(), w.clone().requires_grad_())
        plain = call(x, w)
        assert not alone.requires_grad and not plain.requires_grad and alone.grad_fn is None, name
        assert torch.equal(bits(alone), bits(recorded.detach())) and torch.equal(bits(plain), bits(alone)), name


@pytest.mark.parametrize("device, dtype", [(DEV, torch.bfloat16), ("cpu", torch.float32)])
def test_qk_norm_and_lm_head_logprobs_are_the_custom_ops_bit_for_bit(device, dtype):
    g = torch.Generator(device="cpu").manual_seed(8)
    x0 = torch.randn(11, 4, 64, generator=g).to(device, dtype)
    w0 = torch.randn(64, generator=g).to(device, dtype)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2]).to(device)
    dy = torch.randn(11, 4, 64, generator=g).to(device, dtype)
    for pos, llama3 in ((None, []), (positions, []), (positions, [8.0, 1.0, 4.0, 64.0])):
        def run(fn):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            y = fn(x, w)
            y.backward(dy)
            return y.detach(), x.grad, w.grad
        ours = run(lambda x, w: _common._ext.qk_norm(x, w, 1e-5, pos, 5e5, llama3))
        theirs = run(lambda x, w: ops._qk_norm(x, w, 1e-5, pos, 5e5, llama3)[0])
        for a, b, what in zip(ours, theirs, ("y", "dx", "dweight")):
            assert torch.equal(bits(a), bits(b)), f"qk_norm {what} (positions: {pos is not None}, llama3: {llama3})"
    hidden0 = torch.randn(2, 9, 256, generator=g).to(device, dtype)
    weight0 = torch.randn(3000, 256, generator=g).to(device, dtype)
    targets = torch.randint(0, 3000, (2, 9), generator=g).to(device)
    targets[0, 8] = targets[1, 8] = -100
    dlogp, dent = (torch.randn(2, 9, generator=g).to(device) for _ in range(2))

    def run_lm(fn, entropy_grad):  # without an entropy gradient, the backward is given none
        h, w = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        lp, ent = fn(h, w)
        torch.autograd.backward([lp, ent] if entropy_grad else [lp], [dlogp, dent] if entropy_grad else [dlogp])
        return lp.detach(), ent.detach(), h.grad, w.grad
    for entropy_grad in (True, False):
        ours = run_lm(lambda h, w: _common._ext.lm_head_logprobs(h, w, targets), entropy_grad)
        theirs = run_lm(lambda h, w: ops._lm_head_logprobs(h, w, targets)[:2], entropy_grad)
        # targets vouched for (samebits.hf.patch's next-token ids): no range check, the same bits
        vouched = run_lm(lambda h, w: _common._ext.lm_head_logprobs(h, w, targets, None, None, True), entropy_grad)
        for a, b, c, what in zip(ours, theirs, vouched, ("logp", "entropy", "dhidden", "dweight")):
            assert torch.equal(bits(a), bits(b)), f"lm_head_logprobs {what} (entropy gradient: {entropy_grad})"
            assert torch.equal(bits(c), bits(a)), f"lm_head_logprobs {what}, targets vouched for"


@pytest.mark.skipif(DEV != "cuda", reason="ids in GPU memory: the deferred check")
def test_a_bad_gpu_id_gives_nan_rows_then_an_error_from_a_later_op_and_the_context_stays_usable():
    """Ids in GPU memory are range-checked without a stream synchronisation (samebits::IdCheck::deferred):
    the bad call returns with its row NaN (never another row's values), the first samebits op after
    the check ran raises samebits.Error naming that call, the value and its index (int64 ids: the
    note on int32's bound), and the op after that runs with the waiting check's bits. A bad target's
    gradient is NaN too (never a finite gradient without its one-hot term)."""
    if _common._ext is None:
        pytest.skip("the C++ dispatcher ops are not built for this torch (the custom_op path waits)")
    table = torch.randn(50, 64, device=DEV, dtype=torch.bfloat16)
    good = torch.tensor([7, 3, 9], device=DEV)
    want = sbt.embedding(good, table)
    for bad, match in ((torch.tensor([3, 50, 9], device=DEV, dtype=torch.int32), "value 50 at index 1"),
                       (torch.tensor([3, 2**40, 9], device=DEV), "value 1099511627776 at index 1")):
        y = sbt.embedding(bad, table)
        torch.cuda.synchronize()
        assert torch.isnan(y[1]).all() and torch.equal(bits(y[0]), bits(table[3]))
        with pytest.raises(samebits.Error, match=f"embedding.*{match}"):
            sbt.rms_norm(y.float(), torch.ones(64, device=DEV), 1e-6)  # any op: it raises the earlier call's error
        assert torch.equal(bits(sbt.embedding(good, table)), bits(want))  # reported once; the context is usable
    sbt.check_ids()  # nothing pending
    logits = torch.randn(3, 10, device=DEV)
    logp, _ = sbt.token_logprobs(logits, torch.tensor([1, 10, 2], device=DEV))
    torch.cuda.synchronize()
    assert torch.isnan(logp[1]) and not torch.isnan(logp[0]) and not torch.isnan(logp[2])
    with pytest.raises(samebits.Error, match="targets.*value 10 at index 1"):
        sbt.check_ids()

    def drain():  # every pending error, one a call
        messages = []
        while True:
            try:
                sbt.check_ids()
                return messages
            except samebits.Error as e:
                messages.append(str(e))

    hidden = torch.randn(3, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(10, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    bad_targets = torch.tensor([1, 10, 2], device=DEV)
    logp, _ = sbt.lm_head_logprobs(hidden, weight, bad_targets)
    torch.cuda.synchronize()  # the forward's check has landed: the backward's entry raises it
    with pytest.raises(ValueError, match="lm_head.*value 10 at index 1"):  # through torch's C++ autograd
        logp.sum().backward()  # engine samebits.Error arrives as the ValueError it derives from
    logp, _ = sbt.lm_head_logprobs(hidden, weight, bad_targets)
    with pytest.raises(samebits.Error, match="value 10 at index 1"):
        sbt.check_ids()  # the forward's error taken first: the backward below runs
    logp.sum().backward()
    torch.cuda.synchronize()
    assert torch.isnan(logp[1]) and torch.isnan(hidden.grad[1]).all() and torch.isnan(weight.grad).all()
    assert not torch.isnan(hidden.grad[0]).any() and not torch.isnan(hidden.grad[2]).any()
    errors = drain()  # the backward's own check of the targets, if it makes one
    assert all("value 10 at index 1" in m for m in errors), errors
