"""The samebits ops as torch custom ops: each forward and backward one call of samebits._core.raw on
the tensors' memory, on torch's current stream; autograd wired with register_autograd, fake
kernels for torch.compile."""
import sys
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._common import Error, _acc, _desc, _device, _ext, _ids, _int32, _rows, _stream, raw


def _dispatched(op, *args):
    """A C++ dispatcher op's call (_torch_ops.cpp), a samebits error (ValueError there) as samebits.Error."""
    try:
        return op(*args)
    except ValueError as e:
        raise Error(str(e)) from None


def _needs_dispatcher(main_grad, op: str) -> None:
    """main_grad accumulation is the C++ dispatcher ops' (_torch_ops.cpp: WeightGrad); refuse it elsewhere."""
    if main_grad is not None and (_ext is None or not _eager()):
        raise Error(f"samebits.torch {op}: argument 'main_grad': takes samebits.torch's C++ dispatcher ops in eager "
                    "mode (not built for this torch, or under torch.compile / torch.func / compiled autograd)")


def _eager() -> bool:
    """Whether a call may take the C++ dispatcher op: not while torch.compile traces (the op has no
    fake kernel), nor under torch.func transforms (it runs on the tensors' memory: no batching rule,
    no functorch-aware autograd), nor with compiled autograd on (_compiled_autograd_on)."""
    return (not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()
            and not (torch.is_grad_enabled() and _compiled_autograd_on()))


def _compiled_autograd_on() -> bool:
    """Whether compiled autograd is on — torch._dynamo.config.compiled_autograd, or inside
    torch._dynamo.compiled_autograd.enable(): it traces a backward through each node's
    compiled_args, which the dispatcher ops' hand-made C++ nodes do not have (docs/python.md).
    Looked up only where torch._dynamo is imported — as it is wherever either was set — so a call
    pays no import (getattr: torch versions without them), and only with grad mode on (_eager: a
    call that records no node needs no answer). The module flag first: reading the dynamo config
    goes through its ConfigModule's __getattr__ (~1.7 µs of Python, emulated on this project's CPU
    machine), paid only where the flag is off."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    if getattr(sys.modules.get("torch._dynamo.compiled_autograd"), "compiled_autograd_enabled", False):
        return True
    return bool(getattr(getattr(dynamo, "config", None), "compiled_autograd", False))


def _once_differentiable(backward_op, op: str) -> None:
    """A backward op's own autograd formula: an error naming the op. Under create_graph=True the
    backward ops record a node (their inputs want gradients), which without a formula raises torch's
    "no autograd formula was registered" where a gradient is differentiated; samebits' backward
    kernels have no derivative, so it raises this instead — the message of the dispatcher ops' error
    node (_torch_ops.cpp, BackwardNode)."""
    def refuse(ctx, *grads):
        raise RuntimeError(f"samebits.torch {op}: double backward is not supported (a gradient made with "
                           "create_graph=True was differentiated: samebits' backward has no derivative of its own)")
    backward_op.register_autograd(refuse)


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
def _linear_backward(dy: Tensor, x: Tensor, weight: Tensor, need_input: bool, need_weight: bool,
                     need_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias), each computed only where needed — dx and the weight's two are separate
    calls; dweight goes to a scratch accumulator where only dbias is — and an empty tensor where not."""
    dy2, x2 = _rows(dy.contiguous(), "linear_backward"), _rows(x, "linear_backward")
    need_acc = need_weight or need_bias
    dx = x2.new_empty(x2.shape if need_input else 0)
    dw = torch.zeros(weight.shape if need_acc else 0, dtype=_acc(weight), device=weight.device)  # fp32 accumulator
    db = torch.zeros(weight.shape[0] if need_bias else 0, dtype=_acc(weight), device=weight.device)
    with _device(x):
        s = _stream(x)
        if need_input:
            raw.linear_backward_input(_desc(dy2, "linear_backward", "dy"), _desc(weight, "linear_backward", "weight"),
                                      _desc(dx, "linear_backward", "dx"), s)
        if need_acc:
            raw.linear_backward_weight(_desc(dy2, "linear_backward", "dy"), _desc(x2, "linear_backward", "x"),
                                       _desc(dw, "linear_backward", "dweight"),
                                       _desc(db, "linear_backward", "dbias") if need_bias else None, s)
    dx = dx.reshape(x.shape) if need_input else dx
    dw = dw.to(weight.dtype) if need_weight else weight.new_empty(0)
    return dx, dw, db.to(weight.dtype)


