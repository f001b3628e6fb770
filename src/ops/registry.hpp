// The backend boundary. Each public op validates its arguments (src/ops/<family>.cpp), then calls
// the kernel a backend registered for it. A backend family registers its kernels from its own
// folder with SAMEBITS_REGISTER_KERNEL, so adding one (say src/cuda/linear/) touches nothing else.
// An op with no kernel on the requested backend throws samebits::NotBuilt.
#pragma once
#include "samebits/context.hpp"
#include "samebits/error.hpp"

namespace samebits::detail {

enum class OpId : int {
  linear_forward, linear_group_forward, linear_backward_input, linear_backward_weight,
  rmsnorm_forward, rmsnorm_backward, qk_norm_forward, qk_norm_pair_forward, qk_norm_backward,
  rope_forward, rope_backward,
  swiglu_forward, swiglu_backward, residual_add_forward, residual_add_backward,
  embedding_forward, embedding_backward,
  attention_forward, attention_backward,
  logprob_forward, logprob_backward, lm_head_logprob_forward, lm_head_logprob_backward,
  sample_tokens,
};

template <OpId Id, class Args>
struct KernelSlot {
  using Fn = void (*)(const Context&, const Args&);
  static Fn& at(Backend b) {
    static Fn table[kNumBackends] = {};
    return table[static_cast<int>(b)];
  }
};

// A backend's errors found after an earlier call returned (the CUDA backend's deferred id checks):
// raised when the next op is entered (raise_deferred_errors), never inside an op — a composite op
// calls public ops itself, and a half-written output must not be left by another call's error.
using DeferredErrorsFn = void (*)(bool wait);
DeferredErrorsFn& deferred_errors_of(Backend b);

// How deep this thread is in op calls (1 inside an op's kernel, 2 inside an op it calls, …).
inline thread_local int op_depth = 0;

template <OpId Id, class Args>
void run_kernel(const char* op, const Context& ctx, const Args& args) {
  auto fn = KernelSlot<Id, Args>::at(ctx.backend);
  if (!fn) throw NotBuilt(op, backend_name(ctx.backend));
  if (op_depth == 0)
    if (auto raise = deferred_errors_of(ctx.backend)) raise(false);
  struct Depth {
    Depth() { ++op_depth; }
    ~Depth() { --op_depth; }
  } depth;
  fn(ctx, args);
}

}  // namespace samebits::detail

#define SAMEBITS_CAT_(a, b) a##b
#define SAMEBITS_CAT(a, b) SAMEBITS_CAT_(a, b)
#define SAMEBITS_REGISTER_KERNEL(ID, BACKEND, ARGS, FN)                                        \
  static const bool SAMEBITS_CAT(samebits_registered_, __LINE__) = [] {                       \
    ::samebits::detail::KernelSlot<::samebits::detail::OpId::ID, ARGS>::at(BACKEND) = FN;    \
    return true;                                                                             \
  }()
