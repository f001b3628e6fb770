"""enable(): a model's own torch code routed to the samebits ops (aten mm / addmm / _log_softmax at
the dispatcher, below autograd; scaled_dot_product_attention, rms_norm and per-row mean / sum
through a TorchFunctionMode, above autograd). docs/python.md has the table of what is covered."""
import contextlib

import torch
from torch import Tensor

from ._common import Error, _desc, _device, _stream, raw
from .ops import _attention, _linear, _seq_table, _token_logprobs, rms_norm


# ---------------------------------------------------------------- enable(): routing torch to samebits
_SIXTEEN = (torch.bfloat16, torch.float16)


class _Uncovered(Exception):
    """A call enable() does not route; strict mode turns it into samebits.Error, else stock torch runs."""


def _row_sum(x: Tensor) -> Tensor:
    """Σ over the last dimension (keepdim) in a fixed pairwise order set by its extent alone: the
    row is halved by elementwise adds (first half + second half; an odd width gets one zero column
    first), so no kernel's choice of split (which depends on how many rows there are) can move a
    bit. fp32 for 16-bit inputs. Traffic ≈ twice the input; log2(width) launches."""
    if x.dtype in _SIXTEEN:
        x = x.float()
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = torch.nn.functional.pad(x, (0, 1))
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def _last_dim(x: Tensor, dim) -> bool:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and x.dim() > 0 and dim in (-1, x.dim() - 1)


def _reduce_last(kind: str):
    def route(x, dim=None, keepdim=False, *, dtype=None, out=None):
        if not (isinstance(x, Tensor) and x.is_cuda and x.is_floating_point() and dtype is None and out is None
                and _last_dim(x, dim) and x.shape[-1] > 0):
            raise _Uncovered  # not a per-row reduction: stock torch (reductions over batch dims are the batch's)
        r = _row_sum(x)
        if kind == "mean":
            r = r / x.shape[-1]
        r = r if keepdim else r.squeeze(-1)
        return r.to(x.dtype)
    return route


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] @ b [K, N] on samebits' GEMMs, picked by layout so that nothing is transposed in
    memory: the three products of a linear layer's forward and backward each have their op."""
    if a.dtype not in _SIXTEEN or b.dtype != a.dtype:
        if _STATE["strict"]:
            raise Error(f"samebits.torch enable(): aten::mm of {a.dtype} / {b.dtype} CUDA tensors is not covered "
                        "(samebits' GEMM takes bfloat16 / float16); enable(strict=False) runs it as stock torch")
        return _stock_bmm(a.unsqueeze(0), b.unsqueeze(0))[0]
    if b.t().is_contiguous() or not b.is_contiguous():  # x @ weight.T: the forward
        return _linear(a.contiguous(), b.t().contiguous(), None)
    if a.t().is_contiguous() and not a.is_contiguous():  # dy.T @ x: a weight gradient, Σ over rows
        dy, x = a.t(), b
        dw = torch.zeros(dy.shape[1], x.shape[1], dtype=torch.float32, device=a.device)
        with _device(a):
            raw.linear_backward_weight(_desc(dy, "mm", "dy"), _desc(x, "mm", "x"), _desc(dw, "mm", "dweight"), None,
                                       _stream(a))
        return dw.to(a.dtype)
    dx = a.new_empty(a.shape[0], b.shape[1])  # dy @ weight: an input gradient, Σ over the weight's rows
    with _device(a):
        raw.linear_backward_input(_desc(a.contiguous(), "mm", "dy"), _desc(b, "mm", "weight"), _desc(dx, "mm", "dx"),
                                  _stream(a))
    return dx


def _addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    if beta != 1 or alpha != 1 or bias.dim() != 1 or a.dtype not in _SIXTEEN:
        y = _mm(a, b)
        return y * alpha + bias * beta if (beta != 0) else y * alpha
    return _linear(a.contiguous(), b.t().contiguous(), bias.contiguous())


def _shifted_by_lse(x: Tensor, dim: int, op: str) -> Tensor:
    """x − logsumexp(x) over the last dimension in fp32, the log-sum-exp from samebits' logprob op
    (the vocab reduced in fixed blocks): log_softmax, and softmax's exponent."""
    if dim not in (-1, x.dim() - 1):
        raise Error(f"samebits.torch enable(): aten::{op} over a dimension other than the last is not covered")
    xf = x.contiguous()
    zeros = torch.zeros(xf.shape[:-1], dtype=torch.int32, device=x.device)
    _, _, lse = _token_logprobs(xf, zeros)
    return xf.float() - lse.unsqueeze(-1)


def _log_softmax(x: Tensor, dim: int, half_to_float: bool) -> Tensor:
    out = _shifted_by_lse(x, dim, "_log_softmax")
    return out if (half_to_float or x.dtype == torch.float32) else out.to(x.dtype)


def _stock_bmm(a: Tensor, b: Tensor) -> Tensor:
    """Stock cuBLAS for what enable(strict=False) lets through (baddbmm is not routed)."""
    return torch.baddbmm(a.new_zeros(a.shape[0], a.shape[1], b.shape[2]), a, b, beta=0)


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    if a.shape[-1] == 1:  # K = 1 (transformers' rotary angles): one product per element, no reduction
        return (a * b).to(a.dtype)
    if _STATE["strict"]:
        raise Error(f"samebits.torch enable(): aten::bmm (a batched matmul, K = {a.shape[-1]}) is not covered: its "
                    "reduction order may follow the batch. transformers' eager attention calls it — load the model "
                    "with attn_implementation='sdpa' (routed) — or enable(strict=False) runs it as stock torch")
    return _stock_bmm(a, b)


