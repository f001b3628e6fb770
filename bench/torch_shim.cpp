// A C entry point for the Python benchmarks (bench/bench_logprob.py): they pass torch tensors'
// device pointers through ctypes and time samebits beside torch in one process. Not the Python
// package (that is pybind11, issue 9); each function returns 0, or 1 with the error in `err`.
#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

#include <memory>
#include <optional>

#include "ops/tuning.hpp"
#include "samebits/chain.hpp"
#include "samebits/device.hpp"
#include "samebits/ops.hpp"

using namespace samebits;

namespace {

TensorView cuda_view(void* p, DType d, std::initializer_list<int64_t> shape) {
  return p ? TensorView::of(p, d, shape, Device::cuda) : TensorView{};
}

Context ctx_on(void* stream) {
  Context c;
  c.backend = Backend::cuda;
  c.stream = stream;
  return c;
}

template <class F>
int guarded(char* err, int err_len, F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    if (err && err_len > 0) {
      std::strncpy(err, e.what(), size_t(err_len) - 1);
      err[err_len - 1] = 0;
    }
    return 1;
  }
}

}  // namespace

extern "C" {

// dtype codes: DType's enumerator values (samebits/dtype.hpp).
int sb_logprob_forward(void* logits, int dtype, int64_t T, int64_t V, void* targets, void* mask, int32_t ignore,
                       void* logp, void* entropy, void* lse, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    LogprobForwardArgs a;
    a.logits = cuda_view(logits, DType(dtype), {T, V});
    a.targets = cuda_view(targets, DType::i32, {T});
    a.loss_mask = cuda_view(mask, DType::u8, {T});
    a.logp = cuda_view(logp, DType::f32, {T});
    a.entropy = cuda_view(entropy, DType::f32, {T});
    a.lse = cuda_view(lse, DType::f32, {T});
    a.ignore_index = ignore;
    logprob_forward(ctx_on(stream), a);
  });
}

int sb_logprob_backward(void* logits, int dtype, int64_t T, int64_t V, void* targets, void* mask, int32_t ignore,
                        void* lse, void* dlogp, void* dentropy, void* dlogits, int dlogits_dtype, void* stream, char* err,
                        int err_len) {
  return guarded(err, err_len, [&] {
    LogprobBackwardArgs a;
    a.logits = cuda_view(logits, DType(dtype), {T, V});
    a.targets = cuda_view(targets, DType::i32, {T});
    a.loss_mask = cuda_view(mask, DType::u8, {T});
    a.lse = cuda_view(lse, DType::f32, {T});
    a.dlogp = cuda_view(dlogp, DType::f32, {T});
    a.dentropy = cuda_view(dentropy, DType::f32, {T});
    a.dlogits = cuda_view(dlogits, DType(dlogits_dtype), {T, V});
    a.ignore_index = ignore;
    logprob_backward(ctx_on(stream), a);
  });
}

int sb_embedding_forward(void* ids, int64_t T, void* table, int dtype, int64_t V, int64_t H, void* y, void* stream,
                         char* err, int err_len) {
  return guarded(err, err_len, [&] {
    embedding_forward(ctx_on(stream), {cuda_view(ids, DType::i32, {T}), cuda_view(table, DType(dtype), {V, H}),
                                       cuda_view(y, DType(dtype), {T, H})});
  });
}

int sb_embedding_backward(void* ids, int64_t T, void* dy, int dtype, void* mask, void* dtable, int64_t V, int64_t H,
                          void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    embedding_backward(ctx_on(stream), {cuda_view(ids, DType::i32, {T}), cuda_view(dy, DType(dtype), {T, H}),
                                        cuda_view(mask, DType::u8, {T}), cuda_view(dtable, DType::f32, {V, H})});
  });
}

// y[M,N] = x[M,K]·w[N,K]ᵀ in y_dtype (the bare LM-head GEMM the fused op is compared with).
int sb_linear_forward(void* x, int dtype, int64_t M, int64_t K, void* w, int64_t N, void* y, int y_dtype, void* stream,
                      char* err, int err_len) {
  return guarded(err, err_len, [&] {
    linear_forward(ctx_on(stream), {cuda_view(x, DType(dtype), {M, K}), cuda_view(w, DType(dtype), {N, K}), {},
                                    cuda_view(y, DType(y_dtype), {M, N})});
  });
}

