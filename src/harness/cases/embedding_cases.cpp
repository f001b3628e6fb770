// Op cases: the embedding (a gather forward; a token-ordered scatter into the table as backward).
#include "harness/cases/case_util.hpp"

namespace samebits::harness {

class EmbeddingCase : public OpCase {
 public:
  // id_range < vocab draws ids from a few rows only: many duplicates within and across sequences.
  EmbeddingCase(DType dt, int64_t vocab, int64_t h, int64_t id_range)
      : dt_(dt), vocab_(vocab), h_(h), id_range_(id_range) {}
  std::string op() const override { return "embedding"; }
  std::string params_text() const override {
    return fmt::format("{} V={} H={}{}", dtype_name(dt_), vocab_, h_,
                       id_range_ < vocab_ ? fmt::format(" ids<{}", id_range_) : "");
  }
  DType dtype() const override { return dt_; }
  std::string forward_class() const override { return "elementwise"; }
  std::string backward_class() const override { return "reduction"; }
  TensorMap make_params(Rng& r) const override { return {{"table", r.tensor(dt_, {vocab_, h_}, -1, 1)}}; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    return {len, {{"ids", r.integers({len}, 0, id_range_ - 1)}, {"dy", upstream(r, dt_, {len, h_})}}};
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override { return {{"y", "dy"}}; }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override { return {}; }
  std::vector<std::string> trained_params() const override { return {"table"}; }
  void run(const Context& ctx, CaseIO& io) const override {
    EmbeddingForwardArgs f;
    f.ids = io.view(io.in("ids"));
    f.table = io.view(io.param("table"));
    f.y = io.view(io.output("y", io.out_dtype(dt_), {h_}));
    embedding_forward(ctx, f);
    if (!io.backward) return;
    EmbeddingBackwardArgs b;
    b.ids = f.ids;
    b.dy = io.view(io.in("dy"));
    b.row_mask = io.view(io.batch.row_mask);
    b.dtable = io.grad("table");
    embedding_backward(ctx, b);
  }

 private:
  DType dt_;
  int64_t vocab_, h_, id_range_;
};

void add_embedding_cases(CaseList& out) {
  out.push_back(std::make_shared<EmbeddingCase>(DType::bf16, 1000, 64, 1000));
  out.push_back(std::make_shared<EmbeddingCase>(DType::f32, 50, 32, 6));
}

}  // namespace samebits::harness
