"""samebits: batch-invariant transformer forward and backward, from Python.

The C++ library does the work (samebits._core); a sequence's logprobs and a batch's gradients are
the same bits whatever else shares the call, the micro-batch split or the backend's scheduling.

    import samebits
    chain = samebits.Chain(samebits.Model.load("path/to/hf-model"))      # or Model.builtin()
    logp = chain.logprobs([[1, 2, 3], [4, 5]])                            # per sequence, entry 0 NaN
    grads = chain.gradients([[1, 2, 3], [4, 5]], micro_batch=1)          # {weight: fp32 gradient}

linear / rms_norm / token_logprobs run the ops on NumPy arrays (CPU backend) through
samebits._core.raw, the same door samebits.torch uses: arrays must already be C-contiguous and of a
dtype the ops take; nothing is copied or cast behind the caller's back.
"""
import numpy as np

from ._core import (Chain, Completion, Engine, Error, Model, SamplingParams, backends, cuda_available, raw,  # noqa: F401
                    version)

_NP_DTYPES = {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16", np.dtype(np.int32): "int32",
              np.dtype(np.uint8): "uint8"}


def _desc(a, op, arg):
    """(pointer, dtype, shape, "cpu", array) of a NumPy array, for samebits._core.raw."""
    if a is None:
        return None
    if not isinstance(a, np.ndarray):
        raise Error(f"samebits {op}: argument '{arg}': must be a NumPy array, not {type(a).__name__}")
    if a.dtype not in _NP_DTYPES:
        raise Error(f"samebits {op}: argument '{arg}': dtype {a.dtype} is not taken "
                    "(float32, float16, int32 for ids / targets, uint8 for masks)")
    if not a.flags.c_contiguous:
        raise Error(f"samebits {op}: argument '{arg}': must be C-contiguous (np.ascontiguousarray)")
    return (a.ctypes.data, _NP_DTYPES[a.dtype], a.shape, "cpu", a)


def linear(x, weight, bias=None):
    """y = x @ weight.T (+ bias), fp32 accumulation in a fixed K order (CPU backend)."""
    dx, dw, db = _desc(x, "linear", "x"), _desc(weight, "linear", "weight"), _desc(bias, "linear", "bias")
    if x.ndim != 2 or weight.ndim != 2:
        raise Error("samebits linear: argument 'x': x and weight must be 2-D ([M, K], [N, K])")
    y = np.empty((x.shape[0], weight.shape[0]), x.dtype)
    raw.linear_forward(dx, dw, db, _desc(y, "linear", "y"))
    return y


def rms_norm(x, weight, eps=1e-6):
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last dimension (CPU backend)."""
    dx, dw = _desc(x, "rms_norm", "x"), _desc(weight, "rms_norm", "weight")
    y = np.empty_like(x)
    raw.rmsnorm_forward(dx, dw, _desc(y, "rms_norm", "y"), None, eps=eps)
    return y


def token_logprobs(logits, targets, loss_mask=None):
    """(logp, entropy) of targets[t] under logits[t, :], fp32; masked rows give 0 (CPU backend)."""
    dl, dt = _desc(logits, "token_logprobs", "logits"), _desc(targets, "token_logprobs", "targets")
    if loss_mask is None:
        if targets.ndim != 1:
            raise Error("samebits token_logprobs: argument 'targets': must be 1-D [T]")
        loss_mask = np.ones(targets.shape[0], np.uint8)
    rows = logits.shape[0] if logits.ndim else 0
    logp, entropy = np.empty(rows, np.float32), np.empty(rows, np.float32)
    raw.logprob_forward(dl, dt, _desc(loss_mask, "token_logprobs", "loss_mask"), _desc(logp, "token_logprobs", "logp"),
                        _desc(entropy, "token_logprobs", "entropy"), None)
    return logp, entropy


__all__ = ["Chain", "Completion", "Engine", "Error", "Model", "SamplingParams", "backends", "cuda_available", "linear", "raw", "rms_norm", "token_logprobs",
           "version"]
