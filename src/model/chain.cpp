// The model chain on samebits ops. Every reduction lives inside an op, so the chain inherits the
// ops' invariance: nothing here sums across rows except the ops' own token-ordered weight
// gradients. Where two gradient contributions meet (Q/K/V into the input norm, gate/up into the
// post-attention norm) they are produced in the accumulator dtype and added once, in a fixed order.
#include "samebits/chain.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>

#include <fmt/format.h>

#include "model/chain_tables.hpp"
#include "ops/sampling_rule.hpp"
#include "samebits/device.hpp"
#include "samebits/error.hpp"
#include "samebits/validate.hpp"

namespace samebits {

namespace {

using namespace chain_tables;

TensorView v3(const DeviceTensor& t, int64_t a, int64_t b) {
  const TensorView v = t.view();
  return TensorView::of(v.data, t.dtype(), {t.shape()[0], a, b}, v.device);
}

std::string layer_name(int64_t l, const char* what) { return fmt::format("layer{}.{}", l, what); }

}  // namespace

// ---------------------------------------------------------------- forward
Chain::Chain(const Model& model, Context ctx) : model_(model), ctx_(ctx) {
  const bool truth = ctx.precision == Precision::truth_fp64;
  act_ = truth ? DType::f64 : model.config().dtype;
  acc_ = truth ? DType::f64 : DType::f32;
  if (truth && model.weight("model.embed_tokens.weight").dtype != DType::f64)
    throw Error("Chain", "model", "the truth mode runs a widened (fp64) model: pass model.widened()");
  if (model.device() == Device::cuda && ctx.backend != Backend::cuda)
    throw Error("Chain", "model", "its weights are in GPU memory: run it on the cuda backend");
  // A NaN or Inf weight would poison every logprob: refused here, once, naming the tensor (an op
  // deep in the chain could only say "argument 'weight'"). A GPU framework's tensors are not scanned.
  if (ctx.check_finite_inputs && model.device() == Device::cpu) {
    std::vector<std::pair<const std::string*, const TensorView*>> all;
    for (auto& [name, w] : model.weights()) all.push_back({&name, &w});
    std::vector<int64_t> bad(all.size(), -1);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < int64_t(all.size()); ++i) bad[size_t(i)] = first_nonfinite_index(*all[size_t(i)].second);
    for (size_t i = 0; i < all.size(); ++i)
      if (bad[i] >= 0)
        throw Error("Chain", *all[i].first,
                    fmt::format("this model weight holds a non-finite value (NaN or Inf) at flat index {}", bad[i]));
  }
  // The weights, once, into the backend's memory (unless they are there already: read in place).
  // Every device operation of the chain (its tensors' allocations, copies and frees, its ops) is
  // ordered on ctx.stream.
  const DeviceStreamScope on(ctx.stream);
  if (ctx.backend != Backend::cpu && model.device() == Device::cpu)
    for (auto& [name, w] : model.weights()) device_weights_.emplace(name, DeviceTensor::from_host(ctx.backend, w));
}

TensorView Chain::weight(const std::string& name) const {
  if (ctx_.backend == Backend::cpu || model_.device() != Device::cpu) return model_.weight(name);
  const auto it = device_weights_.find(name);
  if (it == device_weights_.end()) return model_.weight(name);  // throws its "no such weight" error
  return it->second.view();
}

DeviceTensor Chain::activation(DType dtype, std::vector<int64_t> shape) const {
  return ctx_.poison_activations ? DeviceTensor::poisoned(ctx_.backend, dtype, std::move(shape))
                                 : DeviceTensor::uninitialized(ctx_.backend, dtype, std::move(shape));
}

ChainForward Chain::forward(const ChainBatch& batch, ForwardKeep keep) const {
  return run(batch, nullptr, nullptr, /*score_rows=*/true, nullptr, keep);
}

ChainForward Chain::score(const ChainBatch& batch) const { return forward(batch, ForwardKeep::none); }

ChainForward Chain::forward_cached(const ChainBatch& batch, KvCache& cache,
                                   std::vector<std::vector<double>>* last_logits, bool score_rows) const {
  return run(batch, &cache, last_logits, score_rows);
}

DeviceTensor& Chain::record(ActivationTrace& trace, std::string name, DType dtype, std::vector<int64_t> shape) const {
  trace.emplace_back(std::move(name), activation(dtype, std::move(shape)));
  return trace.back().second;
}

void Chain::norm(const DeviceTensor& x, const DeviceTensor* residual, const std::string& weight_name, DeviceTensor& y,
                 DeviceTensor* residual_out, DeviceTensor& rstd) const {
  RmsNormForwardArgs a;
  a.x = x.view();
  if (residual) a.residual = residual->view();
  a.weight = weight(weight_name);
  a.y = y.view();
  if (residual_out) a.residual_out = residual_out->view();
  a.rstd = rstd.view();
  a.eps = model_.config().rms_norm_eps;
  rmsnorm_forward(ctx_, a);
}

