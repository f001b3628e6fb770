"""samebits' ops on preallocated torch tensors, for the kernel benchmarks: each method is one call of
samebits._core.raw on the tensors' memory and torch's current stream (the descriptors are
samebits.torch's own, _desc), writing outputs the caller allocated. So a timed call runs samebits'
kernels alone: no allocation, no cast, no copy (samebits.torch's ops allocate their outputs).

    import timing, raw_ops
    sb = raw_ops.RawOps(timing.samebits_from(BUILD_DIR))
    sb.logprob_forward(logits, targets, mask, logp, entropy, lse)

Scalars the calls leave out keep the library's defaults (eps 1e-6, Qwen3's RoPE theta 1e6,
attention scale 1/sqrt(D), ignore_index -100).
"""
import torch

IGNORE = -100


class RawOps:
    def __init__(self, samebits):
        self.core = samebits._core
        self.raw = samebits._core.raw
        self._desc = samebits.torch._desc

    def d(self, t):
        """The descriptor of a contiguous tensor (None: an omitted argument)."""
        return self._desc(t, "bench", "tensor")

    def flat(self, t):
        """The descriptor of a tensor as one row [1, numel] (the elementwise ops' view)."""
        return self._desc(t.view(1, -1), "bench", "tensor")

    @staticmethod
    def stream():
        return torch.cuda.current_stream().cuda_stream

    # ------------------------------------------------------------ logprob, embedding, LM head
    def logprob_forward(self, logits, targets, mask, logp, entropy=None, lse=None):
        d = self.d
        self.raw.logprob_forward(d(logits), d(targets), d(mask), d(logp), d(entropy), d(lse), self.stream())

    def logprob_backward(self, logits, targets, mask, lse, dlogp, dentropy, dlogits):
        d = self.d
        self.raw.logprob_backward(d(logits), d(targets), d(mask), d(lse), d(dlogp), d(dentropy), d(dlogits),
                                  self.stream())

    def embedding_forward(self, ids, table, y):
        d = self.d
        self.raw.embedding_forward(d(ids), d(table), d(y), self.stream())

    def embedding_backward(self, ids, dy, mask, dtable):
        d = self.d
        self.raw.embedding_backward(d(ids), d(dy), d(mask), d(dtable), self.stream())

    def linear_forward(self, x, w, y):
        """y[M, N] = x[M, K]·w[N, K]ᵀ in y's dtype (the bare GEMM)."""
        d = self.d
        self.raw.linear_forward(d(x), d(w), None, d(y), self.stream())

    def lm_head_forward(self, hidden, weight, targets, mask, logp, entropy=None, lse=None, logits_kept=None):
        d = self.d
        self.raw.lm_head_logprob_forward(d(hidden), d(weight), d(targets), d(mask), d(logp), d(entropy), d(lse),
                                         logits_kept=d(logits_kept), ignore_index=IGNORE, stream=self.stream())

    def lm_head_backward(self, hidden, weight, targets, mask, lse, dlogp, dentropy, dhidden, dweight,
                         logits_kept=None, segments=None):
        d = self.d
        self.raw.lm_head_logprob_backward(d(hidden), d(weight), d(targets), d(mask), d(lse), d(dlogp), d(dentropy),
                                          d(dhidden), d(dweight), logits_kept=d(logits_kept), segments=d(segments),
                                          ignore_index=IGNORE, stream=self.stream())

    # ------------------------------------------------------------ norms, elementwise, RoPE
    def rmsnorm_forward(self, x, weight, y, rstd, residual=None, residual_out=None):
        d = self.d
        self.raw.rmsnorm_forward(d(x), d(weight), d(y), d(rstd), d(residual), d(residual_out), stream=self.stream())

    def rmsnorm_backward(self, dy, x, weight, rstd, dx, dweight):
        d = self.d
        self.raw.rmsnorm_backward(d(dy), d(x), d(weight), d(rstd), d(dx), d(dweight), stream=self.stream())

    def swiglu_forward(self, gate, up, y):
        f = self.flat
        self.raw.swiglu_forward(f(gate), f(up), f(y), self.stream())

    def swiglu_backward(self, dy, gate, up, dgate, dup):
        f = self.flat
        self.raw.swiglu_backward(f(dy), f(gate), f(up), f(dgate), f(dup), self.stream())

    def residual_add(self, a, b, y):
        f = self.flat
        self.raw.residual_add_forward(f(a), f(b), f(y), self.stream())

    def rope(self, x, positions, y, inverse=False):
        """RoPE of x [T, heads, D] into y (y's dtype may differ: the unfused backward writes fp32)."""
        d = self.d
        run = self.raw.rope_backward if inverse else self.raw.rope_forward
        run(d(x), d(positions), d(y), stream=self.stream())

    def qk_norm_forward(self, x, weight, rstd, y, positions=None):
        """QK-norm of x [T, heads, D], fused with RoPE when positions are given."""
        d = self.d
        self.raw.qk_norm_forward(d(x), d(weight), d(y), d(rstd), d(positions), stream=self.stream())

    def qk_norm_backward(self, dy, x, weight, rstd, dx, dweight, positions=None):
        d = self.d
        self.raw.qk_norm_backward(d(dy), d(x), d(weight), d(rstd), d(dx), d(dweight), d(positions),
                                  stream=self.stream())

    # ------------------------------------------------------------ A/B hooks
    def tuned(self, settings, f):
        """f with kernel-shape test hooks set around the call (shapes that change no bit;
        samebits._core._set_tuning), each put back to the library's own choice (0) after."""
        def g(i):
            for k, v in settings.items():
                self.core._set_tuning(k, v)
            try:
                f(i)
            finally:
                for k in settings:
                    self.core._set_tuning(k, 0)
        return g
