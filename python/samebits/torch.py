"""samebits for PyTorch: batch-invariant ops as torch custom ops, with autograd, on the caller's stream.

    import samebits.torch as sbt
    y = sbt.linear(x, w)                       # bitwise the same rows whatever the batch
    with sbt.enable():                          # route aten mm / addmm / _log_softmax to samebits
        logits = model(input_ids).logits

Why it is shaped this way: every op is a `torch.library.custom_op` (so autograd, torch.compile and
fake tensors see one op, not the library's internals) whose forward and backward call the C++
library on the tensors' memory through `samebits._core.raw` — nothing is copied, the work runs on
torch's current stream, and the backward is samebits' own backward kernel (weight gradients in an
fp32 accumulator, cast once to the weight's dtype). Inputs must be contiguous; dtypes and shapes
are checked by the library, whose errors arrive as samebits.Error (a ValueError).

Covered by enable(): aten::mm, aten::addmm (16-bit CUDA tensors: samebits' GEMM, whose K order
depends on K only) and aten::_log_softmax (fp32 / 16-bit CUDA: the row's log-sum-exp from samebits'
vocab-blocked logprob op). Not covered (run as stock torch): bmm / matmul of 3-D operands, fp32
matmuls, RMSNorm written as elementwise torch code, scaled_dot_product_attention, reductions — use
samebits.torch.rms_norm / the model chain for those. See docs/python.md.
"""
import contextlib
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _core
from ._core import Error

raw = _core.raw

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "int32",
           torch.uint8: "uint8"}


def _desc(t: Optional[Tensor], op: str, arg: str):
    """(pointer, dtype, shape, device, tensor) of a contiguous tensor, for samebits._core.raw. The
    tensor rides along so that a temporary (a .contiguous() copy made in the call's argument list)
    stays alive until the op has run: the pointer alone would let torch's allocator hand its memory
    to the next temporary."""
    if t is None:
        return None
    if t.dtype not in _DTYPES:
        raise Error(f"samebits.torch {op}: argument '{arg}': dtype {t.dtype} is not taken "
                    f"(bfloat16, float16, float32; int32 ids / targets; uint8 masks)")
    if t.device.type not in ("cpu", "cuda"):
        raise Error(f"samebits.torch {op}: argument '{arg}': device {t.device} is not taken (cpu or cuda)")
    if not t.is_contiguous():
        raise Error(f"samebits.torch {op}: argument '{arg}': must be contiguous (.contiguous())")
    return (t.data_ptr(), _DTYPES[t.dtype], tuple(t.shape), t.device.type, t)


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _rows(x: Tensor, op: str) -> Tensor:
    if x.dim() < 1:
        raise Error(f"samebits.torch {op}: argument 'x': needs at least one dimension")
    if not x.is_contiguous():
        raise Error(f"samebits.torch {op}: argument 'x': must be contiguous (.contiguous())")
    return x.reshape(-1, x.shape[-1])


# ---------------------------------------------------------------- linear
@torch.library.custom_op("samebits::linear", mutates_args=())
def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    x2 = _rows(x, "linear")
    y = x2.new_empty(x2.shape[0], weight.shape[0])
    with _device(x):
        raw.linear_forward(_desc(x2, "linear", "x"), _desc(weight, "linear", "weight"),
                           _desc(bias, "linear", "bias"), _desc(y, "linear", "y"), _stream(x))
    return y.reshape(*x.shape[:-1], weight.shape[0])