// What a layer's forward reads besides its input and its weights: the step's tables and, in a
// cached step, where its keys and values go.
struct Chain::LayerStep {
  const ChainBatch& batch;
  TensorView positions;  // int32 [rows], on the backend
  TensorView seqs;       // the attention table (host)
  KvCache* cache = nullptr;
  // A paged cache: each sequence's pages (host, and a device copy where the backend needs one) and
  // where the step's key / value rows go: a model with QK-norm writes them in its QK-norm pair call
  // (cache_rows, int32 [rows] on the backend: each row's cache row, -1 for none); one without copies
  // them (kv_map, int32 [2, kv_rows]: the cache rows, then the batch rows).
  TensorView block_table{}, block_table_device{};
  TensorView cache_rows{};
  const int32_t* kv_map = nullptr;
  int64_t kv_rows = 0;
};

Chain::LayerOut Chain::layer_forward(int64_t l, const DeviceTensor& x_in, const DeviceTensor& n1, const LayerStep& step,
                                     ActivationTrace& out, bool mlp_parts) const {
  const ModelConfig& c = model_.config();
  const int64_t T = x_in.shape()[0], H = c.hidden_size, I = c.intermediate_size, Hq = c.num_heads,
                Hkv = c.num_kv_heads, D = c.head_dim;
  const std::string p = fmt::format("model.layers.{}.", l);
  const auto W = [&](const std::string& n) { return weight(n); };
  auto act = [&](const char* name, std::vector<int64_t> shape) -> DeviceTensor& {
    return record(out, layer_name(l, name), act_, std::move(shape));
  };
  auto acc = [&](const char* name, std::vector<int64_t> shape) -> DeviceTensor& {
    return record(out, layer_name(l, name), acc_, std::move(shape));
  };
  KvCache* const cache = step.cache;
  // Linears of one input in one call (Q, K, V; gate, up): each output bitwise its own call's.
  struct Out {
    const char* name;
    const char* weight;
    int64_t n;
  };
  auto linears = [&](const DeviceTensor& in, std::initializer_list<Out> outs) {
    LinearGroupForwardArgs group;
    group.x = in.view();
    group.weights_settled = true;  // model weights: never an output of the kernel before
    std::array<DeviceTensor*, 3> made{};
    for (const Out& o : outs) {
      DeviceTensor& y = act(o.name, {T, o.n});
      group.parts[group.count] = {W(p + o.weight), {}, y.view()};
      made[size_t(group.count++)] = &y;
    }
    linear_group_forward(ctx_, group);
    return made;
  };
  const auto qkv = linears(n1, {{"q", "self_attn.q_proj.weight", Hq * D},
                                {"k", "self_attn.k_proj.weight", Hkv * D},
                                {"v", "self_attn.v_proj.weight", Hkv * D}});
  const DeviceTensor &q = *qkv[0], &k = *qkv[1], &v = *qkv[2];
  // q / k → (QK-norm, fused with) RoPE: the rotated rows are written once.
  DeviceTensor& qr = act("q_rope", {T, Hq * D});
  DeviceTensor& kr = act("k_rope", {T, Hkv * D});
  const bool paged = cache && cache->is_paged();
  if (c.qk_norm) {  // q and k in one call (one launch on CUDA), each part its own call's bits
    QkNormPairForwardArgs a;
    a.q = {v3(q, Hq, D), W(p + "self_attn.q_norm.weight"), v3(qr, Hq, D), acc("q_norm_rstd", {T, Hq}).view()};
    a.k = {v3(k, Hkv, D), W(p + "self_attn.k_norm.weight"), v3(kr, Hkv, D), acc("k_norm_rstd", {T, Hkv}).view()};
    a.eps = c.rms_norm_eps;
    a.positions = step.positions;
    a.rope = c.rope;
    if (paged) {  // the step's rotated keys (kr's bits) and values into their cache rows, in the same launch
      a.cache_rows = step.cache_rows;
      a.k_cache = cache->k_[size_t(l)].view();
      a.v_cache = cache->v_[size_t(l)].view();
      a.v = v3(v, Hkv, D);
    }
    qk_norm_pair_forward(ctx_, a);
  } else {
    rope_forward(ctx_, {v3(q, Hq, D), step.positions, v3(qr, Hq, D), c.rope});
    rope_forward(ctx_, {v3(k, Hkv, D), step.positions, v3(kr, Hkv, D), c.rope});
  }

  AttentionForwardArgs at;
  at.q = v3(qr, Hq, D);
  if (paged) {  // append this step's keys / values to each sequence's pages (QK-norm: done above)
    if (!c.qk_norm) {
      const size_t row_bytes = size_t(Hkv * D * dtype_size(act_));
      copy_rows_indexed(ctx_.backend, {cache->k_[size_t(l)].view().data, row_bytes, kr.view().data, row_bytes},
                        {cache->v_[size_t(l)].view().data, row_bytes, v.view().data, row_bytes}, row_bytes,
                        step.kv_map, step.kv_map + step.kv_rows, step.kv_rows);
    }
    at.k = cache->k_[size_t(l)].view();
    at.v = cache->v_[size_t(l)].view();
    at.block_table = step.block_table;
    at.block_table_device = step.block_table_device;
    at.page_size = cache->page_size();
  } else if (cache) {  // append this step's keys / values to each sequence's slot, a run of like sequences a copy
    const int64_t cap = cache->capacity();
    const std::vector<ChainSequence>& seqs = step.batch.seqs;
    for (size_t i = 0; i < seqs.size();) {
      const ChainSequence& s = seqs[i];
      size_t j = i + 1;  // sequences i … j − 1: same length and cached count, rows back to back, slots in a row
      while (j < seqs.size() && seqs[j].len == s.len && seqs[j].cached == s.cached &&
             seqs[j].row == s.row + int64_t(j - i) * s.len && seqs[j].slot == s.slot + int64_t(j - i))
        ++j;
      for (DeviceTensor* dst : {&cache->k_[size_t(l)], &cache->v_[size_t(l)]})
        dst->copy_row_blocks_from(dst == &cache->k_[size_t(l)] ? kr : v, s.row, s.len, s.slot * cap + s.cached, cap,
                                  s.len, int64_t(j - i));
      i = j;
    }
    at.k = cache->k_[size_t(l)].view();
    at.v = cache->v_[size_t(l)].view();
  } else {
    at.k = v3(kr, Hkv, D);
    at.v = v3(v, Hkv, D);
  }
  at.seqs = step.seqs;
  DeviceTensor& attn = act("attn", {T, Hq * D});
  at.out = v3(attn, Hq, D);
  at.lse = acc("attn_lse", {T, Hq}).view();
  attention_forward(ctx_, at);
  DeviceTensor& o = act("o", {T, H});
  linear_forward(ctx_, {attn.view(), W(p + "self_attn.o_proj.weight"), {}, o.view(), /*weight_settled=*/true});

  DeviceTensor& x_mid = act("x_mid", {T, H});
  DeviceTensor& n2 = act("n2", {T, H});
  DeviceTensor& rstd2 = acc("rstd2", {T});
  norm(o, &x_in, p + "post_attention_layernorm.weight", n2, &x_mid, rstd2);
  if (!mlp_parts) {  // silu(gate)·up alone: bitwise swiglu_forward of the two (LinearGroupForwardArgs::swiglu)
    DeviceTensor& m = act("swiglu", {T, I});
    LinearGroupForwardArgs group;
    group.x = n2.view();
    group.weights_settled = true;
    group.count = 2;
    group.parts[0].weight = W(p + "mlp.gate_proj.weight");
    group.parts[1].weight = W(p + "mlp.up_proj.weight");
    group.swiglu = m.view();
    linear_group_forward(ctx_, group);
    return {&x_mid, &m};
  }
  const auto gate_up = linears(n2, {{"gate", "mlp.gate_proj.weight", I}, {"up", "mlp.up_proj.weight", I}});
  DeviceTensor& m = act("swiglu", {T, I});
  swiglu_forward(ctx_, {gate_up[0]->view(), gate_up[1]->view(), m.view()});
  return {&x_mid, &m};
}

