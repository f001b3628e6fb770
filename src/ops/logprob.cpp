// Selected-logprob and fused LM-head -> logprob entry points.
#include "ops/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits {
using namespace detail;

// The vocab reduction block: a function of the vocab size only (design rule 1). 2048 columns keep
// a block's logits in L1/shared memory; one block when the vocab is smaller.
int64_t logprob_vocab_block(int64_t vocab) { return vocab < 2048 ? (vocab < 1 ? 1 : vocab) : 2048; }

static void check_targets(const Validator& v, const TensorView& targets, const TensorView& mask,
                          int64_t rows, int64_t vocab, int32_t ignore_index) {
  v.required("targets", targets, 1);
  v.dtype("targets", targets, DType::i32);
  v.dim("targets", targets, 0, rows, "one target per token");
  v.optional("loss_mask", mask, 1);
  if (mask.present()) {
    v.dtype("loss_mask", mask, DType::u8);
    v.dim("loss_mask", mask, 0, rows, "one per token");
    v.flags("loss_mask", mask);
  }
  v.int_range("targets", targets, 0, vocab, mask, true, ignore_index);
}

static void check_per_token(const Validator& v, const char* name, const TensorView& t, int64_t rows,
                            bool required) {
  if (required) v.required(name, t, 1); else v.optional(name, t, 1);
  if (t.is_none()) return;
  v.accumulator(name, t);
  v.dim(name, t, 0, rows, "one per token");
}

void logprob_forward(const Context& ctx, const LogprobForwardArgs& a) {
  auto v = begin_op<OpId::logprob_forward>("logprob_forward", ctx, a);
  check_float_input(v, "logits", a.logits, 2);
  check_targets(v, a.targets, a.loss_mask, a.logits.shape[0], a.logits.shape[1], a.ignore_index);
  check_per_token(v, "logp", a.logp, a.logits.shape[0], true);
  check_per_token(v, "entropy", a.entropy, a.logits.shape[0], false);
  check_per_token(v, "lse", a.lse, a.logits.shape[0], false);
  run_kernel<OpId::logprob_forward>("logprob_forward", ctx, a);
}

void logprob_backward(const Context& ctx, const LogprobBackwardArgs& a) {
  auto v = begin_op<OpId::logprob_backward>("logprob_backward", ctx, a);
  check_float_input(v, "logits", a.logits, 2);
  const int64_t rows = a.logits.shape[0];
  check_targets(v, a.targets, a.loss_mask, rows, a.logits.shape[1], a.ignore_index);
  check_per_token(v, "lse", a.lse, rows, false);
  check_per_token(v, "dlogp", a.dlogp, rows, true);
  check_per_token(v, "dentropy", a.dentropy, rows, false);
  v.finite("dlogp", a.dlogp);
  v.finite("dentropy", a.dentropy);
  v.required("dlogits", a.dlogits, 2);
  v.floating("dlogits", a.dlogits);
  v.same_shape("dlogits", a.dlogits, "logits", a.logits);
  v.no_alias("dlogits", a.dlogits, "logits", a.logits);
  run_kernel<OpId::logprob_backward>("logprob_backward", ctx, a);
}

static void check_lm_head(const Validator& v, const TensorView& hidden, const TensorView& weight) {
  check_float_input(v, "hidden", hidden, 2);
  check_float_input(v, "weight", weight, 2);
  v.same_dtype("weight", weight, "hidden", hidden);
  v.dim("weight", weight, 1, hidden.shape[1], "hidden size, as hidden's columns");
}

// logits_kept: fp32 [C, V] with C <= T, apart from the inputs; in the backward (segments given, or
// none: a pointer to an absent view), C at a segment's edge.
static void check_logits_kept(const Validator& v, const TensorView& kept, const TensorView& hidden,
                              const TensorView& weight, const TensorView* backward_segments,
                              std::initializer_list<std::pair<const char*, const TensorView*>> outputs) {
  v.optional("logits_kept", kept, 2);
  if (!kept.present()) return;
  v.dtype("logits_kept", kept, DType::f32);
  v.dim("logits_kept", kept, 1, weight.shape[0], "vocab size, as weight's rows");
  const int64_t C = kept.shape[0], T = hidden.shape[0];
  if (C > T) v.fail("logits_kept", "holds " + std::to_string(C) + " rows, more than hidden's " + std::to_string(T));
  v.no_alias("logits_kept", kept, "hidden", hidden);
  v.no_alias("logits_kept", kept, "weight", weight);
  for (const auto& [name, out] : outputs) v.no_alias("logits_kept", kept, name, *out);
  if (!backward_segments || C == 0 || C == T) return;
  const TensorView& segments = *backward_segments;
  bool edge = false;
  if (segments.present()) {
    const auto* s = segments.as<const int32_t>();
    for (int64_t i = 0; i < segments.shape[0] && !edge; ++i) edge = s[2 * i] == C || s[2 * i] + s[2 * i + 1] == C;
  }
  if (!edge)
    v.fail("logits_kept", "its " + std::to_string(C) + " rows must end where a segment starts or ends (or be 0 or all " +
                              std::to_string(T) + " rows), so the weight gradient groups the tokens as without it");
}

