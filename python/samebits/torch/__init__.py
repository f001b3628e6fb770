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
are checked by the library, whose errors arrive as samebits.Error (a ValueError). Ids and targets in
GPU memory are range-checked without waiting for the GPU (the C++ dispatcher ops, in eager mode): a bad
one makes that call's row NaN and is raised on entering a later samebits op, once its check has run,
or by check_ids().

Ops: linear, rms_norm, add_rms_norm (fused residual add), token_logprobs, attention (packed causal GQA), swiglu, embedding, rope,
qk_norm (+ fused RoPE), lm_head_logprobs (the fused LM head → selected logprob) — each forward and
backward. enable() routes a model's own torch code to them (aten mm / addmm /
_log_softmax at the dispatcher; scaled_dot_product_attention, rms_norm and per-row mean / sum at the
Python level); its table of what is and is not covered is in docs/python.md.
"""
from ._common import Error, _desc, _int32, _stream, raw  # noqa: F401 (the descriptors: benchmarks, samebits.hf)
from .enable import enable
from .ops import (add_rms_norm, attention, embedding, linear, lm_head_logprobs, qk_norm, rms_norm, rope, swiglu,
                  token_logprobs)

__all__ = ["Error", "add_rms_norm", "attention", "check_ids", "embedding", "enable", "linear", "lm_head_logprobs",
           "qk_norm", "rms_norm", "rope", "swiglu", "token_logprobs"]


def check_ids(wait=True):
    """Raises the samebits.Error of an earlier call whose ids / targets in GPU memory were out of range.

    samebits.torch's C++ dispatcher ops (eager mode) check such ids on the GPU without waiting (as a
    torch op never waits on the GPU): the bad call's row comes out NaN and the error is raised on
    entering a later samebits op, once that check and every one queued before it have run. This
    raises it now: wait=True first waits for the work of every device a queued check runs on, so
    every check queued before has reported (wait=False: only those already heard). One error a call.
    """
    from .._core import raise_deferred_errors
    raise_deferred_errors(wait)
