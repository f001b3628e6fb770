"""The C++ dispatcher ops' autograd nodes (python/samebits/torch/_torch_ops.cpp: made by hand, as
torch's own ops make theirs) behave as torch's nodes do: the version-counter check of saved tensors,
a freed graph, retain_graph, saved-tensor hooks, no reference cycle, forward-mode AD refused, their
names; gradients not asked for (torch.autograd.grad of some inputs, a frozen weight) neither computed
where separable nor added into main_grad; a double backward refused naming the op; and gradcheck
of all nine ops (fp64 CPU tensors: the library's truth mode). On CPU tensors:
needs torch (1.13 or later) and the library built for it — neither a GPU nor samebits.torch's Python
modules (whose custom_op needs torch ≥ 2.4). tests/torch/test_torch_ops.py compares the ops' bits
with the custom_op path's."""
import gc
import importlib.util
import os
import weakref

import pytest

torch = pytest.importorskip("torch")

from torch.autograd import forward_ad  # noqa: E402


def _load():
    """torch.ops.samebits_ext where the build made the library for this torch, else None. samebits
    itself is not imported: where its _core shares pybind11's internals with torch (Debian's torch
    1.13), its exception translator would turn the ops' NotImplementedError into a RuntimeError."""
    spec = importlib.util.find_spec("samebits")
    if spec is None or not spec.submodule_search_locations:
        return None
    here = os.path.join(list(spec.submodule_search_locations)[0], "torch")
    lib, stamp = os.path.join(here, "_torch_ops.so"), os.path.join(here, "_torch_ops.version")
    if not os.path.exists(lib) or not os.path.exists(stamp):
        return None
    with open(stamp) as f:
        if f.read().strip() != torch.__version__:
            return None
    torch.ops.load_library(lib)  # a second load (samebits.torch's) is a no-op
    return torch.ops.samebits_ext


E = _load()
if E is None:
    pytest.skip("built without torch's C++ dispatcher ops for this torch", allow_module_level=True)


def bits(t):
    return t.detach().contiguous().view(torch.uint8)


def rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def calls(dtype=torch.float32):
    """name → (node name, the call, its differentiable inputs (leaves made from them)): every op on
    small CPU tensors; the ops that take a main_grad take it as the keyword mg (WEIGHT)."""
    T, H, V = 6, 16, 40
    ids = torch.tensor([3, 0, 3, 39, 7, 1])
    targets = torch.tensor([5, 0, -100, 39, 2, 11])
    positions = torch.tensor([0, 1, 2, 0, 1, 2])
    r = lambda *s, seed: rand(*s, seed=seed, dtype=dtype)  # noqa: E731
    return {
        "rms_norm": ("RmsNormBackward", lambda x, w, mg=None: E.rms_norm(x, w, 1e-5, mg),
                     (r(T, H, seed=1), r(H, seed=2))),
        "add_rms_norm": ("AddRmsNormBackward", lambda x, res, w, mg=None: E.add_rms_norm(x, res, w, 1e-5, mg),
                         (r(T, H, seed=3), r(T, H, seed=4), r(H, seed=5))),
        "linear": ("LinearBackward", lambda x, w, b, mg=None: E.linear(x, w, b, mg),
                   (r(T, H, seed=6), r(12, H, seed=7), r(12, seed=8))),
        "swiglu": ("SwiGluBackward", E.swiglu, (r(T, H, seed=9), r(T, H, seed=10))),
        "token_logprobs": ("TokenLogprobsBackward", lambda z: E.token_logprobs(z, targets), (r(T, V, seed=11),)),
        "attention": ("AttentionBackward", lambda q, k, v: E.attention(q, k, v, [2, 4], 0.0),
                      (r(T, 4, 8, seed=12), r(T, 2, 8, seed=13), r(T, 2, 8, seed=14))),
        "embedding": ("EmbeddingBackward", lambda t, mg=None: E.embedding(ids, t, mg), (r(V, H, seed=15),)),
        "qk_norm": ("QkNormBackward", lambda x, w, mg=None: E.qk_norm(x, w, 1e-5, positions, 1e4, [], mg),
                    (r(T, 2, 8, seed=16), r(8, seed=17))),
        "lm_head_logprobs": ("LmHeadLogprobsBackward", lambda h, w, mg=None: E.lm_head_logprobs(h, w, targets, mg),
                             (r(T, H, seed=18), r(V, H, seed=19))),
    }


OPS = sorted(calls())


def outputs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def backward_all(out, **kw):
    """The backward of every output of a call, with fixed gradients (ones)."""
    outs = outputs(out)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs], **kw)