ChainForward Chain::run(const ChainBatch& batch, KvCache* cache, std::vector<std::vector<double>>* last_logits,
                        bool score_rows, const StepTables* given, ForwardKeep keep) const {
  const DeviceStreamScope on(ctx_.stream);
  const ModelConfig& c = model_.config();
  const int64_t T = batch.rows(), H = c.hidden_size;
  const Rows r = given ? rows_in(given->rows, T, Device::cuda) : rows_of(batch, c, ctx_.backend);
  if (cache) keep = ForwardKeep::none;  // a cached step is never differentiated: it keeps no layer
  ChainForward f;
  f.model = &model_;
  f.backend = ctx_.backend;
  f.keep = keep;
  auto act = [&](const std::string& name, std::vector<int64_t> shape) -> DeviceTensor& {
    return record(f.trace, name, act_, std::move(shape));
  };
  auto acc = [&](const std::string& name, std::vector<int64_t> shape) -> DeviceTensor& {
    return record(f.trace, name, acc_, std::move(shape));
  };

  // The attention sequence table: keys are the batch's rows, or the cache slot's.
  if (cache && (cache->k_.size() != size_t(c.num_layers) || cache->k_[0].dtype() != act_))
    throw Error("chain", "cache", "was made for another model or activation dtype");
  if (cache && cache->k_[0].backend() != ctx_.backend)
    throw Error("chain", "cache", fmt::format("lives on the {} backend, the chain runs on {}",
                                              backend_name(cache->k_[0].backend()), backend_name(ctx_.backend)));
  const HostTensor seqs = attention_table(batch, cache, cache ? cache->capacity() : 0, cache ? &cache->lengths_ : nullptr);
  LayerStep step{batch, r.pos, seqs.view()};
  step.cache = cache;
  // A paged cache: each sequence's pages, and where the step's key / value rows go (the same in
  // every layer: one upload of each for the step; a layer writes its keys and values in its QK-norm
  // pair's launch, or, without QK-norm, in one indexed copy of both).
  HostTensor block_table;
  DeviceTensor block_table_uploaded, write_rows_uploaded;
  if (cache && cache->is_paged()) {
    block_table = cache->block_table_of(batch.seqs, given ? given->block_table.shape[1] : 1);
    step.block_table = block_table.view();
    if (given) {
      step.block_table_device = given->block_table;
      step.kv_map = given->kv_map.as<const int32_t>();
      step.kv_rows = given->kv_map.shape[1];
      step.cache_rows = given->cache_rows;
      if (c.qk_norm && (step.cache_rows.is_none() || step.cache_rows.numel() != T))
        throw Error("chain", "given.cache_rows", "a cached QK-norm step needs each row's cache row (cannot happen)");
    } else {
      if (ctx_.backend == Backend::cuda) {
        block_table_uploaded = DeviceTensor::from_host(ctx_.backend, block_table);
        step.block_table_device = block_table_uploaded.view();
      }
      if (c.qk_norm) {  // [the batch's rows]
        write_rows_uploaded = DeviceTensor::from_host(ctx_.backend, cache->cache_rows_of(batch.seqs, T));
        step.cache_rows = write_rows_uploaded.view();
      } else {
        const HostTensor map = cache->write_rows_of(batch.seqs);  // [2, the step's rows]
        step.kv_rows = map.shape()[1];
        write_rows_uploaded = DeviceTensor::from_host(ctx_.backend, map);
        step.kv_map = static_cast<const int32_t*>(write_rows_uploaded.view().data);
      }
    }
  }

  DeviceTensor* x_in = &act("embed", {T, H});
  embedding_forward(ctx_, {r.ids, weight("model.embed_tokens.weight"), x_in->view()});
  DeviceTensor* n1 = &act("layer0.n1", {T, H});
  DeviceTensor* rstd1 = &acc("layer0.rstd1", {T});
  norm(*x_in, nullptr, "model.layers.0.input_layernorm.weight", *n1, nullptr, *rstd1);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    // Keeping layer inputs alone, the layer's own activations live in `layer` until the next
    // layer's input is made (the backward reruns the layer for them); else in the result's trace.
    ActivationTrace layer;
    ActivationTrace& into = keep == ForwardKeep::layer_inputs ? layer : f.trace;
    const LayerOut made = layer_forward(l, *x_in, *n1, step, into, /*mlp_parts=*/keep != ForwardKeep::none);
    // The down projection and the next input norm stay out of layer_forward: a rerun layer needs
    // neither (its backward reads the kept next input, not `down`).
    DeviceTensor& d = record(into, layer_name(l, "down"), act_, {T, H});
    linear_forward(ctx_, {made.swiglu->view(), weight(fmt::format("model.layers.{}.mlp.down_proj.weight", l)), {},
                          d.view(), /*weight_settled=*/true});  // a model weight

    const bool last = l + 1 == c.num_layers;
    const std::string next = last ? "final." : fmt::format("layer{}.", l + 1);
    x_in = &act(next + "x_in", {T, H});
    n1 = &act(next + "n1", {T, H});
    rstd1 = &acc(next + "rstd1", {T});
    norm(d, made.x_mid, last ? "model.norm.weight" : fmt::format("model.layers.{}.input_layernorm.weight", l + 1),
         *n1, x_in, *rstd1);
    if (keep == ForwardKeep::none)  // no backward will read this layer's activations: they go (stream-ordered frees)
      while (f.trace.front().first != next + "x_in") f.trace.pop_front();
  }
  if (cache && !given)
    for (auto& s : batch.seqs) cache->lengths_[size_t(s.slot)] = s.cached + s.len;

  const TensorView head = head_weight();
  if (!score_rows) {
    f.logp.assign(size_t(T), 0.0);
    f.entropy.assign(size_t(T), 0.0);
  } else {
    DeviceTensor& logp = acc("head.logp", {T});
    DeviceTensor& entropy = acc("head.entropy", {T});
    DeviceTensor& lse = acc("head.lse", {T});
    LmHeadLogprobForwardArgs lh;
    lh.hidden = n1->view();
    lh.weight = head;
    lh.targets = r.targets;
    lh.loss_mask = r.loss_mask;
    lh.logp = logp.view();
    lh.entropy = entropy.view();
    lh.lse = lse.view();
    // Logits kept for the backward (set_lm_head_keep_bytes): the first whole sequences that fit.
    if (keep != ForwardKeep::none && !cache && lm_head_keep_bytes_ > 0) {
      const HostTensor segs = segments_of(batch);
      const int64_t rows = lm_head_rows_to_keep(ctx_.backend, lh.hidden, head, lm_head_keep_bytes_, segs.view());
      if (rows > 0) lh.logits_kept = record(f.trace, "head.logits_kept", DType::f32, {rows, head.shape[0]}).view();
    }
    lm_head_logprob_forward(ctx_, lh);
    const HostTensor logp_host = logp.to_host(), entropy_host = entropy.to_host();
    for (int64_t i = 0; i < T; ++i) {
      f.logp.push_back(logp_host.get(i));
      f.entropy.push_back(entropy_host.get(i));
    }
  }
  if (last_logits) {  // one LM-head GEMM over the sequences' last rows (its bits do not depend on M)
    std::vector<int64_t> rows;
    for (auto& s : batch.seqs) rows.push_back(s.row + s.len - 1);
    *last_logits = row_logits(f, rows);
  }
  return f;
}

