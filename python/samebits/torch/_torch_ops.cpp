// samebits.torch's ops registered in torch's C++ dispatcher (namespace samebits_ext), with their
// autograd in C++: an optional library, built only where the Python interpreter has torch at
// configure time (CMakeLists.txt, SAMEBITS_TORCH_OPS), loaded by samebits.torch with
// torch.ops.load_library when its torch version is the one it was built for.
//
// Why. A samebits.torch op is a torch.library.custom_op whose body is Python (descriptors, output
// allocation, the stream) and whose autograd is a Python autograd.Function: 36–116 µs of host time
// a call on an H100 machine against 9–25 µs for the torch op it replaces (docs/bench/
// op-overhead-h100.md). Here a call is the dispatcher, an at::Tensor allocation and the samebits op:
// no Python runs. The kernels are the same C++ entry points with the same arguments (same bits;
// tests/torch/test_torch_ops.py compares them with the custom_op path). samebits' errors become
// ValueError (samebits.torch re-raises them as samebits.Error). Ops: rms_norm, add_rms_norm, linear,
// swiglu, token_logprobs, attention, embedding, qk_norm (+ RoPE), lm_head_logprobs.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/version.h>
#if SAMEBITS_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "samebits/device.hpp"
#include "samebits/error.hpp"
#include "samebits/ops.hpp"

namespace {

using samebits::DType;
using samebits::TensorView;

DType dtype_of(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    case at::kFloat: return DType::f32;
    case at::kDouble:
      TORCH_CHECK_VALUE(!t.is_cuda(), "samebits.torch ", op, ": argument '", arg,
                        "': dtype torch.float64 is taken on the CPU only (the fp64 truth mode)");
      return DType::f64;
    case at::kInt: return DType::i32;
    case at::kLong: return DType::i64;  // taken where the op says so (the embedding's ids)
    case at::kByte: return DType::u8;
    default:
      TORCH_CHECK_VALUE(false, "samebits.torch ", op, ": argument '", arg, "': dtype ", t.scalar_type(),
                        " is not taken (bfloat16, float16, float32; float64 on the CPU)");
  }
  return DType::f32;
}

// A contiguous tensor's memory as the op's argument (the tensor outlives the call).
TensorView view(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), "samebits.torch ", op, ": argument '", arg,
                    "': device ", t.device(), " is not taken (cpu or cuda)");
  TORCH_CHECK_VALUE(t.is_contiguous(), "samebits.torch ", op, ": argument '", arg,
                    "': must be contiguous (.contiguous())");
  TORCH_CHECK_VALUE(t.dim() <= samebits::kMaxDims, "samebits.torch ", op, ": argument '", arg,
                    "': too many dimensions");
  const std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  return TensorView::of(t.data_ptr(), dtype_of(t, op, arg), shape.data(), int(shape.size()),
                        t.is_cuda() ? samebits::Device::cuda : samebits::Device::cpu);
}

// The backend of the op's first tensor, torch's current stream on its device, the truth mode for fp64.
// Ids in GPU memory are checked without waiting for the GPU (IdCheck::deferred: a bad one is raised
// by the next samebits op, with `id_note` after it), as a torch op never waits on the GPU.
samebits::Context context_of(const at::Tensor& t, const char* id_note = "") {
  samebits::Context ctx;
  ctx.id_check = samebits::IdCheck::deferred;
  ctx.id_note = id_note;
  ctx.backend = t.is_cuda() ? samebits::Backend::cuda : samebits::Backend::cpu;
  if (t.scalar_type() == at::kDouble) ctx.precision = samebits::Precision::truth_fp64;
#if SAMEBITS_TORCH_CUDA
  if (t.is_cuda()) ctx.stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
  return ctx;
}