def leaves(inputs):
    return [t.clone().requires_grad_() for t in inputs]


@pytest.mark.parametrize("op", OPS)
def test_the_node_is_named_after_the_op_and_has_an_edge_per_differentiable_input(op):
    name, fn, inputs = calls()[op]
    out = outputs(fn(*leaves(inputs)))
    node = out[0].grad_fn
    assert node.name() == "samebits::" + name
    assert all(o.grad_fn is node for o in out), "every output comes from the one node"
    assert len(node.next_functions) == len(inputs)
    assert all(type(f).__name__ == "AccumulateGrad" for f, _ in node.next_functions)


@pytest.mark.parametrize("op", OPS)
def test_gradcheck_in_the_fp64_truth_mode(op):
    _, fn, inputs = calls(torch.float64)[op]
    assert torch.autograd.gradcheck(fn, tuple(leaves(inputs)))


def test_inputs_without_a_gradient_get_none_and_the_others_the_same_bits():
    """An input that wants no gradient (or is None) has an edge to nothing: its gradient is dropped."""
    _, fn, inputs = calls()["linear"]
    x, w, b = leaves(inputs)
    backward_all(fn(x, w, b))
    for frozen_weight, bias in ((True, inputs[2]), (False, None)):
        x2, w2 = leaves(inputs[:2])
        w2.requires_grad_(not frozen_weight)
        out = fn(x2, w2, bias)
        assert len(out.grad_fn.next_functions) == 3 and out.grad_fn.next_functions[2][0] is None
        backward_all(out)
        assert (w2.grad is None) == frozen_weight
        if bias is not None:  # the same dy: the same dx (a bias changes y, not dx)
            assert torch.equal(bits(x2.grad), bits(x.grad))


# The inputs each backward reads (saved: an in-place change before the backward is an error), by position.
SAVED = {"rms_norm": (0, 1), "add_rms_norm": (2,), "linear": (0, 1), "swiglu": (0, 1), "token_logprobs": (0,),
         "attention": (0, 1, 2), "embedding": (0,), "qk_norm": (0, 1), "lm_head_logprobs": (0, 1)}


@pytest.mark.parametrize("op", OPS)
def test_a_saved_input_changed_in_place_before_the_backward_is_torchs_version_error(op):
    """As torch's own ops: an input the backward reads, changed in place after the forward, is an
    error at the backward (a gradient of other values otherwise); one it does not read is not."""
    _, fn, inputs = calls()[op]
    for i in range(len(inputs)):
        xs = leaves(inputs)
        changed = xs[i] * 1  # not a leaf: it may be changed in place while recording
        out = fn(*xs[:i], changed, *xs[i + 1:])
        changed.add_(1)
        if i in SAVED[op]:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                backward_all(out)
        else:
            backward_all(out)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ids_changed_in_place_before_the_backward_are_torchs_version_error(dtype):
    """Ids the backward reads where the forward read them (the embedding's, int32 targets and
    positions: no copy made) are saved as the caller's tensor: changing it is an error, as torch's
    embedding. int64 targets / positions are read from the int32 copy the forward made: no error."""
    table = rand(40, 16, seed=1).requires_grad_()
    ids = torch.tensor([[3, 0], [3, 39]], dtype=dtype)
    y = E.embedding(ids, table)
    ids[0, 0] = 5
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    logits = rand(4, 40, seed=2).requires_grad_()
    targets = torch.tensor([5, 0, 39, 2], dtype=dtype)
    want = torch.autograd.grad(E.token_logprobs(logits, targets)[0].sum(), logits)[0]
    logp, _ = E.token_logprobs(logits, targets)
    targets[0] = 7
    if dtype == torch.int32:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            logp.sum().backward()
    else:
        assert torch.equal(bits(torch.autograd.grad(logp.sum(), logits)[0]), bits(want))
    x, w = rand(3, 2, 8, seed=3).requires_grad_(), rand(8, seed=4).requires_grad_()
    positions = torch.tensor([0, 1, 2], dtype=dtype)
    y = E.qk_norm(x, w, 1e-5, positions, 1e4, [])
    positions[1] = 0
    if dtype == torch.int32:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_an_output_the_backward_reads_changed_in_place_is_torchs_version_error():
    """add_rms_norm's sum s and attention's output are saved as outputs."""
    x, r, w = (t.requires_grad_() for t in (rand(4, 16, seed=1), rand(4, 16, seed=2), rand(16, seed=3)))
    y, s = E.add_rms_norm(x, r, w, 1e-5)
    s.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    q, k, v = (rand(5, h, 8, seed=i).requires_grad_() for i, h in ((4, 2), (5, 1), (6, 1)))
    out = E.attention(q, k, v, [5], 0.0)
    out.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("op", OPS)
