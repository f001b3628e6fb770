// samebits._core — the Python door to the C++ library (pybind11).
//
// Why it is shaped this way: Python should reach the same code the CLI and the tests run, not a
// second implementation. So the module is thin: the model chain (load a Hugging Face directory,
// score token sequences, take the gradient of their summed logprobs) and the ops on tensors the
// caller describes (`raw`: NumPy arrays via samebits/__init__.py, torch tensors via
// samebits/torch.py), each validated by the library itself; samebits::Error becomes samebits.Error
// (a ValueError) carrying the library's message, which names the op, the argument and the problem.
// Arrays must already be C-contiguous and of a supported dtype: nothing is copied or cast
// silently, because a silent cast would change the bits the caller asked about.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

#include "samebits/chain.hpp"
#include "samebits/context.hpp"
#include "samebits/device.hpp"
#include "samebits/engine.hpp"
#include "samebits/error.hpp"
#include "samebits/model.hpp"
#include "samebits/ops.hpp"
// The library's kernel-shape test hooks (src/ops/tuning.hpp: not installed, not public), for
// _set_tuning below: benchmarks' A/B timing and tests only.
#include "ops/tuning.hpp"

namespace py = pybind11;
using namespace samebits;

namespace {

// ---------------------------------------------------------------- raw ops (torch / DLPack door)
// A tensor described by the caller as (data pointer, dtype name, shape, device "cpu" | "cuda"), as
// samebits.torch builds it from a torch.Tensor. The caller guarantees a contiguous layout and that
// the memory outlives the call; the op validates dtypes and shapes. None: an omitted argument.
DType dtype_from(const std::string& name, const char* op, const char* arg) {
  for (DType d : {DType::bf16, DType::f16, DType::f32, DType::f64, DType::i32, DType::u8, DType::i64})
    if (name == dtype_name(d)) return d;
  throw Error(op, arg, "dtype \"" + name + "\" is not taken (bf16, fp16, fp32, int32, uint8, int64)");
}

TensorView desc(const py::object& o, const char* op, const char* arg) {
  if (o.is_none()) return TensorView{};
  const auto t = o.cast<py::tuple>();
  // A fifth element (the owning object, e.g. the torch.Tensor) is allowed and ignored: the tuple
  // keeps it alive for the call.
  if (t.size() != 4 && t.size() != 5) throw Error(op, arg, "a tensor is described as (pointer, dtype, shape, device[, owner])");
  const auto shape = t[2].cast<std::vector<int64_t>>();
  if (shape.size() > size_t(kMaxDims)) throw Error(op, arg, "has too many dimensions");
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) throw Error(op, arg, "has a negative dimension");
    numel *= d;
  }
  if (t[0].cast<uintptr_t>() == 0 && numel > 0) throw Error(op, arg, "is a null pointer");
  const auto device = t[3].cast<std::string>();
  if (device != "cpu" && device != "cuda") throw Error(op, arg, "lives on device \"" + device + "\" (cpu or cuda only)");
  return TensorView::of(reinterpret_cast<void*>(t[0].cast<uintptr_t>()), dtype_from(t[1].cast<std::string>(), op, arg),
                        shape.data(), int(shape.size()), device == "cuda" ? Device::cuda : Device::cpu);
}

// The backend of an op's tensors (those of its first argument) and the caller's stream. An fp64
// tensor selects the truth mode (the CPU's fp64 arithmetic, whose accumulators and per-row
// statistics are fp64 too): what torch.autograd.gradcheck runs the ops in.
Context raw_ctx(const TensorView& first, bool any_fp64, uintptr_t stream) {
  Context ctx;
  ctx.backend = first.device == Device::cuda ? Backend::cuda : Backend::cpu;
  if (any_fp64) ctx.precision = Precision::truth_fp64;
  ctx.stream = reinterpret_cast<void*>(stream);
  return ctx;
}

// One raw op: its argument struct's tensors and scalars, in the order they are taken positionally
// (then "stream"), each also by keyword. The op's first tensor decides the backend. Tensors left
// out (or None) are omitted arguments; scalars left out keep the struct's default.
template <class A>
struct RawOp {
  const char* op;  // the name the errors carry
  std::vector<std::pair<const char*, TensorView A::*>> tensors;
  std::vector<std::pair<const char*, void (*)(A&, const py::handle&)>> scalars;
  void (*run)(const Context&, const A&);
};

template <class A>
void bind_raw_op(py::module_& r, const char* name, RawOp<A> t) {
  std::string doc = std::string(name) + "(";
  for (auto& [n, _] : t.tensors) doc += std::string(n) + ", ";
  for (auto& [n, _] : t.scalars) doc += std::string(n) + ", ";
  doc += "stream=0)";
  r.def(name, [t](const py::args& args, const py::kwargs& kw) {
    std::vector<std::string> names;
    for (auto& [n, _] : t.tensors) names.push_back(n);
    for (auto& [n, _] : t.scalars) names.push_back(n);
    names.push_back("stream");
    if (args.size() > names.size())
      throw Error(t.op, "arguments", "takes at most " + std::to_string(names.size()) + " positional arguments");
    for (auto item : kw) {
      const std::string k = item.first.cast<std::string>();
      if (std::find(names.begin(), names.end(), k) == names.end()) throw Error(t.op, k, "is not an argument of this op");
    }
    auto value = [&](size_t i) -> py::object {
      if (i < args.size()) {
        if (kw.contains(names[i].c_str())) throw Error(t.op, names[i].c_str(), "is given twice");
        return args[i];
      }
      return kw.contains(names[i].c_str()) ? py::object(kw[names[i].c_str()]) : py::object(py::none());
    };
    A a{};
    size_t i = 0;
    bool any_fp64 = false;
    for (auto& [n, member] : t.tensors) {
      a.*member = desc(value(i++), t.op, n);
      any_fp64 = any_fp64 || (a.*member).dtype == DType::f64;
    }
    for (auto& [n, set] : t.scalars) {
      const py::object v = value(i++);
      if (!v.is_none()) set(a, v);
    }
    const py::object s = value(i);
    t.run(raw_ctx(a.*(t.tensors.front().second), any_fp64, s.is_none() ? 0 : s.cast<uintptr_t>()), a);
  }, doc.c_str());
}

template <class A>
void set_eps(A& a, const py::handle& v) { a.eps = v.cast<double>(); }
template <class A>
void set_scale(A& a, const py::handle& v) { a.scale = v.cast<double>(); }
template <class A>
void set_ignore_index(A& a, const py::handle& v) { a.ignore_index = v.cast<int32_t>(); }

