// The chain gate. A target sequence's per-token logprobs / entropies (forward) and the gradient of
// its input embeddings (backward) must keep their bits across batch population, position,
// neighbours, padding (left / right, a fully masked slot), packed vs padded, chunked prefill
// against a KV cache, and generate-then-rescore; weight gradients must keep their bits across
// micro-batch splits and layouts; repeats must match. Then the fp32 chain is measured against the
// fp64 chain with the contract's chain metrics.
#include "samebits/chain_gate.hpp"

#include <cmath>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "harness/compare.hpp"
#include "samebits/chain.hpp"
#include "samebits/error.hpp"

namespace samebits::harness {

ChainMetrics chain_metrics(const std::vector<double>& a, const std::vector<double>& b,
                           const std::vector<uint8_t>& active, double low, double high) {
  ChainMetrics m;
  int64_t clipped = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!active[i]) continue;
    const double d = a[i] - b[i];
    m.max_abs = std::max(m.max_abs, std::fabs(d));
    m.approx_kl += std::exp(d) - 1 - d;
    const double ratio = std::exp(d);
    clipped += ratio < low || ratio > high;
    m.tokens++;
  }
  if (m.tokens) {
    m.approx_kl /= double(m.tokens);
    m.clip_fraction = double(clipped) / double(m.tokens);
  }
  return m;
}

namespace {

using Seq = std::vector<int32_t>;

HostTensor doubles(const std::vector<double>& v, int64_t begin, int64_t len) {
  HostTensor t(DType::f64, {len});
  for (int64_t i = 0; i < len; ++i) t.set(i, v[size_t(begin + i)]);
  return t;
}

// The per-sequence upstream gradient dlogp: a function of the sequence (its tokens) only.
std::vector<double> dlogp_of(const Seq& s) {
  Rng r(uint64_t(s.size()) * 7919 + uint64_t(s.empty() ? 0 : s[0]));
  std::vector<double> d(s.size());
  for (auto& x : d) x = float(r.uniform(-1, 1));
  return d;
}

struct Gate {
  const Model& model;
  const ModelConfig& cfg;
  Chain chain;
  const ChainGateOptions& opt;
  CaseResult& out;

  // Target-row outputs of one forward (and backward): logp, entropy, and d(input embeddings).
  struct View {
    TensorMap fwd, bwd;
  };

  std::vector<double> layout_dlogp(const ChainBatch& b, const std::vector<const Seq*>& seqs) const {
    std::vector<double> d(size_t(b.rows()), 0.0);
    for (size_t k = 0; k < seqs.size(); ++k) {
      const auto g = dlogp_of(*seqs[k]);
      for (int64_t i = 0; i < b.seqs[k].len; ++i) d[size_t(b.seqs[k].row + i)] = g[size_t(i)];
    }
    return d;
  }

  View run(const ChainBatch& b, const std::vector<const Seq*>& seqs, size_t target, ChainForward* keep = nullptr) const {
    const ChainForward f = chain.forward(b);
    const ChainSequence& s = b.seqs[target];
    View v;
    v.fwd["logp"] = doubles(f.logp, s.row, s.len);
    v.fwd["entropy"] = doubles(f.entropy, s.row, s.len);
    ModelGrads g(model, chain.act_dtype() == DType::f64 ? DType::f64 : DType::f32, chain.backend());
    const HostTensor d_embed = chain.backward(b, f, layout_dlogp(b, seqs), g).to_host();
    v.bwd["d_embed"] = d_embed.slice_rows(s.row, s.row + s.len);
    if (keep) *keep = f;
    return v;
  }

  // The first activation (in forward order) whose target rows differ: the first failing op.
  std::string first_failing_op(const ChainForward& ref, const ChainSequence& rs, const ChainForward& got,
                               const ChainSequence& gs) const {
    for (auto& [name, t] : ref.trace) {
      const HostTensor a = t.rows_to_host(rs.row, rs.row + rs.len), b = got.at(name).rows_to_host(gs.row, gs.row + gs.len);
      if (std::memcmp(a.data(), b.data(), a.bytes()) != 0) return "chain: " + name;
    }
    return "chain";
  }

