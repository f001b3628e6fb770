// CUDA kernels of the linear family, registered on the CUDA backend. The shared checks ran in
// src/ops/linear.cpp; here only what the CUDA kernels add: 16-bit inputs, one dtype for x, weight
// and bias, and gradients that match the inputs' dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "cuda/common/convert.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "cuda/linear/gemm.cuh"
#include "ops/registry.hpp"
#include "ops/tuning.hpp"
#include "samebits/ops.hpp"
#include "samebits/validate.hpp"

namespace samebits::cuda {
namespace {

void require_16bit(const Validator& v, const char* name, const TensorView& t) {
  if (t.dtype != DType::bf16 && t.dtype != DType::f16)
    throw Unsupported(v.op(), name, std::string("the CUDA GEMM takes bf16 or fp16 inputs, got ") + dtype_name(t.dtype));
}

// TMA needs 16-byte aligned base addresses. With K % 8 == 0 every row of an aligned base is aligned,
// so a misaligned base is the caller's allocation, not a batch position: refuse it rather than take
// another numeric path.
void require_tma_alignment(const Validator& v, const char* name, const TensorView& t) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    v.fail(name, "the Hopper GEMM path needs 16-byte aligned data (K is a multiple of 8)");
}

void linear_forward(const Context& ctx, const LinearForwardArgs& a) {
  Validator v("linear_forward", ctx);
  require_16bit(v, "x", a.x);
  if (a.bias.present()) v.same_dtype("bias", a.bias, "x", a.x);
  with_16bit_storage(a.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t M = a.x.shape[0], K = a.x.shape[1], N = a.weight.shape[0];
    // The architecture picks the path; K % 8 (a property of the weight, never of M) keeps TMA's
    // 16-byte row strides.
    if (sm90_path_available() && K % 8 == 0) {
      require_tma_alignment(v, "x", a.x);
      require_tma_alignment(v, "weight", a.weight);
      gemm_sm90_forward<T>(a.x.as<const T>(), a.weight.as<const T>(),
                           a.bias.present() ? a.bias.as<const T>() : nullptr, a.y.data, a.y.dtype, M, N, K,
                           stream_of(ctx.stream), a.weight_settled);
      return;
    }
    GemmOperands<T> p{a.x.as<const T>(), a.weight.as<const T>(), a.bias.present() ? a.bias.as<const T>() : nullptr,
                      a.y.data, a.y.dtype, M, N, K, K, 1, K, 1, N, true, true};
    gemm_generic(p, stream_of(ctx.stream));
  });
}

// One launch for the parts where the Hopper path takes them all (K % 8 == 0, every y in x's dtype:
// the products kernel stores T); else each part alone. Both give every y its bits (the per-element
// K sequence is the tile's, whatever its width or neighbours). What the CUDA kernels require of a
// part is checked for every part first, under the part's name, so that no part is written when
// another is refused.
void linear_group_forward(const Context& ctx, const LinearGroupForwardArgs& a);  // this file's, below

// A group with a SwiGLU output: one launch where the Hopper kernel takes it (fused_swiglu_override,
// SAMEBITS_FUSED_SWIGLU), else the two parts into stream-ordered temporaries, then swiglu_forward.
void linear_swiglu_forward(const Context& ctx, const LinearGroupForwardArgs& a, const Validator& v) {
  const int64_t M = a.x.shape[0], N = a.parts[0].weight.shape[0], K = a.x.shape[1];
  const bool hopper = sm90_path_available() && K % 8 == 0;
  if (hopper) {
    require_tma_alignment(v, "x", a.x);
    require_tma_alignment(v, "parts[0].weight", a.parts[0].weight);
    require_tma_alignment(v, "parts[1].weight", a.parts[1].weight);
  }
  static const bool env_on = env_opt_in("SAMEBITS_FUSED_SWIGLU");
  const bool fused = hopper && hook_or_env(detail::fused_swiglu_override(), env_on);
  const cudaStream_t stream = stream_of(ctx.stream);
  if (fused) {
    bool ran = false;
    with_16bit_storage(a.x.dtype, [&](auto tag) {
      using T = decltype(tag);
      ran = gemm_sm90_forward_swiglu<T>(a.x.as<const T>(), a.parts[0].weight.as<const T>(),
                                         a.parts[1].weight.as<const T>(), a.swiglu.as<T>(), M, N, K, stream,
                                         a.weights_settled);
    });
    if (ran) {
      ++detail::fused_swiglu_launches();
      return;
    }
  }
  const size_t bytes = size_t(M * N) * dtype_size(a.x.dtype);
  const ScratchBuffer gate(bytes, stream, "linear_group_forward"), up(bytes, stream, "linear_group_forward");
  LinearGroupForwardArgs parts = a;
  parts.swiglu = {};
  parts.parts[0].y = TensorView::of(gate.as<void>(), a.x.dtype, {M, N}, Device::cuda);
  parts.parts[1].y = TensorView::of(up.as<void>(), a.x.dtype, {M, N}, Device::cuda);
  (linear_group_forward)(ctx, parts);
  swiglu_forward(ctx, {parts.parts[0].y, parts.parts[1].y, a.swiglu});
}

