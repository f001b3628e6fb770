"""The custom_op path's backward (python/samebits/torch/ops.py: torch.compile, torch.func, compiled
autograd, SAMEBITS_TORCH_OPS=0): a gradient its inputs do not want is not computed where it is a
computation of its own (linear's dx and dweight), with the bits of a backward of every input; a
double backward raises naming the op, as the C++ dispatcher ops' nodes do
(test_torch_ops_autograd.py). The custom ops are called directly (ops._linear, ...), whichever path
samebits.torch takes. On CPU tensors; needs torch >= 2.4 (torch.library.custom_op)."""
import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip("samebits.torch needs torch >= 2.4 (torch.library.custom_op); test_torch_ops_autograd.py "
                "tests the C++ dispatcher ops' nodes", allow_module_level=True)

from samebits.torch import ops  # noqa: E402


def bits(t):
    return t.detach().contiguous().view(torch.uint8)


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def calls():
    """name → (the custom op's call, its differentiable inputs): every op with a backward of its own."""
    T, H, V = 6, 16, 40
    ids = torch.tensor([3, 0, 3, 39, 7, 1])
    targets = torch.tensor([5, 0, -100, 39, 2, 11])
    positions = torch.tensor([0, 1, 2, 0, 1, 2])
    return {
        "rms_norm": (lambda x, w: ops._rms_norm(x, w, 1e-5)[0], (rand(T, H, seed=1), rand(H, seed=2))),
        "add_rms_norm": (lambda x, res, w: ops._add_rms_norm(x, res, w, 1e-5)[:2],
                         (rand(T, H, seed=3), rand(T, H, seed=4), rand(H, seed=5))),
        "linear": (ops._linear, (rand(T, H, seed=6), rand(12, H, seed=7), rand(12, seed=8))),
        "swiglu": (ops._swiglu, (rand(T, H, seed=9), rand(T, H, seed=10))),
        "token_logprobs": (lambda z: ops._token_logprobs(z, targets)[:2], (rand(T, V, seed=11),)),
        "attention": (lambda q, k, v: ops._attention(q, k, v, ops._seq_table([2, 4]), 0.0)[0],
                      (rand(T, 4, 8, seed=12), rand(T, 2, 8, seed=13), rand(T, 2, 8, seed=14))),
        "embedding": (lambda t: ops._embedding(ids, t), (rand(V, H, seed=15),)),
        "qk_norm": (lambda x, w: ops._qk_norm(x, w, 1e-5, positions, 1e4, [])[0],
                    (rand(T, 2, 8, seed=16), rand(8, seed=17))),
        "lm_head_logprobs": (lambda h, w: ops._lm_head_logprobs(h, w, targets)[:2],
                             (rand(T, H, seed=18), rand(V, H, seed=19))),
    }


OPS = sorted(calls())


def leaves(inputs):
    return [t.clone().requires_grad_() for t in inputs]


def grad_of(out, inputs, **kw):
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs], **kw)


@pytest.mark.parametrize("op", OPS)
def test_the_gradient_of_each_input_alone_is_the_full_backwards_bits(op):
    fn, inputs = calls()[op]
    xs = leaves(inputs)
    full = grad_of(fn(*xs), xs)
    for i in range(len(inputs)):
        ys = leaves(inputs)
        (g,) = grad_of(fn(*ys), [ys[i]])
        assert torch.equal(bits(g), bits(full[i])), i
        assert all(y.grad is None for y in ys)


def test_linear_computes_only_the_gradients_its_inputs_want(monkeypatch):
    """A frozen weight (or bias, or input): linear's backward skips what no input wants — dx is one
    library call, dweight with dbias another — and what it computes has the full backward's bits."""
    called = []
    for name in ("linear_backward_input", "linear_backward_weight"):
        real = getattr(ops.raw, name)
        monkeypatch.setattr(ops.raw, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
    inputs = calls()["linear"][1]
    xs = leaves(inputs)
    full = grad_of(ops._linear(*xs), xs)
    both = ["linear_backward_input", "linear_backward_weight"]
    for wanted, calls_made in (((0,), both[:1]), ((1, 2), both[1:]), ((2,), both[1:]), ((0, 1, 2), both)):
        ys = [t.clone().requires_grad_(i in wanted) for i, t in enumerate(inputs)]
        called.clear()
        got = grad_of(ops._linear(*ys), [ys[i] for i in wanted])
        assert called == calls_made, wanted
        for i, g in zip(wanted, got):
            assert torch.equal(bits(g), bits(full[i])), (wanted, i)


@pytest.mark.parametrize("op", OPS)
def test_differentiating_a_gradient_raises_naming_the_op(op):
    """create_graph=True: the first-order gradients, with a plain backward's bits; differentiating
    one raises, naming the op (torch's message for a custom op without a formula otherwise)."""
    fn, inputs = calls()[op]
    xs = leaves(inputs)
    want = grad_of(fn(*xs), xs)
    ys = leaves(inputs)
    gs = grad_of(fn(*ys), ys, create_graph=True)
    for g, w in zip(gs, want):
        assert torch.equal(bits(g), bits(w))
    with pytest.raises(RuntimeError, match=f"samebits.torch {op}: double backward"):
        torch.autograd.grad(sum((g * g).sum() for g in gs), ys, allow_unused=True)