@_linear_backward.register_fake
def _(dy, x, weight, need_input, need_weight, need_bias):
    return (x.new_empty(x.shape if need_input else 0), weight.new_empty(weight.shape if need_weight else 0),
            weight.new_empty(weight.shape[0] if need_bias else 0))


_once_differentiable(_linear_backward, "linear")


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.need_bias = bias is not None


def _linear_grad(ctx, dy):
    x, weight = ctx.saved_tensors
    # The inputs that want a gradient (a frozen weight does not). needs_input_grad is set at the forward:
    # unlike the dispatcher op's node, this backward does not see which inputs torch.autograd.grad asked for.
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and ctx.need_bias
    dx, dw, db = _linear_backward(dy, x, weight, need_x, need_w, need_b)
    return (dx if need_x else None), (dw if need_w else None), (db if need_b else None)


_linear.register_autograd(_linear_grad, setup_context=_linear_setup)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, main_grad: Optional[Tensor] = None,
           segments: Optional[List[int]] = None) -> Tensor:
    """y = x @ weight.T (+ bias): a row's bits do not depend on how many rows share the call.
    main_grad: weight's fp32 accumulator, which the backward adds into (segment by segment where
    `segments`, the packed sequences' lengths, are given) instead of setting weight.grad."""
    _needs_dispatcher(main_grad, "linear")
    if _ext is not None and _eager():  # the C++ dispatcher op: the same kernels
        return _dispatched(_ext.linear, x, weight, bias, main_grad, segments)
    return _linear(x, weight, bias)


# ---------------------------------------------------------------- RMSNorm
@torch.library.custom_op("samebits::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    x2 = _rows(x, "rms_norm")
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=_acc(x), device=x.device)
    with _device(x):
        raw.rmsnorm_forward(_desc(x2, "rms_norm", "x"), _desc(weight, "rms_norm", "weight"), _desc(y, "rms_norm", "y"),
                            _desc(rstd, "rms_norm", "rstd"), eps=eps, stream=_stream(x))
    return y.reshape(x.shape), rstd


@_rms_norm.register_fake
def _(x, weight, eps):
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return torch.empty_like(x), x.new_empty(rows, dtype=_acc(x))


@torch.library.custom_op("samebits::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    dy2, x2 = _rows(dy.contiguous(), "rms_norm_backward"), _rows(x, "rms_norm_backward")
    dx = torch.empty_like(x2)
    dw = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device)
    with _device(x):
        raw.rmsnorm_backward(_desc(dy2, "rms_norm_backward", "dy"), _desc(x2, "rms_norm_backward", "x"),
                             _desc(weight, "rms_norm_backward", "weight"), _desc(rstd, "rms_norm_backward", "rstd"),
                             _desc(dx, "rms_norm_backward", "dx"), _desc(dw, "rms_norm_backward", "dweight"),
                             eps=eps, stream=_stream(x))
    return dx.reshape(x.shape), dw.to(weight.dtype)


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd, eps):
    return torch.empty_like(x), torch.empty_like(weight)


_once_differentiable(_rms_norm_backward, "rms_norm")


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps = eps


def _rms_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(dy, x, weight, rstd, ctx.eps)
    return dx, dw, None


_rms_norm.register_autograd(_rms_grad, setup_context=_rms_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, main_grad: Optional[Tensor] = None,
             segments: Optional[List[int]] = None) -> Tensor:
    """x * rsqrt(mean(x²) + eps) * weight over the last dimension, computed in fp32, rounded once."""
    _needs_dispatcher(main_grad, "rms_norm")
    if _ext is not None and _eager():  # the C++ dispatcher op: the same kernels
        return _dispatched(_ext.rms_norm, x, weight, float(eps), main_grad, segments)
    return _rms_norm(x, weight, eps)[0]


