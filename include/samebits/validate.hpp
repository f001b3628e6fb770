// samebits/validate.hpp — the argument checks every op runs before it touches memory.
// All failures throw samebits::Error naming the op, the argument and the problem.
#pragma once
#include <cstdint>
#include <string>

#include "samebits/context.hpp"
#include "samebits/error.hpp"
#include "samebits/tensor.hpp"

namespace samebits {

// The flat index of the first NaN / Inf in a floating CPU view (-1: none, or not floating).
int64_t first_nonfinite_index(const TensorView& t);

class Validator {
 public:
  Validator(const char* op, const Context& ctx) : op_(op), ctx_(ctx) {}

  [[noreturn]] void fail(const char* arg, const std::string& problem) const;

  // A present view on the context's device, contiguous, aligned to its element size, with data
  // for every element. `ndim` is checked too.
  void required(const char* name, const TensorView& t, int ndim) const;
  // Same checks when present; nothing when none.
  void optional(const char* name, const TensorView& t, int ndim) const;

  void floating(const char* name, const TensorView& t) const;           // bf16 / fp16 / fp32 / fp64
  void dtype(const char* name, const TensorView& t, DType expected) const;
  void same_dtype(const char* name, const TensorView& t, const char* ref, const TensorView& r) const;
  // An fp32 gradient accumulator (fp64 in the CPU's truth mode).
  void accumulator(const char* name, const TensorView& t) const;
  void dim(const char* name, const TensorView& t, int d, int64_t expected, const char* what) const;
  void same_shape(const char* name, const TensorView& t, const char* ref, const TensorView& r) const;
  void nonempty(const char* name, const TensorView& t) const;
  // With Context::check_finite_inputs, a floating input holding NaN or Inf is rejected.
  void finite(const char* name, const TensorView& t) const;
  // int32 (or int64) values in [lo, hi), skipping rows where `row_mask` (optional uint8) is 0 and values equal
  // to `allowed` (e.g. ignore_index) when `use_allowed`.
  void int_range(const char* name, const TensorView& t, int64_t lo, int64_t hi,
                 const TensorView& row_mask = {}, bool use_allowed = false,
                 int32_t allowed = 0) const;
  // uint8 flags (a loss mask) each 0 or 1 (CPU views; a device mask is not scanned).
  void flags(const char* name, const TensorView& t) const;
  // `out` does not share memory with `in` (for outputs that must not alias an input).
  void no_alias(const char* out_name, const TensorView& out, const char* in_name,
                const TensorView& in) const;

  const char* op() const { return op_; }
  const Context& context() const { return ctx_; }

 private:
  const char* op_;
  const Context& ctx_;
};

}  // namespace samebits
