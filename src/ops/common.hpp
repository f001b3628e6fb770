// Checks shared by several op families.
#pragma once
#include "ops/registry.hpp"
#include "samebits/ops.hpp"
#include "samebits/validate.hpp"

namespace samebits::detail {

// Validator for an op, after the checks on the context itself. An op with no kernel on the
// context's backend reports NotBuilt before looking at its arguments.
template <OpId Id, class Args>
Validator begin_op(const char* op, const Context& ctx, const Args&) {
  if (!KernelSlot<Id, Args>::at(ctx.backend)) throw NotBuilt(op, backend_name(ctx.backend));
  Validator v(op, ctx);
  if (ctx.backend == Backend::cuda && ctx.precision == Precision::truth_fp64)
    v.fail("context.precision", "truth_fp64 is a CPU reference mode; the CUDA backend is fp32");
  return v;
}

// An optional uint8 [T] row mask.
inline void check_row_mask(const Validator& v, const TensorView& mask, int64_t rows) {
  v.optional("row_mask", mask, 1);
  if (mask.is_none()) return;
  v.dtype("row_mask", mask, DType::u8);
  v.dim("row_mask", mask, 0, rows, "one entry per row");
}

// An optional host segment table int32 [S, 2] {row, len}: non-empty, ascending, disjoint, inside
// the rows.
inline void check_segments(const Validator& v, const TensorView& segments, int64_t rows) {
  if (!segments.present()) return;
  if (segments.device != Device::cpu) v.fail("segments", "the segment table lives on the host (cpu)");
  if (segments.ndim != 2 || segments.shape[1] != 2)
    v.fail("segments", "expected int32 [S, 2] {row, len}, got shape " + segments.shape_string());
  v.dtype("segments", segments, DType::i32);
  const auto* s = segments.as<const int32_t>();
  int64_t end = 0;
  for (int64_t i = 0; i < segments.shape[0]; ++i) {
    if (s[2 * i + 1] <= 0) v.fail("segments", "segment " + std::to_string(i) + " is empty (zero-length sequence)");
    if (s[2 * i] < end || int64_t(s[2 * i]) + s[2 * i + 1] > rows)
      v.fail("segments", "segment " + std::to_string(i) + " overlaps the previous one, is out of order, or runs past the rows");
    end = int64_t(s[2 * i]) + s[2 * i + 1];
  }
}

// A floating input of the given rank, non-empty and finite.
inline void check_float_input(const Validator& v, const char* name, const TensorView& t, int ndim) {
  v.required(name, t, ndim);
  v.floating(name, t);
  v.nonempty(name, t);
  v.finite(name, t);
}

// RoPE's positions (int32 [tokens], each in [0, config.max_position)), its config, and an even
// head_dim (of the input named `in`). Defined in rope.cpp; the fused QK-norm + RoPE uses it too.
void check_rope_positions(const Validator& v, const TensorView& positions, const RopeConfig& config,
                          int64_t tokens, int64_t head_dim, const char* in);

}  // namespace samebits::detail
