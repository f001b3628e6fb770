// CPU linear (GEMM): y = x·wᵀ (+ bias), dx = dy·w, dw += dyᵀ·x.
// Output elements reduce over K (or N for dx) with dot_fixed: an order set by the reduced extent
// only. dweight / dbias reduce over tokens strictly in ascending row order from their existing
// value, skipping masked rows (design rule 6).
#include "cpu/common.hpp"
#include "ops/registry.hpp"
#include "samebits/host_tensor.hpp"
#include "samebits/ops.hpp"

namespace samebits::cpu {
namespace {

// Parallel over weight rows: each weight row is converted once, where it is used, so a large
// weight (an LM head) is never copied whole.
void linear_forward(const Context& ctx, const LinearForwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t M = a.x.shape[0], K = a.x.shape[1], N = a.weight.shape[0];
    const auto x = load_all<Acc>(a.x);
    std::vector<Acc> bias(static_cast<size_t>(N), Acc(0));
    if (a.bias.present()) load(a.bias, 0, N, bias.data());
#pragma omp parallel
    {
      std::vector<Acc> w(static_cast<size_t>(K));
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        load(a.weight, n * K, K, w.data());
        for (int64_t m = 0; m < M; ++m) {
          Acc y = dot_fixed(&x[m * K], w.data(), K);
          if (a.bias.present()) y += bias[n];
          store(a.y, m * N + n, 1, &y);
        }
      }
    }
  });
}

// The CPU runs a group's parts one after the other, each through this file's kernel (the
// parentheses keep argument-dependent lookup from finding the public op); a swiglu output is the
// public swiglu_forward of the two parts' outputs, made in temporaries.
void linear_group_forward(const Context& ctx, const LinearGroupForwardArgs& a) {
  if (a.swiglu.present()) {
    const int64_t M = a.x.shape[0], N = a.parts[0].weight.shape[0];
    HostTensor gate(a.swiglu.dtype, {M, N}), up(a.swiglu.dtype, {M, N});
    (linear_forward)(ctx, LinearForwardArgs{a.x, a.parts[0].weight, {}, gate.view()});
    (linear_forward)(ctx, LinearForwardArgs{a.x, a.parts[1].weight, {}, up.view()});
    swiglu_forward(ctx, {gate.view(), up.view(), a.swiglu});
    return;
  }
  for (int i = 0; i < a.count; ++i)
    (linear_forward)(ctx, LinearForwardArgs{a.x, a.parts[i].weight, a.parts[i].bias, a.parts[i].y});
}

void linear_backward_input(const Context& ctx, const LinearBackwardInputArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t M = a.dy.shape[0], N = a.dy.shape[1], K = a.weight.shape[1];
    const auto dy = load_all<Acc>(a.dy);
    const auto wt = transposed(load_all<Acc>(a.weight), N, K);  // [K, N]
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      std::vector<Acc> row(static_cast<size_t>(K));
      for (int64_t k = 0; k < K; ++k) row[k] = dot_fixed(&dy[m * N], &wt[k * N], N);
      store(a.dx, m * K, K, row.data());
    }
  });
}

void linear_backward_weight(const Context& ctx, const LinearBackwardWeightArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t M = a.dy.shape[0], N = a.dy.shape[1], K = a.x.shape[1];
    const auto dy = load_all<Acc>(a.dy), x = load_all<Acc>(a.x);
    auto* dw = a.dweight.as<Acc>();  // validated: fp32 (fixed) or fp64 (truth) == Acc
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      Acc* row = dw + n * K;
      for (int64_t m = 0; m < M; ++m) {
        if (!row_active(a.row_mask, m)) continue;
        const Acc g = dy[m * N + n];
        for (int64_t k = 0; k < K; ++k) row[k] += g * x[m * K + k];
      }
    }
    if (a.dbias.present()) {
      auto* db = a.dbias.as<Acc>();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t m = 0; m < M; ++m)
          if (row_active(a.row_mask, m)) db[n] += dy[m * N + n];
    }
  });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(linear_forward, Backend::cpu, LinearForwardArgs, linear_forward);
SAMEBITS_REGISTER_KERNEL(linear_group_forward, Backend::cpu, LinearGroupForwardArgs, linear_group_forward);
SAMEBITS_REGISTER_KERNEL(linear_backward_input, Backend::cpu, LinearBackwardInputArgs, linear_backward_input);
SAMEBITS_REGISTER_KERNEL(linear_backward_weight, Backend::cpu, LinearBackwardWeightArgs, linear_backward_weight);

}  // namespace samebits::cpu