// Numbers in this library's messages go through std::to_string, never c10::str's stream: on the
// H100 machine (torch 2.11, g++ 13.3) an integer streamed by code compiled into this module crashed
// the process (std::ostream::_M_insert<long>), where strings, dtypes and devices stream fine.
std::string shape_text(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

// Runs a samebits op, its Error as a ValueError naming the same op, argument and problem, and
// `note` after it (clamp_note: why an id may read as an int32 bound).
// An earlier call's bad id (a deferred check, raised on entering an op) carries that call's note.
template <class F>
void run(F&& f, const char* note = "") {
  try {
    f();
  } catch (const samebits::DeferredError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const samebits::Error& e) {
    TORCH_CHECK_VALUE(false, e.what(), note);
  }
}

// The tensor's CUDA device made current for the call (nothing for a CPU tensor, or where it is current).
struct DeviceOf {
  explicit DeviceOf(const at::Tensor& t) {
    if (t.is_cuda()) guard.reset_device(t.device());
  }
  c10::OptionalDeviceGuard guard;
};

at::ScalarType acc_of(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// x as [rows, last dimension] (a view: x is contiguous). `arg` names it in an error.
at::Tensor rows_of(const at::Tensor& x, const char* op, const char* arg = "x") {
  TORCH_CHECK_VALUE(x.dim() >= 1, "samebits.torch ", op, ": argument '", arg, "': needs at least one dimension");
  TORCH_CHECK_VALUE(x.is_contiguous(), "samebits.torch ", op, ": argument '", arg,
                    "': must be contiguous (.contiguous())");
  return x.reshape({-1, x.size(-1)});
}

// Whether a call records a backward: grad mode on and an input that wants a gradient. A call that
// does not runs the op alone (no autograd node, nothing kept for a backward: the norms' rstd and
// the logprob's and attention's lse are not written), which is much of an inference call's host time.
bool records(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

// A weight's gradient where the caller keeps an fp32 accumulator beside it (`main_grad`, the
// convention of Megatron / Transformer Engine): the backward adds into it — row segments given as
// the packed sequences' lengths, so a step's sum does not depend on how its sequences are split
// into micro-batches (the library starts a new group at every segment) — and gives the weight
// itself no gradient. Without main_grad: a zeroed fp32 buffer rounded once to the weight's dtype.
struct WeightGrad {
  at::Tensor main_grad, segments;  // segments: int32 [S, 2] {row, len} on the host (optional)
};
// Sequence lengths (segments, attention's lengths): each ≥ 0, together within int32's rows.
void check_lengths(at::IntArrayRef lengths, const char* op, const char* arg) {
  int64_t rows = 0;
  for (const int64_t len : lengths) {
    TORCH_CHECK_VALUE(len >= 0 && rows + len <= std::numeric_limits<int32_t>::max(), "samebits.torch ", op,
                      ": argument '", arg, "': a length of ", std::to_string(len), " is not taken (each >= 0, ",
                      "2^31 - 1 rows in all)");
    rows += len;
  }
}
// Refuses a main_grad or segments the backward could not take. Called before an autograd Function's
// apply, so a refusal leaves no half-built node behind.
void check_weight_grad(const c10::optional<at::Tensor>& main_grad, at::OptionalIntArrayRef lengths,
                       const at::Tensor& weight, const char* op) {
  if (main_grad && main_grad->defined())
    TORCH_CHECK_VALUE(main_grad->scalar_type() == acc_of(weight) && main_grad->sizes() == weight.sizes() &&
                          main_grad->is_contiguous() && main_grad->device() == weight.device(),
                      "samebits.torch ", op, ": argument 'main_grad': must be a contiguous ", acc_of(weight),
                      " tensor of the weight's shape ", shape_text(weight), " on its device");
  if (lengths.has_value()) check_lengths(*lengths, op, "segments");
}
// The accumulator and the segments' {row, len} table of arguments check_weight_grad took.
WeightGrad weight_grad_of(const c10::optional<at::Tensor>& main_grad, at::OptionalIntArrayRef lengths) {
  WeightGrad g;
  if (main_grad && main_grad->defined()) g.main_grad = *main_grad;
  if (lengths.has_value()) {
    const at::IntArrayRef n = *lengths;
    g.segments = at::empty({int64_t(n.size()), 2}, at::TensorOptions().dtype(at::kInt));
    int32_t* row = g.segments.data_ptr<int32_t>();
    int64_t at_row = 0;
    for (const int64_t len : n) {
      row[0] = int32_t(at_row), row[1] = int32_t(len);
      at_row += len, row += 2;
    }
  }
  return g;
}
// Kept for the backward only where given (an IValue of an undefined tensor is None in some torch versions).
void keep(torch::autograd::AutogradContext* ctx, const WeightGrad& g) {
  ctx->saved_data["has_main_grad"] = g.main_grad.defined();
  ctx->saved_data["has_segments"] = g.segments.defined();
  if (g.main_grad.defined()) ctx->saved_data["main_grad"] = g.main_grad;
  if (g.segments.defined()) ctx->saved_data["segments"] = g.segments;
}
WeightGrad kept(torch::autograd::AutogradContext* ctx) {
  WeightGrad g;
  if (ctx->saved_data["has_main_grad"].toBool()) g.main_grad = ctx->saved_data["main_grad"].toTensor();
  if (ctx->saved_data["has_segments"].toBool()) g.segments = ctx->saved_data["segments"].toTensor();
  return g;
}
// The backward's weight-gradient accumulator, and what autograd gets for the weight.
at::Tensor dweight_of(const WeightGrad& g, const at::Tensor& weight) {
  return g.main_grad.defined() ? g.main_grad : at::zeros(weight.sizes(), weight.options().dtype(acc_of(weight)));
}
at::Tensor weight_grad_out(const WeightGrad& g, const at::Tensor& dw, const at::Tensor& weight) {
  return g.main_grad.defined() ? at::Tensor() : dw.to(weight.scalar_type());
}
void with_segments(samebits::TensorView& field, const WeightGrad& g, const char* op) {
  if (g.segments.defined()) field = view(g.segments, op, "segments");
}

// ---------------------------------------------------------------- rms_norm
// y = rms_norm(s) with s = x, or s = x + residual rounded once (add_rms_norm, which also returns
// s); rstd (fp32) only where a backward will want it.
struct NormOut {
  at::Tensor y, sum, rstd;
};
NormOut norm_forward(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                     bool keep_rstd, const char* op) {
  const DeviceOf guard(x);
  const at::Tensor x2 = rows_of(x, op);
  NormOut o;
  o.y = at::empty_like(x);  // outputs at their final shape, the kernel given 2-D views of them
  samebits::RmsNormForwardArgs a;
  a.x = view(x2, op, "x");
  a.weight = view(weight, op, "weight");
  a.y = view(rows_of(o.y, op, "y"), op, "y");
  at::Tensor r2;
  if (residual) {
    r2 = rows_of(*residual, op, "residual");
    o.sum = at::empty_like(x);
    a.residual = view(r2, op, "residual");
    a.residual_out = view(rows_of(o.sum, op, "residual_out"), op, "residual_out");
  }
  if (keep_rstd) {
    o.rstd = at::empty({x2.size(0)}, x2.options().dtype(acc_of(x)));
    a.rstd = view(o.rstd, op, "rstd");
  }
  a.eps = eps;
  run([&] { samebits::rmsnorm_forward(context_of(x), a); });
  return o;
}

// (dx, what autograd gets for the weight) of the norm of s (the norm's input) from dy, plus ds where
// s is an output too (add_rms_norm: its gradient added inside the norm's backward, dresidual_out).
std::pair<at::Tensor, at::Tensor> norm_backward(const at::Tensor& s, const at::Tensor& weight, const at::Tensor& rstd,
                                                const at::Tensor& dy_in, const at::Tensor& ds_in, double eps,
                                                const WeightGrad& wg, const char* op) {
  const DeviceOf guard(s);
  const at::Tensor s2 = rows_of(s, op);
  const at::Tensor dy = rows_of(dy_in.defined() ? dy_in.contiguous() : at::zeros_like(s), op, "dy");
  at::Tensor ds;
  if (ds_in.defined()) ds = rows_of(ds_in.contiguous(), op, "dresidual_out");
  at::Tensor dx = at::empty_like(s), dw = dweight_of(wg, weight);
  samebits::RmsNormBackwardArgs a;
  with_segments(a.segments, wg, op);
  a.dy = view(dy, op, "dy");
  if (ds.defined()) a.dresidual_out = view(ds, op, "dresidual_out");
  a.x = view(s2, op, "x");
  a.weight = view(weight, op, "weight");
  a.rstd = view(rstd, op, "rstd");
  a.dx = view(rows_of(dx, op, "dx"), op, "dx");
  a.dweight = view(dw, op, "dweight");
  a.eps = eps;
  run([&] { samebits::rmsnorm_backward(context_of(s), a); });
  return {dx, weight_grad_out(wg, dw, weight)};
}

struct RmsNorm : torch::autograd::Function<RmsNorm> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, const c10::optional<at::Tensor>& main_grad,
                            at::OptionalIntArrayRef segments) {
    keep(ctx, weight_grad_of(main_grad, segments));
    const NormOut o = norm_forward(x, nullptr, weight, eps, true, "rms_norm");
    ctx->save_for_backward({x, weight, o.rstd});
    ctx->saved_data["eps"] = eps;
    return o.y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = norm_backward(saved[0], saved[1], saved[2], grads[0], at::Tensor(),
                                  ctx->saved_data["eps"].toDouble(), kept(ctx), "rms_norm_backward");
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const c10::optional<at::Tensor>& main_grad, at::OptionalIntArrayRef segments) {
  check_weight_grad(main_grad, segments, weight, "rms_norm");
  if (!records({&x, &weight})) return norm_forward(x, nullptr, weight, eps, false, "rms_norm").y;
  return RmsNorm::apply(x, weight, eps, main_grad, segments);
}

// ---------------------------------------------------------------- add_rms_norm
// s = x + residual (rounded once to x's dtype), y = rms_norm(s); returns (y, s). The backward takes
// gradients on both (the one on s added inside the norm's backward as the custom_op path does:
// dresidual_out) and gives both summands the same dx. A missing incoming gradient arrives as zeros
// (autograd's default, as for the custom_op path's Python autograd Function: the same arguments).
struct AddRmsNorm : torch::autograd::Function<AddRmsNorm> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& residual, const at::Tensor& weight, double eps,
                                                const c10::optional<at::Tensor>& main_grad,
                                                at::OptionalIntArrayRef segments) {
    keep(ctx, weight_grad_of(main_grad, segments));
    const NormOut o = norm_forward(x, &residual, weight, eps, true, "add_rms_norm");
    ctx->save_for_backward({o.sum, weight, o.rstd});
    ctx->saved_data["eps"] = eps;
    return {o.y, o.sum};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = norm_backward(saved[0], saved[1], saved[2], grads[0], grads[1],
                                  ctx->saved_data["eps"].toDouble(), kept(ctx), "add_rms_norm_backward");
    return {dx, dx, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight,
                                                double eps, const c10::optional<at::Tensor>& main_grad,
                            at::OptionalIntArrayRef segments) {
  check_weight_grad(main_grad, segments, weight, "add_rms_norm");
  if (!records({&x, &residual, &weight})) {
    const NormOut o = norm_forward(x, &residual, weight, eps, false, "add_rms_norm");
    return {o.y, o.sum};
  }
  const auto out = AddRmsNorm::apply(x, residual, weight, eps, main_grad, segments);
  return {out[0], out[1]};
}

// ---------------------------------------------------------------- swiglu
// silu(gate) · up in fp32, rounded once.
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  const DeviceOf guard(gate);
  const at::Tensor g2 = rows_of(gate, "swiglu", "gate"), u2 = rows_of(up, "swiglu", "up");
  at::Tensor y = at::empty_like(gate);
  samebits::SwiGluForwardArgs a;
  a.gate = view(g2, "swiglu", "gate");
  a.up = view(u2, "swiglu", "up");
  a.y = view(rows_of(y, "swiglu", "y"), "swiglu", "y");
  run([&] { samebits::swiglu_forward(context_of(gate), a); });
  return y;
}

struct SwiGlu : torch::autograd::Function<SwiGlu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return swiglu_forward(gate, up);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1];
    const DeviceOf guard(gate);
    const char* op = "swiglu_backward";
    const at::Tensor g2 = rows_of(gate, op), u2 = rows_of(up, op);
    const at::Tensor dy = rows_of(grads[0].defined() ? grads[0].contiguous() : at::zeros_like(gate), op);
    at::Tensor dg = at::empty_like(g2), du = at::empty_like(u2);
    samebits::SwiGluBackwardArgs a;
    a.dy = view(dy, op, "dy");
    a.gate = view(g2, op, "gate");
    a.up = view(u2, op, "up");
    a.dgate = view(dg, op, "dgate");
    a.dup = view(du, op, "dup");
    run([&] { samebits::swiglu_backward(context_of(gate), a); });
    return {dg.view(gate.sizes()), du.view(up.sizes())};
  }
};

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  return records({&gate, &up}) ? SwiGlu::apply(gate, up) : swiglu_forward(gate, up);
}