// RoPE's configuration as a dict: theta, max_position, and Llama-3 scaling (llama3_scaling, factor,
// low_freq_factor, high_freq_factor, original_max_position); keys left out keep their defaults.
RopeConfig rope_from(const py::handle& v) {
  RopeConfig c;
  for (auto item : v.cast<py::dict>()) {
    const std::string k = item.first.cast<std::string>();
    const py::handle x = item.second;
    if (k == "theta") c.theta = x.cast<double>();
    else if (k == "max_position") c.max_position = x.cast<int64_t>();
    else if (k == "llama3_scaling") c.llama3_scaling = x.cast<bool>();
    else if (k == "factor") c.factor = x.cast<double>();
    else if (k == "low_freq_factor") c.low_freq_factor = x.cast<double>();
    else if (k == "high_freq_factor") c.high_freq_factor = x.cast<double>();
    else if (k == "original_max_position") c.original_max_position = x.cast<int64_t>();
    else throw Error("rope", k, "is not a RoPE setting (theta, max_position, llama3_scaling, factor, low_freq_factor, "
                                "high_freq_factor, original_max_position)");
  }
  return c;
}
template <class A>
void set_rope(A& a, const py::handle& v) { a.rope = rope_from(v); }
void set_rope_config(RopeArgs& a, const py::handle& v) { a.config = rope_from(v); }
void set_page_size(AttentionForwardArgs& a, const py::handle& v) { a.page_size = v.cast<int64_t>(); }

void bind_raw(py::module_& m) {
  auto r = m.def_submodule("raw", "The ops on caller-described tensors (pointer, dtype, shape, device[, owner]), on "
                                  "the caller's stream; what samebits.torch calls. Outputs are written, fp32 "
                                  "weight-gradient accumulators added into. Argument meanings: samebits/ops.hpp.");
  using LF = LinearForwardArgs;
  bind_raw_op<LF>(r, "linear_forward", {"linear", {{"x", &LF::x}, {"weight", &LF::weight}, {"bias", &LF::bias}, {"y", &LF::y}}, {}, linear_forward});
  using LI = LinearBackwardInputArgs;
  bind_raw_op<LI>(r, "linear_backward_input", {"linear_backward", {{"dy", &LI::dy}, {"weight", &LI::weight}, {"dx", &LI::dx}}, {}, linear_backward_input});
  using LW = LinearBackwardWeightArgs;
  bind_raw_op<LW>(r, "linear_backward_weight", {"linear_backward", {{"dy", &LW::dy}, {"x", &LW::x}, {"dweight", &LW::dweight}, {"dbias", &LW::dbias}}, {}, linear_backward_weight});
  using NF = RmsNormForwardArgs;
  bind_raw_op<NF>(r, "rmsnorm_forward", {"rms_norm", {{"x", &NF::x}, {"weight", &NF::weight}, {"y", &NF::y}, {"rstd", &NF::rstd}, {"residual", &NF::residual}, {"residual_out", &NF::residual_out}}, {{"eps", set_eps<NF>}}, rmsnorm_forward});
  using NB = RmsNormBackwardArgs;
  bind_raw_op<NB>(r, "rmsnorm_backward", {"rms_norm_backward", {{"dy", &NB::dy}, {"x", &NB::x}, {"weight", &NB::weight}, {"rstd", &NB::rstd}, {"dx", &NB::dx}, {"dweight", &NB::dweight}, {"dresidual_out", &NB::dresidual_out}}, {{"eps", set_eps<NB>}}, rmsnorm_backward});
  using PF = LogprobForwardArgs;
  bind_raw_op<PF>(r, "logprob_forward", {"token_logprobs", {{"logits", &PF::logits}, {"targets", &PF::targets}, {"loss_mask", &PF::loss_mask}, {"logp", &PF::logp}, {"entropy", &PF::entropy}, {"lse", &PF::lse}}, {}, logprob_forward});
  using PB = LogprobBackwardArgs;
  bind_raw_op<PB>(r, "logprob_backward", {"token_logprobs_backward", {{"logits", &PB::logits}, {"targets", &PB::targets}, {"loss_mask", &PB::loss_mask}, {"lse", &PB::lse}, {"dlogp", &PB::dlogp}, {"dentropy", &PB::dentropy}, {"dlogits", &PB::dlogits}}, {}, logprob_backward});
  using AF = AttentionForwardArgs;
  bind_raw_op<AF>(r, "attention_forward", {"attention", {{"q", &AF::q}, {"k", &AF::k}, {"v", &AF::v}, {"seqs", &AF::seqs}, {"out", &AF::out}, {"lse", &AF::lse}}, {{"scale", set_scale<AF>}}, attention_forward});
  // attention_forward with a paged KV cache: block_table (host int32 [B, pages]) and page_size; k / v
  // are then a pool of pages (ops.hpp). A separate name, so that attention_forward's positional
  // arguments (which samebits.torch passes) stay as they are.
  bind_raw_op<AF>(r, "attention_forward_paged", {"attention", {{"q", &AF::q}, {"k", &AF::k}, {"v", &AF::v}, {"seqs", &AF::seqs}, {"out", &AF::out}, {"lse", &AF::lse}, {"block_table", &AF::block_table}}, {{"scale", set_scale<AF>}, {"page_size", set_page_size}}, attention_forward});
  using AB = AttentionBackwardArgs;
  bind_raw_op<AB>(r, "attention_backward", {"attention_backward", {{"q", &AB::q}, {"k", &AB::k}, {"v", &AB::v}, {"seqs", &AB::seqs}, {"out", &AB::out}, {"lse", &AB::lse}, {"dout", &AB::dout}, {"dq", &AB::dq}, {"dk", &AB::dk}, {"dv", &AB::dv}}, {{"scale", set_scale<AB>}}, attention_backward});
  using EF = EmbeddingForwardArgs;
  bind_raw_op<EF>(r, "embedding_forward", {"embedding", {{"ids", &EF::ids}, {"table", &EF::table}, {"y", &EF::y}}, {}, embedding_forward});
  using EB = EmbeddingBackwardArgs;
  bind_raw_op<EB>(r, "embedding_backward", {"embedding_backward", {{"ids", &EB::ids}, {"dy", &EB::dy}, {"row_mask", &EB::row_mask}, {"dtable", &EB::dtable}}, {}, embedding_backward});
  using SF = SwiGluForwardArgs;
  bind_raw_op<SF>(r, "swiglu_forward", {"swiglu", {{"gate", &SF::gate}, {"up", &SF::up}, {"y", &SF::y}}, {}, swiglu_forward});
  using SB = SwiGluBackwardArgs;
  bind_raw_op<SB>(r, "swiglu_backward", {"swiglu_backward", {{"dy", &SB::dy}, {"gate", &SB::gate}, {"up", &SB::up}, {"dgate", &SB::dgate}, {"dup", &SB::dup}}, {}, swiglu_backward});
  using RD = ResidualAddArgs;
  bind_raw_op<RD>(r, "residual_add_forward", {"residual_add", {{"a", &RD::a}, {"b", &RD::b}, {"y", &RD::y}}, {}, residual_add_forward});
  using RA = RopeArgs;
  bind_raw_op<RA>(r, "rope_forward", {"rope", {{"x", &RA::x}, {"positions", &RA::positions}, {"y", &RA::y}}, {{"rope", set_rope_config}}, rope_forward});
  bind_raw_op<RA>(r, "rope_backward", {"rope_backward", {{"x", &RA::x}, {"positions", &RA::positions}, {"y", &RA::y}}, {{"rope", set_rope_config}}, rope_backward});
  using QF = QkNormForwardArgs;
  bind_raw_op<QF>(r, "qk_norm_forward", {"qk_norm", {{"x", &QF::x}, {"weight", &QF::weight}, {"y", &QF::y}, {"rstd", &QF::rstd}, {"positions", &QF::positions}}, {{"eps", set_eps<QF>}, {"rope", set_rope<QF>}}, qk_norm_forward});
  using QB = QkNormBackwardArgs;
  bind_raw_op<QB>(r, "qk_norm_backward", {"qk_norm_backward", {{"dy", &QB::dy}, {"x", &QB::x}, {"weight", &QB::weight}, {"rstd", &QB::rstd}, {"dx", &QB::dx}, {"dweight", &QB::dweight}, {"positions", &QB::positions}}, {{"eps", set_eps<QB>}, {"rope", set_rope<QB>}}, qk_norm_backward});
  using HF = LmHeadLogprobForwardArgs;
  bind_raw_op<HF>(r, "lm_head_logprob_forward", {"lm_head_logprobs", {{"hidden", &HF::hidden}, {"weight", &HF::weight}, {"targets", &HF::targets}, {"loss_mask", &HF::loss_mask}, {"logp", &HF::logp}, {"entropy", &HF::entropy}, {"lse", &HF::lse}, {"logits_kept", &HF::logits_kept}}, {{"ignore_index", set_ignore_index<HF>}}, lm_head_logprob_forward});
  using HB = LmHeadLogprobBackwardArgs;
  bind_raw_op<HB>(r, "lm_head_logprob_backward", {"lm_head_logprobs_backward", {{"hidden", &HB::hidden}, {"weight", &HB::weight}, {"targets", &HB::targets}, {"loss_mask", &HB::loss_mask}, {"lse", &HB::lse}, {"dlogp", &HB::dlogp}, {"dentropy", &HB::dentropy}, {"dhidden", &HB::dhidden}, {"dweight", &HB::dweight}, {"logits_kept", &HB::logits_kept}, {"segments", &HB::segments}}, {{"ignore_index", set_ignore_index<HB>}}, lm_head_logprob_backward});
}

