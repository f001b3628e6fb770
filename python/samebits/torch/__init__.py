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
from ._common import Error, _desc, _int32, _stream, raw  # noqa: F401 (the descriptors: benchmarks, samebits.hf)
from .enable import enable
from .ops import (add_rms_norm, attention, embedding, linear, lm_head_logprobs, qk_norm, rms_norm, rope, swiglu,
                  token_logprobs)

__all__ = ["Error", "add_rms_norm", "attention", "embedding", "enable", "linear", "lm_head_logprobs", "qk_norm",
           "rms_norm", "rope", "swiglu", "token_logprobs"]