@torch.library.custom_op("samebits::add_rms_norm", mutates_args=())
def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    name = "add_rms_norm"
    x2, r2 = _rows(x, name), _rows(residual, name)
    y, s = torch.empty_like(x2), torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=_acc(x), device=x.device)
    with _device(x):
        raw.rmsnorm_forward(_desc(x2, name, "x"), _desc(weight, name, "weight"), _desc(y, name, "y"),
                            _desc(rstd, name, "rstd"), _desc(r2, name, "residual"), _desc(s, name, "residual_out"),
                            eps=eps, stream=_stream(x))
    return y.reshape(x.shape), s.reshape(x.shape), rstd


@_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(rows, dtype=_acc(x))


@torch.library.custom_op("samebits::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward(dy: Tensor, ds: Optional[Tensor], s: Tensor, weight: Tensor, rstd: Tensor,
                           eps: float) -> Tuple[Tensor, Tensor]:
    name = "add_rms_norm_backward"
    dy2, s2 = _rows(dy.contiguous(), name), _rows(s, name)
    ds2 = None if ds is None else _rows(ds.contiguous(), name)
    dx = torch.empty_like(s2)
    dw = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device)
    with _device(s):
        raw.rmsnorm_backward(_desc(dy2, name, "dy"), _desc(s2, name, "x"), _desc(weight, name, "weight"),
                             _desc(rstd, name, "rstd"), _desc(dx, name, "dx"), _desc(dw, name, "dweight"),
                             _desc(ds2, name, "dresidual_out"), eps=eps, stream=_stream(s))
    return dx.reshape(s.shape), dw.to(weight.dtype)


@_add_rms_norm_backward.register_fake
def _(dy, ds, s, weight, rstd, eps):
    return torch.empty_like(s), torch.empty_like(weight)


_once_differentiable(_add_rms_norm_backward, "add_rms_norm")


def _add_rms_setup(ctx, inputs, output):
    x, residual, weight, eps = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.eps = eps


def _add_rms_grad(ctx, dy, ds, _drstd):
    s, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(s)
    dx, dw = _add_rms_norm_backward(dy, ds, s, weight, rstd, ctx.eps)
    return dx, dx, dw, None  # both summands of s get the same gradient


_add_rms_norm.register_autograd(_add_rms_grad, setup_context=_add_rms_setup)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, *,
                 main_grad: Optional[Tensor] = None, segments: Optional[List[int]] = None) -> Tuple[Tensor, Tensor]:
    """The decoder's residual step fused with the next norm: s = x + residual (fp32, rounded once to
    x's dtype), y = rms_norm(s). Returns (y, s); the backward takes gradients on both."""
    _needs_dispatcher(main_grad, "add_rms_norm")
    if _ext is not None and _eager():  # the C++ dispatcher op: the same kernels
        return tuple(_dispatched(_ext.add_rms_norm, x, residual, weight, float(eps), main_grad, segments))
    y, s, _ = _add_rms_norm(x, residual, weight, eps)
    return y, s


