"""samebits: batch-invariant transformer forward and backward, from Python.

The C++ library does the work (samebits._core); a sequence's logprobs and a batch's gradients are
the same bits whatever else shares the call, the micro-batch split or the backend's scheduling.

    import samebits
    chain = samebits.Chain(samebits.Model.load("path/to/hf-model"))      # or Model.builtin()
    logp = chain.logprobs([[1, 2, 3], [4, 5]])                            # per sequence, entry 0 NaN
    grads = chain.gradients([[1, 2, 3], [4, 5]], micro_batch=1)          # {weight: fp32 gradient}
"""
from ._core import (Chain, Error, Model, backends, cuda_available, linear, rms_norm,  # noqa: F401
                    token_logprobs, version)

__all__ = ["Chain", "Error", "Model", "backends", "cuda_available", "linear", "rms_norm", "token_logprobs",
           "version"]