int sb_lm_head_forward(void* hidden, int dtype, int64_t T, int64_t K, void* weight, int64_t V, void* targets,
                       void* mask, int32_t ignore, void* logp, void* entropy, void* lse, void* stream, char* err,
                       int err_len) {
  return guarded(err, err_len, [&] {
    LmHeadLogprobForwardArgs a;
    a.hidden = cuda_view(hidden, DType(dtype), {T, K});
    a.weight = cuda_view(weight, DType(dtype), {V, K});
    a.targets = cuda_view(targets, DType::i32, {T});
    a.loss_mask = cuda_view(mask, DType::u8, {T});
    a.logp = cuda_view(logp, DType::f32, {T});
    a.entropy = cuda_view(entropy, DType::f32, {T});
    a.lse = cuda_view(lse, DType::f32, {T});
    a.ignore_index = ignore;
    lm_head_logprob_forward(ctx_on(stream), a);
  });
}

int sb_lm_head_backward(void* hidden, int dtype, int64_t T, int64_t K, void* weight, int64_t V, void* targets,
                        void* mask, int32_t ignore, void* lse, void* dlogp, void* dentropy, void* dhidden,
                        void* dweight, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    LmHeadLogprobBackwardArgs a;
    a.hidden = cuda_view(hidden, DType(dtype), {T, K});
    a.weight = cuda_view(weight, DType(dtype), {V, K});
    a.targets = cuda_view(targets, DType::i32, {T});
    a.loss_mask = cuda_view(mask, DType::u8, {T});
    a.lse = cuda_view(lse, DType::f32, {T});
    a.dlogp = cuda_view(dlogp, DType::f32, {T});
    a.dentropy = cuda_view(dentropy, DType::f32, {T});
    a.dhidden = cuda_view(dhidden, DType(dtype), {T, K});
    a.dweight = cuda_view(dweight, DType::f32, {V, K});
    a.ignore_index = ignore;
    lm_head_logprob_backward(ctx_on(stream), a);
  });
}

// RMSNorm: x, residual (optional), y, residual_out (optional) [T, H] of dtype; weight [H] of w_dtype.
int sb_rmsnorm_forward(void* x, void* residual, int dtype, int64_t T, int64_t H, void* weight, int w_dtype, void* y,
                       void* residual_out, void* rstd, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    RmsNormForwardArgs a;
    a.x = cuda_view(x, DType(dtype), {T, H});
    a.residual = cuda_view(residual, DType(dtype), {T, H});
    a.weight = cuda_view(weight, DType(w_dtype), {H});
    a.y = cuda_view(y, DType(dtype), {T, H});
    a.residual_out = cuda_view(residual_out, DType(dtype), {T, H});
    a.rstd = cuda_view(rstd, DType::f32, {T});
    rmsnorm_forward(ctx_on(stream), a);
  });
}

int sb_rmsnorm_backward(void* dy, void* x, int dtype, int64_t T, int64_t H, void* weight, int w_dtype, void* rstd,
                        void* dx, void* dweight, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    RmsNormBackwardArgs a;
    a.dy = cuda_view(dy, DType(dtype), {T, H});
    a.x = cuda_view(x, DType(dtype), {T, H});
    a.weight = cuda_view(weight, DType(w_dtype), {H});
    a.rstd = cuda_view(rstd, DType::f32, {T});
    a.dx = cuda_view(dx, DType(dtype), {T, H});
    a.dweight = cuda_view(dweight, DType::f32, {H});
    rmsnorm_backward(ctx_on(stream), a);
  });
}

