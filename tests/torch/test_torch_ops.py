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


def test_outputs_of_the_dispatcher_ops_take_in_place_updates():
    """A C++ autograd Function's outputs that are views refuse in-place ops; the ops return their
    outputs at full shape (no views), as the custom_op path does."""
    E = _common._ext
    x = torch.randn(2, 3, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    for name, y in {"rms_norm": E.rms_norm(x, w, 1e-5), "add_rms_norm": E.add_rms_norm(x, x.detach(), w, 1e-5)[0],
                    "swiglu": E.swiglu(x, x.detach()), "linear": E.linear(x, W, None)}.items():
        y.mul_(2).float().sum().backward()  # raised for views made inside the Function
        assert y.grad_fn is not None, name
