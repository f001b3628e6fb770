// Attention entry points. The sequence table `seqs` is small planning data: it always lives on the
// host, whichever backend runs, so every backend gets the same checks on it here.
#include <algorithm>
#include <string>
#include <vector>

#include "ops/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits {
using namespace detail;

static void check_ranges(const Validator& v, const char* what, std::vector<std::pair<int64_t, int64_t>> r,
                         int64_t rows) {
  std::sort(r.begin(), r.end());
  for (size_t i = 0; i < r.size(); ++i) {
    if (r[i].first < 0 || r[i].second > rows)
      v.fail("seqs", std::string(what) + " rows [" + std::to_string(r[i].first) + ", " +
                         std::to_string(r[i].second) + ") fall outside the " +
                         std::to_string(rows) + " rows of the tensor");
    if (i > 0 && r[i].first < r[i - 1].second)
      v.fail("seqs", std::string(what) + " rows of two sequences overlap at row " +
                         std::to_string(r[i].first));
  }
}

static void check_attention(const Validator& v, const TensorView& q, const TensorView& k,
                            const TensorView& vv, const TensorView& seqs, bool keys_disjoint) {
  check_float_input(v, "q", q, 3);
  check_float_input(v, "k", k, 3);
  check_float_input(v, "v", vv, 3);
  v.same_dtype("k", k, "q", q);
  v.same_dtype("v", vv, "q", q);
  v.same_shape("v", vv, "k", k);
  v.dim("k", k, 2, q.shape[2], "head_dim, as q");
  if (q.shape[1] % k.shape[1] != 0)
    v.fail("k", "query heads (" + std::to_string(q.shape[1]) +
                    ") must be a multiple of key/value heads (" + std::to_string(k.shape[1]) + ")");
  if (seqs.is_none()) v.fail("seqs", "is required but was not given");
  if (seqs.device != Device::cpu) v.fail("seqs", "the sequence table lives on the host (cpu)");
  if (seqs.ndim != 2 || seqs.shape[1] != 4)
    v.fail("seqs", "expected int32 [B, 4] {q_row, q_len, k_row, k_len}, got shape " +
                       seqs.shape_string());
  v.dtype("seqs", seqs, DType::i32);
  if (!seqs.is_contiguous()) v.fail("seqs", "must be contiguous");
  if (seqs.shape[0] == 0) v.fail("seqs", "empty batch: no sequences");
  const auto* s = seqs.as<const int32_t>();
  std::vector<std::pair<int64_t, int64_t>> qr, kr;
  for (int64_t b = 0; b < seqs.shape[0]; ++b) {
    const int32_t q_row = s[4 * b], q_len = s[4 * b + 1], k_row = s[4 * b + 2], k_len = s[4 * b + 3];
    const std::string at = "sequence " + std::to_string(b) + ": ";
    if (q_len <= 0) v.fail("seqs", at + "zero-length sequence (q_len = " + std::to_string(q_len) + ")");
    if (k_len < q_len)
      v.fail("seqs", at + "k_len (" + std::to_string(k_len) + ") is shorter than q_len (" +
                         std::to_string(q_len) + "): queries must be the last tokens of the keys");
    qr.emplace_back(q_row, int64_t(q_row) + q_len);
    kr.emplace_back(k_row, int64_t(k_row) + k_len);
  }
  check_ranges(v, "query", qr, q.shape[0]);
  if (keys_disjoint) {
    check_ranges(v, "key", kr, k.shape[0]);
  } else {
    for (auto& r : kr)
      if (r.first < 0 || r.second > k.shape[0])
        v.fail("seqs", "key rows [" + std::to_string(r.first) + ", " + std::to_string(r.second) +
                           ") fall outside the " + std::to_string(k.shape[0]) + " rows of k");
  }
}

static void check_lse(const Validator& v, const TensorView& lse, const TensorView& q, bool required) {
  if (required) v.required("lse", lse, 2); else v.optional("lse", lse, 2);
  if (lse.is_none()) return;
  v.accumulator("lse", lse);
  v.dim("lse", lse, 0, q.shape[0], "one per query row");
  v.dim("lse", lse, 1, q.shape[1], "one per query head");
}

static void check_out(const Validator& v, const char* name, const TensorView& t, const TensorView& like) {
  v.required(name, t, 3);
  v.floating(name, t);
  v.same_shape(name, t, "its input", like);
}

void attention_forward(const Context& ctx, const AttentionForwardArgs& a) {
  auto v = begin_op<OpId::attention_forward>("attention_forward", ctx, a);
  if (a.scale < 0) v.fail("scale", "must be >= 0 (0 selects 1/sqrt(head_dim))");
  check_attention(v, a.q, a.k, a.v, a.seqs, false);
  check_out(v, "out", a.out, a.q);
  v.no_alias("out", a.out, "q", a.q);
  check_lse(v, a.lse, a.q, false);
  run_kernel<OpId::attention_forward>("attention_forward", ctx, a);
}

void attention_backward(const Context& ctx, const AttentionBackwardArgs& a) {
  auto v = begin_op<OpId::attention_backward>("attention_backward", ctx, a);
  if (a.scale < 0) v.fail("scale", "must be >= 0 (0 selects 1/sqrt(head_dim))");
  check_attention(v, a.q, a.k, a.v, a.seqs, true);
  check_float_input(v, "out", a.out, 3);
  v.same_shape("out", a.out, "q", a.q);
  check_float_input(v, "dout", a.dout, 3);
  v.same_shape("dout", a.dout, "q", a.q);
  check_lse(v, a.lse, a.q, false);
  check_out(v, "dq", a.dq, a.q);
  check_out(v, "dk", a.dk, a.k);
  check_out(v, "dv", a.dv, a.v);
  v.no_alias("dk", a.dk, "dv", a.dv);
  v.no_alias("dq", a.dq, "dk", a.dk);
  v.no_alias("dq", a.dq, "dv", a.dv);
  run_kernel<OpId::attention_backward>("attention_backward", ctx, a);
}

}  // namespace samebits
