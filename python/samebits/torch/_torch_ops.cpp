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
//
// A call that records a backward makes its autograd node by hand, as torch's own ops do
// (BackwardNode, below), not through torch::autograd::Function<T>: recording was still 1.31× (rms_norm)
// and 1.40× (embedding) the torch op's host time on an H100 against issue 29's 1.3×, and the
// Function's generic machinery was most of what recording added. On a 2-core CPU machine (torch
// 1.13, bench/bench_record_overhead.py, tiny tensors) what recording adds to a call went from
// 1.9–3.5 µs to 0.4–2.0 µs by op (rms_norm 2.8 → 1.1, embedding 2.2 → 0.6; attention, with six
// saved tensors, 3.2 → 2.0), the bits unchanged. The nodes have no compiled_args: under compiled
// autograd samebits.torch takes the custom_op path (ops.py, _eager). A node makes only the
// gradients its graph task wants (task_should_compute_output: a frozen weight, torch.autograd.grad
// of other inputs), never adding a weight's into its main_grad otherwise; under create_graph=True its
// gradients lead to an error node that raises, naming the op, where they are differentiated.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/saved_variable.h>
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
// An input with a forward-mode tangent (torch.autograd.forward_ad, grad mode or not) is refused: the
// ops have no forward derivative, and running them would drop the tangent without a word.
bool records(const char* op, std::initializer_list<const at::Tensor*> inputs) {
  bool wants_grad = false;
  for (const at::Tensor* t : inputs) {
    if (!t->defined()) continue;
    TORCH_CHECK_NOT_IMPLEMENTED(!t->_fw_grad(/*level=*/0).defined(), "samebits.torch ", op,
                                ": forward-mode AD is not supported");
    wants_grad = wants_grad || t->requires_grad();
  }
  return wants_grad && at::GradMode::is_enabled();
}

// ---------------------------------------------------------------- autograd nodes
// A call that records a backward makes its op's node by hand, the way torch's own ops do
// (torch/csrc/autograd/generated/Functions.h): edges to the inputs' gradient functions, the saved
// tensors as SavedVariables (torch's version-counter check, saved-tensor hooks, "backward through
// the graph a second time"), the constants as plain members. torch::autograd::Function<T> did the
// same through generic machinery — an AutogradContext, an IValue dictionary with string keys, the
// arguments unpacked and repacked — at a host-time cost (the file's header).
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

struct BackwardNode : torch::autograd::Node {
  // The engine may run a node's backward and release its saved tensors from different threads
  // (torch's generated nodes take a mutex in both; this one is ours, not Node's protected member).
  // Under create_graph=True (grad mode on in a backward) the gradients are made without recording
  // and given an error node: the library's backward kernels have no derivative of their own, and a
  // gradient without history would make a double backward drop this op's second-order terms
  // without a word. As torch's DelayedError, the error is raised only where a gradient is
  // differentiated.
  variable_list apply(variable_list&& grads) final {
    if (!at::GradMode::is_enabled()) return locked_backward(std::move(grads));
    torch::autograd::edge_list edges = torch::autograd::collect_next_edges(grads);
    variable_list out;
    {
      const at::NoGradGuard no_grad;
      out = locked_backward(std::move(grads));
    }
    return not_differentiable(std::move(out), std::move(edges));
  }
  // After a backward without retain_graph: the saved tensors go (a second backward raises torch's
  // "Trying to backward through the graph a second time").
  void release_variables() final {
    const std::lock_guard<std::mutex> lock(saved_mutex);
    release();
  }

 protected:
  // One gradient an input edge, in the order new_backward_node was given them (undefined where none).
  virtual variable_list backward(variable_list&& grads) = 0;
  virtual void release() = 0;
  // A saved tensor as the backward reads it (this node is the grad_fn of those saved as outputs).
  at::Tensor unpack(const SavedVariable& v) { return v.unpack(shared_from_this()); }
  // Whether this backward is to make input i's gradient: its input wants one (a frozen weight does
  // not) and this backward's graph task leads there (torch.autograd.grad of other inputs does not).
  // A gradient not wanted is not computed where it is a computation of its own, and is never
  // added into a main_grad.
  bool wants(size_t i) const { return i < num_outputs() && task_should_compute_output(i); }
  // The op's name in messages (rms_norm, linear, ...).
  virtual const char* op() const = 0;