def test_a_second_backward_of_a_freed_graph_raises_and_retain_graph_gives_the_same_bits(op):
    _, fn, inputs = calls()[op]
    xs = leaves(inputs)
    out = fn(*xs)
    backward_all(out)
    with pytest.raises(RuntimeError, match="second time"):
        backward_all(out)
    xs = leaves(inputs)
    out = fn(*xs)
    backward_all(out, retain_graph=True)
    first = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    backward_all(out)
    for a, b in zip(first, xs):
        assert torch.equal(bits(a), bits(b.grad))


def test_saved_tensor_hooks_see_the_saved_tensors_and_the_backward_reads_what_they_unpack():
    x, w = rand(4, 16, seed=1).requires_grad_(), rand(16, seed=2).requires_grad_()
    want = torch.autograd.grad(E.rms_norm(x, w, 1e-5).sum(), (x, w))
    packed, unpacked = [], []

    def pack(t):
        packed.append(t)
        return t.clone()  # the backward must read this copy (unpack's), not the original

    def unpack(t):
        unpacked.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = E.rms_norm(x, w, 1e-5)
    assert [tuple(t.shape) for t in packed] == [(4, 16), (16,), (4,)]  # x, weight, rstd
    assert packed[0] is x and packed[1] is w and packed[2].dtype == torch.float32
    got = torch.autograd.grad(y.sum(), (x, w))
    assert len(unpacked) == 3
    for a, b in zip(got, want):
        assert torch.equal(bits(a), bits(b))
    # what the backward reads is what unpack returns: a changed rstd changes the gradient
    def doubled_rstd(t):
        return t * 2 if t.dtype == torch.float32 and t.shape == (4,) else t
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), doubled_rstd):
        y = E.rms_norm(x, w, 1e-5)
    assert not torch.equal(bits(torch.autograd.grad(y.sum(), x)[0]), bits(want[0]))


@pytest.mark.parametrize("op", OPS)
def test_saved_tensor_hooks_pack_every_saved_tensor_and_give_the_same_bits(op):
    _, fn, inputs = calls()[op]
    xs = leaves(inputs)
    backward_all(fn(*xs))
    want = [x.grad for x in xs]
    xs = leaves(inputs)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t.clone(), lambda t: t):
        out = fn(*xs)
    assert packed, "the node saves its tensors through the hooks"
    backward_all(out)
    for a, b in zip(want, xs):
        assert torch.equal(bits(a), bits(b.grad))


@pytest.mark.parametrize("op", OPS)
def test_forward_mode_ad_is_refused_naming_the_op(op):
    _, fn, inputs = calls()[op]
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(inputs[0], torch.ones_like(inputs[0]))
        with pytest.raises(NotImplementedError, match=f"samebits.torch {op}: forward-mode AD is not supported"):
            fn(dual, *inputs[1:])
        with torch.no_grad(), pytest.raises(NotImplementedError, match=f"{op}: forward-mode AD"):
            fn(dual, *inputs[1:])  # the tangent would be dropped as silently without a backward


@pytest.mark.parametrize("op", OPS)
def test_no_reference_cycle_the_node_and_what_it_saved_go_with_the_outputs(op):
    """A node that held its own output (an output saved as an input would be) would keep itself, its
    saved tensors and its inputs alive forever: add_rms_norm's s and attention's output are saved."""
    _, fn, inputs = calls()[op]
    xs = leaves(inputs)
    refs = [weakref.ref(x) for x in xs]
    out = fn(*xs)
    del xs
    gc.collect()
    assert all(r() is not None for r in refs), "the node holds its saved inputs"
    del out
    gc.collect()
    assert all(r() is None for r in refs), "the node was not freed with its outputs"


def test_no_reference_cycle_through_saved_tensor_hooks():
    """The saved tensors' packed forms go with the node (weakrefs to what pack returned)."""
    class Box:
        def __init__(self, t):
            self.t = t
    boxes = []

    def pack(t):
        boxes.append(Box(t.detach().clone()))
        return boxes[-1]

    x, w = rand(4, 16, seed=1).requires_grad_(), rand(16, seed=2).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda b: b.t):
        y = E.rms_norm(x, w, 1e-5)
    refs = [weakref.ref(b) for b in boxes]
    del boxes[:]
    gc.collect()
    assert len(refs) == 3 and all(r() is not None for r in refs)
    del y
    gc.collect()
    assert all(r() is None for r in refs)


