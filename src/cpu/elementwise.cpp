// CPU elementwise ops: SwiGLU (silu(gate)·up) and the residual add, forward and backward.
// No reductions: each output element is a function of the same-index inputs only.
#include "cpu/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits::cpu {
namespace {

template <class Acc>
Acc sigmoid(Acc g) { return Acc(1) / (Acc(1) + exp_acc(-g)); }

void swiglu_forward(const Context& ctx, const SwiGluForwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t n = a.gate.numel();
    auto g = load_all<Acc>(a.gate);
    const auto u = load_all<Acc>(a.up);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] * sigmoid(g[i]) * u[i];
    store(a.y, 0, n, g.data());
  });
}

void swiglu_backward(const Context& ctx, const SwiGluBackwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t n = a.gate.numel();
    const auto dy = load_all<Acc>(a.dy), g = load_all<Acc>(a.gate), u = load_all<Acc>(a.up);
    std::vector<Acc> dg(static_cast<size_t>(n)), du(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const Acc sig = sigmoid(g[i]);
      const Acc silu = g[i] * sig;
      du[i] = dy[i] * silu;
      dg[i] = dy[i] * u[i] * (sig * (Acc(1) + g[i] * (Acc(1) - sig)));
    }
    store(a.dgate, 0, n, dg.data());
    store(a.dup, 0, n, du.data());
  });
}

void residual_add_forward(const Context& ctx, const ResidualAddArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    auto x = load_all<Acc>(a.a);
    const auto y = load_all<Acc>(a.b);
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    store(a.y, 0, int64_t(x.size()), x.data());
  });
}

void residual_add_backward(const Context& ctx, const ResidualAddBackwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const auto dy = load_all<Acc>(a.dy);
    if (a.da.present()) store(a.da, 0, int64_t(dy.size()), dy.data());
    if (a.db.present()) store(a.db, 0, int64_t(dy.size()), dy.data());
  });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(swiglu_forward, Backend::cpu, SwiGluForwardArgs, swiglu_forward);
SAMEBITS_REGISTER_KERNEL(swiglu_backward, Backend::cpu, SwiGluBackwardArgs, swiglu_backward);
SAMEBITS_REGISTER_KERNEL(residual_add_forward, Backend::cpu, ResidualAddArgs, residual_add_forward);
SAMEBITS_REGISTER_KERNEL(residual_add_backward, Backend::cpu, ResidualAddBackwardArgs, residual_add_backward);

}  // namespace samebits::cpu