std::vector<double> Chain::last_logprobs(const ChainBatch& batch, const ChainForward& f,
                                         const std::vector<int32_t>& tokens) const {
  if (tokens.size() != batch.seqs.size()) throw Error("Chain::last_logprobs", "tokens", "needs one token per sequence");
  std::vector<int64_t> rows;
  for (const ChainSequence& s : batch.seqs) rows.push_back(s.row + s.len - 1);
  return row_logprobs(f, rows, tokens);
}

namespace {
// Rows of `from` [T, H] as a new tensor (a row may repeat): one gather (the embedding op) over them.
DeviceTensor gather_rows(const DeviceTensor& from, const std::vector<int64_t>& rows, const Context& ctx, const char* op) {
  HostTensor ids(DType::i32, {int64_t(rows.size())});
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= from.rows())
      throw Error(op, "rows", fmt::format("row {} is outside the forward's {} rows", rows[i], from.rows()));
    ids.set(int64_t(i), int32_t(rows[i]));
  }
  DeviceTensor out(ctx.backend, from.dtype(), {int64_t(rows.size()), from.shape()[1]});
  const DeviceTensor d_ids = DeviceTensor::from_host(ctx.backend, ids);
  Context c = ctx;
  c.check_finite_inputs = false;  // activations, checked where they were made
  embedding_forward(c, {d_ids.view(), from.view(), out.view()});
  return out;
}
}  // namespace