@_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("samebits::linear_backward", mutates_args=())
def _linear_backward(dy: Tensor, x: Tensor, weight: Tensor, need_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    dy2, x2 = _rows(dy.contiguous(), "linear_backward"), _rows(x, "linear_backward")
    dx = x2.new_empty(x2.shape)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # fp32 accumulator
    db = torch.zeros(weight.shape[0] if need_bias else 0, dtype=torch.float32, device=weight.device)
    with _device(x):
        s = _stream(x)
        raw.linear_backward_input(_desc(dy2, "linear_backward", "dy"), _desc(weight, "linear_backward", "weight"),
                                  _desc(dx, "linear_backward", "dx"), s)
        raw.linear_backward_weight(_desc(dy2, "linear_backward", "dy"), _desc(x2, "linear_backward", "x"),
                                   _desc(dw, "linear_backward", "dweight"),
                                   _desc(db, "linear_backward", "dbias") if need_bias else None, s)
    return dx.reshape(x.shape), dw.to(weight.dtype), db.to(weight.dtype)


@_linear_backward.register_fake
def _(dy, x, weight, need_bias):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0] if need_bias else 0)


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.need_bias = bias is not None


def _linear_grad(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw, db = _linear_backward(dy, x, weight, ctx.need_bias)
    return dx, dw, (db if ctx.need_bias else None)


_linear.register_autograd(_linear_grad, setup_context=_linear_setup)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """y = x @ weight.T (+ bias): a row's bits do not depend on how many rows share the call."""
    return _linear(x, weight, bias)


# ---------------------------------------------------------------- RMSNorm
@torch.library.custom_op("samebits::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    x2 = _rows(x, "rms_norm")
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    with _device(x):
        raw.rmsnorm_forward(_desc(x2, "rms_norm", "x"), _desc(weight, "rms_norm", "weight"), _desc(y, "rms_norm", "y"),
                            _desc(rstd, "rms_norm", "rstd"), eps, _stream(x))
    return y.reshape(x.shape), rstd


@_rms_norm.register_fake
def _(x, weight, eps):
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("samebits::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    dy2, x2 = _rows(dy.contiguous(), "rms_norm_backward"), _rows(x, "rms_norm_backward")
    dx = torch.empty_like(x2)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    with _device(x):
        raw.rmsnorm_backward(_desc(dy2, "rms_norm_backward", "dy"), _desc(x2, "rms_norm_backward", "x"),
                             _desc(weight, "rms_norm_backward", "weight"), _desc(rstd, "rms_norm_backward", "rstd"),
                             _desc(dx, "rms_norm_backward", "dx"), _desc(dw, "rms_norm_backward", "dweight"), eps,
                             _stream(x))
    return dx.reshape(x.shape), dw.to(weight.dtype)


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd, eps):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps = eps


def _rms_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(dy, x, weight, rstd, ctx.eps)
    return dx, dw, None


_rms_norm.register_autograd(_rms_grad, setup_context=_rms_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """x * rsqrt(mean(x²) + eps) * weight over the last dimension, computed in fp32, rounded once."""
    return _rms_norm(x, weight, eps)[0]


# ---------------------------------------------------------------- selected logprobs
@torch.library.custom_op("samebits::token_logprobs", mutates_args=())
def _token_logprobs(logits: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    l2 = _rows(logits, "token_logprobs")
    t = targets.reshape(-1).to(torch.int32).contiguous()
    mask = torch.ones(t.shape[0], dtype=torch.uint8, device=logits.device)
    logp, entropy, lse = (torch.empty(t.shape[0], dtype=torch.float32, device=logits.device) for _ in range(3))
    with _device(logits):
        raw.logprob_forward(_desc(l2, "token_logprobs", "logits"), _desc(t, "token_logprobs", "targets"),
                            _desc(mask, "token_logprobs", "loss_mask"), _desc(logp, "token_logprobs", "logp"),
                            _desc(entropy, "token_logprobs", "entropy"), _desc(lse, "token_logprobs", "lse"),
                            _stream(logits))
    shape = logits.shape[:-1]
    return logp.reshape(shape), entropy.reshape(shape), lse.reshape(shape)


@_token_logprobs.register_fake
def _(logits, targets):
    shape = logits.shape[:-1]
    return tuple(logits.new_empty(shape, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("samebits::token_logprobs_backward", mutates_args=())
def _token_logprobs_backward(logits: Tensor, targets: Tensor, lse: Tensor, dlogp: Tensor, dentropy: Tensor) -> Tensor:
    l2 = _rows(logits, "token_logprobs_backward")
    t = targets.reshape(-1).to(torch.int32).contiguous()
    mask = torch.ones(t.shape[0], dtype=torch.uint8, device=logits.device)
    dl = torch.empty_like(l2)
    with _device(logits):
        raw.logprob_backward(_desc(l2, "token_logprobs_backward", "logits"), _desc(t, "token_logprobs_backward", "targets"),
                             _desc(mask, "token_logprobs_backward", "loss_mask"),
                             _desc(lse.reshape(-1).contiguous(), "token_logprobs_backward", "lse"),
                             _desc(dlogp.reshape(-1).float().contiguous(), "token_logprobs_backward", "dlogp"),
                             _desc(dentropy.reshape(-1).float().contiguous(), "token_logprobs_backward", "dentropy"),
                             _desc(dl, "token_logprobs_backward", "dlogits"), _stream(logits))
    return dl.reshape(logits.shape)


@_token_logprobs_backward.register_fake
def _(logits, targets, lse, dlogp, dentropy):
    return torch.empty_like(logits)


def _tlp_setup(ctx, inputs, output):
    logits, targets = inputs
    ctx.save_for_backward(logits, targets, output[2])


def _tlp_grad(ctx, dlogp, dentropy, _dlse):
    logits, targets, lse = ctx.saved_tensors
    if dlogp is None:
        dlogp = torch.zeros_like(lse)
    if dentropy is None:
        dentropy = torch.zeros_like(lse)
    return _token_logprobs_backward(logits, targets, lse, dlogp, dentropy), None


_token_logprobs.register_autograd(_tlp_grad, setup_context=_tlp_setup)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor]:
    """(logp, entropy) of targets under logits [..., V], fp32: the vocab is reduced in fixed blocks."""
    logp, entropy, _ = _token_logprobs(logits, targets)
    return logp, entropy


# ---------------------------------------------------------------- enable(): aten routing
_SIXTEEN = (torch.bfloat16, torch.float16)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    if a.dtype not in _SIXTEEN:
        raise Error(f"samebits.torch enable(): aten::mm of {a.dtype} CUDA tensors is not covered "
                    "(samebits' GEMM takes bfloat16 / float16)")
    # b [K, N] is usually weight.T: its transpose [N, K] is then contiguous and no copy is made.
    return _linear(a.contiguous(), b.t().contiguous(), None)


def _addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    if beta != 1 or alpha != 1 or bias.dim() != 1:
        y = _mm(a, b)
        return y * alpha + bias * beta if (beta != 0) else y * alpha
    return _linear(a.contiguous(), b.t().contiguous(), bias.contiguous())


def _log_softmax(x: Tensor, dim: int, half_to_float: bool) -> Tensor:
    if dim not in (-1, x.dim() - 1):
        raise Error("samebits.torch enable(): aten::_log_softmax over a dimension other than the last is not covered")
    xf = x.contiguous()
    zeros = torch.zeros(xf.shape[:-1], dtype=torch.int32, device=x.device)
    _, _, lse = _token_logprobs(xf, zeros)  # the row's log-sum-exp, vocab reduced in fixed blocks
    out = xf.float() - lse.unsqueeze(-1)
    return out if (half_to_float or x.dtype == torch.float32) else out.to(x.dtype)


@contextlib.contextmanager
def enable():
    """Route aten::mm, aten::addmm and aten::_log_softmax on CUDA tensors to samebits for the block.
    What is not covered runs as stock torch (see the module's docstring)."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("mm", _mm, "CUDA")
    lib.impl("addmm", _addmm, "CUDA")
    lib.impl("_log_softmax", _log_softmax, "CUDA")
    try:
        yield
    finally:
        lib._destroy()
