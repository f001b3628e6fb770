// Op cases: attention (prefill, chunked prefill against a KV cache), selected logprob and the
// fused LM head -> logprob.
#include "harness/cases/case_util.hpp"

namespace samebits::harness {

class AttentionCase : public OpCase {
 public:
  AttentionCase(DType dt, int64_t hq, int64_t hkv, int64_t d, int64_t max_len)
      : dt_(dt), hq_(hq), hkv_(hkv), d_(d), max_len_(max_len) {}
  std::string op() const override { return "attention"; }
  std::string params_text() const override {
    return fmt::format("{} Hq={} Hkv={} D={} L<={}", dtype_name(dt_), hq_, hkv_, d_, max_len_);
  }
  DType dtype() const override { return dt_; }
  std::string forward_class() const override { return "attention"; }
  std::string backward_class() const override { return "attention"; }
  int64_t max_length() const override { return max_len_; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    return {len, {{"q", r.tensor(dt_, {len, hq_, d_}, -2, 2)}, {"k", r.tensor(dt_, {len, hkv_, d_}, -2, 2)},
                  {"v", r.tensor(dt_, {len, hkv_, d_}, -1, 1)}, {"dout", upstream(r, dt_, {len, hq_, d_})}}};
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override { return {{"out", "dout"}}; }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override {
    return {{"q", "dq"}, {"k", "dk"}, {"v", "dv"}};
  }
  void run(const Context& ctx, CaseIO& io) const override {
    const Batch& b = io.batch;
    bool whole = true;
    for (auto& p : b.pieces) whole = whole && p.begin == 0 && p.len == b.seqs[size_t(p.seq)]->length;
    HostTensor seqs(DType::i32, {int64_t(b.pieces.size()), 4});
    HostTensor k_cache, v_cache;
    AttentionForwardArgs f;
    if (whole) {  // prefill: keys are the batch's own rows
      for (size_t i = 0; i < b.pieces.size(); ++i) {
        const Piece& p = b.pieces[i];
        for (int c = 0; c < 4; ++c) seqs.set(int64_t(i) * 4 + c, double(c % 2 == 0 ? p.row : p.len));
      }
      f.k = io.view(io.in("k"));
      f.v = io.view(io.in("v"));
    } else {  // a chunk against a KV cache holding each sequence's prefix, junk rows in between
      constexpr int64_t kGap = 3;
      int64_t rows = 0;
      for (auto& p : b.pieces) rows += p.begin + p.len + kGap;
      Rng junk{static_cast<uint64_t>(rows)};
      k_cache = junk.tensor(io.in("k").dtype(), {rows, hkv_, d_}, -2, 2);
      v_cache = junk.tensor(io.in("v").dtype(), {rows, hkv_, d_}, -1, 1);
      int64_t at = kGap;
      for (size_t i = 0; i < b.pieces.size(); ++i) {
        const Piece& p = b.pieces[i];
        const Sequence& s = *b.seqs[size_t(p.seq)];
        const int64_t k_len = p.begin + p.len;
        k_cache.copy_rows_from(s.tokens.at("k"), 0, at, k_len);
        v_cache.copy_rows_from(s.tokens.at("v"), 0, at, k_len);
        const int64_t row[4] = {p.row, p.len, at, k_len};
        for (int c = 0; c < 4; ++c) seqs.set(int64_t(i) * 4 + c, double(row[c]));
        at += k_len;
      }
      f.k = io.view(k_cache);
      f.v = io.view(v_cache);
    }
    f.q = io.view(io.in("q"));
    f.seqs = V(seqs);
    f.out = io.view(io.output("out", io.out_dtype(dt_), {hq_, d_}));
    f.lse = io.view(io.output("lse", io.acc_dtype(), {hq_}));
    attention_forward(ctx, f);
    if (!io.backward) return;
    AttentionBackwardArgs g;
    g.q = f.q;
    g.k = f.k;
    g.v = f.v;
    g.seqs = f.seqs;
    g.out = f.out;
    g.lse = f.lse;
    g.dout = io.view(io.in("dout"));
    g.dq = io.view(io.output("dq", io.out_dtype(dt_), {hq_, d_}));
    g.dk = io.view(io.output("dk", io.out_dtype(dt_), {hkv_, d_}));
    g.dv = io.view(io.output("dv", io.out_dtype(dt_), {hkv_, d_}));
    attention_backward(ctx, g);
  }

 private:
  DType dt_;
  int64_t hq_, hkv_, d_, max_len_;
};

// Targets with ~10% ignore_index and a loss mask with ~15% zeros; upstream gradients in fp32.
static void add_targets(Sequence& s, Rng& r, int64_t len, int64_t vocab) {
  HostTensor targets(DType::i32, {len}), mask(DType::u8, {len});
  for (int64_t t = 0; t < len; ++t) {
    targets.set(t, r.uniform(0, 1) < 0.1 ? -100.0 : double(r.integer(0, vocab - 1)));
    mask.set(t, r.uniform(0, 1) < 0.15 ? 0.0 : 1.0);
  }
  s.tokens["targets"] = targets;
  s.tokens["loss_mask"] = mask;
  s.tokens["dlogp"] = r.tensor(DType::f32, {len}, -1, 1);
  s.tokens["dentropy"] = r.tensor(DType::f32, {len}, -1, 1);
}

class LogprobCase : public OpCase {
 public:
  LogprobCase(DType dt, int64_t vocab, int64_t max_len) : dt_(dt), vocab_(vocab), max_len_(max_len) {}
  std::string op() const override { return "logprob"; }
  std::string params_text() const override { return fmt::format("{} V={}", dtype_name(dt_), vocab_); }
  DType dtype() const override { return dt_; }
  std::string forward_class() const override { return "logprob"; }
  std::string backward_class() const override { return "reduction"; }
  int64_t max_length() const override { return max_len_; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    Sequence s{len, {}};
    HostTensor logits(dt_, {len, vocab_});
    for (int64_t i = 0; i < logits.numel(); ++i) logits.set(i, 3.0 * r.normal());
    s.tokens["logits"] = logits;
    add_targets(s, r, len, vocab_);
    return s;
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override {
    return {{"logp", "dlogp"}, {"entropy", "dentropy"}};
  }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override { return {{"logits", "dlogits"}}; }
  void run(const Context& ctx, CaseIO& io) const override {
    LogprobForwardArgs f;
    f.logits = io.view(io.in("logits"));
    f.targets = io.view(io.in("targets"));
    f.loss_mask = io.view(io.in("loss_mask"));
    f.logp = io.view(io.output("logp", io.acc_dtype(), {}));
    f.entropy = io.view(io.output("entropy", io.acc_dtype(), {}));
    f.lse = io.view(io.output("lse", io.acc_dtype(), {}));
    logprob_forward(ctx, f);
    if (!io.backward) return;
    LogprobBackwardArgs b;
    b.logits = f.logits;
    b.targets = f.targets;
    b.loss_mask = f.loss_mask;
    b.lse = f.lse;
    b.dlogp = io.view(io.in("dlogp"));
    b.dentropy = io.view(io.in("dentropy"));
    b.dlogits = io.view(io.output("dlogits", io.out_dtype(dt_), {vocab_}));
    logprob_backward(ctx, b);
  }

 private:
  DType dt_;
  int64_t vocab_, max_len_;
};

class LmHeadLogprobCase : public OpCase {
 public:
  LmHeadLogprobCase(DType dt, int64_t h, int64_t vocab) : dt_(dt), h_(h), vocab_(vocab) {}
  std::string op() const override { return "lm_head_logprob"; }
  std::string params_text() const override { return fmt::format("{} H={} V={}", dtype_name(dt_), h_, vocab_); }
  DType dtype() const override { return dt_; }
  std::string forward_class() const override { return "logprob"; }
  std::string backward_class() const override { return "reduction"; }
  int64_t max_length() const override { return 12; }
  TensorMap make_params(Rng& r) const override { return {{"weight", r.tensor(dt_, {vocab_, h_}, -0.5, 0.5)}}; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    Sequence s{len, {{"hidden", r.tensor(dt_, {len, h_}, -1, 1)}}};
    add_targets(s, r, len, vocab_);
    return s;
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override {
    return {{"logp", "dlogp"}, {"entropy", "dentropy"}};
  }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override { return {{"hidden", "dhidden"}}; }
  std::vector<std::string> trained_params() const override { return {"weight"}; }
  // The backward may round dlogits to the storage dtype before its two GEMMs (the CUDA backend
  // does: tensor cores take 16-bit operands, as the unfused chain's stored dlogits are); the truth
  // keeps them exact, so what follows that rounding, the weight gradient, is judged by the storage
  // dtype (dhidden is stored in it anyway).
  DType tolerance_dtype(const std::string& tensor, DType stored) const override {
    return tensor == "weight" ? dt_ : stored;
  }
  void run(const Context& ctx, CaseIO& io) const override {
    LmHeadLogprobForwardArgs f;
    f.hidden = io.view(io.in("hidden"));
    f.weight = io.view(io.param("weight"));
    f.targets = io.view(io.in("targets"));
    f.loss_mask = io.view(io.in("loss_mask"));
    f.logp = io.view(io.output("logp", io.acc_dtype(), {}));
    f.entropy = io.view(io.output("entropy", io.acc_dtype(), {}));
    f.lse = io.view(io.output("lse", io.acc_dtype(), {}));
    lm_head_logprob_forward(ctx, f);
    if (!io.backward) return;
    LmHeadLogprobBackwardArgs b;
    b.hidden = f.hidden;
    b.weight = f.weight;
    b.targets = f.targets;
    // Padding rows contribute nothing: they are masked out of the loss like any masked token.
    HostTensor mask = io.in("loss_mask");
    for (int64_t r = 0; r < mask.numel(); ++r)
      if (io.batch.row_mask.get(r) == 0) mask.set(r, 0);
    b.loss_mask = io.view(mask);
    b.lse = f.lse;
    b.dlogp = io.view(io.in("dlogp"));
    b.dentropy = io.view(io.in("dentropy"));
    b.dhidden = io.view(io.output("dhidden", io.out_dtype(dt_), {h_}));
    b.dweight = io.grad("weight");
    const HostTensor segments = segment_table(io.batch);
    b.segments = V(segments);  // read on the host during the call
    lm_head_logprob_backward(ctx, b);
  }

 private:
  DType dt_;
  int64_t h_, vocab_;
};

void add_attention_logprob_cases(CaseList& out) {
  out.push_back(std::make_shared<AttentionCase>(DType::bf16, 4, 2, 64, 130));
  out.push_back(std::make_shared<AttentionCase>(DType::f32, 4, 1, 32, 40));
  out.push_back(std::make_shared<AttentionCase>(DType::f16, 2, 2, 128, 24));
  out.push_back(std::make_shared<LogprobCase>(DType::bf16, 32000, 8));
  out.push_back(std::make_shared<LogprobCase>(DType::f32, 1031, 24));
  out.push_back(std::make_shared<LogprobCase>(DType::f16, 4099, 12));
  out.push_back(std::make_shared<LogprobCase>(DType::bf16, 151936, 3));
  out.push_back(std::make_shared<LogprobCase>(DType::bf16, 128256, 3));
  out.push_back(std::make_shared<LmHeadLogprobCase>(DType::bf16, 64, 5000));
  out.push_back(std::make_shared<LmHeadLogprobCase>(DType::f32, 32, 2500));
  out.push_back(std::make_shared<LmHeadLogprobCase>(DType::f16, 32, 1031));  // odd vocab
}

}  // namespace samebits::harness