// ---------------------------------------------------------------- linear
// y = x · weightᵀ (+ bias); the backward's weight (and bias) gradients in fp32 accumulators rounded
// once to the parameter's dtype, as the custom_op path does.
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const DeviceOf guard(x);
  const at::Tensor x2 = rows_of(x, "linear");
  TORCH_CHECK_VALUE(weight.dim() == 2, "samebits.torch linear: argument 'weight': must be 2-D [out, in]");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  at::Tensor y = at::empty(shape, x.options());
  samebits::LinearForwardArgs a;
  a.x = view(x2, "linear", "x");
  a.weight = view(weight, "linear", "weight");
  if (bias && bias->defined()) a.bias = view(*bias, "linear", "bias");
  a.y = view(rows_of(y, "linear", "y"), "linear", "y");
  run([&] { samebits::linear_forward(context_of(x), a); });
  return y;
}

struct Linear : torch::autograd::Function<Linear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& main_grad, at::OptionalIntArrayRef segments) {
    keep(ctx, weight_grad_of(main_grad, segments));
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias"] = bool(bias && bias->defined());
    return linear_forward(x, weight, bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const bool has_bias = ctx->saved_data["bias"].toBool();
    const DeviceOf guard(x);
    const at::Tensor x2 = rows_of(x, "linear_backward");
    const at::Tensor g = grads[0].defined() ? grads[0].contiguous()
                                            : at::zeros({x2.size(0), weight.size(0)}, x2.options());
    const at::Tensor dy = g.reshape({-1, weight.size(0)});
    const WeightGrad wg = kept(ctx);
    at::Tensor dx = at::empty_like(x2), dw = dweight_of(wg, weight);
    at::Tensor db = at::zeros({has_bias ? weight.size(0) : 0}, weight.options().dtype(acc_of(weight)));
    const samebits::Context c = context_of(x);
    samebits::LinearBackwardInputArgs bi;
    bi.dy = view(dy, "linear_backward", "dy");
    bi.weight = view(weight, "linear_backward", "weight");
    bi.dx = view(dx, "linear_backward", "dx");
    samebits::LinearBackwardWeightArgs bw;
    bw.dy = bi.dy;
    bw.x = view(x2, "linear_backward", "x");
    bw.dweight = view(dw, "linear_backward", "dweight");
    with_segments(bw.segments, wg, "linear_backward");
    if (has_bias) bw.dbias = view(db, "linear_backward", "dbias");
    run([&] {
      samebits::linear_backward_input(c, bi);
      samebits::linear_backward_weight(c, bw);
    });
    return {dx.view(x.sizes()), weight_grad_out(wg, dw, weight), has_bias ? db.to(weight.scalar_type()) : at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& main_grad, at::OptionalIntArrayRef segments) {
  check_weight_grad(main_grad, segments, weight, "linear");
  const at::Tensor none;
  if (!records({&x, &weight, bias ? &*bias : &none})) return linear_forward(x, weight, bias);
  return Linear::apply(x, weight, bias, main_grad, segments);
}

// ---------------------------------------------------------------- integer ids
// Ids an op reads as int32 or int64 (the embedding's), flattened, as they are: no narrowing copy.
at::Tensor ids_flat(const at::Tensor& ids, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, "samebits.torch ", op,
                    ": argument '", arg, "': dtype ", ids.scalar_type(), " is not taken (int32 or int64)");
  return ids.reshape({-1}).contiguous();
}
// Token ids / targets as int32 (the library's index type). int32 passes as it is. int64 on the CPU
// is checked here (a value int32 cannot hold is named); on a GPU a check would read a flag back,
// so a value outside int32 is clamped to int32's nearest bound instead — outside every vocab and not
// an ignore index — which the op's own range check names as out of range at its index (clamp_note
// says why).
at::Tensor ids_int32(const at::Tensor& ids, const char* op, const char* arg) {
  const at::Tensor flat = ids_flat(ids, op, arg);
  if (ids.scalar_type() == at::kInt) return flat;
  constexpr int64_t lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
  if (!ids.is_cuda()) {
    if (flat.numel())
      TORCH_CHECK_VALUE(flat.min().item<int64_t>() >= lo && flat.max().item<int64_t>() <= hi, "samebits.torch ", op,
                        ": argument '", arg, "': a value does not fit in int32");
    return flat.to(at::kInt);
  }
  return flat.clamp(lo, hi).to(at::kInt);  // two launches; a clamped value is outside every vocab
}
// What an op's error adds where ids_int32 clamped its ids (int64 on a GPU): why a value may read as
// an int32 bound.
const char* clamp_note(const at::Tensor& ids) {
  return ids.is_cuda() && ids.scalar_type() == at::kLong
             ? " (int64 ids / targets on a GPU: a value outside int32 reads as its nearest int32 bound)"
             : "";
}

// ---------------------------------------------------------------- token_logprobs
// (logp, entropy) of targets under logits [..., V] in fp32, the vocab in fixed blocks; the row's
// log-sum-exp kept for the backward (the custom_op path returns it as a third output).
struct LogprobOut {
  at::Tensor logp, entropy, lse, targets;  // lse where kept; targets as int32
};
LogprobOut logprob_forward(const at::Tensor& logits, const at::Tensor& targets, bool keep_lse) {
  const char* op = "token_logprobs";
  const DeviceOf guard(logits);
  LogprobOut o;
  const at::Tensor l2 = rows_of(logits, op, "logits");
  o.targets = ids_int32(targets, op, "targets");
  const auto options = l2.options().dtype(acc_of(logits));
  const auto shape = logits.sizes().slice(0, logits.dim() - 1);
  o.logp = at::empty(shape, options);  // at the final shape, the kernel given flat views
  o.entropy = at::empty(shape, options);
  samebits::LogprobForwardArgs a;
  a.logits = view(l2, op, "logits");
  a.targets = view(o.targets, op, "targets");
  a.logp = view(o.logp.reshape({-1}), op, "logp");
  a.entropy = view(o.entropy.reshape({-1}), op, "entropy");
  if (keep_lse) {
    o.lse = at::empty({o.targets.size(0)}, options);
    a.lse = view(o.lse, op, "lse");
  }
  run([&] { samebits::logprob_forward(context_of(logits, clamp_note(targets)), a); }, clamp_note(targets));
  return o;
}

struct TokenLogprobs : torch::autograd::Function<TokenLogprobs> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                                                const at::Tensor& targets) {
    const LogprobOut o = logprob_forward(logits, targets, true);
    ctx->save_for_backward({logits, o.targets, o.lse});
    return {o.logp, o.entropy};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const char* op = "token_logprobs_backward";
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &t = saved[1], &lse = saved[2];
    const DeviceOf guard(logits);
    const at::Tensor l2 = rows_of(logits, op);
    auto flat = [&](const at::Tensor& g) {
      return g.defined() ? g.reshape({-1}).to(lse.scalar_type()).contiguous() : at::zeros_like(lse);
    };
    const at::Tensor dlogp = flat(grads[0]), dentropy = flat(grads[1]);
    at::Tensor dl = at::empty_like(l2);
    samebits::LogprobBackwardArgs a;
    a.logits = view(l2, op, "logits");
    a.targets = view(t, op, "targets");
    a.lse = view(lse, op, "lse");
    a.dlogp = view(dlogp, op, "dlogp");
    a.dentropy = view(dentropy, op, "dentropy");
    a.dlogits = view(dl, op, "dlogits");
    run([&] { samebits::logprob_backward(context_of(logits), a); });
    return {dl.view(logits.sizes()), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> token_logprobs(const at::Tensor& logits, const at::Tensor& targets) {
  if (!records({&logits})) {
    const LogprobOut o = logprob_forward(logits, targets, false);
    return {o.logp, o.entropy};
  }
  const auto out = TokenLogprobs::apply(logits, targets);
  return {out[0], out[1]};
}

// ---------------------------------------------------------------- attention
// Causal GQA attention over sequences packed back to back: q [T, Hq, D], k / v [T, Hkv, D], the
// sequences' lengths. The work table {q_row, q_len, k_row, k_len} is made here, on the host (where
// the library reads it), as the custom_op path's _seq_table makes it.
at::Tensor seq_table(at::IntArrayRef lengths) {  // lengths checked (check_lengths)
  at::Tensor table = at::empty({int64_t(lengths.size()), 4}, at::TensorOptions().dtype(at::kInt));
  int32_t* row = table.data_ptr<int32_t>();
  int64_t at_row = 0;
  for (const int64_t n : lengths) {
    row[0] = row[2] = int32_t(at_row);
    row[1] = row[3] = int32_t(n);
    at_row += n;
    row += 4;
  }
  return table;
}

struct AttentionOut {
  at::Tensor out, lse, seqs;  // lse where kept; seqs: the work table
};
AttentionOut attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef lengths,
                               double scale, bool keep_lse) {
  const char* op = "attention";
  const DeviceOf guard(q);
  check_lengths(lengths, op, "lengths");
  TORCH_CHECK_VALUE(q.dim() == 3, "samebits.torch ", op, ": argument 'q': must be 3-D [tokens, heads, head_dim], got ",
                    std::to_string(q.dim()), "-D");
  AttentionOut o;
  o.seqs = seq_table(lengths);
  o.out = at::empty_like(q);
  samebits::AttentionForwardArgs a;
  a.q = view(q, op, "q");
  a.k = view(k, op, "k");
  a.v = view(v, op, "v");
  a.seqs = view(o.seqs, op, "seqs");
  a.out = view(o.out, op, "out");
  if (keep_lse) {
    o.lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(acc_of(q)));
    a.lse = view(o.lse, op, "lse");
  }
  a.scale = scale;
  run([&] { samebits::attention_forward(context_of(q), a); });
  return o;
}

