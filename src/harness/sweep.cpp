// The sweeps: lay a batch out, run a case, cut sequences back out, compare.
//
// Invariance (raw bits) of a target sequence's outputs against it run alone, packed:
//   T1 batch population (2 … N sequences, target at a random slot), T2 position (first / middle /
//   last), T3 neighbour content (same slots, other neighbours), T4 padding (left / right, extra
//   padding, a fully masked slot), T5 schedule (chunked prefill against a cache, chunk sizes that
//   divide nothing), T6 packed vs padded; plus a repeat of the same run.
// Weight gradients: one batch of 8 vs micro-batches 2×4, 4×2, 8×1 accumulated into the same
// buffers (which start non-zero), and padded layouts of the same batch.
#include <algorithm>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "harness/compare.hpp"
#include "samebits/error.hpp"

namespace samebits::harness {
namespace {

struct PieceSpec {
  int64_t seq, begin, len;
};

Batch make_batch(const std::vector<const Sequence*>& seqs, const std::vector<PieceSpec>& specs,
                 Layout layout, int64_t extra_pad, bool empty_slot, const OpCase& c, Rng& rng) {
  Batch b;
  b.seqs = seqs;
  b.layout = layout;
  int64_t slot = 0;
  for (auto& s : specs) slot = std::max(slot, s.len);
  slot += extra_pad;
  const int64_t slots = int64_t(specs.size()) + (empty_slot ? 1 : 0);
  const int64_t empty_at = empty_slot ? int64_t(specs.size()) / 2 : -1;
  int64_t row = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    Piece p{specs[i].seq, 0, specs[i].begin, specs[i].len};
    if (layout == Layout::packed) {
      p.row = row;
      row += p.len;
    } else {
      const int64_t s = int64_t(i) + (empty_slot && int64_t(i) >= empty_at ? 1 : 0);
      p.row = s * slot + (layout == Layout::padded_left ? slot - p.len : 0);
    }
    b.pieces.push_back(p);
  }
  b.rows = layout == Layout::packed ? row : slots * slot;
  // Padding rows hold a random filler sequence: realistic, valid content that must not matter.
  const Sequence filler = c.make_sequence(rng, std::max<int64_t>(b.rows, 1));
  for (auto& [name, t] : seqs.front()->tokens) {
    auto shape = t.shape();
    shape[0] = b.rows;
    HostTensor laid(t.dtype(), shape);
    const HostTensor& fill = filler.tokens.at(name);
    if (b.rows > 0) laid.copy_rows_from(fill.dtype() == t.dtype() ? fill : fill.converted(t.dtype()), 0, 0, b.rows);
    for (auto& p : b.pieces) laid.copy_rows_from(seqs[size_t(p.seq)]->tokens.at(name), p.begin, p.row, p.len);
    b.tokens[name] = std::move(laid);
  }
  b.row_mask = HostTensor(DType::u8, {b.rows});
  for (auto& p : b.pieces)
    for (int64_t r = p.row; r < p.row + p.len; ++r) b.row_mask.set(r, 1);
  return b;
}

std::vector<PieceSpec> whole(size_t n, const std::vector<const Sequence*>& seqs) {
  std::vector<PieceSpec> out;
  for (size_t i = 0; i < n; ++i) out.push_back({int64_t(i), 0, seqs[i]->length});
  return out;
}

struct RunOutput {
  TensorMap outputs, grads;
  std::vector<Drift> guard;
};

RunOutput execute(const OpCase& c, const Context& ctx, const Batch& b, const TensorMap& params,
                  const TensorMap& grads, bool backward) {
  RunOutput r;
  r.grads = grads;
  CaseIO io(b, params, r.grads, backward, ctx.precision == Precision::truth_fp64, ctx.backend);
  c.run(ctx, io);
  io.finish_device_run();
  r.outputs = std::move(io.outputs);
  auto guard = [&](const TensorMap& m, const char* what) {
    for (auto& [name, t] : m)
      if (!t.guards_intact()) {
        Drift d;
        d.op = c.op();
        d.check = "guard";
        d.tensor = name;
        d.count = 1;
        d.first_index_text = fmt::format("wrote outside the bounds of {} '{}'", what, name);
        r.guard.push_back(d);
      }
  };
  guard(r.outputs, "output");
  guard(r.grads, "gradient accumulator");
  return r;
}

// The rows of sequence `seq` (all its pieces, in token order) of every per-token output.
TensorMap extract(const Batch& b, const TensorMap& outputs, int64_t seq) {
  std::vector<Piece> pieces;
  for (auto& p : b.pieces)
    if (p.seq == seq) pieces.push_back(p);
  std::sort(pieces.begin(), pieces.end(), [](auto& x, auto& y) { return x.begin < y.begin; });
  int64_t len = 0;
  for (auto& p : pieces) len += p.len;
  TensorMap out;
  for (auto& [name, t] : outputs) {
    auto shape = t.shape();
    shape[0] = len;
    HostTensor s(t.dtype(), shape);
    int64_t at = 0;
    for (auto& p : pieces) {
      s.copy_rows_from(t, p.row, at, p.len);
      at += p.len;
    }
    out[name] = std::move(s);
  }
  return out;
}

// Concatenation of per-step extractions (chunked schedules run one call per step).
void append_rows(TensorMap& acc, const TensorMap& part) {
  for (auto& [name, t] : part) {
    auto it = acc.find(name);
    if (it == acc.end()) { acc[name] = t; continue; }
    auto shape = it->second.shape();
    shape[0] += t.rows();
    HostTensor joined(t.dtype(), shape);
    joined.copy_rows_from(it->second, 0, 0, it->second.rows());
    joined.copy_rows_from(t, 0, it->second.rows(), t.rows());
    it->second = std::move(joined);
  }
}

std::set<std::string> grad_names(const OpCase& c) {
  std::set<std::string> s;
  for (auto& [in, g] : c.grad_pairs()) s.insert(g);
  return s;
}

TensorMap initial_grads(const OpCase& c, const TensorMap& params, Rng& rng, DType acc) {
  TensorMap g;
  for (auto& name : c.trained_params()) g[name] = rng.tensor(acc, params.at(name).shape(), -0.5, 0.5);
  return g;
}

Sequence to_truth(const Sequence& s) {
  Sequence t{s.length, {}};
  for (auto& [name, x] : s.tokens) t.tokens[name] = is_floating(x.dtype()) ? x.converted(DType::f64) : x;
  return t;
}

TensorMap map_to_truth(const TensorMap& m) {
  TensorMap t;
  for (auto& [name, x] : m) t[name] = is_floating(x.dtype()) ? x.converted(DType::f64) : x;
  return t;
}

std::vector<Sequence> make_sequences(const OpCase& c, Rng& rng, int n) {
  std::vector<Sequence> out;
  for (int i = 0; i < n; ++i) out.push_back(c.make_sequence(rng, rng.integer(c.min_length(), c.max_length())));
  return out;
}

// Records a bitwise comparison of `got` against `ref` into the forward / backward cell.
void compare_into(const OpCase& c, const std::string& check, const TensorMap& ref,
                  const TensorMap& got, const std::set<std::string>& grads, bool with_backward,
                  CaseResult& out, bool all_grads = false) {
  for (auto& [name, r] : ref) {
    const bool is_grad = all_grads || grads.count(name) > 0;
    if (is_grad && !with_backward) continue;
    CellResult& cell = is_grad ? out.bwd_invariance : out.fwd_invariance;
    cell.comparisons++;
    Drift d;
    d.op = c.op();
    d.check = check;
    d.tensor = name;
    auto it = got.find(name);
    if (it == got.end()) {
      d.count = 1;
      d.first_index_text = "output missing";
      cell.drifts.push_back(d);
      continue;
    }
    if (!same_bits(it->second, r, d)) cell.drifts.push_back(d);
  }
}

void add_guard_failures(const std::vector<Drift>& guard, CellResult& cell) {
  for (auto& d : guard) cell.drifts.push_back(d);
}

void finish(CellResult& cell) {
  if (cell.status == Status::not_built || cell.status == Status::error) return;
  if (cell.comparisons == 0 && cell.drifts.empty()) { cell.status = Status::not_applicable; return; }
  cell.status = cell.drifts.empty() ? Status::pass : Status::fail;
}

void require_device(Backend b) {
  if (b == Backend::cuda && !cuda_device_present())
    throw Error("harness", "backend", "the cuda backend was asked for, but no CUDA device is visible");
}

template <class Fn>
void guarded(CellResult& a, CellResult& b, Fn&& fn) {
  try {
    fn();
  } catch (const NotBuilt& e) {
    for (CellResult* c : {&a, &b}) { c->status = Status::not_built; c->note = e.what(); }
  } catch (const Unsupported& e) {
    for (CellResult* c : {&a, &b}) { c->status = Status::not_applicable; c->note = e.what(); }
  } catch (const std::exception& e) {
    for (CellResult* c : {&a, &b}) { c->status = Status::error; c->note = e.what(); }
  }
}

bool has_backward(const OpCase& c) { return !c.grad_pairs().empty() || !c.trained_params().empty(); }

// fn(with_backward) under guarded(), and where the backend has the forward but not the backward of
// the case: the forward judged alone (fn(false)), the backward cell NOT BUILT.
template <class Fn>
void guarded_forward_first(const OpCase& c, CellResult& fwd, CellResult& bwd, Fn&& fn) {
  std::string missing;
  guarded(fwd, bwd, [&] {
    try {
      fn(has_backward(c));
    } catch (const NotBuilt& e) {
      if (!has_backward(c)) throw;
      missing = e.what();
      fwd = CellResult{};
      bwd = CellResult{};
      fn(false);  // NotBuilt again when the forward is missing too
    }
  });
  if (!missing.empty() && bwd.status != Status::not_built && bwd.status != Status::error) {
    bwd = CellResult{};
    bwd.status = Status::not_built;
    bwd.note = missing;
  }
}

}  // namespace

