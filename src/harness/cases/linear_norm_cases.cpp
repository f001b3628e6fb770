// Op cases: linear (GEMM), RMSNorm (plain and fused with the residual add), QK-norm.
#include "harness/cases/case_util.hpp"

namespace samebits::harness {

class LinearCase : public OpCase {
 public:
  LinearCase(DType dt, int64_t n, int64_t k, bool bias) : dt_(dt), n_(n), k_(k), bias_(bias) {}
  std::string op() const override { return "linear"; }
  std::string params_text() const override {
    return fmt::format("{} N={} K={}{}", dtype_name(dt_), n_, k_, bias_ ? " +bias" : "");
  }
  DType dtype() const override { return dt_; }
  std::string forward_class() const override { return "reduction"; }
  std::string backward_class() const override { return "reduction"; }
  TensorMap make_params(Rng& r) const override {
    TensorMap p{{"weight", r.tensor(dt_, {n_, k_}, -1, 1)}};
    if (bias_) p["bias"] = r.tensor(dt_, {n_}, -1, 1);
    return p;
  }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    return {len, {{"x", r.tensor(dt_, {len, k_}, -1, 1)}, {"dy", upstream(r, dt_, {len, n_})}}};
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override { return {{"y", "dy"}}; }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override { return {{"x", "dx"}}; }
  std::vector<std::string> trained_params() const override {
    return bias_ ? std::vector<std::string>{"weight", "bias"} : std::vector<std::string>{"weight"};
  }
  void run(const Context& ctx, CaseIO& io) const override {
    LinearForwardArgs f;
    f.x = io.view(io.in("x"));
    f.weight = io.view(io.param("weight"));
    if (bias_) f.bias = io.view(io.param("bias"));
    f.y = io.view(io.output("y", io.out_dtype(dt_), {n_}));
    linear_forward(ctx, f);
    if (!io.backward) return;
    LinearBackwardInputArgs bi;
    bi.dy = io.view(io.in("dy"));
    bi.weight = f.weight;
    bi.dx = io.view(io.output("dx", io.out_dtype(dt_), {k_}));
    linear_backward_input(ctx, bi);
    LinearBackwardWeightArgs bw;
    bw.dy = bi.dy;
    bw.x = f.x;
    bw.row_mask = io.view(io.batch.row_mask);
    bw.dweight = io.grad("weight");
    const HostTensor segments = segment_table(io.batch);
    bw.segments = V(segments);  // read on the host during the call
    bw.dbias = io.grad("bias");
    linear_backward_weight(ctx, bw);
  }