# ---------------------------------------------------------------- selected logprobs
@torch.library.custom_op("samebits::token_logprobs", mutates_args=())
def _token_logprobs(logits: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    l2 = _rows(logits, "token_logprobs")
    t = _int32(targets, "token_logprobs", "targets")
    logp, entropy, lse = (torch.empty(t.shape[0], dtype=_acc(logits), device=logits.device) for _ in range(3))
    with _device(logits):
        raw.logprob_forward(_desc(l2, "token_logprobs", "logits"), _desc(t, "token_logprobs", "targets"),
                            None, _desc(logp, "token_logprobs", "logp"),
                            _desc(entropy, "token_logprobs", "entropy"), _desc(lse, "token_logprobs", "lse"),
                            _stream(logits))
    shape = logits.shape[:-1]
    return logp.reshape(shape), entropy.reshape(shape), lse.reshape(shape)


@_token_logprobs.register_fake
def _(logits, targets):
    shape = logits.shape[:-1]
    return tuple(logits.new_empty(shape, dtype=_acc(logits)) for _ in range(3))


@torch.library.custom_op("samebits::token_logprobs_backward", mutates_args=())
def _token_logprobs_backward(logits: Tensor, targets: Tensor, lse: Tensor, dlogp: Tensor, dentropy: Tensor) -> Tensor:
    l2 = _rows(logits, "token_logprobs_backward")
    t = _int32(targets, "token_logprobs_backward", "targets")
    dl = torch.empty_like(l2)
    with _device(logits):
        raw.logprob_backward(_desc(l2, "token_logprobs_backward", "logits"), _desc(t, "token_logprobs_backward", "targets"),
                             None,
                             _desc(lse.reshape(-1).contiguous(), "token_logprobs_backward", "lse"),
                             _desc(dlogp.reshape(-1).to(_acc(logits)).contiguous(), "token_logprobs_backward", "dlogp"),
                             _desc(dentropy.reshape(-1).to(_acc(logits)).contiguous(), "token_logprobs_backward",
                                   "dentropy"),
                             _desc(dl, "token_logprobs_backward", "dlogits"), _stream(logits))
    return dl.reshape(logits.shape)


@_token_logprobs_backward.register_fake
def _(logits, targets, lse, dlogp, dentropy):
    return torch.empty_like(logits)


_once_differentiable(_token_logprobs_backward, "token_logprobs")


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
    if _ext is not None and _eager():  # the C++ dispatcher op: the same kernels
        return _dispatched(_ext.token_logprobs, logits, targets)
    logp, entropy, _ = _token_logprobs(logits, targets)
    return logp, entropy


# ---------------------------------------------------------------- attention (packed, causal, GQA)
def _seq_table(lengths) -> Tensor:
    """int32 [B, 4] {q_row, q_len, k_row, k_len} on the host for sequences packed back to back."""
    rows, at = [], 0
    for n in lengths:
        n = int(n)
        rows.append([at, n, at, n])
        at += n
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4)