void check_invariance(const OpCase& c, const SweepOptions& opt, CaseResult& out) {
  guarded_forward_first(c, out.fwd_invariance, out.bwd_invariance, [&](const bool bwd) {
    require_device(opt.backend);
    Context ctx;
    ctx.backend = opt.backend;
    Rng rng(opt.seed);
    const TensorMap params = c.make_params(rng);
    const auto grads0 = initial_grads(c, params, rng, DType::f32);
    const auto names = grad_names(c);
    const Sequence target = c.make_sequence(rng, rng.integer(c.min_length(), c.max_length()));

    // Runs `seqs` (target at `pos`) in one call and compares the target with the reference.
    TensorMap reference;
    auto run_batch = [&](const std::string& check, std::vector<const Sequence*> seqs, Layout layout,
                         int64_t pad, bool empty_slot) {
      Rng fill(opt.seed ^ std::hash<std::string>{}(check));
      const Batch b = make_batch(seqs, whole(seqs.size(), seqs), layout, pad, empty_slot, c, fill);
      const RunOutput r = execute(c, ctx, b, params, grads0, bwd);
      add_guard_failures(r.guard, out.fwd_invariance);
      int64_t at = 0;
      while (seqs[size_t(at)] != &target) ++at;
      return extract(b, r.outputs, at);
    };
    reference = run_batch("reference", {&target}, Layout::packed, 0, false);
    compare_into(c, "repeat", reference, run_batch("repeat", {&target}, Layout::packed, 0, false),
                 names, bwd, out);

    auto with_target = [&](const std::vector<Sequence>& nb, size_t pos) {
      std::vector<const Sequence*> s;
      for (auto& n : nb) s.push_back(&n);
      s.insert(s.begin() + long(std::min(pos, s.size())), &target);
      return s;
    };
    for (int n : {2, 3, 5, opt.batch_max}) {  // T1
      Rng r(opt.seed + uint64_t(n));
      const auto nb = make_sequences(c, r, n - 1);
      const size_t pos = size_t(r.integer(0, n - 1));
      compare_into(c, fmt::format("T1 batch={} at {}", n, pos), reference,
                   run_batch(fmt::format("T1 {}", n), with_target(nb, pos), Layout::packed, 0, false),
                   names, bwd, out);
    }
    {  // T2
      Rng r(opt.seed + 101);
      const auto nb = make_sequences(c, r, 4);
      for (auto [pos, label] : {std::pair<size_t, const char*>{0, "first"}, {2, "middle"}, {4, "last"}})
        compare_into(c, fmt::format("T2 {} of 5", label), reference,
                     run_batch(fmt::format("T2 {}", pos), with_target(nb, pos), Layout::packed, 0, false),
                     names, bwd, out);
    }
    for (uint64_t v = 0; v < 2; ++v) {  // T3
      Rng r(opt.seed + 202 + v);
      const auto nb = make_sequences(c, r, 4);
      compare_into(c, fmt::format("T3 neighbours #{}", v), reference,
                   run_batch(fmt::format("T3 {}", v), with_target(nb, 2), Layout::packed, 0, false),
                   names, bwd, out);
    }
    {  // T4 / T6
      Rng r(opt.seed + 303);
      const auto nb = make_sequences(c, r, 3);
      for (Layout l : {Layout::padded_right, Layout::padded_left})
        for (auto [pad, empty] : {std::pair<int64_t, bool>{0, false}, {5, true}})
          compare_into(c, fmt::format("T4 {} pad+{}{}", layout_name(l), pad, empty ? " +masked slot" : ""),
                       reference,
                       run_batch(fmt::format("T4 {} {}", int(l), pad), with_target(nb, 1), l, pad, empty),
                       names, bwd, out);
    }
    if (c.chunkable()) {  // T5: chunked prefill against a cache, forward only
      Rng r(opt.seed + 404);
      const auto nb = make_sequences(c, r, 2);
      const auto seqs = with_target(nb, 1);
      for (int64_t chunk : opt.chunk_sizes) {
        TensorMap got;
        for (int64_t begin = 0;; begin += chunk) {
          std::vector<PieceSpec> step;
          for (size_t i = 0; i < seqs.size(); ++i)
            if (seqs[i]->length > begin)
              step.push_back({int64_t(i), begin, std::min(chunk, seqs[i]->length - begin)});
          if (step.empty()) break;
          Rng fill(opt.seed + uint64_t(begin));
          const Batch b = make_batch(seqs, step, Layout::packed, 0, false, c, fill);
          const RunOutput ro = execute(c, ctx, b, params, grads0, false);
          add_guard_failures(ro.guard, out.fwd_invariance);
          if (target.length > begin) append_rows(got, extract(b, ro.outputs, 1));
        }
        compare_into(c, fmt::format("T5 chunk={}", chunk), reference, got, names, false, out);
      }
    }
    if (bwd && !c.trained_params().empty()) {  // weight gradients: micro-batches and padding
      Rng r(opt.seed + 505);
      const auto nb = make_sequences(c, r, 7);
      const auto seqs = with_target(nb, 3);
      auto grads_of = [&](const std::vector<std::vector<const Sequence*>>& micro, Layout l) {
        TensorMap g = grads0;
        for (auto& m : micro) {
          Rng fill(opt.seed + 606);
          const Batch b = make_batch(m, whole(m.size(), m), l, l == Layout::packed ? 0 : 2,
                                     l != Layout::packed, c, fill);
          RunOutput ro = execute(c, ctx, b, params, g, true);
          add_guard_failures(ro.guard, out.bwd_invariance);
          g = std::move(ro.grads);
        }
        return g;
      };
      const TensorMap one = grads_of({seqs}, Layout::packed);
      for (size_t per : {4u, 2u, 1u}) {
        std::vector<std::vector<const Sequence*>> micro;
        for (size_t i = 0; i < seqs.size(); i += per)
          micro.emplace_back(seqs.begin() + long(i), seqs.begin() + long(std::min(seqs.size(), i + per)));
        compare_into(c, fmt::format("micro-batches {}x{}", micro.size(), per), one,
                     grads_of(micro, Layout::packed), {}, true, out, true);
      }
      for (Layout l : {Layout::padded_right, Layout::padded_left})
        compare_into(c, fmt::format("weight grads {}", layout_name(l)), one, grads_of({seqs}, l), {},
                     true, out, true);
    }
  });
  finish(out.fwd_invariance);
  finish(out.bwd_invariance);
}