// SwiGLU (backward when dy is given: dgate, dup) and the residual add, n elements of dtype.
int sb_swiglu(void* gate, void* up, int dtype, int64_t n, void* y, void* dy, void* dgate, void* dup, void* stream,
              char* err, int err_len) {
  return guarded(err, err_len, [&] {
    if (dy) {
      SwiGluBackwardArgs a;
      a.dy = cuda_view(dy, DType(dtype), {1, n});
      a.gate = cuda_view(gate, DType(dtype), {1, n});
      a.up = cuda_view(up, DType(dtype), {1, n});
      a.dgate = cuda_view(dgate, DType(dtype), {1, n});
      a.dup = cuda_view(dup, DType(dtype), {1, n});
      swiglu_backward(ctx_on(stream), a);
    } else {
      SwiGluForwardArgs a;
      a.gate = cuda_view(gate, DType(dtype), {1, n});
      a.up = cuda_view(up, DType(dtype), {1, n});
      a.y = cuda_view(y, DType(dtype), {1, n});
      swiglu_forward(ctx_on(stream), a);
    }
  });
}

int sb_residual_add(void* a_, void* b_, int dtype, int64_t n, void* y, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    ResidualAddArgs a;
    a.a = cuda_view(a_, DType(dtype), {1, n});
    a.b = cuda_view(b_, DType(dtype), {1, n});
    a.y = cuda_view(y, DType(dtype), {1, n});
    residual_add_forward(ctx_on(stream), a);
  });
}

// RoPE (Qwen3's theta) from x [T, heads, D] of dtype to y of y_dtype (in place when y == x; the
// unfused QK-norm + RoPE backward writes fp32).
int sb_rope_to(void* x, int dtype, int64_t T, int64_t heads, int64_t D, void* positions, void* y, int y_dtype,
               int inverse, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    RopeArgs a;
    a.x = cuda_view(x, DType(dtype), {T, heads, D});
    a.positions = cuda_view(positions, DType::i32, {T});
    a.y = cuda_view(y, DType(y_dtype), {T, heads, D});
    if (inverse) rope_backward(ctx_on(stream), a);
    else rope_forward(ctx_on(stream), a);
  });
}

int sb_rope(void* x, int dtype, int64_t T, int64_t heads, int64_t D, void* positions, void* y, int inverse, void* stream,
            char* err, int err_len) {
  return sb_rope_to(x, dtype, T, heads, D, positions, y, dtype, inverse, stream, err, err_len);
}

// QK-norm of x [T, heads, D] (bf16 weight [D], fp32 rstd [T, heads]), fused with RoPE (Qwen3's theta)
// when positions is given.
int sb_qk_norm_forward(void* x, int dtype, int64_t T, int64_t heads, int64_t D, void* weight, void* rstd, void* y,
                       void* positions, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    QkNormForwardArgs a;
    a.x = cuda_view(x, DType(dtype), {T, heads, D});
    a.weight = cuda_view(weight, DType(dtype), {D});
    a.rstd = cuda_view(rstd, DType::f32, {T, heads});
    a.y = cuda_view(y, DType(dtype), {T, heads, D});
    if (positions) a.positions = cuda_view(positions, DType::i32, {T});
    qk_norm_forward(ctx_on(stream), a);
  });
}

// Its backward (dy: fp32 when it is an unfused rope_backward's output, `dy_dtype`).
int sb_qk_norm_backward(void* dy, int dy_dtype, void* x, int dtype, int64_t T, int64_t heads, int64_t D, void* weight,
                        void* rstd, void* dx, void* dweight, void* positions, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    QkNormBackwardArgs a;
    a.dy = cuda_view(dy, DType(dy_dtype), {T, heads, D});
    a.x = cuda_view(x, DType(dtype), {T, heads, D});
    a.weight = cuda_view(weight, DType(dtype), {D});
    a.rstd = cuda_view(rstd, DType::f32, {T, heads});
    a.dx = cuda_view(dx, DType(dtype), {T, heads, D});
    a.dweight = cuda_view(dweight, DType::f32, {D});
    if (positions) a.positions = cuda_view(positions, DType::i32, {T});
    qk_norm_backward(ctx_on(stream), a);
  });
}

