"""samebits for PyTorch: batch-invariant ops as torch custom ops, with autograd, on the caller's stream.

    import samebits.torch as sbt
    y = sbt.linear(x, w)                       # bitwise the same rows whatever the batch
    with sbt.enable():                          # route matmuls, attention, norms, log_softmax to samebits
        logits = model(input_ids).logits

Why it is shaped this way: every op is a `torch.library.custom_op` (so autograd, torch.compile and
fake tensors see one op, not the library's internals) whose forward and backward call the C++
library on the tensors' memory through `samebits._core.raw` — nothing is copied, the work runs on
torch's current stream, and the backward is samebits' own backward kernel (weight gradients in an
fp32 accumulator, cast once to the weight's dtype). Inputs must be contiguous; dtypes and shapes
are checked by the library, whose errors arrive as samebits.Error (a ValueError).

Ops: linear, rms_norm, add_rms_norm (fused residual add), token_logprobs, attention (packed causal GQA), swiglu, embedding, rope,
qk_norm (+ fused RoPE), lm_head_logprobs (the fused LM head → selected logprob) — each forward and
backward. enable() routes a model's own torch code to them (aten mm / addmm /
_log_softmax at the dispatcher; scaled_dot_product_attention, rms_norm and per-row mean / sum at the
Python level); its table of what is and is not covered is in docs/python.md.
"""
import contextlib
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _core
from ._core import Error

raw = _core.raw

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int32: "int32", torch.uint8: "uint8"}