std::vector<std::vector<int32_t>> token_lists(const std::vector<std::vector<int64_t>>& seqs, const ModelConfig& config) {
  const int64_t vocab = config.vocab_size;
  if (seqs.empty()) throw Error("Chain", "sequences", "empty batch: no sequences");
  std::vector<std::vector<int32_t>> out;
  for (size_t s = 0; s < seqs.size(); ++s) {
    if (seqs[s].empty()) throw Error("Chain", "sequences", "sequence " + std::to_string(s) + " is empty");
    if (int64_t(seqs[s].size()) > config.rope.max_position)
      throw Error("Chain", "sequences",
                  "sequence " + std::to_string(s) + " has " + std::to_string(seqs[s].size()) +
                      " tokens, more than the model's max_position_embeddings (" +
                      std::to_string(config.rope.max_position) + ")");
    std::vector<int32_t> t;
    for (int64_t id : seqs[s]) {
      if (id < 0 || id >= vocab)
        throw Error("Chain", "sequences",
                    "token id " + std::to_string(id) + " in sequence " + std::to_string(s) + " is outside [0, " +
                        std::to_string(vocab) + ")");
      t.push_back(int32_t(id));
    }
    out.push_back(std::move(t));
  }
  return out;
}

// One forward of a packed batch, kept for its backward: the batch's tables and every activation
// (in the chain's backend memory). `logp` / `entropy`: the scored tokens, flat, in sequence order —
// sequence s contributes len_s - 1 values, for its tokens 1 … len_s - 1.
struct PyForward {
  ChainBatch batch;
  ChainForward fwd;
  py::array_t<double> flat(const std::vector<double>& per_row) const {
    std::vector<double> out;
    for (const ChainSequence& s : batch.seqs)
      for (int64_t i = 0; i + 1 < s.len; ++i) out.push_back(per_row[size_t(s.row + i)]);
    return py::array_t<double>(py::ssize_t(out.size()), out.data());
  }
  int64_t scored() const {
    int64_t n = 0;
    for (const ChainSequence& s : batch.seqs) n += s.len - 1;
    return n;
  }
};

// Gradient accumulators filled by backward calls (fp32, in the chain's backend memory).
struct PyGrads {
  std::shared_ptr<ModelGrads> grads;
  bool tied = false;
  Backend backend = Backend::cpu;

  py::array_t<float> host(const std::string& name) const {
    const HostTensor g = grads->gradient(name);  // an unknown name: samebits.Error
    std::vector<py::ssize_t> shape(g.shape().begin(), g.shape().end());
    py::array_t<float> a(shape);
    std::memcpy(a.mutable_data(), g.data(), g.bytes());
    return a;
  }
  // The accumulator `name` in GPU memory as a __cuda_array_interface__ dict (torch.as_tensor takes
  // it; the caller keeps this object alive). A tied model has two: model.embed_tokens.weight (the
  // embedding's use) and lm_head.weight (the LM head's); the gradient is their sum.
  py::dict cuda_array_interface(const std::string& name) {
    if (backend != Backend::cuda) throw Error("Grads", name, "the gradients are in CPU memory: use host()");
    const auto it = grads->accumulators().find(name);
    if (it == grads->accumulators().end()) throw Error("Grads", name, "no such accumulator");
    DeviceTensor& t = grads->accumulator(name);
    py::dict d;
    py::tuple shape(t.shape().size());
    for (size_t i = 0; i < t.shape().size(); ++i) shape[i] = t.shape()[i];
    d["shape"] = shape;
    d["typestr"] = "<f4";
    d["data"] = py::make_tuple(reinterpret_cast<uintptr_t>(t.view().data), false);
    d["version"] = 3;
    d["strides"] = py::none();
    d["stream"] = 1;  // the legacy default stream: the chain's
    return d;
  }
};

std::vector<double> flat_to_rows(const ChainBatch& b, const py::array_t<double, py::array::c_style | py::array::forcecast>& flat,
                                 int64_t scored) {
  if (flat.ndim() != 1 || flat.shape(0) != scored)
    throw Error("Chain.backward", "dlogp", "expected a 1-D array of " + std::to_string(scored) +
                                               " values (one per scored token, as forward's logp), got " +
                                               std::to_string(flat.ndim() == 1 ? flat.shape(0) : -1));
  std::vector<double> rows(size_t(b.rows()), 0.0);
  const double* d = flat.data();
  int64_t k = 0;
  for (const ChainSequence& s : b.seqs)
    for (int64_t i = 0; i + 1 < s.len; ++i, ++k) {
      if (!std::isfinite(d[k])) throw Error("Chain.backward", "dlogp", "value " + std::to_string(k) + " is not finite");
      rows[size_t(s.row + i)] = d[k];
    }
  return rows;
}