struct Attention : torch::autograd::Function<Attention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, at::IntArrayRef lengths, double scale) {
    const AttentionOut o = attention_forward(q, k, v, lengths, scale, true);
    ctx->save_for_backward({q, k, v, o.seqs, o.out, o.lse});
    ctx->saved_data["scale"] = scale;
    return o.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const char* op = "attention_backward";
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &seqs = saved[3], &out = saved[4], &lse = saved[5];
    const DeviceOf guard(q);
    const at::Tensor dout = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(out);
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    samebits::AttentionBackwardArgs a;
    a.q = view(q, op, "q");
    a.k = view(k, op, "k");
    a.v = view(v, op, "v");
    a.seqs = view(seqs, op, "seqs");
    a.out = view(out, op, "out");
    a.lse = view(lse, op, "lse");
    a.dout = view(dout, op, "dout");
    a.dq = view(dq, op, "dq");
    a.dk = view(dk, op, "dk");
    a.dv = view(dv, op, "dv");
    a.scale = ctx->saved_data["scale"].toDouble();
    run([&] { samebits::attention_backward(context_of(q), a); });
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
  }
};

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef lengths,
                     double scale) {
  if (!records({&q, &k, &v})) return attention_forward(q, k, v, lengths, scale, false).out;
  return Attention::apply(q, k, v, lengths, scale);
}