// The tensors attention's forward and backward share: q [Tq, Hq, D], k / v [Tk, Hkv, D], out like q,
// lse [Tq, Hq] fp32, and the host sequence table seqs int32 [B, 4] {q_row, q_len, k_row, k_len}.
}  // extern "C"
template <class Args>
void attention_views(Args& a, void* q, void* k, void* v, void* out, void* lse, int dtype, int64_t Tq, int64_t Tk,
                     int64_t Hq, int64_t Hkv, int64_t D, const int32_t* seqs, int64_t B) {
  a.q = cuda_view(q, DType(dtype), {Tq, Hq, D});
  a.k = cuda_view(k, DType(dtype), {Tk, Hkv, D});
  a.v = cuda_view(v, DType(dtype), {Tk, Hkv, D});
  a.seqs = TensorView::of(const_cast<int32_t*>(seqs), DType::i32, {B, 4});
  a.out = cuda_view(out, DType(dtype), {Tq, Hq, D});
  a.lse = cuda_view(lse, DType::f32, {Tq, Hq});
}
extern "C" {

// Causal attention forward (prefill, decode, ...: the sequence table says which).
// With block_table (host int32 [B, cols]) k / v are a pool of pages of page_size rows.
int sb_attention_forward(void* q, void* k, void* v, int dtype, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                         int64_t D, const int32_t* seqs, int64_t B, const int32_t* block_table, int64_t cols,
                         int64_t page_size, void* out, void* lse, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    AttentionForwardArgs a;
    attention_views(a, q, k, v, out, lse, dtype, Tq, Tk, Hq, Hkv, D, seqs, B);
    if (block_table) {
      a.block_table = TensorView::of(const_cast<int32_t*>(block_table), DType::i32, {B, cols});
      a.page_size = page_size;
    }
    attention_forward(ctx_on(stream), a);
  });
}

// Causal attention backward: out / lse from the forward, dout like q; dq like q, dk / dv like k, in
// q's dtype.
int sb_attention_backward(void* q, void* k, void* v, void* out, void* lse, void* dout, void* dq, void* dk, void* dv,
                          int dtype, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D, const int32_t* seqs,
                          int64_t B, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    AttentionBackwardArgs a;
    attention_views(a, q, k, v, out, lse, dtype, Tq, Tk, Hq, Hkv, D, seqs, B);
    a.dout = cuda_view(dout, DType(dtype), {Tq, Hq, D});
    a.dq = cuda_view(dq, DType(dtype), {Tq, Hq, D});
    a.dk = cuda_view(dk, DType(dtype), {Tk, Hkv, D});
    a.dv = cuda_view(dv, DType(dtype), {Tk, Hkv, D});
    attention_backward(ctx_on(stream), a);
  });
}

// A kernel-shape test hook (ops/tuning.hpp) for A/B timing: "norm_any_dtype" (0: the bf16 instance
// where it applies, 1: the run-time-dtype instance).
int sb_set_tuning(const char* name, int value) {
  if (std::strcmp(name, "norm_any_dtype") == 0) {
    detail::norm_any_dtype_path_override() = value != 0;
    return 0;
  }
  return 1;
}

// The model chain on the CUDA backend, for the end-to-end benchmark (bench/bench_chain.py): a model
// directory loaded once, packed batches scored (forward) or scored and differentiated (forward +
// backward into fp32 accumulators kept by the handle), and steps against a KV cache.
struct SbChain {
  Model model;
  std::optional<Chain> chain;
  std::optional<ModelGrads> grads;
  std::optional<KvCache> cache;
};

void* sb_chain_load(const char* dir, char* err, int err_len) {
  SbChain* h = nullptr;
  guarded(err, err_len, [&] {
    auto owned = std::make_unique<SbChain>();
    owned->model = Model::load(dir);
    Context ctx;
    ctx.backend = Backend::cuda;
    owned->chain.emplace(owned->model, ctx);
    h = owned.release();
  });
  return h;
}

void sb_chain_free(void* h) { delete static_cast<SbChain*>(h); }

