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

// Rows [begin, end) of `t` hold no NaN / Inf (with Context::check_finite_inputs, on the CPU); the
// index in the message counts from the tensor's start.
static void finite_rows(const Validator& v, const char* name, const TensorView& t, int64_t begin, int64_t end) {
  if (!v.context().check_finite_inputs || t.device != Device::cpu || end <= begin) return;
  const int64_t bad = first_nonfinite_index(t.rows(begin, end));
  if (bad >= 0)
    v.fail(name, "holds a non-finite value (NaN or Inf) at flat index " +
                     std::to_string(begin * (t.numel() / std::max<int64_t>(t.shape[0], 1)) + bad));
}

// keys: "disjoint" (backward: each key row belongs to one sequence), "inside" (forward: the ranges
// lie inside k and may overlap) or "paged" (forward: a block table says where keys live).
enum class KeyRanges { disjoint, inside, paged };

static void check_attention(const Validator& v, const TensorView& q, const TensorView& k,
                            const TensorView& vv, const TensorView& seqs, KeyRanges keys) {
  check_float_input(v, "q", q, 3);
  // k and v: finite only where a sequence reads them (below). A KV cache holds far more rows than
  // a step reads (free slots, the rest of each slot), and scanning all of it every step would cost
  // more than the step.
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"k", &k}, {"v", &vv}}) {
    v.required(name, *t, 3);
    v.floating(name, *t);
    v.nonempty(name, *t);
  }
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
  if (keys == KeyRanges::disjoint) {
    check_ranges(v, "key", kr, k.shape[0]);
  } else if (keys == KeyRanges::inside) {
    for (auto& r : kr)
      if (r.first < 0 || r.second > k.shape[0])
        v.fail("seqs", "key rows [" + std::to_string(r.first) + ", " + std::to_string(r.second) +
                           ") fall outside the " + std::to_string(k.shape[0]) + " rows of k");
  }
  if (keys != KeyRanges::paged) {  // paged: check_pages checks the pages a sequence reads
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"k", &k}, {"v", &vv}})
      for (auto& r : kr) finite_rows(v, name, *t, r.first, r.second);
  }
}

// The block table of a paged KV cache: one row per sequence, enough pages for its keys, each page
// inside the pool k / v.
static void check_pages(const Validator& v, const TensorView& table, int64_t page_size, const TensorView& seqs,
                        const TensorView& k, const TensorView& vv) {
  if (table.device != Device::cpu) v.fail("block_table", "the block table lives on the host (cpu)");
  if (table.ndim != 2 || table.shape[0] != seqs.shape[0])
    v.fail("block_table", "expected int32 [B, pages] with one row per sequence (B = " + std::to_string(seqs.shape[0]) +
                              "), got shape " + table.shape_string());
  v.dtype("block_table", table, DType::i32);
  if (!table.is_contiguous()) v.fail("block_table", "must be contiguous");
  if (page_size <= 0) v.fail("page_size", "must be > 0 with a block table, got " + std::to_string(page_size));
  if (k.shape[0] % page_size != 0)
    v.fail("k", "rows (" + std::to_string(k.shape[0]) + ") must be whole pages of page_size " + std::to_string(page_size));
  const int64_t pages = k.shape[0] / page_size, cols = table.shape[1];
  const auto* s = seqs.as<const int32_t>();
  const auto* t = table.as<const int32_t>();
  for (int64_t b = 0; b < seqs.shape[0]; ++b) {
    const std::string at = "sequence " + std::to_string(b) + ": ";
    if (s[4 * b + 2] != 0) v.fail("seqs", at + "k_row must be 0 with a block table (its keys come from its pages)");
    const int64_t needed = (int64_t(s[4 * b + 3]) + page_size - 1) / page_size;
    if (needed > cols)
      v.fail("block_table", at + "k_len " + std::to_string(s[4 * b + 3]) + " needs " + std::to_string(needed) +
                                " pages, the table has " + std::to_string(cols) + " columns");
    for (int64_t i = 0; i < needed; ++i)
      if (t[b * cols + i] < 0 || t[b * cols + i] >= pages)
        v.fail("block_table", at + "page " + std::to_string(i) + " is " + std::to_string(t[b * cols + i]) +
                                  ", outside the " + std::to_string(pages) + " pages of k / v");
    for (int64_t i = 0; i < needed; ++i) {  // the rows of its pages it reads hold no NaN / Inf
      const int64_t first = int64_t(t[b * cols + i]) * page_size,
                    n = std::min<int64_t>(page_size, int64_t(s[4 * b + 3]) - i * page_size);
      finite_rows(v, "k", k, first, first + n);
      finite_rows(v, "v", vv, first, first + n);
    }
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

bool paged_attention_takes(Backend backend, int64_t page_size) {
  if (page_size < 1) return false;
  if (backend != Backend::cuda) return true;
  return page_size % 8 == 0 && (page_size % 128 == 0 || 128 % page_size == 0);
}

void attention_forward(const Context& ctx, const AttentionForwardArgs& a) {
  auto v = begin_op<OpId::attention_forward>("attention_forward", ctx, a);
  if (a.scale < 0) v.fail("scale", "must be >= 0 (0 selects 1/sqrt(head_dim))");
  const bool paged = a.block_table.present();
  if (!paged && a.page_size != 0) v.fail("page_size", "is set but no block_table was given");
  check_attention(v, a.q, a.k, a.v, a.seqs, paged ? KeyRanges::paged : KeyRanges::inside);
  if (paged) check_pages(v, a.block_table, a.page_size, a.seqs, a.k, a.v);
  if (a.block_table_device.present()) {
    if (!paged) v.fail("block_table_device", "is given but no block_table (the host table it copies) was");
    if (a.block_table_device.device != a.q.device)
      v.fail("block_table_device", "must live on the device of q (it is the kernels' copy of block_table)");
    v.dtype("block_table_device", a.block_table_device, DType::i32);
    v.same_shape("block_table_device", a.block_table_device, "block_table", a.block_table);
    if (!a.block_table_device.is_contiguous()) v.fail("block_table_device", "must be contiguous");
  }
  check_out(v, "out", a.out, a.q);
  v.no_alias("out", a.out, "q", a.q);
  check_lse(v, a.lse, a.q, false);
  run_kernel<OpId::attention_forward>("attention_forward", ctx, a);
}

void attention_backward(const Context& ctx, const AttentionBackwardArgs& a) {
  auto v = begin_op<OpId::attention_backward>("attention_backward", ctx, a);
  if (a.scale < 0) v.fail("scale", "must be >= 0 (0 selects 1/sqrt(head_dim))");
  check_attention(v, a.q, a.k, a.v, a.seqs, KeyRanges::disjoint);
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