@torch.library.custom_op("samebits::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, seqs: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=_acc(q), device=q.device)
    with _device(q):
        raw.attention_forward(_desc(q, "attention", "q"), _desc(k, "attention", "k"), _desc(v, "attention", "v"),
                              _desc(seqs, "attention", "seqs"), _desc(out, "attention", "out"),
                              _desc(lse, "attention", "lse"), scale, _stream(q))
    return out, lse


@_attention.register_fake
def _(q, k, v, seqs, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=_acc(q))


@torch.library.custom_op("samebits::attention_backward", mutates_args=())
def _attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, seqs: Tensor, out: Tensor, lse: Tensor,
                        scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    name = "attention_backward"
    with _device(q):
        raw.attention_backward(_desc(q, name, "q"), _desc(k, name, "k"), _desc(v, name, "v"), _desc(seqs, name, "seqs"),
                               _desc(out, name, "out"), _desc(lse, name, "lse"),
                               _desc(dout.contiguous(), name, "dout"), _desc(dq, name, "dq"), _desc(dk, name, "dk"),
                               _desc(dv, name, "dv"), scale, _stream(q))
    return dq, dk, dv


@_attention_backward.register_fake
def _(dout, q, k, v, seqs, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_once_differentiable(_attention_backward, "attention")


def _attention_setup(ctx, inputs, output):
    q, k, v, seqs, scale = inputs
    ctx.save_for_backward(q, k, v, seqs, output[0], output[1])
    ctx.scale = scale


def _attention_grad(ctx, dout, _dlse):
    q, k, v, seqs, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward(dout, q, k, v, seqs, out, lse, ctx.scale)
    return dq, dk, dv, None, None


_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def attention(q: Tensor, k: Tensor, v: Tensor, lengths, scale: Optional[float] = None) -> Tensor:
    """Causal attention over sequences packed back to back: q [T, Hq, D], k / v [T, Hkv, D]
    (Hq % Hkv == 0, GQA), `lengths` the sequences' lengths (summing to T). Keys are reduced in
    ascending position, so a sequence's rows do not depend on the others packed with it."""
    if _ext is not None and _eager():  # the C++ dispatcher op: the same kernels, the table made in C++
        return _dispatched(_ext.attention, q, k, v, [int(n) for n in lengths], float(scale or 0.0))
    return _attention(q, k, v, _seq_table(lengths), float(scale or 0.0))[0]


# ---------------------------------------------------------------- SwiGLU
@torch.library.custom_op("samebits::swiglu", mutates_args=())
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    g2, u2 = _rows(gate, "swiglu"), _rows(up, "swiglu")
    y = torch.empty_like(g2)
    with _device(gate):
        raw.swiglu_forward(_desc(g2, "swiglu", "gate"), _desc(u2, "swiglu", "up"), _desc(y, "swiglu", "y"),
                           _stream(gate))
    return y.reshape(gate.shape)


@_swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("samebits::swiglu_backward", mutates_args=())
def _swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    name = "swiglu_backward"
    g2, u2, dy2 = _rows(gate, name), _rows(up, name), _rows(dy.contiguous(), name)
    dg, du = torch.empty_like(g2), torch.empty_like(u2)
    with _device(gate):
        raw.swiglu_backward(_desc(dy2, name, "dy"), _desc(g2, name, "gate"), _desc(u2, name, "up"),
                            _desc(dg, name, "dgate"), _desc(du, name, "dup"), _stream(gate))
    return dg.reshape(gate.shape), du.reshape(up.shape)


@_swiglu_backward.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


_once_differentiable(_swiglu_backward, "swiglu")


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dy):
    gate, up = ctx.saved_tensors
    return _swiglu_backward(dy, gate, up)


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up computed in fp32 and rounded once (the MLP's activation)."""
    if _ext is not None and _eager():  # the C++ dispatcher op: the same kernels
        return _dispatched(_ext.swiglu, gate, up)
    return _swiglu(gate, up)


# ---------------------------------------------------------------- embedding
@torch.library.custom_op("samebits::embedding", mutates_args=())
def _embedding(ids: Tensor, table: Tensor) -> Tensor:
    flat = _ids(ids, "embedding", "ids")
    y = table.new_empty(flat.shape[0], table.shape[1])
    with _device(table):
        raw.embedding_forward(_desc(flat, "embedding", "ids"), _desc(table, "embedding", "table"),
                              _desc(y, "embedding", "y"), _stream(table))
    return y.reshape(*ids.shape, table.shape[1])


@_embedding.register_fake
def _(ids, table):
    return table.new_empty(*ids.shape, table.shape[1])


@torch.library.custom_op("samebits::embedding_backward", mutates_args=())
def _embedding_backward(dy: Tensor, ids: Tensor, table: Tensor) -> Tensor:
    flat = _ids(ids, "embedding_backward", "ids")
    dt = torch.zeros(table.shape, dtype=_acc(table), device=table.device)  # fp32 accumulator
    with _device(table):
        raw.embedding_backward(_desc(flat, "embedding_backward", "ids"),
                               _desc(dy.reshape(-1, table.shape[1]).contiguous(), "embedding_backward", "dy"), None,
                               _desc(dt, "embedding_backward", "dtable"), _stream(table))
    return dt.to(table.dtype)


@_embedding_backward.register_fake
def _(dy, ids, table):
    return torch.empty_like(table)


_once_differentiable(_embedding_backward, "embedding")


def _embedding_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _embedding_grad(ctx, dy):
    ids, table = ctx.saved_tensors
    return None, _embedding_backward(dy, ids, table)


_embedding.register_autograd(_embedding_grad, setup_context=_embedding_setup)


def embedding(ids: Tensor, table: Tensor, *, main_grad: Optional[Tensor] = None) -> Tensor:
    """table[ids] (int32 / int64 ids); the table's gradient sums each row's uses in ascending token order
    in an fp32 accumulator, without atomics."""
    _needs_dispatcher(main_grad, "embedding")
    if _ext is not None and _eager():  # the C++ dispatcher op: the same kernels
        return _dispatched(_ext.embedding, ids, table, main_grad)
    return _embedding(ids, table)


def _embedding_of_checked_ids(ids: Tensor, table: Tensor, *, main_grad: Optional[Tensor] = None) -> Tensor:
    """embedding for ids every one of which the caller has checked is in [0, vocab) (samebits.hf.patch:
    ids that arrived in host memory, checked there): the dispatcher op skips its own range check (a
    search on the GPU whose answer a later op reads)."""
    _needs_dispatcher(main_grad, "embedding")
    if _ext is not None and _eager():
        return _dispatched(_ext.embedding, ids, table, main_grad, True)
    return embedding(ids, table, main_grad=main_grad)


# ---------------------------------------------------------------- RoPE and QK-norm (+ RoPE)
def _rope_dict(theta: float, llama3: List[float]) -> dict:
    d = {"theta": theta}
    if llama3:
        d.update(llama3_scaling=True, factor=llama3[0], low_freq_factor=llama3[1], high_freq_factor=llama3[2],
                 original_max_position=int(llama3[3]))
    return d


def _llama3(rope_scaling: Optional[dict]) -> List[float]:
    """Hugging Face's rope_scaling dict ({"rope_type": "llama3", "factor": ...}) as an op argument:
    [factor, low_freq_factor, high_freq_factor, original_max_position], or [] for none."""
    if not rope_scaling:
        return []
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind != "llama3":
        raise Error(f"samebits.torch rope: argument 'rope_scaling': type {kind!r} is not taken (llama3 only)")
    return [float(rope_scaling["factor"]), float(rope_scaling["low_freq_factor"]),
            float(rope_scaling["high_freq_factor"]), float(rope_scaling["original_max_position_embeddings"])]


@torch.library.custom_op("samebits::rope", mutates_args=())
def _rope(x: Tensor, positions: Tensor, theta: float, llama3: List[float], inverse: bool) -> Tensor:
    pos = _int32(positions, "rope", "positions")
    y = torch.empty_like(x)
    run = raw.rope_backward if inverse else raw.rope_forward
    with _device(x):
        run(_desc(x, "rope", "x"), _desc(pos, "rope", "positions"), _desc(y, "rope", "y"), _rope_dict(theta, llama3),
            _stream(x))
    return y


@_rope.register_fake
def _(x, positions, theta, llama3, inverse):
    return torch.empty_like(x)


def _rope_setup(ctx, inputs, output):
    x, positions, theta, llama3, inverse = inputs
    ctx.save_for_backward(positions)
    ctx.args = (theta, llama3, not inverse)


def _rope_grad(ctx, dy):
    (positions,) = ctx.saved_tensors
    return _rope(dy.contiguous(), positions, *ctx.args), None, None, None, None


_rope.register_autograd(_rope_grad, setup_context=_rope_setup)


def rope(x: Tensor, positions: Tensor, theta: float = 1e6, rope_scaling: Optional[dict] = None) -> Tensor:
    """Rotary embedding of x [T, heads, head_dim] at positions [T] (rotate_half pairs i, i + D/2);
    the angle in fp32 as Hugging Face computes it, cos / sin of it in fp64 rounded to fp32, so a
    position gives the same bits on every path. rope_scaling: Hugging Face's Llama-3 dict."""
    return _rope(x, positions, float(theta), _llama3(rope_scaling), False)


@torch.library.custom_op("samebits::qk_norm", mutates_args=())
def _qk_norm(x: Tensor, weight: Tensor, eps: float, positions: Optional[Tensor], theta: float,
             llama3: List[float]) -> Tuple[Tensor, Tensor]:
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:2], dtype=_acc(x), device=x.device)
    pos = None if positions is None else _int32(positions, "qk_norm", "positions")
    with _device(x):
        raw.qk_norm_forward(_desc(x, "qk_norm", "x"), _desc(weight, "qk_norm", "weight"), _desc(y, "qk_norm", "y"),
                            _desc(rstd, "qk_norm", "rstd"), _desc(pos, "qk_norm", "positions"), eps,
                            _rope_dict(theta, llama3), _stream(x))
    return y, rstd