void check_accuracy(const OpCase& c, const Contract& contract, const SweepOptions& opt,
                    CaseResult& out) {
  guarded_forward_first(c, out.fwd_accuracy, out.bwd_accuracy, [&](const bool bwd) {
    require_device(opt.backend);
    Rng rng(opt.seed + 999);
    const TensorMap params = c.make_params(rng);
    const auto grads0 = initial_grads(c, params, rng, DType::f32);
    const auto seqs = make_sequences(c, rng, 3);
    std::vector<const Sequence*> ptr;
    std::vector<Sequence> truth_seqs;
    for (auto& s : seqs) { ptr.push_back(&s); truth_seqs.push_back(to_truth(s)); }
    std::vector<const Sequence*> truth_ptr;
    for (auto& s : truth_seqs) truth_ptr.push_back(&s);

    Context ctx;
    ctx.backend = opt.backend;
    Rng f1(1), f2(1);
    const Batch b = make_batch(ptr, whole(ptr.size(), ptr), Layout::packed, 0, false, c, f1);
    const Batch bt = make_batch(truth_ptr, whole(ptr.size(), truth_ptr), Layout::packed, 0, false, c, f2);
    const RunOutput got = execute(c, ctx, b, params, grads0, bwd);
    Context truth;
    truth.precision = Precision::truth_fp64;
    const RunOutput ref = execute(c, truth, bt, map_to_truth(params), map_to_truth(grads0), bwd);
    add_guard_failures(got.guard, out.fwd_accuracy);

    const auto names = grad_names(c);
    auto compare = [&](const std::string& name, const HostTensor& a, const HostTensor& t, bool is_grad) {
      CellResult& cell = is_grad ? out.bwd_accuracy : out.fwd_accuracy;
      const std::string cls = is_grad ? c.backward_class() : c.forward_class();
      Drift d;
      d.op = c.op();
      const DType tol_dtype = c.tolerance_dtype(name, a.dtype());
      d.check = fmt::format("accuracy ({}, {})", cls, dtype_name(tol_dtype));
      d.tensor = name;
      cell.comparisons++;
      const bool ok = within_tolerance(a, t, contract.tolerance(cls, tol_dtype), d);
      cell.worst_ratio = std::max(cell.worst_ratio, d.worst_ratio);
      cell.drifts.push_back(d);  // kept for the report; status comes from `ok`
      if (!ok) cell.note = "fail";
    };
    for (auto& [name, t] : ref.outputs) compare(name, got.outputs.at(name), t, names.count(name) > 0);
    for (auto& [name, t] : ref.grads) compare(name, got.grads.at(name), t, true);
  });
  for (CellResult* cell : {&out.fwd_accuracy, &out.bwd_accuracy}) {
    if (cell->status == Status::not_built || cell->status == Status::error) continue;
    if (cell->comparisons == 0) { cell->status = Status::not_applicable; continue; }
    bool ok = true;
    for (auto& d : cell->drifts) ok = ok && d.count == 0;
    cell->status = ok ? Status::pass : Status::fail;
  }
}