// A KV cache made by Chain.kv_cache: `slots` sequences of up to `capacity` tokens each, in the
// memory of the chain's backend (a GPU chain's cache lives on the GPU). Remembers its model, so that
// a step never runs it with another model's chain.
struct PyKvCache {
  std::shared_ptr<KvCache> cache;
  const Model* model = nullptr;
  int64_t slots = 0;

  int64_t length(int64_t slot) const {
    check_slot(slot, "KvCache.length");
    return cache->length(slot);
  }
  void reset(int64_t slot) {
    check_slot(slot, "KvCache.reset");
    cache->reset(slot);
  }
  void check_slot(int64_t slot, const char* who) const {
    if (slot < 0 || slot >= slots)
      throw Error(who, "slot", std::to_string(slot) + " is outside [0, " + std::to_string(slots) + ")");
  }
};

// What a Python forward keeps: everything, each layer's input alone (recompute), or nothing (keep=False).
ForwardKeep keep_of(bool keep, bool recompute) {
  return !keep ? ForwardKeep::none : recompute ? ForwardKeep::layer_inputs : ForwardKeep::all;
}

// The model chain of one model on one backend. Keeps its Model alive (keep_alive below).
class PyChain {
 public:
  PyChain(const Model& model, const std::string& backend) : model_(model), chain_(model, ctx_for(backend)) {}

  // Per sequence an array of its length: entry i is log p(token i | tokens < i); entry 0 is NaN.
  // No activations are kept (Chain::score): scoring holds about two layers' activations, not all.
  py::object logprobs(const std::vector<std::vector<int64_t>>& seqs, bool entropy) const {
    const std::shared_ptr<PyForward> kept = forward(seqs, /*keep=*/false);
    const ChainForward& f = kept->fwd;
    py::list lp, en;
    for (const ChainSequence& s : kept->batch.seqs) {
      py::array_t<double> a(s.len), e(s.len);
      double *pa = a.mutable_data(), *pe = e.mutable_data();
      pa[0] = pe[0] = std::numeric_limits<double>::quiet_NaN();
      for (int64_t i = 0; i + 1 < s.len; ++i) {
        pa[i + 1] = f.logp[size_t(s.row + i)];
        pe[i + 1] = f.entropy[size_t(s.row + i)];
      }
      lp.append(a);
      en.append(e);
    }
    if (entropy) return py::make_tuple(lp, en);
    return std::move(lp);
  }

  // A forward kept for backward (the sequences packed back to back); keep = false: scores only;
  // recompute: keeps each layer's input alone (ForwardKeep::layer_inputs), the backward reruns it.
  std::shared_ptr<PyForward> forward(const std::vector<std::vector<int64_t>>& seqs, bool keep = true,
                                     bool recompute = false) const {
    if (recompute && !keep) throw Error("Chain.forward", "recompute", "is for a forward kept for backward (keep=True)");
    auto f = std::make_shared<PyForward>();
    f->batch = ChainBatch::packed(token_lists(seqs, model_.config()));
    py::gil_scoped_release unlocked;
    f->fwd = chain_.forward(f->batch, keep_of(keep, recompute));
    return f;
  }

  PyGrads new_grads() const { return PyGrads{std::make_shared<ModelGrads>(model_, DType::f32, chain_.backend()),
                                             model_.config().tie_word_embeddings, chain_.backend()}; }

  // Adds d(Σ dlogp·logp)/d(every weight) of one kept forward into `grads` (new ones when None).
  PyGrads backward(const PyForward& f, const py::array_t<double, py::array::c_style | py::array::forcecast>& dlogp,
                   std::optional<PyGrads> grads) const {
    const std::vector<double> rows = flat_to_rows(f.batch, dlogp, f.scored());
    PyGrads g = grads ? *grads : new_grads();
    py::gil_scoped_release unlocked;
    chain_.backward(f.batch, f.fwd, rows, *g.grads);
    return g;
  }

  // d(Σ logp over every scored token)/d(every weight), fp32, accumulated over micro-batches of
  // `micro_batch` sequences (the bits do not depend on it). A tied embedding's is the sum of its uses.
  py::dict gradients(const std::vector<std::vector<int64_t>>& seqs, int micro_batch, bool recompute) const {
    if (micro_batch < 1) throw Error("Chain", "micro_batch", "must be at least 1");
    const auto lists = token_lists(seqs, model_.config());
    PyGrads grads = new_grads();
    {
      py::gil_scoped_release unlocked;
      for (size_t at = 0; at < lists.size(); at += size_t(micro_batch)) {
        const std::vector<std::vector<int32_t>> part(lists.begin() + long(at),
                                                     lists.begin() + long(std::min(lists.size(), at + size_t(micro_batch))));
        const ChainBatch b = ChainBatch::packed(part);
        std::vector<double> dlogp(b.loss_mask.begin(), b.loss_mask.end());
        chain_.backward(b, chain_.forward(b, keep_of(true, recompute)), dlogp, *grads.grads);
      }
    }
    py::dict out;
    for (const std::string& name : grads.grads->names()) out[py::str(name)] = grads.host(name);
    return out;
  }

  std::string backend() const { return backend_name(chain_.backend()); }

  // A KV cache for step(): `slots` sequences of up to `capacity` tokens each.
  PyKvCache kv_cache(int64_t slots, int64_t capacity) const {
    if (slots < 1) throw Error("Chain.kv_cache", "slots", "must be at least 1");
    if (capacity < 1) throw Error("Chain.kv_cache", "capacity", "must be at least 1");
    if (capacity > model_.config().rope.max_position)
      throw Error("Chain.kv_cache", "capacity",
                  std::to_string(capacity) + " is more than the model's max_position_embeddings (" +
                      std::to_string(model_.config().rope.max_position) + ")");
    return PyKvCache{std::make_shared<KvCache>(model_.config(), slots, capacity, chain_.act_dtype(), chain_.backend()),
                     &model_, slots};
  }