// ---------------------------------------------------------------- embedding
// table[ids]; the table's gradient sums each row's uses in ascending token order in an fp32
// accumulator, rounded once to the table's dtype.
// (y, the ids as int32).
std::pair<at::Tensor, at::Tensor> embedding_forward(const at::Tensor& ids, const at::Tensor& table, bool ids_checked) {
  const char* op = "embedding";
  const DeviceOf guard(table);
  const at::Tensor flat = ids_flat(ids, op, "ids");
  TORCH_CHECK_VALUE(table.dim() == 2, "samebits.torch ", op, ": argument 'table': must be 2-D [vocab, hidden]");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(table.size(1));
  at::Tensor y = at::empty(shape, table.options());  // at its final shape, the kernel given a 2-D view
  samebits::EmbeddingForwardArgs a;
  a.ids = view(flat, op, "ids");
  a.table = view(table, op, "table");
  a.y = view(y.view({flat.size(0), table.size(1)}), op, "y");
  a.ids_checked = ids_checked;
  run([&] { samebits::embedding_forward(context_of(table), a); });
  return {y, flat};
}

struct Embedding : torch::autograd::Function<Embedding> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& ids, const at::Tensor& table,
                            const c10::optional<at::Tensor>& main_grad, bool ids_checked) {
    keep(ctx, weight_grad_of(main_grad, c10::nullopt));
    ctx->saved_data["ids_checked"] = ids_checked;
    auto [y, flat] = embedding_forward(ids, table, ids_checked);
    ctx->save_for_backward({flat, table});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const char* op = "embedding_backward";
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &flat = saved[0], &table = saved[1];
    const DeviceOf guard(table);
    const at::Tensor dy = grads[0].defined() ? grads[0].reshape({-1, table.size(1)}).contiguous()
                                             : at::zeros({flat.size(0), table.size(1)}, table.options());
    const WeightGrad wg = kept(ctx);
    at::Tensor dt = dweight_of(wg, table);
    samebits::EmbeddingBackwardArgs a;
    a.ids = view(flat, op, "ids");
    a.dy = view(dy, op, "dy");
    a.dtable = view(dt, op, "dtable");
    a.ids_checked = ctx->saved_data["ids_checked"].toBool();
    run([&] { samebits::embedding_backward(context_of(table), a); });
    return {at::Tensor(), weight_grad_out(wg, dt, table), at::Tensor(), at::Tensor()};
  }
};

