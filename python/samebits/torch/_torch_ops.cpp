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
// ValueError (samebits.torch re-raises them as samebits.Error). Ops so far: rms_norm, add_rms_norm, linear, swiglu.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/library.h>
#if SAMEBITS_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <tuple>
#include <utility>
#include <vector>

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
  TORCH_CHECK_VALUE(t.is_contiguous(), "samebits.torch ", op, ": argument '", arg, "': must be contiguous (.contiguous())");
  TORCH_CHECK_VALUE(t.dim() <= samebits::kMaxDims, "samebits.torch ", op, ": argument '", arg, "': too many dimensions");
  const std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  return TensorView::of(t.data_ptr(), dtype_of(t, op, arg), shape.data(), int(shape.size()),
                        t.is_cuda() ? samebits::Device::cuda : samebits::Device::cpu);
}

// The backend of the op's first tensor, torch's current stream on its device, the truth mode for fp64.
samebits::Context context_of(const at::Tensor& t) {
  samebits::Context ctx;
  ctx.backend = t.is_cuda() ? samebits::Backend::cuda : samebits::Backend::cpu;
  if (t.scalar_type() == at::kDouble) ctx.precision = samebits::Precision::truth_fp64;
#if SAMEBITS_TORCH_CUDA
  if (t.is_cuda()) ctx.stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
  return ctx;
}

// Runs a samebits op, its Error as a ValueError naming the same op, argument and problem.
template <class F>
void run(F&& f) {
  try {
    f();
  } catch (const samebits::Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
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

// ---------------------------------------------------------------- rms_norm
// y = rms_norm(s) with s = x, or s = x + residual rounded once (add_rms_norm, which also returns
// s). Outputs are allocated at their final shape and the kernel given 2-D views of them: a custom
// autograd Function's outputs that are views refuse in-place updates.
struct NormOut {
  at::Tensor y, sum, rstd;
};
NormOut norm_forward(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                     const char* op) {
  const DeviceOf guard(x);
  const at::Tensor x2 = rows_of(x, op);
  NormOut o;
  o.y = at::empty_like(x);
  o.rstd = at::empty({x2.size(0)}, x2.options().dtype(acc_of(x)));
  samebits::RmsNormForwardArgs a;
  a.x = view(x2, op, "x");
  a.weight = view(weight, op, "weight");
  a.y = view(rows_of(o.y, op, "y"), op, "y");
  a.rstd = view(o.rstd, op, "rstd");
  at::Tensor r2;
  if (residual) {
    r2 = rows_of(*residual, op, "residual");
    o.sum = at::empty_like(x);
    a.residual = view(r2, op, "residual");
    a.residual_out = view(rows_of(o.sum, op, "residual_out"), op, "residual_out");
  }
  a.eps = eps;
  run([&] { samebits::rmsnorm_forward(context_of(x), a); });
  return o;
}

// (dx, dweight) of the norm of s (the norm's input) from dy, plus ds where s is an output too
// (add_rms_norm: its gradient added inside the norm's backward, dresidual_out).
std::pair<at::Tensor, at::Tensor> norm_backward(const at::Tensor& s, const at::Tensor& weight, const at::Tensor& rstd,
                                                const at::Tensor& dy_in, const at::Tensor& ds_in, double eps,
                                                const char* op) {
  const DeviceOf guard(s);
  const at::Tensor s2 = rows_of(s, op);
  const at::Tensor dy = rows_of(dy_in.defined() ? dy_in.contiguous() : at::zeros_like(s), op, "dy");
  at::Tensor ds;
  if (ds_in.defined()) ds = rows_of(ds_in.contiguous(), op, "dresidual_out");
  at::Tensor dx = at::empty_like(s), dw = at::zeros(weight.sizes(), weight.options().dtype(acc_of(weight)));
  samebits::RmsNormBackwardArgs a;
  a.dy = view(dy, op, "dy");
  if (ds.defined()) a.dresidual_out = view(ds, op, "dresidual_out");
  a.x = view(s2, op, "x");
  a.weight = view(weight, op, "weight");
  a.rstd = view(rstd, op, "rstd");
  a.dx = view(rows_of(dx, op, "dx"), op, "dx");
  a.dweight = view(dw, op, "dweight");
  a.eps = eps;
  run([&] { samebits::rmsnorm_backward(context_of(s), a); });
  return {dx, dw.to(weight.scalar_type())};
}

struct RmsNorm : torch::autograd::Function<RmsNorm> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    const NormOut o = norm_forward(x, nullptr, weight, eps, "rms_norm");
    ctx->save_for_backward({x, weight, o.rstd});
    ctx->saved_data["eps"] = eps;
    return o.y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = norm_backward(saved[0], saved[1], saved[2], grads[0], at::Tensor(),
                                  ctx->saved_data["eps"].toDouble(), "rms_norm_backward");
    return {dx, dw, at::Tensor()};
  }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return RmsNorm::apply(x, weight, eps); }