  // One step against the cache (prefill, chunked prefill and decode alike): sequence i's tokens are
  // appended to slot slots[i] (default: slot i) after the tokens that slot holds, attending to them.
  // Returns, flat in sequence order (one value per appended token), the logprob of the token that
  // follows each appended token: the next one in the sequence, and after its last token
  // next_tokens[i] when given (NaN when not).
  py::array_t<double> step(PyKvCache& cache, const std::vector<std::vector<int64_t>>& seqs,
                           const std::optional<std::vector<int64_t>>& next_tokens,
                           const std::optional<std::vector<int64_t>>& slots) const {
    if (cache.model != &model_) throw Error("Chain.step", "cache", "was made for another model (Chain.kv_cache)");
    const ModelConfig& c = model_.config();
    const auto lists = token_lists(seqs, c);
    const int64_t S = int64_t(lists.size());
    if (next_tokens) {
      if (int64_t(next_tokens->size()) != S)
        throw Error("Chain.step", "next_tokens", "needs one token per sequence (" + std::to_string(S) + "), got " +
                                                     std::to_string(next_tokens->size()));
      for (int64_t id : *next_tokens)
        if (id < 0 || id >= c.vocab_size)
          throw Error("Chain.step", "next_tokens",
                      "token id " + std::to_string(id) + " is outside [0, " + std::to_string(c.vocab_size) + ")");
    }
    std::vector<int64_t> slot_of(static_cast<size_t>(S));
    for (int64_t i = 0; i < S; ++i) slot_of[size_t(i)] = i;
    if (slots) {
      if (int64_t(slots->size()) != S)
        throw Error("Chain.step", "slots", "needs one slot per sequence (" + std::to_string(S) + "), got " +
                                               std::to_string(slots->size()));
      slot_of = *slots;
    }
    std::vector<bool> taken(size_t(cache.slots), false);
    for (int64_t s : slot_of) {
      cache.check_slot(s, "Chain.step");
      if (taken[size_t(s)]) throw Error("Chain.step", "slots", "slot " + std::to_string(s) + " is given twice");
      taken[size_t(s)] = true;
    }
    ChainBatch b;
    for (int64_t i = 0; i < S; ++i) {
      const std::vector<int32_t>& t = lists[size_t(i)];
      const int64_t len = int64_t(t.size()), cached = cache.cache->length(slot_of[size_t(i)]);
      b.seqs.push_back({b.rows(), len, slot_of[size_t(i)], cached});
      for (int64_t k = 0; k < len; ++k) {
        const int64_t target = k + 1 < len ? t[size_t(k + 1)] : (next_tokens ? (*next_tokens)[size_t(i)] : -100);
        b.tokens.push_back(t[size_t(k)]);
        b.positions.push_back(int32_t(std::min<int64_t>(cached + k, std::numeric_limits<int32_t>::max())));
        b.targets.push_back(int32_t(target));
        b.loss_mask.push_back(target >= 0 ? 1 : 0);
      }
    }
    ChainForward f;
    {
      py::gil_scoped_release unlocked;
      f = chain_.forward_cached(b, *cache.cache);
    }
    py::array_t<double> out(py::ssize_t(b.rows()));
    double* o = out.mutable_data();
    for (int64_t r = 0; r < b.rows(); ++r)
      o[r] = b.loss_mask[size_t(r)] ? f.logp[size_t(r)] : std::numeric_limits<double>::quiet_NaN();
    return out;
  }

 private:
  static Context ctx_for(const std::string& backend) {
    Context ctx;
    ctx.backend = choose_backend(backend.c_str(), "Chain", "backend");
    return ctx;
  }
  const Model& model_;
  Chain chain_;
};

py::dict config_dict(const ModelConfig& c) {
  py::dict d;
  d["architecture"] = c.architecture;
  d["vocab_size"] = c.vocab_size;
  d["hidden_size"] = c.hidden_size;
  d["intermediate_size"] = c.intermediate_size;
  d["num_layers"] = c.num_layers;
  d["num_heads"] = c.num_heads;
  d["num_kv_heads"] = c.num_kv_heads;
  d["head_dim"] = c.head_dim;
  d["tie_word_embeddings"] = c.tie_word_embeddings;
  d["dtype"] = dtype_name(c.dtype);
  d["rms_norm_eps"] = c.rms_norm_eps;
  d["qk_norm"] = c.qk_norm;
  d["rope_theta"] = c.rope.theta;
  if (c.rope.llama3_scaling) {
    py::dict r;
    r["rope_type"] = "llama3";
    r["factor"] = c.rope.factor;
    r["low_freq_factor"] = c.rope.low_freq_factor;
    r["high_freq_factor"] = c.rope.high_freq_factor;
    r["original_max_position_embeddings"] = c.rope.original_max_position;
    d["rope_scaling"] = r;
  } else {
    d["rope_scaling"] = py::none();
  }
  return d;
}

py::dict config_of(const Model& m) { return config_dict(m.config()); }

// The generation engine: SamplingParams, Completion, Engine — generate (prompts -> completions per
// prompt) and the step-level door (submit / step / run) the benchmarks and custom loops drive. A bad
// prompt gives one Completion with finish_reason "error" naming it; the others run. The GIL is
// released while the engine steps.
class PyEngine {
 public:
  PyEngine(const Model& model, const std::string& backend, int64_t max_slots, int64_t max_batch_tokens,
           int64_t max_context, bool share_prefix, int64_t page_size, int64_t kv_pages, int64_t kv_memory_bytes,
           bool cuda_graphs, bool overlap_steps)
      : engine_(model, EngineOptions{choose_backend(backend.c_str(), "Engine", "backend"), max_slots, max_batch_tokens,
                                     max_context, share_prefix, page_size, kv_pages, kv_memory_bytes, cuda_graphs,
                                     overlap_steps}) {}

  int64_t submit(const std::vector<int64_t>& prompt, const SamplingParams& params) {
    GenerationRequest r;
    // An id int32 cannot hold becomes -1: the engine refuses it as outside the vocab, naming the request.
    for (int64_t t : prompt) r.prompt.push_back(t < INT32_MIN || t > INT32_MAX ? -1 : int32_t(t));
    r.sampling = params;
    return engine_.submit(std::move(r));
  }

  bool step() {
    bool more;
    {
      py::gil_scoped_release unlocked;
      more = engine_.step();
    }
    warn_if_graphs_off();
    return more;
  }

  // Every completion not returned before (also those of submitted requests that a generate() call
  // ran to the end), ordered by (request, sample).
  std::vector<Completion> run() {
    std::vector<Completion> done;
    {
      py::gil_scoped_release unlocked;
      done = engine_.run();
    }
    warn_if_graphs_off();
    if (!kept_.empty()) {
      done.insert(done.end(), std::make_move_iterator(kept_.begin()), std::make_move_iterator(kept_.end()));
      kept_.clear();
      std::sort(done.begin(), done.end(), [](const Completion& a, const Completion& b) {
        return std::tie(a.request, a.sample) < std::tie(b.request, b.sample);
      });
    }
    return done;
  }

  std::vector<std::vector<Completion>> generate(const std::vector<std::vector<int64_t>>& prompts,
                                                const py::object& params) {
    std::vector<SamplingParams> per;
    if (py::isinstance<SamplingParams>(params)) per.assign(prompts.size(), params.cast<SamplingParams>());
    else per = params.cast<std::vector<SamplingParams>>();
    if (per.size() != prompts.size())
      throw Error("Engine.generate", "params", "one SamplingParams, or one per prompt (" + std::to_string(prompts.size()) +
                                                   "), got " + std::to_string(per.size()));
    std::map<int64_t, size_t> index;  // request id -> prompt
    for (size_t i = 0; i < prompts.size(); ++i) index[submit(prompts[i], per[i])] = i;
    std::vector<Completion> done;
    {
      py::gil_scoped_release unlocked;
      done = engine_.run();
    }
    warn_if_graphs_off();
    std::vector<std::vector<Completion>> out(prompts.size());
    for (Completion& c : done) {
      const auto at = index.find(c.request);
      if (at != index.end()) out[at->second].push_back(std::move(c));
      else kept_.push_back(std::move(c));  // a submit()ted request's: the next run() returns it
    }
    return out;
  }