// ids_checked (samebits.hf.patch's ids checked on the host): the library's
// EmbeddingForwardArgs::ids_checked — no range check, no read-back.
at::Tensor embedding(const at::Tensor& ids, const at::Tensor& table, const c10::optional<at::Tensor>& main_grad,
                     bool ids_checked) {
  check_weight_grad(main_grad, c10::nullopt, table, "embedding");
  return records({&table}) ? Embedding::apply(ids, table, main_grad, ids_checked)
                           : embedding_forward(ids, table, ids_checked).first;
}

// ---------------------------------------------------------------- qk_norm (+ RoPE)
// Qwen3's QK-norm over head_dim of every head of x [T, heads, D]; with positions fused with RoPE
// (llama3: [] or [factor, low_freq_factor, high_freq_factor, original_max_position], as the
// custom_op path takes Hugging Face's rope_scaling). rstd [T, heads] only where a backward wants it.
samebits::RopeConfig rope_config(double theta, at::ArrayRef<double> llama3, const char* op) {
  samebits::RopeConfig c;
  c.theta = theta;
  if (!llama3.empty()) {
    TORCH_CHECK_VALUE(llama3.size() == 4, "samebits.torch ", op, ": argument 'llama3': 4 values or none, got ",
                      std::to_string(llama3.size()));
    c.llama3_scaling = true;
    c.factor = llama3[0], c.low_freq_factor = llama3[1], c.high_freq_factor = llama3[2];
    c.original_max_position = int64_t(llama3[3]);
  }
  return c;
}

// (y, rstd where kept, the positions as int32 where given).
std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_forward(const at::Tensor& x, const at::Tensor& weight,
                                                               double eps, const at::Tensor& positions, double theta,
                                                               at::ArrayRef<double> llama3, bool keep_rstd) {
  const char* op = "qk_norm";
  const DeviceOf guard(x);
  TORCH_CHECK_VALUE(x.dim() == 3, "samebits.torch ", op, ": argument 'x': must be 3-D [tokens, heads, head_dim], got ",
                    std::to_string(x.dim()), "-D");
  at::Tensor y = at::empty_like(x), rstd;
  samebits::QkNormForwardArgs a;
  a.x = view(x, op, "x");
  a.weight = view(weight, op, "weight");
  a.y = view(y, op, "y");
  if (keep_rstd) {
    rstd = at::empty({x.size(0), x.size(1)}, x.options().dtype(acc_of(x)));
    a.rstd = view(rstd, op, "rstd");
  }
  a.eps = eps;
  at::Tensor pos;
  if (positions.defined()) {
    pos = ids_int32(positions, op, "positions");
    a.positions = view(pos, op, "positions");
  }
  a.rope = rope_config(theta, llama3, op);
  run([&] { samebits::qk_norm_forward(context_of(x), a); }, positions.defined() ? clamp_note(positions) : "");
  return {y, rstd, pos};
}

struct QkNorm : torch::autograd::Function<QkNorm> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, const c10::optional<at::Tensor>& positions, double theta,
                            std::vector<double> llama3,
                            const c10::optional<at::Tensor>& main_grad, at::OptionalIntArrayRef segments) {
    keep(ctx, weight_grad_of(main_grad, segments));
    const at::Tensor pos = positions ? *positions : at::Tensor();
    auto [y, rstd, pos32] = qk_norm_forward(x, weight, eps, pos, theta, llama3, true);
    ctx->save_for_backward({x, weight, rstd, pos32});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["theta"] = theta;
    ctx->saved_data["llama3"] = c10::IValue(llama3);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const char* op = "qk_norm_backward";
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2], &pos = saved[3];
    const DeviceOf guard(x);
    const at::Tensor dy = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(x);
    const WeightGrad wg = kept(ctx);
    at::Tensor dx = at::empty_like(x), dw = dweight_of(wg, weight);
    const std::vector<double> llama3 = ctx->saved_data["llama3"].toDoubleVector();
    samebits::QkNormBackwardArgs a;
    with_segments(a.segments, wg, op);
    a.dy = view(dy, op, "dy");
    a.x = view(x, op, "x");
    a.weight = view(weight, op, "weight");
    a.rstd = view(rstd, op, "rstd");
    a.dx = view(dx, op, "dx");
    a.dweight = view(dw, op, "dweight");
    a.eps = ctx->saved_data["eps"].toDouble();
    if (pos.defined()) a.positions = view(pos, op, "positions");
    a.rope = rope_config(ctx->saved_data["theta"].toDouble(), llama3, op);
    run([&] { samebits::qk_norm_backward(context_of(x), a); });
    return {dx, weight_grad_out(wg, dw, weight), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor qk_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                   const c10::optional<at::Tensor>& positions,
                   double theta, at::ArrayRef<double> llama3,
                   const c10::optional<at::Tensor>& main_grad, at::OptionalIntArrayRef segments) {
  check_weight_grad(main_grad, segments, weight, "qk_norm");
  if (!records({&x, &weight}))
    return std::get<0>(qk_norm_forward(x, weight, eps, positions ? *positions : at::Tensor(), theta, llama3, false));
  return QkNorm::apply(x, weight, eps, positions, theta, llama3.vec(), main_grad, segments);
}