#if SAMEBITS_WITH_CUDA
namespace cuda {
bool lm_head_keeps_logits(const TensorView& hidden, const TensorView& weight);  // logprob/lm_head.cu
}
#endif
bool lm_head_keeps_logits(Backend backend, const TensorView& hidden, const TensorView& weight) {
#if SAMEBITS_WITH_CUDA
  if (backend == Backend::cuda) return cuda::lm_head_keeps_logits(hidden, weight);
#endif
  (void)backend, (void)hidden, (void)weight;
  return false;
}

int64_t lm_head_rows_to_keep(Backend backend, const TensorView& hidden, const TensorView& weight, int64_t budget_bytes,
                             const TensorView& segments) {
  const int64_t T = hidden.shape[0], per_row = weight.shape[0] * 6;
  if (budget_bytes <= 0 || T == 0 || per_row <= 0 || !lm_head_keeps_logits(backend, hidden, weight)) return 0;
  const int64_t fit = budget_bytes / per_row;
  if (fit >= T) return T;
  int64_t rows = 0;
  const auto* s = segments.present() ? segments.as<const int32_t>() : nullptr;
  for (int64_t i = 0; s && i < segments.shape[0]; ++i) {
    const int64_t end = int64_t(s[2 * i]) + s[2 * i + 1];
    if (end > fit) break;
    rows = end;
  }
  return rows;
}

void lm_head_logprob_forward(const Context& ctx, const LmHeadLogprobForwardArgs& a) {
  auto v = begin_op<OpId::lm_head_logprob_forward>("lm_head_logprob_forward", ctx, a);
  check_lm_head(v, a.hidden, a.weight);
  const int64_t rows = a.hidden.shape[0];
  check_targets(v, a.targets, a.loss_mask, rows, a.weight.shape[0], a.ignore_index);
  check_per_token(v, "logp", a.logp, rows, true);
  check_per_token(v, "entropy", a.entropy, rows, false);
  check_per_token(v, "lse", a.lse, rows, false);
  check_logits_kept(v, a.logits_kept, a.hidden, a.weight, nullptr,  // any C (the backward checks where it ends)
                    {{"logp", &a.logp}, {"entropy", &a.entropy}, {"lse", &a.lse}});
  run_kernel<OpId::lm_head_logprob_forward>("lm_head_logprob_forward", ctx, a);
}

void lm_head_logprob_backward(const Context& ctx, const LmHeadLogprobBackwardArgs& a) {
  auto v = begin_op<OpId::lm_head_logprob_backward>("lm_head_logprob_backward", ctx, a);
  check_lm_head(v, a.hidden, a.weight);
  const int64_t rows = a.hidden.shape[0];
  check_targets(v, a.targets, a.loss_mask, rows, a.weight.shape[0], a.ignore_index);
  check_per_token(v, "lse", a.lse, rows, false);
  check_per_token(v, "dlogp", a.dlogp, rows, true);
  check_per_token(v, "dentropy", a.dentropy, rows, false);
  v.finite("dlogp", a.dlogp);
  v.finite("dentropy", a.dentropy);
  v.required("dhidden", a.dhidden, 2);
  v.floating("dhidden", a.dhidden);
  v.same_shape("dhidden", a.dhidden, "hidden", a.hidden);
  v.no_alias("dhidden", a.dhidden, "hidden", a.hidden);
  v.optional("dweight", a.dweight, 2);  // absent: a frozen head, no weight gradient
  if (a.dweight.present()) {
    v.accumulator("dweight", a.dweight);
    v.same_shape("dweight", a.dweight, "weight", a.weight);
  }
  check_segments(v, a.segments, rows);
  check_logits_kept(v, a.logits_kept, a.hidden, a.weight, &a.segments, {{"dhidden", &a.dhidden}, {"dweight", &a.dweight}});
  run_kernel<OpId::lm_head_logprob_backward>("lm_head_logprob_backward", ctx, a);
}

}  // namespace samebits