def _acc(t: Tensor) -> torch.dtype:
    """The dtype of accumulators and per-row statistics: fp32, or fp64 for fp64 tensors (the CPU's
    truth mode, which torch.autograd.gradcheck runs the ops in)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _desc(t: Optional[Tensor], op: str, arg: str):
    """(pointer, dtype, shape, device, tensor) of a contiguous tensor, for samebits._core.raw. The
    tensor rides along so that a temporary (a .contiguous() copy made in the call's argument list)
    stays alive until the op has run: the pointer alone would let torch's allocator hand its memory
    to the next temporary."""
    if t is None:
        return None
    if t.dtype not in _DTYPES:
        raise Error(f"samebits.torch {op}: argument '{arg}': dtype {t.dtype} is not taken "
                    f"(bfloat16, float16, float32; float64 on the CPU; int32 ids / targets; uint8 masks)")
    if t.dtype == torch.float64 and t.device.type == "cuda":
        raise Error(f"samebits.torch {op}: argument '{arg}': dtype torch.float64 is taken on the CPU only (the "
                    "fp64 truth mode); CUDA ops take bfloat16, float16 and float32")
    if t.device.type not in ("cpu", "cuda"):
        raise Error(f"samebits.torch {op}: argument '{arg}': device {t.device} is not taken (cpu or cuda)")
    if not t.is_contiguous():
        raise Error(f"samebits.torch {op}: argument '{arg}': must be contiguous (.contiguous())")
    return (t.data_ptr(), _DTYPES[t.dtype], tuple(t.shape), t.device.type, t)


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _int32(t: Tensor, op: str, arg: str) -> Tensor:
    """Token ids / targets as int32, refusing an int64 value int32 cannot hold (a cast would wrap it
    into a valid-looking id)."""
    if t.dtype == torch.int64 and t.numel() and bool((t.max() >= 2**31) | (t.min() < -2**31)):
        raise Error(f"samebits.torch {op}: argument '{arg}': a value does not fit in int32")
    if t.dtype not in (torch.int32, torch.int64):
        raise Error(f"samebits.torch {op}: argument '{arg}': dtype {t.dtype} is not taken (int32 or int64)")
    return t.reshape(-1).to(torch.int32).contiguous()


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
    dw = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device)  # fp32 accumulator
    db = torch.zeros(weight.shape[0] if need_bias else 0, dtype=_acc(weight), device=weight.device)
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


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """The decoder's residual step fused with the next norm: s = x + residual (fp32, rounded once to
    x's dtype), y = rms_norm(s). Returns (y, s); the backward takes gradients on both."""
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


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dy):
    gate, up = ctx.saved_tensors
    return _swiglu_backward(dy, gate, up)


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up computed in fp32 and rounded once (the MLP's activation)."""
    return _swiglu(gate, up)


# ---------------------------------------------------------------- embedding
@torch.library.custom_op("samebits::embedding", mutates_args=())
def _embedding(ids: Tensor, table: Tensor) -> Tensor:
    flat = _int32(ids, "embedding", "ids")
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
    flat = _int32(ids, "embedding_backward", "ids")
    dt = torch.zeros(table.shape, dtype=_acc(table), device=table.device)  # fp32 accumulator
    with _device(table):
        raw.embedding_backward(_desc(flat, "embedding_backward", "ids"),
                               _desc(dy.reshape(-1, table.shape[1]).contiguous(), "embedding_backward", "dy"), None,
                               _desc(dt, "embedding_backward", "dtable"), _stream(table))
    return dt.to(table.dtype)


@_embedding_backward.register_fake
def _(dy, ids, table):
    return torch.empty_like(table)


def _embedding_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _embedding_grad(ctx, dy):
    ids, table = ctx.saved_tensors
    return None, _embedding_backward(dy, ids, table)


_embedding.register_autograd(_embedding_grad, setup_context=_embedding_setup)


def embedding(ids: Tensor, table: Tensor) -> Tensor:
    """table[ids] (int32 / int64 ids); the table's gradient sums each row's uses in ascending token order
    in an fp32 accumulator, without atomics."""
    return _embedding(ids, table)


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
            rope_scaling: Optional[dict] = None) -> Tensor:
    """Qwen3's QK-norm: RMSNorm over head_dim of every head of x [T, heads, head_dim]; with
    positions, fused with RoPE (the same bits as qk_norm then rope, in one pass; its backward keeps
    the rotated-back gradient in fp32)."""
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
                               dentropy: Tensor) -> Tuple[Tensor, Tensor]:
    name = "lm_head_logprobs_backward"
    h2 = _rows(hidden, name)
    t = _int32(targets, name, "targets")
    mask = torch.ones(t.shape[0], dtype=torch.uint8, device=hidden.device)
    dh = torch.empty_like(h2)
    dw = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device)  # fp32 accumulator
    acc = _acc(hidden)
    with _device(hidden):
        raw.lm_head_logprob_backward(_desc(h2, name, "hidden"), _desc(weight, name, "weight"), _desc(t, name, "targets"),
                                     _desc(mask, name, "loss_mask"), _desc(lse.reshape(-1).contiguous(), name, "lse"),
                                     _desc(dlogp.reshape(-1).to(acc).contiguous(), name, "dlogp"),
                                     _desc(dentropy.reshape(-1).to(acc).contiguous(), name, "dentropy"),
                                     _desc(dh, name, "dhidden"), _desc(dw, name, "dweight"), ignore_index=-100,
                                     stream=_stream(hidden))
    return dh.reshape(hidden.shape), dw.to(weight.dtype)


@_lm_head_logprobs_backward.register_fake
def _(hidden, weight, targets, lse, dlogp, dentropy):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _lm_setup(ctx, inputs, output):
    hidden, weight, targets = inputs
    ctx.save_for_backward(hidden, weight, targets, output[2])


def _lm_grad(ctx, dlogp, dentropy, _dlse):
    hidden, weight, targets, lse = ctx.saved_tensors
    dlogp = torch.zeros_like(lse) if dlogp is None else dlogp
    dentropy = torch.zeros_like(lse) if dentropy is None else dentropy
    dh, dw = _lm_head_logprobs_backward(hidden, weight, targets, lse, dlogp, dentropy)
    return dh, dw, None


_lm_head_logprobs.register_autograd(_lm_grad, setup_context=_lm_setup)


def lm_head_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor]:
    """(logp, entropy) of targets under logits = hidden @ weight.T, computed in fp32 vocab block by
    vocab block and never stored (bitwise an fp32-output linear followed by token_logprobs): the
    [tokens, vocab] logits matrix an RL loss would otherwise materialize is never allocated, forward
    or backward. Targets equal to -100 are not scored (logp = entropy = 0, no gradient)."""
    logp, entropy, _ = _lm_head_logprobs(hidden, weight, targets)
    return logp, entropy


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
