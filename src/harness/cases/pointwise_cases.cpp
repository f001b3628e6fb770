// Op cases: RoPE, SwiGLU, residual add.
#include "harness/cases/case_util.hpp"

namespace samebits::harness {

class RopeCase : public OpCase {
 public:
  RopeCase(DType dt, int64_t heads, int64_t d, RopeConfig cfg, std::string label)
      : dt_(dt), heads_(heads), d_(d), cfg_(cfg), label_(std::move(label)) {}
  std::string op() const override { return "rope"; }
  std::string params_text() const override {
    return fmt::format("{} heads={} D={} {}", dtype_name(dt_), heads_, d_, label_);
  }
  DType dtype() const override { return dt_; }
  std::string forward_class() const override { return "elementwise"; }
  std::string backward_class() const override { return "elementwise"; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    const HostTensor positions = rope_positions(r, len);
    return {len, {{"x", r.tensor(dt_, {len, heads_, d_}, -2, 2)}, {"positions", positions},
                  {"dy", upstream(r, dt_, {len, heads_, d_})}}};
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override { return {{"y", "dy"}}; }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override { return {{"x", "dx"}}; }
  void run(const Context& ctx, CaseIO& io) const override {
    RopeArgs f;
    f.x = io.view(io.in("x"));
    f.positions = io.view(io.in("positions"));
    f.y = io.view(io.output("y", io.out_dtype(dt_), {heads_, d_}));
    f.config = cfg_;
    rope_forward(ctx, f);
    if (!io.backward) return;
    RopeArgs b = f;
    b.x = io.view(io.in("dy"));
    b.y = io.view(io.output("dx", io.out_dtype(dt_), {heads_, d_}));
    rope_backward(ctx, b);
  }

 private:
  DType dt_;
  int64_t heads_, d_;
  RopeConfig cfg_;
  std::string label_;
};

class SwiGluCase : public OpCase {
 public:
  SwiGluCase(DType dt, int64_t i) : dt_(dt), i_(i) {}
  std::string op() const override { return "swiglu"; }
  std::string params_text() const override { return fmt::format("{} I={}", dtype_name(dt_), i_); }
  DType dtype() const override { return dt_; }
  std::string forward_class() const override { return "elementwise"; }
  std::string backward_class() const override { return "elementwise"; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    return {len, {{"gate", r.tensor(dt_, {len, i_}, -6, 6)}, {"up", r.tensor(dt_, {len, i_}, -2, 2)},
                  {"dy", upstream(r, dt_, {len, i_})}}};
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override { return {{"y", "dy"}}; }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override {
    return {{"gate", "dgate"}, {"up", "dup"}};
  }
  void run(const Context& ctx, CaseIO& io) const override {
    SwiGluForwardArgs f;
    f.gate = io.view(io.in("gate"));
    f.up = io.view(io.in("up"));
    f.y = io.view(io.output("y", io.out_dtype(dt_), {i_}));
    swiglu_forward(ctx, f);
    if (!io.backward) return;
    SwiGluBackwardArgs b;
    b.dy = io.view(io.in("dy"));
    b.gate = f.gate;
    b.up = f.up;
    b.dgate = io.view(io.output("dgate", io.out_dtype(dt_), {i_}));
    b.dup = io.view(io.output("dup", io.out_dtype(dt_), {i_}));
    swiglu_backward(ctx, b);
  }

 private:
  DType dt_;
  int64_t i_;
};

class ResidualAddCase : public OpCase {
 public:
  ResidualAddCase(DType dt, int64_t h) : dt_(dt), h_(h) {}
  std::string op() const override { return "residual_add"; }
  std::string params_text() const override { return fmt::format("{} H={}", dtype_name(dt_), h_); }
  DType dtype() const override { return dt_; }
  std::string forward_class() const override { return "elementwise"; }
  std::string backward_class() const override { return "elementwise"; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    return {len, {{"a", r.tensor(dt_, {len, h_}, -4, 4)}, {"b", r.tensor(dt_, {len, h_}, -1, 1)},
                  {"dy", upstream(r, dt_, {len, h_})}}};
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override { return {{"y", "dy"}}; }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override { return {{"a", "da"}, {"b", "db"}}; }
  void run(const Context& ctx, CaseIO& io) const override {
    ResidualAddArgs f;
    f.a = io.view(io.in("a"));
    f.b = io.view(io.in("b"));
    f.y = io.view(io.output("y", io.out_dtype(dt_), {h_}));
    residual_add_forward(ctx, f);
    if (!io.backward) return;
    ResidualAddBackwardArgs b;
    b.dy = io.view(io.in("dy"));
    b.da = io.view(io.output("da", io.out_dtype(dt_), {h_}));
    b.db = io.view(io.output("db", io.out_dtype(dt_), {h_}));
    residual_add_backward(ctx, b);
  }

 private:
  DType dt_;
  int64_t h_;
};

void add_pointwise_cases(CaseList& out) {
  RopeConfig qwen3;  // theta 1e6
  RopeConfig llama3;
  llama3.theta = 500000.0;
  llama3.llama3_scaling = true;
  RopeConfig classic;
  classic.theta = 10000.0;
  out.push_back(std::make_shared<RopeCase>(DType::bf16, 4, 64, qwen3, "theta=1e6"));
  out.push_back(std::make_shared<RopeCase>(DType::f32, 2, 128, llama3, "llama3-scaling"));
  out.push_back(std::make_shared<RopeCase>(DType::f16, 3, 32, classic, "theta=1e4"));
  out.push_back(std::make_shared<SwiGluCase>(DType::bf16, 192));
  out.push_back(std::make_shared<SwiGluCase>(DType::f16, 100));
  out.push_back(std::make_shared<SwiGluCase>(DType::f32, 64));
  out.push_back(std::make_shared<ResidualAddCase>(DType::bf16, 128));
  out.push_back(std::make_shared<ResidualAddCase>(DType::f32, 64));
}

}  // namespace samebits::harness