void linear_group_forward(const Context& ctx, const LinearGroupForwardArgs& a) {
  Validator v("linear_group_forward", ctx);
  require_16bit(v, "x", a.x);
  if (a.swiglu.present()) return linear_swiglu_forward(ctx, a, v);
  const bool hopper = sm90_path_available() && a.x.shape[1] % 8 == 0;
  if (hopper) require_tma_alignment(v, "x", a.x);
  bool one_launch = hopper && a.count > 1;
  for (int i = 0; i < a.count; ++i) {
    const LinearPart& p = a.parts[i];
    const std::string name = "parts[" + std::to_string(i) + "].";
    if (p.bias.present()) v.same_dtype((name + "bias").c_str(), p.bias, "x", a.x);
    if (hopper) require_tma_alignment(v, (name + "weight").c_str(), p.weight);
    one_launch = one_launch && p.y.dtype == a.x.dtype;
  }
  if (!one_launch) {
    for (int i = 0; i < a.count; ++i)  // this file's kernel (the parentheses keep ADL from the public op)
      (linear_forward)(ctx, LinearForwardArgs{a.x, a.parts[i].weight, a.parts[i].bias, a.parts[i].y, a.weights_settled});
    return;
  }
  with_16bit_storage(a.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* w[kMaxLinearProducts] = {};
    const T* bias[kMaxLinearProducts] = {};
    void* out[kMaxLinearProducts] = {};
    int64_t N[kMaxLinearProducts] = {};
    for (int i = 0; i < a.count; ++i) {
      w[i] = a.parts[i].weight.as<const T>();
      bias[i] = a.parts[i].bias.present() ? a.parts[i].bias.as<const T>() : nullptr;
      out[i] = a.parts[i].y.data;
      N[i] = a.parts[i].weight.shape[0];
    }
    gemm_sm90_forward_products<T>(a.x.as<const T>(), w, bias, out, N, a.count, a.x.shape[0], a.x.shape[1],
                                  stream_of(ctx.stream), a.weights_settled);
  });
}

void linear_backward_input(const Context& ctx, const LinearBackwardInputArgs& a) {
  Validator v("linear_backward_input", ctx);
  require_16bit(v, "dy", a.dy);
  v.same_dtype("weight", a.weight, "dy", a.dy);
  with_16bit_storage(a.dy.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t M = a.dy.shape[0], N = a.dy.shape[1], K = a.weight.shape[1];
    if (sm90_path_available() && K % 8 == 0 && N % 8 == 0) {
      require_tma_alignment(v, "dy", a.dy);
      require_tma_alignment(v, "weight", a.weight);
      gemm_sm90_input_grad<T>(a.dy.as<const T>(), a.weight.as<const T>(), a.dx.data, a.dx.dtype, M, N, K,
                              stream_of(ctx.stream));
      return;
    }
    // dx[m][k] = Σ_n dy[m][n]·w[n][k]: A = dy (reduction contiguous), B(k, n) = w[n*K + k].
    GemmOperands<T> p{a.dy.as<const T>(), a.weight.as<const T>(), nullptr, a.dx.data, a.dx.dtype,
                      M, K, N, N, 1, 1, K, K, true, false};
    gemm_generic(p, stream_of(ctx.stream));
  });
}

void linear_backward_weight(const Context& ctx, const LinearBackwardWeightArgs& a) {
  Validator v("linear_backward_weight", ctx);
  require_16bit(v, "dy", a.dy);
  v.same_dtype("x", a.x, "dy", a.dy);
  with_16bit_storage(a.dy.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t M = a.dy.shape[0], N = a.dy.shape[1], K = a.x.shape[1];
    if (sm90_path_available() && N % 8 == 0 && K % 8 == 0) {
      require_tma_alignment(v, "dy", a.dy);
      require_tma_alignment(v, "x", a.x);
      require_tma_alignment(v, "dweight", a.dweight);
      gemm_sm90_weight_grad<T>(a.dy.as<const T>(), a.x.as<const T>(),
                               a.row_mask.present() ? a.row_mask.as<const uint8_t>() : nullptr,
                               a.segments.present() ? a.segments.as<const int32_t>() : nullptr,
                               a.segments.present() ? a.segments.shape[0] : 0, a.dweight.as<float>(), M, N, K,
                               stream_of(ctx.stream));
      if (a.dbias.present())
        gemm_weight_grad_sequential<T>(a.dy.as<const T>(), a.x.as<const T>(),
                                       a.row_mask.present() ? a.row_mask.as<const uint8_t>() : nullptr, nullptr,
                                       a.dbias.as<float>(), M, N, 0, stream_of(ctx.stream));
      return;
    }
    gemm_weight_grad_sequential<T>(a.dy.as<const T>(), a.x.as<const T>(),
                                   a.row_mask.present() ? a.row_mask.as<const uint8_t>() : nullptr,
                                   a.dweight.as<float>(), a.dbias.present() ? a.dbias.as<float>() : nullptr,
                                   a.dy.shape[0], a.dy.shape[1], a.x.shape[1], stream_of(ctx.stream));
  });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(linear_forward, Backend::cuda, LinearForwardArgs, linear_forward);
SAMEBITS_REGISTER_KERNEL(linear_group_forward, Backend::cuda, LinearGroupForwardArgs, linear_group_forward);
SAMEBITS_REGISTER_KERNEL(linear_backward_input, Backend::cuda, LinearBackwardInputArgs, linear_backward_input);
SAMEBITS_REGISTER_KERNEL(linear_backward_weight, Backend::cuda, LinearBackwardWeightArgs, linear_backward_weight);

}  // namespace samebits::cuda