  void compare(const std::string& check, const TensorMap& ref, const TensorMap& got, CellResult& cell,
               const std::string& op = "chain") {
    for (auto& [name, r] : ref) {
      cell.comparisons++;
      Drift d;
      d.op = op;
      d.check = check;
      d.tensor = name;
      if (!same_bits(got.at(name), r, d)) cell.drifts.push_back(d);
    }
  }
};

std::vector<Seq> random_sequences(Rng& r, int n, int64_t min_len, int64_t max_len, int64_t vocab) {
  std::vector<Seq> out;
  for (int i = 0; i < n; ++i) {
    Seq s(size_t(r.integer(min_len, max_len)));
    for (auto& t : s) t = int32_t(r.integer(0, vocab - 1));
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<Seq> values(const std::vector<const Seq*>& p) {
  std::vector<Seq> v;
  for (auto* s : p) v.push_back(*s);
  return v;
}

void finish(CellResult& c) {
  if (c.status == Status::error || c.status == Status::not_built) return;
  c.status = c.comparisons == 0 ? Status::not_applicable : c.drifts.empty() ? Status::pass : Status::fail;
}

}  // namespace

CaseResult run_chain_gate(const Model& model, const std::string& label, const Contract& contract,
                          const ChainGateOptions& opt, const std::function<void(const std::string&)>& progress) {
  CaseResult out;
  out.op = "chain";
  out.case_name = "chain " + label;
  const ModelConfig& cfg = model.config();
  auto step = [&](const std::string& what) {
    if (progress) progress(out.case_name + ": " + what);
  };
  try {
    Context ctx;
    ctx.backend = opt.backend;
    ctx.poison_activations = true;  // an element no op wrote shows as NaN
    Gate g{model, cfg, Chain(model, ctx), opt, out};
    Rng rng(opt.seed);
    const Seq target = random_sequences(rng, 1, opt.target_len, opt.target_len, cfg.vocab_size)[0];
    const auto nb = random_sequences(rng, opt.batch - 1, 2, opt.neighbour_max_len, cfg.vocab_size);
    auto with_target = [&](size_t count, size_t pos) {
      std::vector<const Seq*> s;
      for (size_t i = 0; i < count; ++i) s.push_back(&nb[i]);
      s.insert(s.begin() + long(std::min(pos, s.size())), &target);
      return s;
    };

    step("batch compositions and layouts");
    ChainForward ref_f;
    const ChainBatch ref_batch = ChainBatch::packed({target});
    const Gate::View ref = g.run(ref_batch, {&target}, 0, &ref_f);
    auto check = [&](const std::string& name, const std::vector<const Seq*>& seqs, const ChainBatch& b) {
      size_t at = 0;
      while (seqs[at] != &target) ++at;
      ChainForward f;
      const Gate::View v = g.run(b, seqs, at, &f);
      const size_t before = out.fwd_invariance.drifts.size();
      g.compare(name, ref.fwd, v.fwd, out.fwd_invariance);
      if (out.fwd_invariance.drifts.size() > before) {  // name the first op whose bits moved
        const std::string op = g.first_failing_op(ref_f, ref_batch.seqs[0], f, b.seqs[at]);
        for (size_t i = before; i < out.fwd_invariance.drifts.size(); ++i) out.fwd_invariance.drifts[i].op = op;
      }
      g.compare(name, ref.bwd, v.bwd, out.bwd_invariance);
    };
    check("repeat", {&target}, ref_batch);
    for (int n : {2, 3, 5, opt.batch}) {
      const size_t pos = size_t(rng.integer(0, n - 1));
      const auto seqs = with_target(size_t(n - 1), pos);
      check(fmt::format("T1 batch={} at {}", n, pos), seqs, ChainBatch::packed(values(seqs)));
    }
    for (size_t pos : {size_t(0), size_t(2), size_t(4)})
      check(fmt::format("T2 position {} of 5", pos), with_target(4, pos), ChainBatch::packed(values(with_target(4, pos))));
    {
      const auto other = random_sequences(rng, 4, 2, opt.neighbour_max_len, cfg.vocab_size);
      std::vector<const Seq*> seqs{&other[0], &other[1], &target, &other[2], &other[3]};
      check("T3 other neighbours", seqs, ChainBatch::packed(values(seqs)));
    }
    for (bool left : {false, true})
      for (auto [extra, empty] : {std::pair<int64_t, int>{0, 0}, {5, 1}}) {
        const auto seqs = with_target(3, 1);
        const int64_t slot = opt.target_len + extra;
        check(fmt::format("T4/T6 padded-{} +{}{}", left ? "left" : "right", extra, empty ? " +masked slot" : ""),
              seqs, ChainBatch::padded(values(seqs), slot, left, empty, 7));
      }

    step("chunked prefill against the KV cache");
    {
      const auto seqs = with_target(2, 1);
      int64_t cap = 0;
      for (auto* s : seqs) cap = std::max<int64_t>(cap, int64_t(s->size()));
      std::vector<int64_t> chunks = opt.chunk_sizes;
      chunks.push_back(cap);  // whole prefill, through the cache
      for (int64_t chunk : chunks) {
        KvCache cache(cfg, int64_t(seqs.size()), cap, g.chain.act_dtype(), g.chain.backend());
        std::vector<double> logp, entropy;
        for (int64_t begin = 0; begin < int64_t(target.size()) || begin < cap; begin += chunk) {
          ChainBatch b;
          int64_t target_row = -1, target_len = 0;
          for (size_t k = 0; k < seqs.size(); ++k) {
            const Seq& s = *seqs[k];
            if (begin >= int64_t(s.size())) continue;
            const int64_t len = std::min<int64_t>(chunk, int64_t(s.size()) - begin);
            if (seqs[k] == &target) { target_row = b.rows(); target_len = len; }
            b.seqs.push_back({b.rows(), len, int64_t(k), begin});
            for (int64_t i = begin; i < begin + len; ++i) {
              b.tokens.push_back(s[size_t(i)]);
              b.positions.push_back(int32_t(i));
              const bool has_next = i + 1 < int64_t(s.size());
              b.targets.push_back(has_next ? s[size_t(i + 1)] : -100);
              b.loss_mask.push_back(has_next ? 1 : 0);
            }
          }
          if (b.seqs.empty()) break;
          const ChainForward f = g.chain.forward_cached(b, cache);
          for (int64_t i = 0; i < target_len; ++i) {
            logp.push_back(f.logp[size_t(target_row + i)]);
            entropy.push_back(f.entropy[size_t(target_row + i)]);
          }
        }
        const TensorMap got{{"logp", doubles(logp, 0, int64_t(logp.size()))},
                            {"entropy", doubles(entropy, 0, int64_t(entropy.size()))}};
        g.compare(fmt::format("T5 chunked prefill, chunk={}", chunk == cap ? std::string("whole") : std::to_string(chunk)),
                  ref.fwd, got, out.fwd_invariance, "chain (KV-cache path)");
      }
    }

    step("generate, then rescore");
    {
      auto prompts = random_sequences(rng, 3, 3, 12, cfg.vocab_size);
      const int64_t cap = 12 + opt.decode_tokens;
      KvCache cache(cfg, 3, cap, g.chain.act_dtype(), g.chain.backend());
      std::vector<std::vector<double>> decode_logp(3);
      ChainBatch b;
      for (size_t k = 0; k < prompts.size(); ++k) {
        b.seqs.push_back({b.rows(), int64_t(prompts[k].size()), int64_t(k), 0});
        for (size_t i = 0; i < prompts[k].size(); ++i) {
          b.tokens.push_back(prompts[k][i]);
          b.positions.push_back(int32_t(i));
          b.targets.push_back(i + 1 < prompts[k].size() ? prompts[k][i + 1] : -100);
          b.loss_mask.push_back(1);
        }
      }
      Rng sampler(opt.seed + 77);
      for (int t = 0; t < opt.decode_tokens; ++t) {
        std::vector<std::vector<double>> logits;
        const ChainForward step = g.chain.forward_cached(b, cache, &logits);
        std::vector<int32_t> sampled;
        ChainBatch next;
        for (size_t k = 0; k < prompts.size(); ++k) {
          // Gumbel-max sampling from the step's fp32 logits.
          int32_t tok = 0;
          double best = -INFINITY;
          for (int64_t j = 0; j < cfg.vocab_size; ++j) {
            const double gmb = logits[k][size_t(j)] - std::log(-std::log(sampler.uniform(1e-12, 1.0)));
            if (gmb > best) { best = gmb; tok = int32_t(j); }
          }
          sampled.push_back(tok);
          next.seqs.push_back({next.rows(), 1, int64_t(k), int64_t(prompts[k].size())});
          next.tokens.push_back(tok);
          next.positions.push_back(int32_t(prompts[k].size()));
          next.targets.push_back(-100);
          next.loss_mask.push_back(0);
          prompts[k].push_back(tok);
        }
        // The rollout's logprob of each sample, as the engine reports it: the fused LM-head
        // logprob of the step's last hidden rows.
        const std::vector<double> lp = g.chain.last_logprobs(b, step, sampled);
        for (size_t k = 0; k < prompts.size(); ++k) decode_logp[k].push_back(lp[k]);
        b = next;
      }
      // Rescore the finished sequences in one packed forward (the trainer's view).
      const ChainBatch packed = ChainBatch::packed(prompts);
      const ChainForward f = g.chain.forward(packed);
      for (size_t k = 0; k < prompts.size(); ++k) {
        const int64_t first = packed.seqs[k].row + packed.seqs[k].len - opt.decode_tokens - 1;
        const TensorMap got{{"logp", doubles(f.logp, first, opt.decode_tokens)}};
        const TensorMap want{{"logp", doubles(decode_logp[k], 0, opt.decode_tokens)}};
        g.compare(fmt::format("generate-then-rescore, sequence {}", k), want, got, out.fwd_invariance,
                  "chain (decode vs prefill)");
      }
    }

    step("micro-batch splits of the weight gradients");
    {
      const auto seqs = with_target(size_t(opt.batch - 1), 3);
      const DType accd = g.chain.act_dtype() == DType::f64 ? DType::f64 : DType::f32;
      auto grads_of = [&](const std::vector<std::vector<const Seq*>>& micro, int layout) {
        ModelGrads grads(model, accd, g.chain.backend());
        Rng init(opt.seed + 5);  // accumulators start non-zero: micro-batches add into them
        for (auto& [name, t] : grads.accumulators()) {
          HostTensor a(t.dtype(), t.shape());
          for (int64_t i = 0; i < t.numel(); ++i) a.set(i, init.uniform(-1e-3, 1e-3));
          grads.accumulator(name).upload(a);
        }
        for (auto& m : micro) {
          const ChainBatch b = layout == 0 ? ChainBatch::packed(values(m))
                                           : ChainBatch::padded(values(m), opt.target_len + 2, layout == 2, 1, 3);
          const ChainForward f = g.chain.forward(b);
          g.chain.backward(b, f, g.layout_dlogp(b, m), grads);
        }
        TensorMap all;
        for (auto& [name, t] : grads.accumulators()) all[name] = t.to_host();
        return all;
      };
      const TensorMap one = grads_of({seqs}, 0);
      for (size_t per : {size_t(4), size_t(1)}) {
        std::vector<std::vector<const Seq*>> micro;
        for (size_t i = 0; i < seqs.size(); i += per)
          micro.emplace_back(seqs.begin() + long(i), seqs.begin() + long(std::min(seqs.size(), i + per)));
        g.compare(fmt::format("weight grads, micro-batches {}x{}", micro.size(), per), one, grads_of(micro, 0),
                  out.bwd_invariance);
      }
      g.compare("weight grads, padded-right", one, grads_of({seqs}, 1), out.bwd_invariance);
      g.compare("weight grads, padded-left", one, grads_of({seqs}, 2), out.bwd_invariance);
    }

    step("accuracy against the fp64 chain");
    {
      // Judged on the CPU backend: the fp32 chain (the model's weights widened exactly to fp32, fp32
      // activations) against the fp64 chain, with the contract's fp32 chain bounds; reported
      // alongside, not judged: the model-dtype chain (bf16 activations), i.e. the rounding noise of
      // the dtype itself (see docs/contract.md). The CUDA backend's GEMMs take 16-bit inputs only:
      // there the judged chain is the finest it runs, fp16 (the model converted to fp16, against
      // the fp64 chain of those same fp16 weights), with the contract's bf16 chain bounds (fp16
      // rounds 8× finer); the model-dtype chain is reported.
      const auto seqs = random_sequences(rng, 3, 8, opt.neighbour_max_len, cfg.vocab_size);
      const ChainBatch b = ChainBatch::packed(seqs);
      std::vector<const Seq*> ptr;
      for (auto& s : seqs) ptr.push_back(&s);
      const auto dl = g.layout_dlogp(b, ptr);
      struct Truth {
        ChainForward f;
        std::optional<ModelGrads> g;
      };
      auto truth_of = [&](const Model& m) {  // the fp64 chain of m's weights, on the CPU
        const Model wide = m.widened();
        Context truth_ctx;
        truth_ctx.precision = Precision::truth_fp64;
        truth_ctx.poison_activations = true;
        const Chain truth(wide, truth_ctx);
        Truth t{truth.forward(b), std::nullopt};
        t.g.emplace(wide, DType::f64);
        truth.backward(b, t.f, dl, *t.g);
        return t;
      };
      const Truth model_truth = truth_of(model);
      const DType judged_dtype = opt.backend == Backend::cpu ? DType::f32 : DType::f16;
      const Model judged_model = cfg.dtype == judged_dtype ? Model() : model.converted(judged_dtype);
      const Model& judged_ref = cfg.dtype == judged_dtype ? model : judged_model;
      std::optional<Truth> judged_truth;
      if (cfg.dtype != judged_dtype && judged_dtype != DType::f32) judged_truth.emplace(truth_of(judged_model));
      Context judged_ctx;
      judged_ctx.backend = opt.backend;
      judged_ctx.poison_activations = true;
      std::optional<Chain> judged_chain;
      if (cfg.dtype != judged_dtype) judged_chain.emplace(judged_model, judged_ctx);
      struct Variant { const Chain* chain; const Model* model; DType dtype; bool judged; const Truth* truth; };
      std::vector<Variant> variants{{judged_chain ? &*judged_chain : &g.chain, &judged_ref, judged_dtype, true,
                                     judged_truth ? &*judged_truth : &model_truth}};
      if (cfg.dtype != judged_dtype) variants.push_back({&g.chain, &model, cfg.dtype, false, &model_truth});
      for (const Variant& var : variants) {
        const ChainForward& t = var.truth->f;
        const ModelGrads& gt = *var.truth->g;
        const ChainForward f = var.chain->forward(b);
        ModelGrads gf(*var.model, DType::f32, var.chain->backend());
        var.chain->backward(b, f, dl, gf);
        const std::string who = fmt::format("{} chain", dtype_name(var.dtype));
        const std::string judged = var.judged ? "" : " [reported, not judged]";
        const ChainMetrics m = chain_metrics(f.logp, t.logp, b.loss_mask);
        // A reported (not judged) dtype may have no bound in the contract: NaN prints as "nan".
        auto bound = [&](const char* metric) {
          try {
            return contract.chain_bound(metric, var.dtype == DType::f16 ? DType::bf16 : var.dtype);  // see above
          } catch (const Error&) {
            if (var.judged) throw;
            return std::nan("");
          }
        };
        const double bound_abs = bound("max_abs_dlogp");
        const double bound_kl = bound("approx_kl");
        const double bound_clip = bound("clip_fraction");
        Drift d;
        d.op = "chain";
        d.check = fmt::format("{} vs fp64, {} tokens: max|dlogp| {:.3g} (<= {}), approx KL {:.3g} (<= {}), "
                              "clip fraction {:.3g} (<= {}){}", who, m.tokens, m.max_abs, bound_abs, m.approx_kl,
                              bound_kl, m.clip_fraction, bound_clip, judged);
        d.tensor = "logp";
        d.max_abs = m.max_abs;
        d.worst_ratio = std::max(m.max_abs / bound_abs, m.approx_kl / bound_kl);
        const bool over = m.max_abs > bound_abs || m.approx_kl > bound_kl || m.clip_fraction > bound_clip;
        d.count = var.judged && over ? 1 : 0;
        d.first_index_text = over ? "chain metric over its bound" : "";
        out.fwd_accuracy.drifts.push_back(d);
        if (var.judged) {
          out.fwd_accuracy.comparisons++;
          out.fwd_accuracy.worst_ratio = d.worst_ratio;
        }
        const double bound_g = bound("grad_rel_l2");
        for (auto& name : gf.names()) {
          const HostTensor a = gf.gradient(name), b2 = gt.gradient(name);
          double num = 0, den = 0;
          for (int64_t i = 0; i < a.numel(); ++i) {
            num += (a.get(i) - b2.get(i)) * (a.get(i) - b2.get(i));
            den += b2.get(i) * b2.get(i);
          }
          const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
          Drift e;
          e.op = "chain";
          e.check = fmt::format("{} gradient rel. L2 vs fp64 (<= {}){}", who, bound_g, judged);
          e.tensor = name;
          e.max_rel = rel;
          e.worst_ratio = rel / bound_g;
          e.count = var.judged && rel > bound_g ? 1 : 0;
          e.first_index_text = fmt::format("relative L2 error {:.3g}", rel);
          out.bwd_accuracy.drifts.push_back(e);
          if (var.judged) {
            out.bwd_accuracy.comparisons++;
            out.bwd_accuracy.worst_ratio = std::max(out.bwd_accuracy.worst_ratio, e.worst_ratio);
          }
        }
      }
    }
  } catch (const NotBuilt& e) {
    for (CellResult* c : {&out.fwd_invariance, &out.fwd_accuracy, &out.bwd_invariance, &out.bwd_accuracy}) {
      c->status = Status::not_built;
      c->note = e.what();
    }
  } catch (const std::exception& e) {
    for (CellResult* c : {&out.fwd_invariance, &out.fwd_accuracy, &out.bwd_invariance, &out.bwd_accuracy}) {
      c->status = Status::error;
      c->note = e.what();
    }
  }
  for (CellResult* c : {&out.fwd_invariance, &out.bwd_invariance}) finish(*c);
  for (CellResult* c : {&out.fwd_accuracy, &out.bwd_accuracy}) {
    if (c->status == Status::error || c->status == Status::not_built) continue;
    bool ok = true;
    for (auto& d : c->drifts) ok = ok && d.count == 0;
    c->status = c->comparisons == 0 ? Status::not_applicable : ok ? Status::pass : Status::fail;
  }
  return out;
}

}  // namespace samebits::harness