 private:
  DType dt_;
  int64_t n_, k_;
  bool bias_;
};

class RmsNormCase : public OpCase {
 public:
  RmsNormCase(DType dt, int64_t h, bool fused) : dt_(dt), h_(h), fused_(fused) {}
  std::string op() const override { return fused_ ? "add_rmsnorm" : "rmsnorm"; }
  std::string params_text() const override { return fmt::format("{} H={}", dtype_name(dt_), h_); }
  DType dtype() const override { return dt_; }
  std::string forward_class() const override { return "reduction"; }
  std::string backward_class() const override { return "reduction"; }
  TensorMap make_params(Rng& r) const override { return {{"weight", r.tensor(dt_, {h_}, 0.5, 1.5)}}; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    Sequence s{len, {{"x", r.tensor(dt_, {len, h_}, -2, 2)}, {"dy", upstream(r, dt_, {len, h_})}}};
    if (fused_) {
      s.tokens["residual"] = r.tensor(dt_, {len, h_}, -2, 2);
      s.tokens["dresidual_out"] = upstream(r, dt_, {len, h_});
    }
    return s;
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override {
    if (fused_) return {{"y", "dy"}, {"residual_out", "dresidual_out"}};
    return {{"y", "dy"}};
  }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override {
    if (fused_) return {{"x", "dx"}, {"residual", "dx"}};
    return {{"x", "dx"}};
  }
  std::vector<std::string> trained_params() const override { return {"weight"}; }
  // Fused: the sum is rounded to the storage dtype by definition, the truth keeps it exact.
  DType tolerance_dtype(const std::string& tensor, DType stored) const override {
    return fused_ && tensor != "residual_out" ? dt_ : stored;
  }
  void run(const Context& ctx, CaseIO& io) const override {
    RmsNormForwardArgs f;
    f.x = io.view(io.in("x"));
    f.weight = io.view(io.param("weight"));
    if (fused_) {
      f.residual = io.view(io.in("residual"));
      f.residual_out = io.view(io.output("residual_out", io.out_dtype(dt_), {h_}));
    }
    f.y = io.view(io.output("y", io.out_dtype(dt_), {h_}));
    f.rstd = io.view(io.output("rstd", io.acc_dtype(), {}));
    rmsnorm_forward(ctx, f);
    if (!io.backward) return;
    RmsNormBackwardArgs b;
    b.dy = io.view(io.in("dy"));
    if (fused_) b.dresidual_out = io.view(io.in("dresidual_out"));
    b.x = fused_ ? f.residual_out : f.x;
    b.weight = f.weight;
    b.rstd = f.rstd;
    b.row_mask = io.view(io.batch.row_mask);
    b.dx = io.view(io.output("dx", io.out_dtype(dt_), {h_}));
    b.dweight = io.grad("weight");
    const HostTensor segments = segment_table(io.batch);
    b.segments = V(segments);  // read on the host during the call
    rmsnorm_backward(ctx, b);
  }

 private:
  DType dt_;
  int64_t h_;
  bool fused_;
};

// QK-norm, alone or fused with RoPE (positions as the RoPE case's: restarts, offsets, far out).
class QkNormCase : public OpCase {
 public:
  QkNormCase(DType dt, int64_t heads, int64_t d, bool rope = false) : dt_(dt), heads_(heads), d_(d), rope_(rope) {}
  std::string op() const override { return rope_ ? "qk_norm_rope" : "qk_norm"; }
  std::string params_text() const override { return fmt::format("{} heads={} D={}", dtype_name(dt_), heads_, d_); }
  DType dtype() const override { return dt_; }
  std::string forward_class() const override { return "reduction"; }
  std::string backward_class() const override { return "reduction"; }
  TensorMap make_params(Rng& r) const override { return {{"weight", r.tensor(dt_, {d_}, 0.5, 1.5)}}; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    Sequence s{len, {{"x", r.tensor(dt_, {len, heads_, d_}, -2, 2)}, {"dy", upstream(r, dt_, {len, heads_, d_})}}};
    if (rope_) s.tokens.emplace("positions", rope_positions(r, len));
    return s;
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override { return {{"y", "dy"}}; }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override { return {{"x", "dx"}}; }
  std::vector<std::string> trained_params() const override { return {"weight"}; }
  void run(const Context& ctx, CaseIO& io) const override {
    QkNormForwardArgs f;
    f.x = io.view(io.in("x"));
    f.weight = io.view(io.param("weight"));
    f.y = io.view(io.output("y", io.out_dtype(dt_), {heads_, d_}));
    f.rstd = io.view(io.output("rstd", io.acc_dtype(), {heads_}));
    if (rope_) f.positions = io.view(io.in("positions"));
    qk_norm_forward(ctx, f);
    if (!io.backward) return;
    QkNormBackwardArgs b;
    b.dy = io.view(io.in("dy"));
    b.x = f.x;
    b.weight = f.weight;
    b.rstd = f.rstd;
    b.row_mask = io.view(io.batch.row_mask);
    b.dx = io.view(io.output("dx", io.out_dtype(dt_), {heads_, d_}));
    b.dweight = io.grad("weight");
    b.positions = f.positions;
    const HostTensor segments = segment_table(io.batch);
    b.segments = V(segments);  // read on the host during the call
    qk_norm_backward(ctx, b);
  }

 private:
  DType dt_;
  int64_t heads_, d_;
  bool rope_;
};

void add_linear_norm_cases(CaseList& out) {
  out.push_back(std::make_shared<LinearCase>(DType::bf16, 96, 160, false));
  out.push_back(std::make_shared<LinearCase>(DType::bf16, 33, 67, true));
  out.push_back(std::make_shared<LinearCase>(DType::f16, 64, 96, true));
  out.push_back(std::make_shared<LinearCase>(DType::f32, 48, 136, true));
  out.push_back(std::make_shared<RmsNormCase>(DType::bf16, 256, false));
  out.push_back(std::make_shared<RmsNormCase>(DType::f16, 200, false));
  out.push_back(std::make_shared<RmsNormCase>(DType::f32, 96, false));
  out.push_back(std::make_shared<RmsNormCase>(DType::bf16, 256, true));
  out.push_back(std::make_shared<RmsNormCase>(DType::f32, 96, true));
  out.push_back(std::make_shared<QkNormCase>(DType::bf16, 4, 64));
  out.push_back(std::make_shared<QkNormCase>(DType::f32, 2, 128));
  out.push_back(std::make_shared<QkNormCase>(DType::bf16, 4, 64, true));
  out.push_back(std::make_shared<QkNormCase>(DType::f32, 3, 128, true));
}

}  // namespace samebits::harness