std::vector<double> Chain::row_logprobs(const ChainForward& f, const std::vector<int64_t>& rows,
                                        const std::vector<int32_t>& tokens) const {
  const DeviceStreamScope on(ctx_.stream);
  const ModelConfig& c = model_.config();
  const int64_t S = int64_t(rows.size());
  if (int64_t(tokens.size()) != S) throw Error("Chain::row_logprobs", "tokens", "needs one token per row");
  if (S == 0) return {};
  const DeviceTensor hidden = gather_rows(f.at("final.n1"), rows, ctx_, "Chain::row_logprobs");
  HostTensor targets(DType::i32, {S}), mask(DType::u8, {S});
  for (int64_t i = 0; i < S; ++i) {
    if (tokens[size_t(i)] < 0 || tokens[size_t(i)] >= c.vocab_size)
      throw Error("Chain::row_logprobs", "tokens", fmt::format("token id {} is outside [0, {})", tokens[size_t(i)], c.vocab_size));
    targets.set(i, tokens[size_t(i)]);
    mask.set(i, 1);
  }
  const DeviceTensor d_targets = DeviceTensor::from_host(ctx_.backend, targets),
                     d_mask = DeviceTensor::from_host(ctx_.backend, mask);
  DeviceTensor logp(ctx_.backend, acc_, {S}), entropy(ctx_.backend, acc_, {S}), lse(ctx_.backend, acc_, {S});
  LmHeadLogprobForwardArgs lh;
  lh.hidden = hidden.view();
  lh.weight = head_weight();
  lh.targets = d_targets.view();
  lh.loss_mask = d_mask.view();
  lh.logp = logp.view();
  lh.entropy = entropy.view();
  lh.lse = lse.view();
  lm_head_logprob_forward(ctx_, lh);
  const HostTensor host = logp.to_host();
  std::vector<double> out;
  for (int64_t i = 0; i < S; ++i) out.push_back(host.get(i));
  return out;
}