  // A RuntimeWarning, once, when a CUDA graph capture failed: from then on every decode step runs
  // eagerly (the same bits, ~1.7x the time of a Qwen3-8B step), which would otherwise go unseen.
  void warn_if_graphs_off() {
    if (warned_graphs_off_ || engine_.graphs_off_reason().empty()) return;
    warned_graphs_off_ = true;
    const std::string msg = "samebits.Engine: decode steps run eagerly from here on (the same tokens and logprobs, "
                            "slower): a CUDA graph capture failed: " + engine_.graphs_off_reason();
    if (PyErr_WarnEx(PyExc_RuntimeWarning, msg.c_str(), 1) != 0) throw py::error_already_set();
  }

  int64_t max_context() const { return engine_.max_context(); }
  int64_t preemptions() const { return engine_.preemptions(); }
  int64_t kv_pages() const { return engine_.kv_pages(); }
  int64_t steps() const { return engine_.steps(); }
  int64_t generated() const { return engine_.generated(); }
  int64_t graph_steps() const { return engine_.graph_steps(); }
  int64_t captured_graphs() const { return engine_.captured_graphs(); }
  std::string graphs_off_reason() const { return engine_.graphs_off_reason(); }
  int64_t overlapped_steps() const { return engine_.overlapped_steps(); }

 private:
  Engine engine_;
  std::vector<Completion> kept_;
  bool warned_graphs_off_ = false;
};