@_qk_norm.register_fake
def _(x, weight, eps, positions, theta, llama3):
    return torch.empty_like(x), x.new_empty(x.shape[:2], dtype=_acc(x))


@torch.library.custom_op("samebits::qk_norm_backward", mutates_args=())
def _qk_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, eps: float, positions: Optional[Tensor],
                      theta: float, llama3: List[float]) -> Tuple[Tensor, Tensor]:
    name = "qk_norm_backward"
    dx = torch.empty_like(x)
    dw = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device)
    pos = None if positions is None else _int32(positions, name, "positions")
    with _device(x):
        raw.qk_norm_backward(_desc(dy.contiguous(), name, "dy"), _desc(x, name, "x"), _desc(weight, name, "weight"),
                             _desc(rstd, name, "rstd"), _desc(dx, name, "dx"), _desc(dw, name, "dweight"),
                             _desc(pos, name, "positions"), eps, _rope_dict(theta, llama3), _stream(x))
    return dx, dw.to(weight.dtype)


@_qk_norm_backward.register_fake
def _(dy, x, weight, rstd, eps, positions, theta, llama3):
    return torch.empty_like(x), torch.empty_like(weight)


_once_differentiable(_qk_norm_backward, "qk_norm")


def _qk_setup(ctx, inputs, output):
    x, weight, eps, positions, theta, llama3 = inputs
    ctx.save_for_backward(x, weight, output[1], positions)
    ctx.args = (eps, theta, llama3)