def _softmax(x: Tensor, dim: int, half_to_float: bool) -> Tensor:
    out = torch.exp(_shifted_by_lse(x, dim, "_softmax"))
    return out if (half_to_float or x.dtype == torch.float32) else out.to(x.dtype)


def _softmax_backward(grad: Tensor, output: Tensor, dim: int, input_dtype) -> Tensor:
    if dim not in (-1, output.dim() - 1):
        raise Error("samebits.torch enable(): aten::_softmax_backward_data over a dimension other than the last is "
                    "not covered")
    g, y = grad.float(), output.float()
    return (y * (g - _row_sum(g * y))).to(input_dtype)  # y · (dy − Σ dy·y), Σ in a fixed order


def _log_softmax_backward(grad: Tensor, output: Tensor, dim: int, input_dtype) -> Tensor:
    if dim not in (-1, output.dim() - 1):
        raise Error("samebits.torch enable(): aten::_log_softmax_backward_data over a dimension other than the last "
                    "is not covered")
    g = grad.float()
    gi = torch.addcmul(g, torch.exp(output.float()), _row_sum(g), value=-1)  # dy − softmax · Σ dy, Σ in a fixed order
    return gi.to(input_dtype)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention [B, H, S, D] → samebits' packed causal attention, B sequences of S."""
    if attn_mask is not None or dropout_p != 0.0:
        raise _Uncovered("scaled_dot_product_attention with an attention mask or dropout (pack the sequences: "
                         "samebits.torch.attention, or score with samebits.hf)")
    if query.dim() != 4 or key.dim() != 4 or query.shape[2] != key.shape[2] or not (is_causal or query.shape[2] == 1):
        raise _Uncovered("scaled_dot_product_attention other than causal self-attention over [B, H, S, D] "
                         "(or one query against one key)")
    if not query.is_cuda:
        raise _Uncovered  # enable() routes CUDA tensors
    if query.dtype not in _SIXTEEN:
        raise _Uncovered(f"scaled_dot_product_attention on {query.dtype} (samebits' attention takes 16-bit)")
    b, h, s, d = query.shape
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], d).contiguous() for t in (query, key, value))
    out = _attention(q, k, v, _seq_table([s] * b), float(scale or 0.0))[0]
    return out.reshape(b, s, h, d).transpose(1, 2)


def _rms_norm_route(x, normalized_shape, weight=None, eps=None):
    shape = tuple(normalized_shape) if isinstance(normalized_shape, (list, tuple)) else (normalized_shape,)
    if not x.is_cuda:
        raise _Uncovered  # enable() routes CUDA tensors
    if weight is None or len(shape) != 1 or shape[0] != x.shape[-1] or weight.dtype != x.dtype:
        raise _Uncovered("rms_norm without a weight of the input's dtype, or over more than the last dimension")
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return rms_norm(x.contiguous(), weight.contiguous(), eps)


_STATE = {"strict": True}


def _function_routes():
    f = torch.nn.functional
    mean, summed = _reduce_last("mean"), _reduce_last("sum")
    routes = {f.scaled_dot_product_attention: _sdpa, f.rms_norm: _rms_norm_route,
              torch.mean: mean, Tensor.mean: mean, torch.sum: summed, Tensor.sum: summed}
    if hasattr(torch, "rms_norm"):
        routes[torch.rms_norm] = _rms_norm_route
    return routes


class _Routes(torch.overrides.TorchFunctionMode):
    """The Python-level half of enable(): functions a model calls from Python (attention, norms,
    per-row reductions), routed above autograd so their backward is samebits' (or, for the
    reductions, the elementwise ops' exact backward)."""

    def __init__(self):
        super().__init__()
        self.routes = _function_routes()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = self.routes.get(func)
        if route is not None:
            try:
                return route(*args, **kwargs)
            except _Uncovered as e:
                if _STATE["strict"] and e.args:
                    raise Error(f"samebits.torch enable(): {e.args[0]} is not covered; enable(strict=False) runs it "
                                "as stock torch") from None
        return func(*args, **kwargs)


@contextlib.contextmanager
def enable(strict: bool = True):
    """Route torch to samebits for the block (CUDA tensors; see docs/python.md for the table):
    aten mm / addmm (so nn.Linear, F.linear, matmul on 2-D weights) → samebits' GEMM, forward and
    backward; aten _log_softmax / _softmax and their backward → samebits' vocab-blocked
    log-sum-exp and a fixed-order row sum; F.scaled_dot_product_attention (causal, no mask) →
    samebits' attention and its backward; F.rms_norm → samebits' RMSNorm; mean / sum over the last
    dimension → a fixed pairwise order; bmm with K = 1 → the exact products. With strict (the
    default) a call enable() cannot route where batch invariance is at stake (an fp32 matmul, a
    batched matmul with K > 1, attention with a mask) raises samebits.Error; strict=False runs it as
    stock torch. Eager execution only: under torch.compile, call this module's ops directly (they
    are custom ops that compile traces)."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("mm", _mm, "CUDA")
    lib.impl("addmm", _addmm, "CUDA")
    lib.impl("_log_softmax", _log_softmax, "CUDA")
    lib.impl("_log_softmax_backward_data", _log_softmax_backward, "CUDA")
    lib.impl("_softmax", _softmax, "CUDA")
    lib.impl("_softmax_backward_data", _softmax_backward, "CUDA")
    lib.impl("bmm", _bmm, "CUDA")
    previous = _STATE["strict"]
    _STATE["strict"] = strict
    try:
        with _Routes():
            yield
    finally:
        _STATE["strict"] = previous
        lib._destroy()