// ---------------------------------------------------------------- fused LM head → selected logprob
// (logp, entropy) of targets under hidden · weightᵀ, fp32, vocab block by vocab block, the logits
// never stored; -100 targets not scored. Like the custom_op path, the op is given a loss mask of
// ones (the path the LM head's GPU tests take). lse only where a backward wants it.
struct LmHeadOut {
  at::Tensor logp, entropy, lse, targets, mask, kept;  // kept: the first rows' fp32 logits (where kept)
};
// keep_logits_bytes: the memory a recording call may spend keeping the first rows' fp32 logits for
// its backward (LmHeadLogprobForwardArgs::logits_kept, three GEMMs for them instead of four), ending
// at a sequence's end where `segments` (WeightGrad's table) are given (lm_head_rows_to_keep).
LmHeadOut lm_head_forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                          bool keep_lse, bool targets_checked, int64_t keep_logits_bytes = 0,
                          const at::Tensor& segments = at::Tensor()) {
  const char* op = "lm_head_logprobs";
  const DeviceOf guard(hidden);
  LmHeadOut o;
  const at::Tensor h2 = rows_of(hidden, op, "hidden");
  o.targets = ids_int32(targets, op, "targets");
  o.mask = at::ones({o.targets.size(0)}, o.targets.options().dtype(at::kByte));
  const auto options = h2.options().dtype(acc_of(hidden));
  const auto shape = hidden.sizes().slice(0, hidden.dim() - 1);
  o.logp = at::empty(shape, options);
  o.entropy = at::empty(shape, options);
  samebits::LmHeadLogprobForwardArgs a;
  a.hidden = view(h2, op, "hidden");
  a.weight = view(weight, op, "weight");
  a.targets = view(o.targets, op, "targets");
  a.loss_mask = view(o.mask, op, "loss_mask");
  a.logp = view(o.logp.reshape({-1}), op, "logp");
  a.entropy = view(o.entropy.reshape({-1}), op, "entropy");
  if (keep_lse) {
    o.lse = at::empty({o.targets.size(0)}, options);
    a.lse = view(o.lse, op, "lse");
  }
  a.targets_checked = targets_checked;
  const int64_t kept_rows = samebits::lm_head_rows_to_keep(context_of(hidden).backend, a.hidden, a.weight,
                                                          keep_logits_bytes,
                                                          segments.defined() ? view(segments, op, "segments") : TensorView{});
  if (kept_rows > 0) {
    o.kept = at::empty({kept_rows, weight.size(0)}, h2.options().dtype(at::kFloat));
    a.logits_kept = view(o.kept, op, "logits_kept");
  }
  run([&] { samebits::lm_head_logprob_forward(context_of(hidden, clamp_note(targets)), a); }, clamp_note(targets));
  return o;
}