CaseResult run_case(const OpCase& c, const Contract& contract, const SweepOptions& opt) {
  CaseResult r;
  r.op = c.op();
  r.case_name = c.name();
  if (opt.progress) opt.progress(r.case_name);
  check_invariance(c, opt, r);
  check_accuracy(c, contract, opt, r);
  return r;
}

std::vector<Drift> check_gradients_fd(const OpCase& c, const FdOptions& opt) {
  std::vector<Drift> failures;
  Rng rng(opt.seed);
  TensorMap params = map_to_truth(c.make_params(rng));
  std::vector<Sequence> seqs;
  for (int i = 0; i < 2; ++i)
    seqs.push_back(to_truth(c.make_sequence(rng, rng.integer(c.min_length(), std::max(c.min_length(), std::min<int64_t>(6, c.max_length()))))));
  TensorMap zero;
  for (auto& name : c.trained_params()) zero[name] = HostTensor(DType::f64, params.at(name).shape());
  Context truth;
  truth.precision = Precision::truth_fp64;

  auto run = [&](bool backward) {
    std::vector<const Sequence*> ptr;
    for (auto& s : seqs) ptr.push_back(&s);
    Rng fill(3);
    Batch b = make_batch(ptr, whole(ptr.size(), ptr), Layout::packed, 0, false, c, fill);
    RunOutput r = execute(c, truth, b, params, zero, backward);
    return std::make_pair(std::move(b), std::move(r));
  };
  auto loss = [&]() {
    auto [b, r] = run(false);
    double l = 0;
    for (auto& [out, up] : c.loss_terms()) {
      const HostTensor& o = r.outputs.at(out);
      const HostTensor& u = b.tokens.at(up);
      for (int64_t i = 0; i < o.numel(); ++i) l += o.get(i) * u.get(i);
    }
    return l;
  };
  auto [b0, analytic] = run(true);

  auto check_element = [&](const std::string& label, double& x, double grad) {
    const double saved = x, h = opt.step * std::max(1.0, std::fabs(saved));
    x = saved + h;
    const double lp = loss();
    x = saved - h;
    const double lm = loss();
    x = saved;
    const double fd = (lp - lm) / (2 * h);
    if (std::fabs(fd - grad) > opt.atol + opt.rtol * std::max(std::fabs(fd), std::fabs(grad))) {
      Drift d;
      d.op = c.op();
      d.check = "finite differences";
      d.tensor = label;
      d.count = 1;
      d.first_a = grad;
      d.first_b = fd;
      d.max_abs = std::fabs(fd - grad);
      d.first_index_text = fmt::format("analytic {:.10g} vs finite difference {:.10g}", grad, fd);
      failures.push_back(d);
    }
  };
  for (auto& [input, gname] : c.grad_pairs()) {
    for (size_t s = 0; s < seqs.size(); ++s) {
      const TensorMap g = extract(b0, analytic.outputs, int64_t(s));
      HostTensor& x = seqs[s].tokens.at(input);
      auto* data = static_cast<double*>(x.data());
      for (int k = 0; k < opt.samples_per_tensor; ++k) {
        const int64_t i = rng.integer(0, x.numel() - 1);
        check_element(fmt::format("{} (d{} at {} of sequence {})", gname, input, index_text(x.shape(), i), s),
                      data[i], g.at(gname).get(i));
      }
    }
  }
  for (auto& name : c.trained_params()) {
    HostTensor& p = params.at(name);
    auto* data = static_cast<double*>(p.data());
    for (int k = 0; k < opt.samples_per_tensor; ++k) {
      const int64_t i = rng.integer(0, p.numel() - 1);
      check_element(fmt::format("d{} at {}", name, index_text(p.shape(), i)), data[i],
                    analytic.grads.at(name).get(i));
    }
  }
  return failures;
}

}  // namespace samebits::harness