namespace {
// Sequences of lens[i] tokens packed back to back; every token but a sequence's last scored.
ChainBatch packed_batch(const int32_t* tokens, const int64_t* lens, int64_t S) {
  std::vector<std::vector<int32_t>> seqs;
  int64_t at = 0;
  for (int64_t i = 0; i < S; ++i) {
    seqs.emplace_back(tokens + at, tokens + at + lens[i]);
    at += lens[i];
  }
  return ChainBatch::packed(seqs);
}
}  // namespace

// Forward of a packed batch; logp (host, one per token, 0 where not scored) when not null.
int sb_chain_forward(void* h, const int32_t* tokens, const int64_t* lens, int64_t S, double* logp, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    auto* c = static_cast<SbChain*>(h);
    const ChainBatch b = packed_batch(tokens, lens, S);
    const ChainForward f = c->chain->forward(b);
    if (logp) std::copy(f.logp.begin(), f.logp.end(), logp);
  });
}

// Forward + backward of L = Σ logp over the scored tokens; the weight gradients add into the
// handle's fp32 accumulators (zeroed when `reset`).
int sb_chain_forward_backward(void* h, const int32_t* tokens, const int64_t* lens, int64_t S, int reset, char* err,
                              int err_len) {
  return guarded(err, err_len, [&] {
    auto* c = static_cast<SbChain*>(h);
    if (reset || !c->grads) c->grads.emplace(c->model, DType::f32, Backend::cuda);
    const ChainBatch b = packed_batch(tokens, lens, S);
    std::vector<double> dlogp(b.loss_mask.begin(), b.loss_mask.end());
    c->chain->backward(b, c->chain->forward(b), dlogp, *c->grads);
  });
}

// Frees the handle's gradient accumulators (the next forward_backward makes new ones).
void sb_chain_drop_grads(void* h) { static_cast<SbChain*>(h)->grads.reset(); }

// A KV cache of `slots` sequences of up to `capacity` tokens (replaces the handle's cache).
int sb_chain_cache(void* h, int64_t slots, int64_t capacity, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    auto* c = static_cast<SbChain*>(h);
    c->cache.reset();
    c->cache.emplace(c->model.config(), slots, capacity, c->model.config().dtype, Backend::cuda);
  });
}

// One step against the cache: sequence i (slot i) appends lens[i] tokens at positions
// cached[i] … (its slot must hold cached[i] tokens). Prefill, chunked prefill and decode alike.
int sb_chain_step(void* h, const int32_t* tokens, const int64_t* lens, const int64_t* cached, int64_t S, char* err,
                  int err_len) {
  return guarded(err, err_len, [&] {
    auto* c = static_cast<SbChain*>(h);
    ChainBatch b;
    int64_t at = 0;
    for (int64_t i = 0; i < S; ++i) {
      b.seqs.push_back({b.rows(), lens[i], i, cached[i]});
      for (int64_t t = 0; t < lens[i]; ++t) {
        b.tokens.push_back(tokens[at + t]);
        b.positions.push_back(int32_t(cached[i] + t));
        b.targets.push_back(t + 1 < lens[i] ? tokens[at + t + 1] : -100);
        b.loss_mask.push_back(t + 1 < lens[i] ? 1 : 0);
      }
      at += lens[i];
    }
    c->chain->forward_cached(b, *c->cache);
  });
}

// samebits' device memory in use now, and its high-water mark since the last reset (then reset
// when asked), in bytes.
int64_t sb_memory_in_use() { return int64_t(device_memory_in_use(Backend::cuda)); }
int64_t sb_memory_peak(int reset) { return int64_t(device_memory_peak(Backend::cuda, reset != 0)); }
// Hands samebits' unused pooled memory back to the device (before a torch phase of a benchmark).
int sb_memory_release(char* err, int err_len) {
  return guarded(err, err_len, [] { device_memory_release(Backend::cuda); });
}

int sb_dtype_code(const char* name) {
  for (DType d : {DType::bf16, DType::f16, DType::f32})
    if (std::strcmp(dtype_name(d), name) == 0) return int(d);
  return -1;
}

}  // extern "C"