// ---------------------------------------------------------------- add_rms_norm
// s = x + residual (rounded once to x's dtype), y = rms_norm(s); returns (y, s). The backward takes
// gradients on both (the one on s added inside the norm's backward as the custom_op path does:
// dresidual_out) and gives both summands the same dx. A missing incoming gradient arrives as zeros
// (autograd's default, as for the custom_op path's Python autograd Function: the same arguments).
struct AddRmsNorm : torch::autograd::Function<AddRmsNorm> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& residual, const at::Tensor& weight, double eps) {
    const NormOut o = norm_forward(x, &residual, weight, eps, "add_rms_norm");
    ctx->save_for_backward({o.sum, weight, o.rstd});
    ctx->saved_data["eps"] = eps;
    return {o.y, o.sum};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = norm_backward(saved[0], saved[1], saved[2], grads[0], grads[1],
                                  ctx->saved_data["eps"].toDouble(), "add_rms_norm_backward");
    return {dx, dx, dw, at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                                double eps) {
  const auto out = AddRmsNorm::apply(x, residual, weight, eps);
  return {out[0], out[1]};
}

// ---------------------------------------------------------------- swiglu
// silu(gate) · up in fp32, rounded once.
struct SwiGlu : torch::autograd::Function<SwiGlu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const DeviceOf guard(gate);
    const at::Tensor g2 = rows_of(gate, "swiglu", "gate"), u2 = rows_of(up, "swiglu", "up");
    at::Tensor y = at::empty_like(gate);  // at its final shape (a view would refuse in-place updates)
    samebits::SwiGluForwardArgs a;
    a.gate = view(g2, "swiglu", "gate");
    a.up = view(u2, "swiglu", "up");
    a.y = view(rows_of(y, "swiglu", "y"), "swiglu", "y");
    run([&] { samebits::swiglu_forward(context_of(gate), a); });
    ctx->save_for_backward({gate, up});
    return y;
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

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) { return SwiGlu::apply(gate, up); }

// ---------------------------------------------------------------- linear
// y = x · weightᵀ (+ bias); the backward's weight (and bias) gradients in fp32 accumulators rounded
// once to the parameter's dtype, as the custom_op path does.
struct Linear : torch::autograd::Function<Linear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias) {
    const DeviceOf guard(x);
    const at::Tensor x2 = rows_of(x, "linear");
    TORCH_CHECK_VALUE(weight.dim() == 2, "samebits.torch linear: argument 'weight': must be 2-D [out, in]");
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0);
    at::Tensor y = at::empty(shape, x.options());  // at its final shape (a view would refuse in-place updates)
    samebits::LinearForwardArgs a;
    a.x = view(x2, "linear", "x");
    a.weight = view(weight, "linear", "weight");
    if (bias && bias->defined()) a.bias = view(*bias, "linear", "bias");
    a.y = view(rows_of(y, "linear", "y"), "linear", "y");
    run([&] { samebits::linear_forward(context_of(x), a); });
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias"] = bool(bias && bias->defined());
    return y;
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
    at::Tensor dx = at::empty_like(x2), dw = at::zeros(weight.sizes(), weight.options().dtype(acc_of(weight)));
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
    if (has_bias) bw.dbias = view(db, "linear_backward", "dbias");
    run([&] {
      samebits::linear_backward_input(c, bi);
      samebits::linear_backward_weight(c, bw);
    });
    return {dx.view(x.sizes()), dw.to(weight.scalar_type()), has_bias ? db.to(weight.scalar_type()) : at::Tensor()};
  }
};

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return Linear::apply(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY(samebits_ext, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
}
// One kernel for every device, autograd included: the op records its own backward (RmsNorm), so it
// is registered at CompositeImplicitAutograd (the dispatcher runs it above autograd).
TORCH_LIBRARY_IMPL(samebits_ext, CompositeImplicitAutograd, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("linear", linear);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("swiglu", swiglu);
}