 private:
  variable_list locked_backward(variable_list&& grads) {
    const std::lock_guard<std::mutex> lock(saved_mutex);
    return backward(std::move(grads));
  }
  // The gradients `out` as outputs of an error node whose edges lead to what they depend on (the
  // incoming gradients' history, `edges`, and this op's inputs), so that a backward of any of them
  // reaches it — torch.autograd.grad(..., allow_unused=True) too — and raises, naming the op.
  variable_list not_differentiable(variable_list out, torch::autograd::edge_list edges) {
    for (const torch::autograd::Edge& e : next_edges()) edges.push_back(e);
    auto error = std::make_shared<torch::autograd::Error>(
        std::string("samebits.torch ") + op() +
            ": double backward is not supported (a gradient made with create_graph=True was differentiated: "
            "samebits' backward has no derivative of its own)",
        std::move(edges));
    for (at::Tensor& g : out) {
      if (!g.defined()) continue;
      g = g.tensor_data();  // no view or autograd state of the backward's own: the error node's output
      torch::autograd::create_gradient_edge(g, error);
    }
    return out;
  }

  std::mutex saved_mutex;
};

// The node of a call that records, its edges to `inputs`' gradient functions (an undefined input,
// or one without requires_grad, gets an edge to nothing: its gradient is dropped).
template <class N, class... Inputs>
std::shared_ptr<N> new_backward_node(const Inputs&... inputs) {
  std::shared_ptr<N> node(new N(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  return node;
}

// The outputs' history: output i's gradient is the node's backward's grads[i]. Outputs the backward
// reads are saved after this (SavedVariable(out, /*is_output=*/true): no node → output → node cycle).
template <class... Outputs>
void attach_outputs(const std::shared_ptr<torch::autograd::Node>& node, Outputs&... outputs) {
  (torch::autograd::create_gradient_edge(outputs, node), ...);
}

// The forward of a call that records, below autograd: its own ATen calls (reshapes, allocations)
// record nothing and skip autograd's kernels. (Views made here share no version counter with their
// base: a saved view of an input is saved as the input itself, saved_input_or.)
using BelowAutograd = at::AutoDispatchBelowADInplaceOrView;

// What to save of `t`, a flat / narrowed form of the caller's `input`: `input` itself where t is a
// view of its memory (the backward flattens it again), so that an in-place change to it before the
// backward is torch's version-counter error; t where it is a copy.
at::Tensor saved_input_or(const at::Tensor& t, const at::Tensor& input) {
  return t.defined() && input.defined() && t.is_alias_of(input) ? input : t;
}
// Ids saved so, flat again (a view: the saved input's memory is the flat view's, contiguous).
at::Tensor flat_ids(const at::Tensor& saved) { return saved.dim() == 1 ? saved : saved.reshape({-1}); }

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
// Refuses a main_grad or segments the backward could not take. Called first, so a refusal comes
// before any work and before the call's autograd node is made.
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
// The backward's weight-gradient accumulator, and what autograd gets for the weight. A weight
// gradient not `wanted` (BackwardNode::wants) that a fused kernel writes all the same (the norms',
// the LM head's: dx and dweight in one pass) goes to a scratch buffer, never into main_grad, and
// autograd gets none.
at::Tensor dweight_of(const WeightGrad& g, const at::Tensor& weight, bool wanted = true) {
  return g.main_grad.defined() && wanted ? g.main_grad
                                         : at::zeros(weight.sizes(), weight.options().dtype(acc_of(weight)));
}
at::Tensor weight_grad_out(const WeightGrad& g, const at::Tensor& dw, const at::Tensor& weight, bool wanted = true) {
  return g.main_grad.defined() || !wanted ? at::Tensor() : dw.to(weight.scalar_type());
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
                                                const WeightGrad& wg, bool want_dw, const char* op) {
  const DeviceOf guard(s);
  const at::Tensor s2 = rows_of(s, op);
  const at::Tensor dy = rows_of(dy_in.defined() ? dy_in.contiguous() : at::zeros_like(s), op, "dy");
  at::Tensor ds;
  if (ds_in.defined()) ds = rows_of(ds_in.contiguous(), op, "dresidual_out");
  at::Tensor dx = at::empty_like(s), dw = dweight_of(wg, weight, want_dw);
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
  return {dx, weight_grad_out(wg, dw, weight, want_dw)};
}

struct RmsNormBackward final : BackwardNode {
  SavedVariable x_, weight_, rstd_;
  double eps = 0;
  WeightGrad wg;

  std::string name() const override { return "samebits::RmsNormBackward"; }
  const char* op() const override { return "rms_norm"; }
  variable_list backward(variable_list&& grads) override {  // edges: x, weight
    auto [dx, dw] = norm_backward(unpack(x_), unpack(weight_), unpack(rstd_), grads[0], at::Tensor(), eps, wg,
                                  wants(1), "rms_norm_backward");
    return {dx, dw};
  }
  void release() override {
    x_.reset_data();
    weight_.reset_data();
    rstd_.reset_data();
  }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const c10::optional<at::Tensor>& main_grad, at::OptionalIntArrayRef segments) {
  check_weight_grad(main_grad, segments, weight, "rms_norm");
  if (!records("rms_norm", {&x, &weight})) return norm_forward(x, nullptr, weight, eps, false, "rms_norm").y;
  NormOut o;
  {
    const BelowAutograd below;
    o = norm_forward(x, nullptr, weight, eps, true, "rms_norm");
  }
  auto node = new_backward_node<RmsNormBackward>(x, weight);
  node->x_ = SavedVariable(x, false);
  node->weight_ = SavedVariable(weight, false);
  node->rstd_ = SavedVariable(o.rstd, false);
  node->eps = eps;
  node->wg = weight_grad_of(main_grad, segments);
  attach_outputs(node, o.y);
  return o.y;
}

// ---------------------------------------------------------------- add_rms_norm
// s = x + residual (rounded once to x's dtype), y = rms_norm(s); returns (y, s). The backward takes
// gradients on both (the one on s added inside the norm's backward as the custom_op path does:
// dresidual_out) and gives both summands the same dx. A missing incoming gradient is given as zeros
// (as autograd.Function materializes it on the custom_op path: the same arguments).
struct AddRmsNormBackward final : BackwardNode {
  SavedVariable sum_, weight_, rstd_;  // sum_: the output s (the norm's input)
  double eps = 0;
  WeightGrad wg;

  std::string name() const override { return "samebits::AddRmsNormBackward"; }
  const char* op() const override { return "add_rms_norm"; }
  variable_list backward(variable_list&& grads) override {  // edges: x, residual, weight
    const at::Tensor s = unpack(sum_);
    // s without a gradient: zeros (dresidual_out given either way, as on the custom_op path)
    const at::Tensor ds = grads[1].defined() ? grads[1] : at::zeros_like(s);
    auto [dx, dw] = norm_backward(s, unpack(weight_), unpack(rstd_), grads[0], ds, eps, wg, wants(2),
                                  "add_rms_norm_backward");
    return {dx, dx, dw};
  }
  void release() override {
    sum_.reset_data();
    weight_.reset_data();
    rstd_.reset_data();
  }
};

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps,
                                                const c10::optional<at::Tensor>& main_grad,
                                                at::OptionalIntArrayRef segments) {
  check_weight_grad(main_grad, segments, weight, "add_rms_norm");
  if (!records("add_rms_norm", {&x, &residual, &weight})) {
    const NormOut o = norm_forward(x, &residual, weight, eps, false, "add_rms_norm");
    return {o.y, o.sum};
  }
  NormOut o;
  {
    const BelowAutograd below;
    o = norm_forward(x, &residual, weight, eps, true, "add_rms_norm");
  }
  auto node = new_backward_node<AddRmsNormBackward>(x, residual, weight);
  node->weight_ = SavedVariable(weight, false);
  node->rstd_ = SavedVariable(o.rstd, false);
  node->eps = eps;
  node->wg = weight_grad_of(main_grad, segments);
  attach_outputs(node, o.y, o.sum);
  node->sum_ = SavedVariable(o.sum, true);
  return {o.y, o.sum};
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

struct SwiGluBackward final : BackwardNode {
  SavedVariable gate_, up_;

  std::string name() const override { return "samebits::SwiGluBackward"; }
  const char* op() const override { return "swiglu"; }
  variable_list backward(variable_list&& grads) override {  // edges: gate, up
    const char* op = "swiglu_backward";
    const at::Tensor g = unpack(gate_), u = unpack(up_);
    const DeviceOf guard(g);
    const at::Tensor g2 = rows_of(g, op), u2 = rows_of(u, op);
    const at::Tensor dy = rows_of(grads[0].defined() ? grads[0].contiguous() : at::zeros_like(g), op);
    at::Tensor dg = at::empty_like(g2), du = at::empty_like(u2);
    samebits::SwiGluBackwardArgs a;
    a.dy = view(dy, op, "dy");
    a.gate = view(g2, op, "gate");
    a.up = view(u2, op, "up");
    a.dgate = view(dg, op, "dgate");
    a.dup = view(du, op, "dup");
    run([&] { samebits::swiglu_backward(context_of(g), a); });
    return {dg.view(g.sizes()), du.view(u.sizes())};
  }
  void release() override {
    gate_.reset_data();
    up_.reset_data();
  }
};

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  if (!records("swiglu", {&gate, &up})) return swiglu_forward(gate, up);
  at::Tensor y;
  {
    const BelowAutograd below;
    y = swiglu_forward(gate, up);
  }
  auto node = new_backward_node<SwiGluBackward>(gate, up);
  node->gate_ = SavedVariable(gate, false);
  node->up_ = SavedVariable(up, false);
  attach_outputs(node, y);
  return y;
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

struct LinearBackward final : BackwardNode {
  SavedVariable x_, weight_;
  bool has_bias = false;
  WeightGrad wg;

  std::string name() const override { return "samebits::LinearBackward"; }
  const char* op() const override { return "linear"; }
  // dx, and dweight with dbias, are separate computations: each made only where wanted (dweight
  // into a scratch buffer where only dbias is).
  variable_list backward(variable_list&& grads) override {  // edges: x, weight, bias
    const bool want_dx = wants(0), want_dw = wants(1), want_db = has_bias && wants(2);
    const at::Tensor x = unpack(x_), weight = unpack(weight_);
    const DeviceOf guard(x);
    const at::Tensor x2 = rows_of(x, "linear_backward");
    const at::Tensor g = grads[0].defined() ? grads[0].contiguous()
                                            : at::zeros({x2.size(0), weight.size(0)}, x2.options());
    const at::Tensor dy = g.reshape({-1, weight.size(0)});
    const samebits::Context c = context_of(x);
    at::Tensor dx, dw, db;
    if (want_dx) {
      dx = at::empty_like(x2);
      samebits::LinearBackwardInputArgs bi;
      bi.dy = view(dy, "linear_backward", "dy");
      bi.weight = view(weight, "linear_backward", "weight");
      bi.dx = view(dx, "linear_backward", "dx");
      run([&] { samebits::linear_backward_input(c, bi); });
      dx = dx.view(x.sizes());
    }
    if (want_dw || want_db) {
      const at::Tensor acc = dweight_of(wg, weight, want_dw);
      samebits::LinearBackwardWeightArgs bw;
      bw.dy = view(dy, "linear_backward", "dy");
      bw.x = view(x2, "linear_backward", "x");
      bw.dweight = view(acc, "linear_backward", "dweight");
      with_segments(bw.segments, wg, "linear_backward");
      at::Tensor db_acc;
      if (want_db) {
        db_acc = at::zeros({weight.size(0)}, weight.options().dtype(acc_of(weight)));
        bw.dbias = view(db_acc, "linear_backward", "dbias");
      }
      run([&] { samebits::linear_backward_weight(c, bw); });
      dw = weight_grad_out(wg, acc, weight, want_dw);
      if (want_db) db = db_acc.to(weight.scalar_type());
    }
    return {dx, dw, db};
  }
  void release() override {
    x_.reset_data();
    weight_.reset_data();
  }
};

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& main_grad, at::OptionalIntArrayRef segments) {
  check_weight_grad(main_grad, segments, weight, "linear");
  const at::Tensor none;
  if (!records("linear", {&x, &weight, bias ? &*bias : &none})) return linear_forward(x, weight, bias);
  at::Tensor y;
  {
    const BelowAutograd below;
    y = linear_forward(x, weight, bias);
  }
  auto node = new_backward_node<LinearBackward>(x, weight, bias);
  node->x_ = SavedVariable(x, false);
  node->weight_ = SavedVariable(weight, false);
  node->has_bias = bias && bias->defined();
  node->wg = weight_grad_of(main_grad, segments);
  attach_outputs(node, y);
  return y;
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

struct TokenLogprobsBackward final : BackwardNode {
  SavedVariable logits_, targets_, lse_;  // targets_: the caller's int32 targets, or their int32 copy

  std::string name() const override { return "samebits::TokenLogprobsBackward"; }
  const char* op() const override { return "token_logprobs"; }
  variable_list backward(variable_list&& grads) override {  // edges: logits
    const char* op = "token_logprobs_backward";
    const at::Tensor logits = unpack(logits_), t = flat_ids(unpack(targets_)), lse = unpack(lse_);
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
    return {dl.view(logits.sizes())};
  }
  void release() override {
    logits_.reset_data();
    targets_.reset_data();
    lse_.reset_data();
  }
};

std::tuple<at::Tensor, at::Tensor> token_logprobs(const at::Tensor& logits, const at::Tensor& targets) {
  if (!records("token_logprobs", {&logits})) {
    const LogprobOut o = logprob_forward(logits, targets, false);
    return {o.logp, o.entropy};
  }
  LogprobOut o;
  {
    const BelowAutograd below;
    o = logprob_forward(logits, targets, true);
  }
  auto node = new_backward_node<TokenLogprobsBackward>(logits);
  node->logits_ = SavedVariable(logits, false);
  node->targets_ = SavedVariable(saved_input_or(o.targets, targets), false);
  node->lse_ = SavedVariable(o.lse, false);
  attach_outputs(node, o.logp, o.entropy);
  return {o.logp, o.entropy};
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

struct AttentionBackward final : BackwardNode {
  SavedVariable q_, k_, v_, seqs_, out_, lse_;  // out_: the output
  double scale = 0;

  std::string name() const override { return "samebits::AttentionBackward"; }
  const char* op() const override { return "attention"; }
  variable_list backward(variable_list&& grads) override {  // edges: q, k, v
    const char* op = "attention_backward";
    const at::Tensor q = unpack(q_), k = unpack(k_), v = unpack(v_), seqs = unpack(seqs_), out = unpack(out_),
                     lse = unpack(lse_);
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
    a.scale = scale;
    run([&] { samebits::attention_backward(context_of(q), a); });
    return {dq, dk, dv};
  }
  void release() override {
    q_.reset_data();
    k_.reset_data();
    v_.reset_data();
    seqs_.reset_data();
    out_.reset_data();
    lse_.reset_data();
  }
};

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef lengths,
                     double scale) {
  if (!records("attention", {&q, &k, &v})) return attention_forward(q, k, v, lengths, scale, false).out;
  AttentionOut o;
  {
    const BelowAutograd below;
    o = attention_forward(q, k, v, lengths, scale, true);
  }
  auto node = new_backward_node<AttentionBackward>(q, k, v);
  node->q_ = SavedVariable(q, false);
  node->k_ = SavedVariable(k, false);
  node->v_ = SavedVariable(v, false);
  node->seqs_ = SavedVariable(o.seqs, false);
  node->lse_ = SavedVariable(o.lse, false);
  node->scale = scale;
  attach_outputs(node, o.out);
  node->out_ = SavedVariable(o.out, true);
  return o.out;
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

struct EmbeddingBackward final : BackwardNode {
  SavedVariable ids_, table_;  // ids_: the caller's ids (or their contiguous copy)
  bool ids_checked = false;
  WeightGrad wg;

  std::string name() const override { return "samebits::EmbeddingBackward"; }
  const char* op() const override { return "embedding"; }
  variable_list backward(variable_list&& grads) override {  // edges: table
    if (!wants(0)) return {at::Tensor()};  // never into main_grad (the engine seldom runs it so)
    const char* op = "embedding_backward";
    const at::Tensor flat = flat_ids(unpack(ids_)), table = unpack(table_);
    const DeviceOf guard(table);
    const at::Tensor dy = grads[0].defined() ? grads[0].reshape({-1, table.size(1)}).contiguous()
                                             : at::zeros({flat.size(0), table.size(1)}, table.options());
    at::Tensor dt = dweight_of(wg, table);
    samebits::EmbeddingBackwardArgs a;
    a.ids = view(flat, op, "ids");
    a.dy = view(dy, op, "dy");
    a.dtable = view(dt, op, "dtable");
    a.ids_checked = ids_checked;
    run([&] { samebits::embedding_backward(context_of(table), a); });
    return {weight_grad_out(wg, dt, table)};
  }
  void release() override {
    ids_.reset_data();
    table_.reset_data();
  }
};

// ids_checked (samebits.hf.patch's ids checked on the host): the library's
// EmbeddingForwardArgs::ids_checked — no range check, no read-back.
at::Tensor embedding(const at::Tensor& ids, const at::Tensor& table, const c10::optional<at::Tensor>& main_grad,
                     bool ids_checked) {
  check_weight_grad(main_grad, c10::nullopt, table, "embedding");
  if (!records("embedding", {&table})) return embedding_forward(ids, table, ids_checked).first;
  std::pair<at::Tensor, at::Tensor> y_flat;
  {
    const BelowAutograd below;
    y_flat = embedding_forward(ids, table, ids_checked);
  }
  auto& [y, flat] = y_flat;
  auto node = new_backward_node<EmbeddingBackward>(table);
  node->ids_ = SavedVariable(saved_input_or(flat, ids), false);
  node->table_ = SavedVariable(table, false);
  node->ids_checked = ids_checked;
  node->wg = weight_grad_of(main_grad, c10::nullopt);
  attach_outputs(node, y);
  return y;
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

struct QkNormBackward final : BackwardNode {
  SavedVariable x_, weight_, rstd_, positions_;  // positions_: the caller's int32 positions or their copy
  double eps = 0, theta = 0;
  std::vector<double> llama3;
  WeightGrad wg;

  std::string name() const override { return "samebits::QkNormBackward"; }
  const char* op() const override { return "qk_norm"; }
  variable_list backward(variable_list&& grads) override {  // edges: x, weight
    const char* op = "qk_norm_backward";
    const at::Tensor x = unpack(x_), weight = unpack(weight_), rstd = unpack(rstd_), pos = unpack(positions_);
    const DeviceOf guard(x);
    const at::Tensor dy = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(x);
    at::Tensor dx = at::empty_like(x), dw = dweight_of(wg, weight, wants(1));
    samebits::QkNormBackwardArgs a;
    with_segments(a.segments, wg, op);
    a.dy = view(dy, op, "dy");
    a.x = view(x, op, "x");
    a.weight = view(weight, op, "weight");
    a.rstd = view(rstd, op, "rstd");
    a.dx = view(dx, op, "dx");
    a.dweight = view(dw, op, "dweight");
    a.eps = eps;
    at::Tensor flat_pos;
    if (pos.defined()) {
      flat_pos = flat_ids(pos);
      a.positions = view(flat_pos, op, "positions");
    }
    a.rope = rope_config(theta, llama3, op);
    run([&] { samebits::qk_norm_backward(context_of(x), a); });
    return {dx, weight_grad_out(wg, dw, weight, wants(1))};
  }
  void release() override {
    x_.reset_data();
    weight_.reset_data();
    rstd_.reset_data();
    positions_.reset_data();
  }
};

at::Tensor qk_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                   const c10::optional<at::Tensor>& positions,
                   double theta, at::ArrayRef<double> llama3,
                   const c10::optional<at::Tensor>& main_grad, at::OptionalIntArrayRef segments) {
  check_weight_grad(main_grad, segments, weight, "qk_norm");
  const at::Tensor pos = positions ? *positions : at::Tensor();
  if (!records("qk_norm", {&x, &weight}))
    return std::get<0>(qk_norm_forward(x, weight, eps, pos, theta, llama3, false));
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out;
  {
    const BelowAutograd below;
    out = qk_norm_forward(x, weight, eps, pos, theta, llama3, true);
  }
  auto& [y, rstd, pos32] = out;
  auto node = new_backward_node<QkNormBackward>(x, weight);
  node->x_ = SavedVariable(x, false);
  node->weight_ = SavedVariable(weight, false);
  node->rstd_ = SavedVariable(rstd, false);
  node->positions_ = SavedVariable(saved_input_or(pos32, pos), false);
  node->eps = eps;
  node->theta = theta;
  node->llama3 = llama3.vec();
  node->wg = weight_grad_of(main_grad, segments);
  attach_outputs(node, y);
  return y;
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

struct LmHeadLogprobsBackward final : BackwardNode {
  SavedVariable hidden_, weight_, targets_, mask_, lse_;  // targets_: the caller's int32 targets or their copy
  at::Tensor kept;  // the forward's first rows' fp32 logits (where kept), taken by the first backward
  bool targets_checked = false;
  WeightGrad wg;

  std::string name() const override { return "samebits::LmHeadLogprobsBackward"; }
  const char* op() const override { return "lm_head_logprobs"; }
  // An output without a gradient gets none here (no zero entropy gradient: with one, the backward
  // would recompute the statistics, a whole extra pass of the LM-head GEMM).
  variable_list backward(variable_list&& grads) override {  // edges: hidden, weight
    const char* op = "lm_head_logprobs_backward";
    const at::Tensor hidden = unpack(hidden_), weight = unpack(weight_), t = flat_ids(unpack(targets_)),
                     mask = unpack(mask_), lse = unpack(lse_);
    const DeviceOf guard(hidden);
    const at::Tensor h2 = rows_of(hidden, op, "hidden");
    auto flat = [&](const at::Tensor& g) {
      return g.defined() ? g.reshape({-1}).to(lse.scalar_type()).contiguous() : at::zeros_like(lse);
    };
    const at::Tensor dlogp = flat(grads[0]), dentropy = grads[1].defined() ? flat(grads[1]) : at::Tensor();
    // A frozen head (no gradient wanted for the weight): no dweight, so neither its vocab-sized fp32
    // accumulator nor the weight-gradient GEMM (the library skips it; dhidden's bits are the same).
    const bool want_dw = wants(1);
    at::Tensor dh = at::empty_like(hidden), dw = want_dw ? dweight_of(wg, weight) : at::Tensor();
    samebits::LmHeadLogprobBackwardArgs a;
    with_segments(a.segments, wg, op);
    a.hidden = view(h2, op, "hidden");
    a.weight = view(weight, op, "weight");
    a.targets = view(t, op, "targets");
    a.loss_mask = view(mask, op, "loss_mask");
    a.lse = view(lse, op, "lse");
    a.dlogp = view(dlogp, op, "dlogp");
    if (dentropy.defined()) a.dentropy = view(dentropy, op, "dentropy");
    a.targets_checked = targets_checked;
    // Taken once: the buffer goes with this backward (a retained graph's next backward recomputes the
    // logits: the same bits).
    const at::Tensor logits = std::move(kept);
    kept = at::Tensor();
    if (logits.defined()) a.logits_kept = view(logits, op, "logits_kept");
    a.dhidden = view(rows_of(dh, op, "dhidden"), op, "dhidden");
    if (want_dw) a.dweight = view(dw, op, "dweight");
    run([&] { samebits::lm_head_logprob_backward(context_of(hidden), a); });
    return {dh, want_dw ? weight_grad_out(wg, dw, weight) : at::Tensor()};
  }
  void release() override {
    hidden_.reset_data();
    weight_.reset_data();
    targets_.reset_data();
    mask_.reset_data();
    lse_.reset_data();
    kept = at::Tensor();
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
  if (!records("lm_head_logprobs", {&hidden, &weight})) {
    const LmHeadOut o = lm_head_forward(hidden, weight, targets, false, targets_checked);
    return {o.logp, o.entropy};
  }
  const WeightGrad wg = weight_grad_of(main_grad, segments);
  LmHeadOut o;
  {
    const BelowAutograd below;
    o = lm_head_forward(hidden, weight, targets, true, targets_checked, keep_logits_bytes, wg.segments);
  }
  auto node = new_backward_node<LmHeadLogprobsBackward>(hidden, weight);
  node->hidden_ = SavedVariable(hidden, false);
  node->weight_ = SavedVariable(weight, false);
  node->targets_ = SavedVariable(saved_input_or(o.targets, targets), false);
  node->mask_ = SavedVariable(o.mask, false);
  node->lse_ = SavedVariable(o.lse, false);
  node->kept = o.kept;
  node->targets_checked = targets_checked;
  node->wg = wg;
  attach_outputs(node, o.logp, o.entropy);
  return {o.logp, o.entropy};
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