def _qk_grad(ctx, dy, _drstd):
    x, weight, rstd, positions = ctx.saved_tensors
    eps, theta, llama3 = ctx.args
    dx, dw = _qk_norm_backward(dy, x, weight, rstd, eps, positions, theta, llama3)
    return dx, dw, None, None, None, None


_qk_norm.register_autograd(_qk_grad, setup_context=_qk_setup)


def qk_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, positions: Optional[Tensor] = None, theta: float = 1e6,
            rope_scaling: Optional[dict] = None, *, main_grad: Optional[Tensor] = None,
            segments: Optional[List[int]] = None) -> Tensor:
    """Qwen3's QK-norm: RMSNorm over head_dim of every head of x [T, heads, head_dim]; with
    positions, fused with RoPE (the same bits as qk_norm then rope, in one pass; its backward keeps
    the rotated-back gradient in fp32)."""
    _needs_dispatcher(main_grad, "qk_norm")
    if _ext is not None and _eager():  # the C++ dispatcher op: the same kernels
        return _dispatched(_ext.qk_norm, x, weight, float(eps), positions, float(theta), _llama3(rope_scaling),
                           main_grad, segments)
    return _qk_norm(x, weight, eps, positions, float(theta), _llama3(rope_scaling))[0]


# ---------------------------------------------------------------- fused LM head → selected logprob
@torch.library.custom_op("samebits::lm_head_logprobs", mutates_args=())
def _lm_head_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    name = "lm_head_logprobs"
    h2 = _rows(hidden, name)
    t = _int32(targets, name, "targets")
    mask = torch.ones(t.shape[0], dtype=torch.uint8, device=hidden.device)  # given: the path the GPU tests of the LM-head op take
    logp, entropy, lse = (torch.empty(t.shape[0], dtype=_acc(hidden), device=hidden.device) for _ in range(3))
    with _device(hidden):
        raw.lm_head_logprob_forward(_desc(h2, name, "hidden"), _desc(weight, name, "weight"), _desc(t, name, "targets"),
                                    _desc(mask, name, "loss_mask"), _desc(logp, name, "logp"),
                                    _desc(entropy, name, "entropy"), _desc(lse, name, "lse"), ignore_index=-100,
                                    stream=_stream(hidden))
    shape = hidden.shape[:-1]
    return logp.reshape(shape), entropy.reshape(shape), lse.reshape(shape)


@_lm_head_logprobs.register_fake
def _(hidden, weight, targets):
    shape = hidden.shape[:-1]
    return tuple(hidden.new_empty(shape, dtype=_acc(hidden)) for _ in range(3))


@torch.library.custom_op("samebits::lm_head_logprobs_backward", mutates_args=())
def _lm_head_logprobs_backward(hidden: Tensor, weight: Tensor, targets: Tensor, lse: Tensor, dlogp: Tensor,
                               dentropy: Optional[Tensor], want_dw: bool) -> Tuple[Tensor, Tensor]:
    """(dhidden, dweight); a frozen head (want_dw False): no dweight — neither its fp32 accumulator nor
    the weight-gradient GEMM — and an empty tensor in its place."""
    name = "lm_head_logprobs_backward"
    h2 = _rows(hidden, name)
    t = _int32(targets, name, "targets")
    mask = torch.ones(t.shape[0], dtype=torch.uint8, device=hidden.device)
    dh = torch.empty_like(h2)
    dw = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device) if want_dw else None  # fp32 accumulator
    acc = _acc(hidden)
    with _device(hidden):
        raw.lm_head_logprob_backward(_desc(h2, name, "hidden"), _desc(weight, name, "weight"), _desc(t, name, "targets"),
                                     _desc(mask, name, "loss_mask"), _desc(lse.reshape(-1).contiguous(), name, "lse"),
                                     _desc(dlogp.reshape(-1).to(acc).contiguous(), name, "dlogp"),
                                     _desc(None if dentropy is None else dentropy.reshape(-1).to(acc).contiguous(),
                                           name, "dentropy"),
                                     _desc(dh, name, "dhidden"), _desc(dw, name, "dweight"), ignore_index=-100,
                                     stream=_stream(hidden))
    return dh.reshape(hidden.shape), dw.to(weight.dtype) if want_dw else weight.new_empty(0)