# ---------------------------------------------------------------- gradients not asked for
# The position of the weight whose fp32 main_grad each op takes (the keyword mg of calls()).
WEIGHT = {"rms_norm": 1, "add_rms_norm": 2, "linear": 1, "embedding": 0, "qk_norm": 1, "lm_head_logprobs": 1}


def zero_main_grad(weight):
    return torch.zeros(weight.shape, dtype=torch.float32)


def grad_of(out, inputs, **kw):
    outs = outputs(out)
    return torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs], **kw)


@pytest.mark.parametrize("op", OPS)
def test_the_gradient_of_each_input_alone_is_the_full_backwards_bits(op):
    """torch.autograd.grad of one input: the node computes what is asked for (a weight gradient no
    longer where it is not), with the bits of a backward of every input; no other input gets a .grad."""
    _, fn, inputs = calls()[op]
    xs = leaves(inputs)
    backward_all(fn(*xs))
    for i in range(len(inputs)):
        ys = leaves(inputs)
        (g,) = grad_of(fn(*ys), [ys[i]])
        assert torch.equal(bits(g), bits(xs[i].grad)), i
        assert all(y.grad is None for y in ys)


@pytest.mark.parametrize("op", sorted(WEIGHT))
def test_main_grad_is_added_into_only_where_the_weights_gradient_is_asked_for(op):
    """A backward that does not want the weight's gradient — torch.autograd.grad of the other inputs,
    or a frozen weight (requires_grad=False) — leaves its main_grad as it was: before, the weight
    gradient was computed and added in anyway (a micro-batch's main_grad counted twice, say)."""
    _, fn, inputs = calls()[op]
    w = WEIGHT[op]
    xs = leaves(inputs)
    want = zero_main_grad(inputs[w])
    backward_all(fn(*xs, mg=want))
    assert xs[w].grad is None and want.abs().sum() > 0  # main_grad took the weight's gradient
    for i in range(len(inputs)):  # another input alone: its bits, main_grad untouched
        if i == w:
            continue
        ys, mg = leaves(inputs), zero_main_grad(inputs[w])
        (g,) = grad_of(fn(*ys, mg=mg), [ys[i]])
        assert torch.equal(bits(g), bits(xs[i].grad)), i
        assert ys[w].grad is None and not mg.any(), "main_grad of a weight whose gradient was not asked for"
    ys, mg = leaves(inputs), zero_main_grad(inputs[w])  # the weight alone: main_grad the full backward's
    grad_of(fn(*ys, mg=mg), [ys[w]], allow_unused=True)
    assert torch.equal(bits(mg), bits(want))
    ys, mg = leaves(inputs), zero_main_grad(inputs[w])  # a frozen weight: no gradient, no main_grad add
    ys[w].requires_grad_(False)
    if len(inputs) > 1:
        backward_all(fn(*ys, mg=mg))
    else:  # the embedding's table alone: nothing records a backward
        assert fn(*ys, mg=mg).grad_fn is None
    assert ys[w].grad is None and not mg.any()


def test_linear_weight_or_bias_alone_frozen_or_asked_for_the_same_bits():
    """linear's input, weight and bias gradients are separate computations (dx, then dweight and
    dbias): each is made only where asked for, each with the bits of a backward of all three."""
    _, fn, inputs = calls()["linear"]
    xs = leaves(inputs)
    want = zero_main_grad(inputs[1])
    backward_all(fn(*xs, mg=want))
    for asked in ([0, 2], [2], [1, 2], [0, 1]):
        ys, mg = leaves(inputs), zero_main_grad(inputs[1])
        got = grad_of(fn(*ys, mg=mg), [ys[i] for i in asked], allow_unused=True)
        for i, g in zip(asked, got):
            if i != 1:  # the weight's gradient went to main_grad
                assert torch.equal(bits(g), bits(xs[i].grad)), (asked, i)
        assert torch.equal(bits(mg), bits(want if 1 in asked else torch.zeros_like(want))), asked