void bind_engine(py::module_& m) {
  py::class_<SamplingParams>(m, "SamplingParams",
                             "How a prompt's samples are drawn: n, temperature (0: greedy), top_k (0: off), top_p "
                             "(1: off), min_p (0: off), max_new_tokens, stop_token_ids, seed.")
      .def(py::init([](int64_t n, double temperature, int64_t top_k, double top_p, double min_p, int64_t max_new_tokens,
                       std::vector<int32_t> stop_token_ids, uint64_t seed) {
             return SamplingParams{n, temperature, top_k, top_p, min_p, max_new_tokens, std::move(stop_token_ids), seed};
           }),
           py::kw_only(), py::arg("n") = 1, py::arg("temperature") = 1.0, py::arg("top_k") = 0, py::arg("top_p") = 1.0,
           py::arg("min_p") = 0.0, py::arg("max_new_tokens") = 16, py::arg("stop_token_ids") = std::vector<int32_t>{},
           py::arg("seed") = 0)
      .def_readwrite("n", &SamplingParams::n)
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("min_p", &SamplingParams::min_p)
      .def_readwrite("max_new_tokens", &SamplingParams::max_new_tokens)
      .def_readwrite("stop_token_ids", &SamplingParams::stop_token_ids)
      .def_readwrite("seed", &SamplingParams::seed)
      .def("__repr__", [](const SamplingParams& p) {
        return "SamplingParams(n=" + std::to_string(p.n) + ", temperature=" + std::to_string(p.temperature) +
               ", top_k=" + std::to_string(p.top_k) + ", top_p=" + std::to_string(p.top_p) +
               ", min_p=" + std::to_string(p.min_p) + ", max_new_tokens=" + std::to_string(p.max_new_tokens) +
               ", seed=" + std::to_string(p.seed) + ")";
      });
  py::class_<Completion>(m, "Completion", "One sample of one prompt: tokens, their logprobs (the trainer's), why it ended.")
      .def_readonly("request", &Completion::request,
                    "The request id: what Engine.submit returned (generate() submits its prompts in order).")
      .def_readonly("sample", &Completion::sample)
      .def_readonly("tokens", &Completion::tokens)
      .def_property_readonly("logprobs", [](const Completion& c) {
        return py::array_t<double>(py::ssize_t(c.logprobs.size()), c.logprobs.data());
      })
      .def_property_readonly(
          "sampling_logprobs",
          [](const Completion& c) {
            return py::array_t<double>(py::ssize_t(c.sampling_logprobs.size()), c.sampling_logprobs.data());
          },
          "Each token's logprob under the distribution it was drawn from (temperature and top-k / top-p / "
          "min-p applied; 0 for greedy): the behaviour policy's, for importance weights.")
      .def_readonly("finish_reason", &Completion::finish_reason)
      .def_readonly("error", &Completion::error)
      .def("__repr__", [](const Completion& c) {
        return "Completion(request=" + std::to_string(c.request) + ", sample=" + std::to_string(c.sample) + ", " +
               std::to_string(c.tokens.size()) +
               " tokens, finish_reason='" + c.finish_reason + "')";
      });
  py::class_<PyEngine>(m, "Engine",
                       "Rollouts whose logprobs are the trainer's, bit for bit: continuous batching, chunked prefill, "
                       "a prompt's prefill shared by its samples, batch-invariant sampling.")
      .def(py::init<const Model&, const std::string&, int64_t, int64_t, int64_t, bool, int64_t, int64_t, int64_t, bool,
                    bool>(),
           py::arg("model"), py::arg("backend") = "auto", py::arg("max_slots") = 64, py::arg("max_batch_tokens") = 2048,
           py::arg("max_context") = 0, py::arg("share_prefix") = true, py::arg("page_size") = 64,
           py::arg("kv_pages") = 0, py::arg("kv_memory_bytes") = 0, py::arg("cuda_graphs") = true,
           py::arg("overlap_steps") = true, py::keep_alive<1, 2>())
      .def("generate", &PyEngine::generate, py::arg("prompts"), py::arg("params"),
           "Per prompt, its completions (n of them; one with finish_reason 'error' for a bad prompt). params: one "
           "SamplingParams for all, or one per prompt.")
      .def("submit", &PyEngine::submit, py::arg("prompt"), py::arg("params"),
           "Queues one prompt; returns its request id (0, 1, ... in submission order, generate() included). A bad "
           "request is not queued: the next run() returns its error Completion.")
      .def("step", &PyEngine::step,
           "One scheduler step (decode rows, then prompt chunks, under max_batch_tokens); False when nothing is "
           "left to run. With overlap_steps (the default) a step returns once it is launched and the step before "
           "it has been applied: its own draws are applied by the next call, and its GPU work may still run "
           "(ordered before later work on PyTorch's default stream; from another stream, synchronise first).")
      .def("run", &PyEngine::run,
           "Steps until every submitted request is done; returns every Completion not returned before, ordered by "
           "(request, sample).")
      .def_property_readonly("max_context", &PyEngine::max_context)
      .def_property_readonly("preemptions", &PyEngine::preemptions)
      .def_property_readonly("kv_pages", &PyEngine::kv_pages)
      .def_property_readonly("steps", &PyEngine::steps, "Scheduler steps run so far (each ran a batch).")
      .def_property_readonly("generated", &PyEngine::generated, "Tokens drawn so far, over every request.")
      .def_property_readonly("graph_steps", &PyEngine::graph_steps,
                             "Steps run as a CUDA graph replay (decode steps, with cuda_graphs on a Hopper GPU).")
      .def_property_readonly("captured_graphs", &PyEngine::captured_graphs, "Batch-size buckets captured so far.")
      .def_property_readonly("graphs_off_reason", &PyEngine::graphs_off_reason,
                             "Why decode steps stopped replaying CUDA graphs (empty while they replay).")
      .def_property_readonly("overlapped_steps", &PyEngine::overlapped_steps,
                             "Steps launched while the step before them was still in flight (overlap_steps).");
  m.def("sampling_candidates", [](const std::vector<double>& logits, const SamplingParams& p) {
    return sampling_candidates(logits, p);
  }, py::arg("logits"), py::arg("params"), "The ids sampling may draw from a logits row under params (ascending).");
  m.def("sample_token", &sample_token, py::arg("logits"), py::arg("params"), py::arg("sample"), py::arg("position"),
        "The token drawn for (params.seed, sample, position) from a logits row.");
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "samebits: batch-invariant transformer forward and backward (the C++ library's Python door)";
  // The one handler for everything the library throws: samebits::Error (bad input, refused
  // requests, I/O failures, named by the library) -> samebits.Error; a file system failure the
  // library did not name -> samebits.Error too; host memory exhausted -> MemoryError saying so;
  // anything else is a bug -> RuntimeError asking for a report. Never a crash of the interpreter.
  // Local: only this module's functions — a global translator also took exceptions of other modules
  // sharing pybind11's internals (Debian's torch: its own errors came out as "samebits internal
  // error" once samebits was imported).
  static py::exception<Error> error(m, "Error", PyExc_ValueError);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      error(e.what());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(PyExc_MemoryError, "samebits: out of host memory (std::bad_alloc)");
    } catch (const std::filesystem::filesystem_error& e) {
      error((std::string("samebits: file system error: ") + e.what()).c_str());
    } catch (const py::builtin_exception&) {
      throw;  // pybind11's own (cast errors, stop iteration, ...): its translator handles them
    } catch (const py::error_already_set&) {
      throw;
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, (std::string("samebits internal error: ") + e.what() +
                                           " (please report it)").c_str());
    }
  });
  // Raises each class of C++ exception the handler above knows, for the tests of that handler.
  m.def("_raise_for_test", [](const std::string& kind) {
    if (kind == "error") throw Error("test", "kind", "a samebits::Error");
    if (kind == "bad_alloc") throw std::bad_alloc();
    if (kind == "filesystem")
      throw std::filesystem::filesystem_error("test", std::make_error_code(std::errc::not_a_directory));
    if (kind == "out_of_range") throw std::out_of_range("map::at");
    if (kind == "runtime") throw std::runtime_error("a runtime_error");
    throw Error("_raise_for_test", "kind", "unknown kind '" + kind + "'");
  });
  m.def(
      "config_of_json", [](const std::string& text) { return config_dict(ModelConfig::from_json(text)); },
      py::arg("text"),
      "A config.json's model as the chain reads it (architecture, sizes, eps, RoPE); raises samebits.Error "
      "on one it does not take.");
  m.def("version", [] { return std::string("0.1.0"); });
  m.def("backends", [] {
    std::vector<std::string> b{"cpu"};
    if (cuda_backend_built()) b.push_back("cuda");
    return b;
  }, "The backends this build has (cuda: compiled in; whether a GPU is visible is another matter).");
  m.def("cuda_available", [] { return cuda_backend_built() && cuda_device_present(); });

  py::class_<Model>(m, "Model", "A Qwen3 / Llama-3 model: a Hugging Face directory or the built-in one.")
      .def_static("load", &Model::load, py::arg("path"), "Load config.json + safetensors from a directory.")
      .def_static("builtin", &Model::builtin, py::arg("tied") = false, py::arg("seed") = 1234,
                  "The built-in seeded Qwen3-shaped model (2 layers).")
      .def_static(
          "from_tensors",
          [](const std::string& config_json, const py::dict& tensors) {
            std::map<std::string, TensorView> views;
            for (auto item : tensors) {
              const std::string name = item.first.cast<std::string>();
              views[name] = desc(py::reinterpret_borrow<py::object>(item.second), "Model.from_tensors", name.c_str());
            }
            // The dict (and the owners in its descriptions) lives as long as the model.
            std::shared_ptr<void> keep(new py::object(tensors), [](void* p) {
              py::gil_scoped_acquire gil;
              delete static_cast<py::object*>(p);
            });
            return Model::from_views(config_json, views, std::move(keep));
          },
          py::arg("config_json"), py::arg("tensors"),
          "A model over weights in memory: config.json text and {name: (pointer, dtype, shape, device, owner)}, all "
          "on one device (\"cpu\" or \"cuda\": a cuda chain reads GPU weights in place); not copied (samebits.hf "
          "builds it from a transformers model).")
      .def_property_readonly("device", [](const Model& m) { return std::string(device_name(m.device())); })
      .def_property_readonly("config", &config_of)
      .def("save", &Model::save, py::arg("path"), "Write config.json and model.safetensors.");

  py::class_<PyChain>(m, "Chain", "The model chain on a backend: batch-invariant logprobs and gradients.")
      .def(py::init<const Model&, const std::string&>(), py::arg("model"), py::arg("backend") = "auto",
           py::keep_alive<1, 2>())
      .def("logprobs", &PyChain::logprobs, py::arg("sequences"), py::arg("entropy") = false,
           "Per sequence: log p(token i | tokens < i) for every i (entry 0: NaN); with entropy, a "
           "(logprobs, entropies) pair. A sequence's values never depend on the others in the call.")
      .def("gradients", &PyChain::gradients, py::arg("sequences"), py::arg("micro_batch") = 16,
           py::arg("recompute") = false,
           "{weight name: fp32 gradient of the summed logprobs}; the same bits for any micro_batch, with or "
           "without recompute (see forward).")
      .def("forward", &PyChain::forward, py::arg("sequences"), py::arg("keep") = true, py::arg("recompute") = false,
           py::keep_alive<0, 1>(),
           "A forward of the packed sequences kept for backward(); .logp / .entropy: the scored tokens, flat "
           "(sequence s gives len_s - 1 values: tokens 1 ... len_s - 1). keep=False: the same logp / entropy bits "
           "without the activations a backward needs (each layer's freed as the next begins); backward() refuses it. "
           "recompute=True: keeps only each layer's input and backward() reruns the layer before its backward "
           "(about one layer's activations at a time instead of all; the same gradient bits).")
      .def("backward", &PyChain::backward, py::arg("forward"), py::arg("dlogp"), py::arg("grads") = py::none(),
           "Adds d(sum dlogp * logp)/d(every weight) into grads (new Grads when None) and returns them; dlogp: one "
           "value per scored token, as forward's logp.")
      .def_property_readonly("backend", &PyChain::backend)
      .def("kv_cache", &PyChain::kv_cache, py::arg("slots"), py::arg("capacity"), py::keep_alive<0, 1>(),
           "A KV cache of `slots` sequences of up to `capacity` tokens each, in the chain's backend memory, for "
           "step().")
      .def("step", &PyChain::step, py::arg("cache"), py::arg("sequences"), py::arg("next_tokens") = py::none(),
           py::arg("slots") = py::none(),
           "One step against a KV cache (prefill, chunked prefill, decode): sequence i's tokens are appended to "
           "slot slots[i] (default i) after the tokens the slot holds. Returns one float64 array, flat in sequence "
           "order, one value per appended token: the logprob of the token that follows it (the next one of the "
           "sequence; after its last token next_tokens[i], NaN when not given). The same bits as a full forward "
           "of the whole sequence.");

  py::class_<PyKvCache>(m, "KvCache", "A KV cache made by Chain.kv_cache (its memory is freed with the object).")
      .def_readonly("slots", &PyKvCache::slots)
      .def_property_readonly("capacity", [](const PyKvCache& c) { return c.cache->capacity(); })
      .def("length", &PyKvCache::length, py::arg("slot"), "How many tokens the slot holds.")
      .def("reset", &PyKvCache::reset, py::arg("slot"), "Empties the slot (its next step starts a new sequence).");

  py::class_<PyForward, std::shared_ptr<PyForward>>(m, "Forward", "One kept forward (its activations live until it is dropped).")
      .def_property_readonly("logp", [](const PyForward& f) { return f.flat(f.fwd.logp); })
      .def_property_readonly("entropy", [](const PyForward& f) { return f.flat(f.fwd.entropy); })
      .def_property_readonly("lengths", [](const PyForward& f) {
        std::vector<int64_t> n;
        for (const ChainSequence& s : f.batch.seqs) n.push_back(s.len);
        return n;
      });

  py::class_<PyGrads>(m, "Grads", "fp32 gradient accumulators in the chain's backend memory.")
      .def("names", [](const PyGrads& g) { return g.grads->names(); }, "The weights' names (a tied LM head has none).")
      .def("host", &PyGrads::host, py::arg("name"), "The gradient of a weight, copied to a NumPy fp32 array.")
      .def("cuda_array_interface", &PyGrads::cuda_array_interface, py::arg("name"),
           "An accumulator in GPU memory as a __cuda_array_interface__ dict (no copy).")
      .def_readonly("tied", &PyGrads::tied);

  // samebits' own device memory (its pool), for a process that shares the GPU with another allocator
  // (torch's): what samebits holds now, its high-water mark, and giving back what it keeps unused.
  auto backend_of = [](const std::string& b, const char* who) { return choose_backend(b.c_str(), who, "backend"); };
  m.def("device_memory_in_use", [backend_of](const std::string& backend) {
    return int64_t(device_memory_in_use(backend_of(backend, "device_memory_in_use")));
  }, py::arg("backend") = "auto", "Bytes of device memory samebits holds now (tensors and temporaries; 0 on the CPU).");
  m.def("device_memory_peak", [backend_of](const std::string& backend, bool reset) {
    return int64_t(device_memory_peak(backend_of(backend, "device_memory_peak"), reset));
  }, py::arg("backend") = "auto", py::arg("reset") = false,
     "The most bytes samebits held at once since the last reset (0 on the CPU); reset=True starts a new mark.");
  m.def("device_memory_release", [backend_of](const std::string& backend) {
    const Backend b = backend_of(backend, "device_memory_release");
    py::gil_scoped_release unlocked;
    device_memory_release(b);
  }, py::arg("backend") = "auto",
     "Gives the memory samebits keeps for reuse but does not use back to the device (synchronises it first).");

  m.def("raise_deferred_errors", [](bool wait) {
    py::gil_scoped_release unlocked;
    raise_deferred_errors(Backend::cuda, wait);
  }, py::arg("wait") = true,
        "Raises the samebits.Error of an id check that ran on the GPU without being waited for (samebits.torch's "
        "ops) and found a bad id, one a call; wait=True first waits for every device a queued check runs on.");

  // A test / benchmark hook, not an API: forces one of the library's kernel-shape choices (choices
  // that change no bit: the tests prove it) for A/B timing; returns the previous value. 0 restores
  // the library's own choice. norm_any_dtype: 1 runs the RMSNorm kernels' run-time-dtype instance;
  // gemm_tile_width: 32, 48, 64, 128, 192 or 256; lm_head_vocab_chunk: a multiple of 256 columns.
  m.def("_set_tuning", [](const std::string& name, int64_t value) -> int64_t {
    if (name == "norm_any_dtype") {
      if (value != 0 && value != 1) throw Error("_set_tuning", name, "takes 0 or 1");
      const int64_t before = detail::norm_any_dtype_path_override() ? 1 : 0;
      detail::norm_any_dtype_path_override() = value != 0;
      return before;
    }
    if (name == "gemm_tile_width") {
      if (value != 0 && value != 32 && value != 48 && value != 64 && value != 128 && value != 192 && value != 256)
        throw Error("_set_tuning", name, "takes 0, 32, 48, 64, 128, 192 or 256");
      const int64_t before = detail::gemm_tile_width_override();
      detail::gemm_tile_width_override() = int(value);
      return before;
    }
    if (name == "lm_head_vocab_chunk") {
      if (value < 0 || value % 256 != 0 || value > (int64_t(1) << 30))
        throw Error("_set_tuning", name, "takes 0 or a positive multiple of 256");
      const int64_t before = detail::lm_head_vocab_chunk_override();
      detail::lm_head_vocab_chunk_override() = int(value);
      return before;
    }
    // The kernel variants' switches: -1 never, 0 as their SAMEBITS_* variable says (the library's
    // default), 1 wherever they take a call.
    struct OptIn {
      const char* name;
      int& (*hook)();
      const char* env;
    };
    for (const OptIn& o : {OptIn{"fused_swiglu", detail::fused_swiglu_override, "SAMEBITS_FUSED_SWIGLU"},
                           OptIn{"narrow_decode", detail::narrow_decode_override, "SAMEBITS_NARROW_DECODE"},
                           OptIn{"persistent_prefill", detail::persistent_prefill_override,
                                 "SAMEBITS_PERSISTENT_PREFILL"},
                           OptIn{"attention_overlap", detail::attention_overlap_override,
                                 "SAMEBITS_ATTENTION_OVERLAP"}}) {
      if (name != o.name) continue;
      if (value < -1 || value > 1)
        throw Error("_set_tuning", name, std::string("takes -1 (never), 0 (") + o.env + ") or 1");
      const int64_t before = o.hook();
      o.hook() = int(value);
      return before;
    }
    throw Error("_set_tuning", name,
                "is not a tuning hook (norm_any_dtype, gemm_tile_width, lm_head_vocab_chunk, fused_swiglu, "
                "narrow_decode, persistent_prefill, attention_overlap)");
  }, py::arg("name"), py::arg("value"),
     "Test / benchmark hook: forces a kernel-shape choice that changes no bit (0: the library's own); returns the "
     "previous value.");

  bind_engine(m);
  bind_raw(m);
}