struct LmHeadLogprobs : torch::autograd::Function<LmHeadLogprobs> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                                                const at::Tensor& weight, const at::Tensor& targets,
                                                const c10::optional<at::Tensor>& main_grad,
                                                at::OptionalIntArrayRef segments, bool targets_checked,
                                                int64_t keep_logits_bytes) {
    const WeightGrad wg = weight_grad_of(main_grad, segments);
    keep(ctx, wg);
    ctx->saved_data["targets_checked"] = targets_checked;
    ctx->set_materialize_grads(false);  // an output without a gradient gets none (no zero entropy gradient)
    const LmHeadOut o = lm_head_forward(hidden, weight, targets, true, targets_checked, keep_logits_bytes, wg.segments);
    ctx->saved_data["has_kept"] = o.kept.defined();
    if (o.kept.defined()) ctx->saved_data["kept"] = o.kept;
    ctx->save_for_backward({hidden, weight, o.targets, o.mask, o.lse});
    return {o.logp, o.entropy};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const char* op = "lm_head_logprobs_backward";
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weight = saved[1], &t = saved[2], &mask = saved[3], &lse = saved[4];
    const DeviceOf guard(hidden);
    const at::Tensor h2 = rows_of(hidden, op, "hidden");
    auto flat = [&](const at::Tensor& g) {
      return g.defined() ? g.reshape({-1}).to(lse.scalar_type()).contiguous() : at::zeros_like(lse);
    };
    // No entropy gradient: none given (a zero one would make the backward recompute the statistics,
    // a whole extra pass of the LM-head GEMM)
    const at::Tensor dlogp = flat(grads[0]), dentropy = grads[1].defined() ? flat(grads[1]) : at::Tensor();
    const WeightGrad wg = kept(ctx);
    at::Tensor dh = at::empty_like(hidden), dw = dweight_of(wg, weight);
    samebits::LmHeadLogprobBackwardArgs a;
    with_segments(a.segments, wg, op);
    a.hidden = view(h2, op, "hidden");
    a.weight = view(weight, op, "weight");
    a.targets = view(t, op, "targets");
    a.loss_mask = view(mask, op, "loss_mask");
    a.lse = view(lse, op, "lse");
    a.dlogp = view(dlogp, op, "dlogp");
    if (dentropy.defined()) a.dentropy = view(dentropy, op, "dentropy");
    a.targets_checked = ctx->saved_data["targets_checked"].toBool();
    at::Tensor kept;
    if (ctx->saved_data["has_kept"].toBool()) {  // taken once: the buffer goes with this backward
      kept = ctx->saved_data["kept"].toTensor();   // (a retained graph's next backward recomputes: the same bits)
      ctx->saved_data["has_kept"] = false;
      ctx->saved_data.erase("kept");
      a.logits_kept = view(kept, op, "logits_kept");
    }
    a.dhidden = view(rows_of(dh, op, "dhidden"), op, "dhidden");
    a.dweight = view(dw, op, "dweight");
    run([&] { samebits::lm_head_logprob_backward(context_of(hidden), a); });
    return {dh, weight_grad_out(wg, dw, weight), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// targets_checked (samebits.hf.patch's next-token targets, ids its embedding call has just checked):
// the library's LmHeadLogprobForwardArgs::targets_checked — no range check, no read-back.
// keep_logits_bytes: the memory a recording call may spend keeping logits for its backward
// (lm_head_forward); the same bits either way.
std::tuple<at::Tensor, at::Tensor> lm_head_logprobs(const at::Tensor& hidden, const at::Tensor& weight,
                                                    const at::Tensor& targets,
                                                    const c10::optional<at::Tensor>& main_grad,
                                                    at::OptionalIntArrayRef segments, bool targets_checked,
                                                    int64_t keep_logits_bytes) {
  check_weight_grad(main_grad, segments, weight, "lm_head_logprobs");
  if (!records({&hidden, &weight})) {
    const LmHeadOut o = lm_head_forward(hidden, weight, targets, false, targets_checked);
    return {o.logp, o.entropy};
  }
  const auto out =
      LmHeadLogprobs::apply(hidden, weight, targets, main_grad, segments, targets_checked, keep_logits_bytes);
  return {out[0], out[1]};
}

// ---------------------------------------------------------------- device memory
// samebits' device memory (the chain's activations, an engine's KV cache, the kernels' temporaries)
// from PyTorch's caching allocator while this library is loaded: one cache of free GPU memory in
// the process, which torch.cuda.memory_allocated() and torch.cuda.empty_cache() see, instead of
// samebits' own pool beside torch's, each blind to the other's free memory (samebits/device.hpp,
// set_device_allocator; samebits' own CUDA graph captures keep its pool). SAMEBITS_TORCH_ALLOCATOR=0
// in the environment keeps samebits' own pool.
#if SAMEBITS_TORCH_CUDA
// torch's CUDA state (its caching allocator among it) is made on torch's first CUDA use; samebits'
// may come first (a Model or an Engine before any torch tensor on the GPU).
void init_torch_cuda() {
  static std::once_flag once;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
  std::call_once(once, [] { at::globalContext().lazyInitDevice(c10::DeviceType::CUDA); });
#else
  std::call_once(once, [] { at::globalContext().lazyInitCUDA(); });
#endif
}

void* torch_alloc(size_t bytes, int device, void* stream, void*) {
  init_torch_cuda();
  const c10::cuda::CUDAGuard guard{c10::DeviceIndex(device)};
  // samebits' "default stream" is the legacy stream's handle; torch files its default stream's
  // blocks under the null handle (the same stream to the device): one set of blocks for both.
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (s == cudaStreamLegacy) s = nullptr;
  try {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, s);
  } catch (const c10::OutOfMemoryError&) {  // samebits names it (out of device memory)
    return nullptr;
  } catch (const c10::Error& e) {
    throw samebits::Error("device memory", "torch allocator", e.what_without_backtrace());
  }
}

void torch_free(void* p, int, void*, void*) { c10::cuda::CUDACachingAllocator::raw_delete(p); }

// What torch's cache holds unused on the device: reserved − allocated.
size_t torch_cached(int device, void*) {
  init_torch_cuda();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::DeviceIndex(device));
  constexpr size_t all = 0;  // StatType::AGGREGATE (whose namespace moved between torch versions)
  const int64_t unused = stats.reserved_bytes[all].current - stats.allocated_bytes[all].current;
  return unused > 0 ? size_t(unused) : 0;
}

const bool torch_allocator_installed = [] {
  const char* v = std::getenv("SAMEBITS_TORCH_ALLOCATOR");
  if (v && std::string(v) == "0") return false;
  samebits::ExternalAllocator a;
  a.alloc = torch_alloc;
  a.free = torch_free;
  a.cached = torch_cached;
  samebits::set_device_allocator(a);
  return true;
}();
#endif

}  // namespace

TORCH_LIBRARY(samebits_ext, m) {
  // main_grad: the weight's fp32 accumulator (WeightGrad); segments: the packed sequences' lengths.
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? main_grad=None, int[]? segments=None) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, Tensor? main_grad=None, int[]? segments=None) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, Tensor? main_grad=None, "
        "int[]? segments=None) -> (Tensor, Tensor)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("token_logprobs(Tensor logits, Tensor targets) -> (Tensor, Tensor)");
  m.def("attention(Tensor q, Tensor k, Tensor v, int[] lengths, float scale) -> Tensor");
  m.def("embedding(Tensor ids, Tensor table, Tensor? main_grad=None, bool ids_checked=False) -> Tensor");
  m.def("qk_norm(Tensor x, Tensor weight, float eps, Tensor? positions, float theta, float[] llama3, "
        "Tensor? main_grad=None, int[]? segments=None) -> Tensor");
  m.def("lm_head_logprobs(Tensor hidden, Tensor weight, Tensor targets, Tensor? main_grad=None, "
        "int[]? segments=None, bool targets_checked=False, int keep_logits_bytes=0) -> (Tensor, Tensor)");
}
// One kernel for every device, autograd included: the op records its own backward (RmsNorm), so it
// is registered at CompositeImplicitAutograd (the dispatcher runs it above autograd).
TORCH_LIBRARY_IMPL(samebits_ext, CompositeImplicitAutograd, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("linear", linear);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("swiglu", swiglu);
  m.impl("token_logprobs", token_logprobs);
  m.impl("attention", attention);
  m.impl("embedding", embedding);
  m.impl("qk_norm", qk_norm);
  m.impl("lm_head_logprobs", lm_head_logprobs);
}