TensorView Chain::head_weight() const {
  return weight(model_.config().tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
}

DeviceTensor Chain::logits_of(const TensorView& hidden, DType dtype) const {
  DeviceTensor logits(ctx_.backend, dtype, {hidden.shape[0], model_.config().vocab_size});
  linear_forward(ctx_, {hidden, head_weight(), {}, logits.view(), /*weight_settled=*/true});
  return logits;
}

std::vector<std::vector<double>> Chain::row_logits(const ChainForward& f, const std::vector<int64_t>& rows) const {
  const DeviceStreamScope on(ctx_.stream);
  const int64_t S = int64_t(rows.size()), V = model_.config().vocab_size;
  if (S == 0) return {};
  const DeviceTensor hidden = gather_rows(f.at("final.n1"), rows, ctx_, "Chain::row_logits");
  const HostTensor host = logits_of(hidden.view(), acc_).to_host();
  std::vector<std::vector<double>> out(static_cast<size_t>(S), std::vector<double>(static_cast<size_t>(V)));
  for (int64_t i = 0; i < S; ++i)
    for (int64_t j = 0; j < V; ++j) out[size_t(i)][size_t(j)] = host.get(i * V + j);
  return out;
}

Chain::RowDraws Chain::sample_rows(const ChainForward& f, const std::vector<int64_t>& rows,
                                   const std::vector<double>& params) const {
  const DeviceStreamScope on(ctx_.stream);
  constexpr int64_t P = sampling_rule::PARAMS;
  const int64_t S = int64_t(rows.size());
  check_draw_params("Chain::sample_rows", params, S);
  if (S == 0) return {};
  if (acc_ != DType::f32) throw Error("Chain::sample_rows", "precision", "sampling reads fp32 logits (not the fp64 truth mode)");
  const DeviceTensor hidden = gather_rows(f.at("final.n1"), rows, ctx_, "Chain::sample_rows");
  HostTensor p(DType::f64, {S, P});
  std::memcpy(p.data(), params.data(), params.size() * sizeof(double));
  const DeviceTensor d_params = DeviceTensor::from_host(ctx_.backend, p);
  DeviceTensor tokens(ctx_.backend, DType::i32, {S}), logp(ctx_.backend, DType::f32, {S}),
      weights(ctx_.backend, DType::f32, {S, 2});
  draw(hidden.view(), d_params.view(), tokens.view(), logp.view(), weights.view());
  const HostTensor t = tokens.to_host(), l = logp.to_host(), w = weights.to_host();
  return draws_of(S, static_cast<const int32_t*>(t.data()), static_cast<const float*>(l.data()),
                  static_cast<const float*>(w.data()));
}

void Chain::check_draw_params(const char* op, const std::vector<double>& params, int64_t rows) {
  constexpr int64_t P = sampling_rule::PARAMS;
  if (int64_t(params.size()) != rows * P) throw Error(op, "params", "needs five settings a row");
  for (int64_t i = 0; i < rows; ++i)  // checked on the host, so that the only bad token is a bad row's −1
    if (!sampling_rule::params_ok(sampling_rule::params_of(params.data() + i * P)))
      throw Error(op, "params", fmt::format("row {}'s settings are out of range", i));
}

Chain::RowDraws Chain::draws_of(int64_t rows, const int32_t* tokens, const float* logp, const float* weights) {
  RowDraws out;
  for (int64_t i = 0; i < rows; ++i) {
    const bool bad = tokens[i] < 0;
    out.tokens.push_back(tokens[i]);
    out.logprobs.push_back(bad ? NAN : double(logp[i]));
    out.sampling_logprobs.push_back(bad ? NAN : sampling_rule::sampling_logprob(weights[2 * i], weights[2 * i + 1]));
  }
  return out;
}

void Chain::draw(const TensorView& hidden, const TensorView& params, const TensorView& tokens, const TensorView& logp,
                 const TensorView& weights) const {
  const DeviceTensor logits = logits_of(hidden, DType::f32);
  Context quiet = ctx_;
  quiet.check_finite_inputs = false;
  sample_tokens(quiet, {logits.view(), params, tokens, {}, weights});
  // The drawn tokens are the targets as they lie; a row whose logits hold NaN / Inf drew −1 and is ignored.
  LogprobForwardArgs lp{logits.view(), tokens, {}, logp, {}, {}};
  lp.ignore_index = sampling_rule::BAD_LOGITS;
  logprob_forward(quiet, lp);
}

// ---------------------------------------------------------------- backward
DeviceTensor Chain::backward(const ChainBatch& batch, const ChainForward& f, const std::vector<double>& dlogp,
                             ModelGrads& grads) const {
  const DeviceStreamScope on(ctx_.stream);
  const ModelConfig& c = model_.config();
  const int64_t T = batch.rows(), H = c.hidden_size, I = c.intermediate_size, Hq = c.num_heads,
                Hkv = c.num_kv_heads, D = c.head_dim;
  if (f.model != &model_ || f.backend != ctx_.backend)
    throw Error("Chain::backward", "forward", "was made by a chain over another model or on another backend: run the "
                                              "backward on the chain that ran the forward");
  if (!f.activations_kept())
    throw Error("Chain::backward", "forward", "kept no activations (Chain::score or a cached step): run forward() for a backward");
  if (int64_t(f.logp.size()) != T) throw Error("Chain::backward", "forward", "was made for another batch (its rows differ)");
  if (int64_t(dlogp.size()) != T) throw Error("Chain::backward", "dlogp", "needs one entry per row");
  for (auto& s : batch.seqs)
    if (s.slot >= 0) throw Error("Chain::backward", "batch", "the backward runs on a forward() batch, not a cached step");
  for (auto& [name, t] : grads.accumulators())
    if (t.backend() != ctx_.backend)
      throw Error("Chain::backward", "grads", fmt::format("accumulators live on the {} backend, the chain runs on {}",
                                                          backend_name(t.backend()), backend_name(ctx_.backend)));
  const Rows r = rows_of(batch, c, ctx_.backend);
  const auto W = [&](const std::string& n) { return weight(n); };
  // A forward that kept layer inputs alone: each layer's activations are rerun into `rerun` just
  // before its backward and freed after it, so the backward holds one layer's at a time.
  ActivationTrace rerun;
  const auto at = [&](const std::string& n) -> const DeviceTensor& {
    const DeviceTensor* t = find_activation(rerun, n);
    return t ? *t : f.at(n);
  };
  const auto A = [&](const std::string& n) { return at(n).view(); };
  const auto G = [&](const std::string& n) { return grads.accumulator(n).view(); };
  const TensorView mask = r.row_mask;
  auto act = [&](std::vector<int64_t> shape) { return activation(act_, std::move(shape)); };
  auto acc = [&](std::vector<int64_t> shape) { return activation(acc_, std::move(shape)); };

  const HostTensor seqs = attention_table(batch, nullptr, 0, nullptr);
  const LayerStep step{batch, r.pos, seqs.view()};
  const HostTensor segments = segments_of(batch);
  HostTensor g_logp_host(acc_, {T});
  for (int64_t i = 0; i < T; ++i) g_logp_host.set(i, dlogp[size_t(i)]);
  const DeviceTensor g_logp = DeviceTensor::from_host(ctx_.backend, g_logp_host);

  DeviceTensor dn = act({T, H});
  {
    LmHeadLogprobBackwardArgs a;
    a.hidden = A("final.n1");
    a.weight = head_weight();
    a.targets = r.targets;
    a.loss_mask = r.loss_mask;
    a.lse = A("head.lse");
    a.dlogp = g_logp.view();
    a.dhidden = dn.view();
    a.dweight = G("lm_head.weight");  // the tied model's LM-head accumulator is a separate buffer
    if (const DeviceTensor* kept = find_activation(f.trace, "head.logits_kept"))
      a.logits_kept = kept->view();
    a.segments = segments.view();
    lm_head_logprob_backward(ctx_, a);
  }
  // Backward of an RMSNorm whose input was the activation `x`: dy from the norm's output, plus
  // (when fused) the gradient already on the residual stream; returns the input's gradient.
  auto norm_back = [&](const DeviceTensor& dy, const DeviceTensor* dresidual, const std::string& x,
                       const std::string& rstd, const std::string& weight) {
    DeviceTensor dx_out = act({T, H});
    RmsNormBackwardArgs a;
    a.dy = dy.view();
    if (dresidual) a.dresidual_out = dresidual->view();
    a.x = A(x);
    a.weight = W(weight);
    a.rstd = A(rstd);
    a.row_mask = mask;
    a.dx = dx_out.view();
    a.dweight = G(weight);
    a.eps = c.rms_norm_eps;
    a.segments = segments.view();
    rmsnorm_backward(ctx_, a);
    return dx_out;
  };
  DeviceTensor dx = norm_back(dn, nullptr, "final.x_in", "final.rstd1", "model.norm.weight");
  // Σ of gradient contributions, each produced in the accumulator dtype, added in list order and
  // rounded once into `out`.
  auto sum_into = [&](std::vector<DeviceTensor>& parts, DeviceTensor& out) {
    for (size_t i = 1; i + 1 < parts.size(); ++i)
      residual_add_forward(ctx_, {parts[0].view(), parts[i].view(), parts[0].view()});
    residual_add_forward(ctx_, {parts[0].view(), parts.back().view(), out.view()});
  };
  for (int64_t l = c.num_layers - 1; l >= 0; --l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    const std::string in_name = l == 0 ? "embed" : layer_name(l, "x_in");
    const std::string n1_name = layer_name(l, "n1"), rstd1_name = layer_name(l, "rstd1");
    if (f.keep == ForwardKeep::layer_inputs) layer_forward(l, f.at(in_name), f.at(n1_name), step, rerun);
    auto back_linear = [&](const TensorView& dy, const TensorView& x, const std::string& w, DeviceTensor& dx_out) {
      linear_backward_input(ctx_, {dy, W(w), dx_out.view()});
      linear_backward_weight(ctx_, {dy, x, mask, G(w), {}, segments.view()});
    };
    // MLP: x_next = x_mid + down(swiglu(gate(n2), up(n2)))
    DeviceTensor dm = act({T, I});
    back_linear(dx.view(), A(layer_name(l, "swiglu")), p + "mlp.down_proj.weight", dm);
    DeviceTensor dg = act({T, I}), du = act({T, I});
    swiglu_backward(ctx_, {dm.view(), A(layer_name(l, "gate")), A(layer_name(l, "up")), dg.view(), du.view()});
    std::vector<DeviceTensor> parts;
    parts.push_back(acc({T, H}));
    parts.push_back(acc({T, H}));
    back_linear(dg.view(), A(layer_name(l, "n2")), p + "mlp.gate_proj.weight", parts[0]);
    back_linear(du.view(), A(layer_name(l, "n2")), p + "mlp.up_proj.weight", parts[1]);
    DeviceTensor dn2 = act({T, H});
    sum_into(parts, dn2);
    const DeviceTensor dx_mid =
        norm_back(dn2, &dx, layer_name(l, "x_mid"), layer_name(l, "rstd2"), p + "post_attention_layernorm.weight");
    // Attention: x_mid = x_in + o_proj(attention(rope(qk_norm(q)), rope(qk_norm(k)), v))
    DeviceTensor da = act({T, Hq * D});
    back_linear(dx_mid.view(), A(layer_name(l, "attn")), p + "self_attn.o_proj.weight", da);
    DeviceTensor dqr = act({T, Hq * D}), dkr = act({T, Hkv * D}), dv = act({T, Hkv * D});
    {
      AttentionBackwardArgs a;
      a.q = v3(at(layer_name(l, "q_rope")), Hq, D);
      a.k = v3(at(layer_name(l, "k_rope")), Hkv, D);
      a.v = v3(at(layer_name(l, "v")), Hkv, D);
      a.seqs = seqs.view();
      a.out = v3(at(layer_name(l, "attn")), Hq, D);
      a.lse = A(layer_name(l, "attn_lse"));
      a.dout = v3(da, Hq, D);
      a.dq = v3(dqr, Hq, D);
      a.dk = v3(dkr, Hkv, D);
      a.dv = v3(dv, Hkv, D);
      attention_backward(ctx_, a);
    }
    // RoPE (fused with the QK-norm) backward: dq / dk, the gradients of the projections' outputs.
    DeviceTensor dq = act({T, Hq * D}), dk = act({T, Hkv * D});
    for (auto [grad, out, name, heads, w] : {std::tuple{&dqr, &dq, "q", Hq, "self_attn.q_norm.weight"},
                                             std::tuple{&dkr, &dk, "k", Hkv, "self_attn.k_norm.weight"}}) {
      if (!c.qk_norm) {
        rope_backward(ctx_, {v3(*grad, heads, D), r.pos, v3(*out, heads, D), c.rope});
        continue;
      }
      QkNormBackwardArgs a;
      a.dy = v3(*grad, heads, D);
      a.x = v3(at(layer_name(l, name)), heads, D);
      a.weight = W(p + w);
      a.rstd = A(layer_name(l, name) + "_norm_rstd");
      a.row_mask = mask;
      a.dx = v3(*out, heads, D);
      a.dweight = G(p + w);
      a.eps = c.rms_norm_eps;
      a.positions = r.pos;
      a.rope = c.rope;
      a.segments = segments.view();
      qk_norm_backward(ctx_, a);
    }
    std::vector<DeviceTensor> qkv;
    for (int i = 0; i < 3; ++i) qkv.push_back(acc({T, H}));
    back_linear(dq.view(), A(n1_name), p + "self_attn.q_proj.weight", qkv[0]);
    back_linear(dk.view(), A(n1_name), p + "self_attn.k_proj.weight", qkv[1]);
    back_linear(dv.view(), A(n1_name), p + "self_attn.v_proj.weight", qkv[2]);
    DeviceTensor dn1 = act({T, H});
    sum_into(qkv, dn1);
    dx = norm_back(dn1, &dx_mid, in_name, rstd1_name, p + "input_layernorm.weight");
    rerun.clear();
  }
  embedding_backward(ctx_, {r.ids, dx.view(), mask, G("model.embed_tokens.weight")});
  return dx;
}

}  // namespace samebits