def test_a_model_backward_of_its_input_alone_leaves_every_weight_and_main_grad_alone():
    """A small model through embedding, rms_norm, linear, qk_norm, attention, add_rms_norm, the LM
    head and token_logprobs, its weights wanting gradients (most into a main_grad): the gradient of
    its input x alone has the bits of a full backward, and no weight gets a .grad or a main_grad add
    — asked for with torch.autograd.grad, or with every weight frozen."""
    T, H, V = 6, 16, 40
    ids = torch.tensor([3, 0, 3, 39, 7, 1])
    targets = torch.tensor([5, 0, -100, 39, 2, 11])
    positions = torch.tensor([0, 1, 2, 0, 1, 2])
    shapes = {"table": (V, H), "norm": (H,), "qkv": (64, H), "qkv_bias": (64,), "qk": (8,), "o": (H, 32),
              "norm2": (H,), "head": (V, H), "head2": (V, H)}
    weights0 = {name: rand(*shape, seed=i) for i, (name, shape) in enumerate(shapes.items())}
    no_main_grad = ("qkv_bias", "head2")  # weights that take a .grad

    def model(x, w, mg):
        h = E.embedding(ids, w["table"], mg["table"]) + x
        n = E.rms_norm(h, w["norm"], 1e-5, mg["norm"])
        q, k, v = E.linear(n, w["qkv"], w["qkv_bias"], mg["qkv"]).split([32, 16, 16], dim=-1)
        q = E.qk_norm(q.reshape(T, 4, 8).contiguous(), w["qk"], 1e-5, positions, 1e4, [], mg["qk"])
        a = E.attention(q, k.reshape(T, 2, 8).contiguous(), v.reshape(T, 2, 8).contiguous(), [2, 4], 0.0)
        y, _ = E.add_rms_norm(E.linear(a.reshape(T, 32), w["o"], None, mg["o"]), h, w["norm2"], 1e-5, mg["norm2"])
        logp, entropy = E.lm_head_logprobs(y, w["head"], targets, mg["head"])
        logp2, _ = E.token_logprobs(E.linear(y, w["head2"], None), targets)
        return (logp * torch.arange(1.0, T + 1)).sum() + entropy.sum() - logp2.sum()

    def run(frozen):
        x = rand(T, H, seed=99).requires_grad_()
        w = {name: t.clone().requires_grad_(not frozen) for name, t in weights0.items()}
        mg = {name: None if name in no_main_grad else zero_main_grad(t) for name, t in w.items()}
        return x, w, mg, model(x, w, mg)

    x, w, mg, loss = run(frozen=False)
    loss.backward()
    want = x.grad
    assert all(m is None or m.any() for m in mg.values()) and all(w[n].grad is not None for n in no_main_grad)
    for frozen in (False, True):
        x, w, mg, loss = run(frozen)
        if frozen:
            loss.backward()
            g = x.grad
        else:
            (g,) = torch.autograd.grad(loss, [x])
        assert torch.equal(bits(g), bits(want)), frozen
        for name in shapes:
            assert w[name].grad is None, (frozen, name)
            assert mg[name] is None or not mg[name].any(), (frozen, name)


# ---------------------------------------------------------------- double backward
@pytest.mark.parametrize("op", OPS)
def test_differentiating_a_gradient_raises_naming_the_op(op):
    """A samebits backward's gradients have no derivative of their own: made with create_graph=True
    they carry an error node, so that differentiating them raises, naming the op (before, they had
    no history and a double backward dropped the op's second-order terms without a word). As torch's
    DelayedError: the first-order gradients themselves are given, with the bits of a plain backward."""
    _, fn, inputs = calls()[op]
    xs = leaves(inputs)
    backward_all(fn(*xs))
    ys = leaves(inputs)
    gs = grad_of(fn(*ys), ys, create_graph=True)
    for g, x in zip(gs, xs):
        assert torch.equal(bits(g), bits(x.grad))
        assert g.requires_grad
    message = f"samebits.torch {op}: double backward"
    with pytest.raises(RuntimeError, match=message):  # allow_unused: the error, not a None
        torch.autograd.grad(sum((g * g).sum() for g in gs), ys, allow_unused=True)
    ys = leaves(inputs)
    out = outputs(fn(*ys))
    gs = torch.autograd.grad(sum((o.double() ** 2).sum() for o in out), ys, create_graph=True)  # dy with a history
    with pytest.raises(RuntimeError, match=message):
        sum(g.sum() for g in gs).backward()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_first_order_backward_with_create_graph_still_runs():
    """backward(create_graph=True) where nothing differentiates the gradients (a gradient penalty on
    another part of a model, say): the .grad values are the plain backward's."""
    _, fn, inputs = calls()["linear"]
    xs, ys = leaves(inputs), leaves(inputs)
    backward_all(fn(*xs))
    backward_all(fn(*ys), create_graph=True)
    for x, y in zip(xs, ys):
        assert torch.equal(bits(x.grad), bits(y.grad))
        y.grad = None  # the reference cycle torch's warning is about