@_lm_head_logprobs_backward.register_fake
def _(hidden, weight, targets, lse, dlogp, dentropy, want_dw):
    return torch.empty_like(hidden), torch.empty_like(weight) if want_dw else weight.new_empty(0)


_once_differentiable(_lm_head_logprobs_backward, "lm_head_logprobs")


def _lm_setup(ctx, inputs, output):
    hidden, weight, targets = inputs
    ctx.save_for_backward(hidden, weight, targets, output[2])
    ctx.set_materialize_grads(False)  # an output without a gradient gets None (no zero entropy gradient)


def _lm_grad(ctx, dlogp, dentropy, _dlse):
    hidden, weight, targets, lse = ctx.saved_tensors
    dlogp = torch.zeros_like(lse) if dlogp is None else dlogp
    # No entropy gradient: none given (a zero one would make the backward recompute the statistics,
    # a whole extra pass of the LM-head GEMM)
    want_dw = ctx.needs_input_grad[1]
    dh, dw = _lm_head_logprobs_backward(hidden, weight, targets, lse, dlogp, dentropy, want_dw)
    return dh, dw if want_dw else None, None


_lm_head_logprobs.register_autograd(_lm_grad, setup_context=_lm_setup)


def lm_head_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, main_grad: Optional[Tensor] = None,
                     segments: Optional[List[int]] = None, keep_logits_bytes: int = 0) -> Tuple[Tensor, Tensor]:
    """(logp, entropy) of targets under logits = hidden @ weight.T, computed in fp32 vocab block by
    vocab block and never stored (bitwise an fp32-output linear followed by token_logprobs): the
    [tokens, vocab] logits matrix an RL loss would otherwise materialize is never allocated, forward
    or backward. Targets equal to -100 are not scored (logp = entropy = 0, no gradient).
    keep_logits_bytes: memory a call that records a backward may spend keeping the first rows'
    fp32 logits for it (6 bytes a logit with the backward's dlogits; rows ending at a sequence's end
    where `segments` are given, else all rows or none), whose backward then runs three GEMMs for
    them instead of four — the same bits (the C++ dispatcher ops on a GPU; ignored elsewhere)."""
    _needs_dispatcher(main_grad, "lm_head_logprobs")
    if _ext is not None and _eager():  # the C++ dispatcher op: the same kernels
        return tuple(_dispatched(_ext.lm_head_logprobs, hidden, weight, targets, main_grad, segments, False,
                                 int(keep_logits_bytes)))
    logp, entropy, _ = _lm_head_logprobs(hidden, weight, targets)
    return logp, entropy


def _lm_head_logprobs_of_checked_targets(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                                         main_grad: Optional[Tensor] = None, segments: Optional[List[int]] = None,
                                         keep_logits_bytes: int = 0) -> Tuple[Tensor, Tensor]:
    """lm_head_logprobs for targets every one of which the caller has checked is in [0, vocab) or -100
    (samebits.hf.patch: the next-token ids its embedding call has just checked against a table of at
    most weight's rows): the dispatcher op skips its own range check (one more kernel launch a call)."""
    _needs_dispatcher(main_grad, "lm_head_logprobs")
    if _ext is not None and _eager():
        return tuple(_dispatched(_ext.lm_head_logprobs, hidden, weight, targets, main_grad, segments, True,
                                 int(keep_logits_bytes)))
    return lm_head_logprobs(hidden, weight, targets, main_grad=main_grad, segments=segments)
