// CUDA attention forward (runs where a GPU is visible; skipped elsewhere). Raw bits of a sequence's
// rows: whole prefill = chunked prefill (chunks 1, 7, 64, 100 and the rest) = decode token by token
// = the same sequence packed among others at another offset; rows no sequence covers get out = 0
// and lse = −inf; accuracy against the CPU's fp64 truth within the contract's attention class.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/captured_graph.hpp"
#include "samebits/device.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"
#include "ops/tuning.hpp"
#include "samebits/ops.hpp"
#include "tests/cuda/cuda_test_util.hpp"

using harness::Contract;
using harness::Tolerance;

namespace {

class CudaAttention : public testing_cuda::CudaTest {};

struct SeqRow {
  int32_t q_row, q_len, k_row, k_len;
};

struct Fwd {
  HostTensor out, lse;
};

// The host sequence table int32 [B, 4] of `rows`.
HostTensor seq_table(const std::vector<SeqRow>& rows) {
  HostTensor seqs(DType::i32, {int64_t(rows.size()), 4});
  for (size_t i = 0; i < rows.size(); ++i) {
    const int32_t r[4] = {rows[i].q_row, rows[i].q_len, rows[i].k_row, rows[i].k_len};
    for (int c = 0; c < 4; ++c) seqs.set(int64_t(i) * 4 + c, r[c]);
  }
  return seqs;
}

AttentionForwardArgs forward_args(const TensorView& q, const TensorView& k, const TensorView& v, const HostTensor& seqs,
                                  const TensorView& out, const TensorView& lse) {
  AttentionForwardArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.seqs = seqs.view();
  a.out = out;
  a.lse = lse;
  return a;
}

// attention_forward on the GPU over q [Tq, Hq, D] and k / v [Tk, Hkv, D] with the given sequences.
// With `table` (int32 [B, pages] on the host), k / v are a pool of pages of page_size rows.
Fwd run_gpu(const HostTensor& q, const HostTensor& k, const HostTensor& v, const std::vector<SeqRow>& rows,
            const HostTensor* table = nullptr, int64_t page_size = 0) {
  const HostTensor seqs = seq_table(rows);
  const DeviceBuffer dq(q), dk(k), dv(v), out(HostTensor(q.dtype(), q.shape())),
      lse(DType::f32, {q.shape()[0], q.shape()[1]});
  AttentionForwardArgs a = forward_args(dq.view(), dk.view(), dv.view(), seqs, out.view(), lse.view());
  if (table) {
    a.block_table = table->view();
    a.page_size = page_size;
  }
  attention_forward(cuda_ctx(), a);
  return {out.host(), lse.host()};
}

struct Shape {
  DType dt;
  int64_t hq, hkv, d, len;
};

// Random q, k, v and an upstream gradient g of one sequence of s.len tokens.
struct Inputs {
  HostTensor q, k, v, g;
};
Inputs random_inputs(const Shape& s, Rng& r) {
  return {r.tensor(s.dt, {s.len, s.hq, s.d}, -2, 2), r.tensor(s.dt, {s.len, s.hkv, s.d}, -2, 2),
          r.tensor(s.dt, {s.len, s.hkv, s.d}, -1, 1), r.tensor(s.dt, {s.len, s.hq, s.d}, -1, 1)};
}
std::string describe(const Shape& s) {
  return std::string(dtype_name(s.dt)) + " Hq=" + std::to_string(s.hq) + " D=" + std::to_string(s.d);
}

}  // namespace

// One sequence gives the same bits as a whole prefill, in chunks against a cache, token by token,
// and packed among other sequences at another offset.
TEST_F(CudaAttention, PrefillChunkedDecodeAndPackingGiveTheSameBits) {
  for (const Shape& s : {Shape{DType::bf16, 8, 2, 128, 300}, Shape{DType::f16, 4, 4, 64, 200}, Shape{DType::bf16, 32, 8, 128, 1100}}) {
    const std::string what = std::string(dtype_name(s.dt)) + " Hq=" + std::to_string(s.hq) + " D=" + std::to_string(s.d);
    Rng r(71 + s.d + s.hq);
    const int32_t L = int32_t(s.len);
    const HostTensor q = r.tensor(s.dt, {L, s.hq, s.d}, -2, 2), k = r.tensor(s.dt, {L, s.hkv, s.d}, -2, 2),
                     v = r.tensor(s.dt, {L, s.hkv, s.d}, -1, 1);
    const Fwd whole = run_gpu(q, k, v, {{0, L, 0, L}});
    // Chunked prefill: each chunk's queries against the cache of every key so far.
    int32_t done = 0;
    for (int32_t c : {1, 7, 12, 64, 100, L}) {
      const int32_t n = std::min(c, L - done);
      if (n <= 0) break;
      const Fwd part = run_gpu(q.slice_rows(done, done + n), k, v, {{0, n, 0, done + n}});
      expect_same_bits(part.out, whole.out.slice_rows(done, done + n), what + ": chunk at " + std::to_string(done));
      expect_same_bits(part.lse, whole.lse.slice_rows(done, done + n), what + ": chunk lse at " + std::to_string(done));
      done += n;
    }
    // Decode: one query against the cache.
    for (int32_t t : {0, 1, 63, 64, 65, L / 2, L - 1}) {
      const Fwd one = run_gpu(q.slice_rows(t, t + 1), k, v, {{0, 1, 0, t + 1}});
      expect_same_bits(one.out, whole.out.slice_rows(t, t + 1), what + ": decode at " + std::to_string(t));
    }
    // Every third token decoded in one call: a grid larger than the GPU (no head_dim split), and
    // cache lengths that end inside a key block.
    {
      std::vector<SeqRow> steps;
      for (int32_t t = 0; t < L; t += 3) steps.push_back({int32_t(steps.size()), 1, 0, t + 1});
      HostTensor qs(s.dt, {int64_t(steps.size()), s.hq, s.d});
      for (size_t i = 0; i < steps.size(); ++i) qs.copy_rows_from(q, int64_t(i) * 3, int64_t(i), 1);
      const Fwd batch = run_gpu(qs, k, v, steps);
      for (size_t i = 0; i < steps.size(); ++i)
        expect_same_bits(batch.out.slice_rows(int64_t(i), int64_t(i) + 1), whole.out.slice_rows(int64_t(i) * 3, int64_t(i) * 3 + 1),
                         what + ": batched decode at " + std::to_string(i * 3));
    }
    // Packed after a 37-token sequence and before a 5-token one, keys in the same packed layout.
    const int32_t pre = 37, post = 5, T = pre + L + post;
    HostTensor qp = r.tensor(s.dt, {T, s.hq, s.d}, -2, 2), kp = r.tensor(s.dt, {T, s.hkv, s.d}, -2, 2),
               vp = r.tensor(s.dt, {T, s.hkv, s.d}, -1, 1);
    qp.copy_rows_from(q, 0, pre, L);
    kp.copy_rows_from(k, 0, pre, L);
    vp.copy_rows_from(v, 0, pre, L);
    const Fwd packed = run_gpu(qp, kp, vp, {{0, pre, 0, pre}, {pre, L, pre, L}, {pre + L, post, pre + L, post}});
    expect_same_bits(packed.out.slice_rows(pre, pre + L), whole.out, what + ": packed");
    expect_same_bits(packed.lse.slice_rows(pre, pre + L), whole.lse, what + ": packed lse");
  }
}

// Past 1024 keys the Hopper path combines keys in 1024-key spans, and a decode-sized call runs each
// span in its own CTA, folded by a second kernel: decode one by one, decode batched in one call
// (split-KV), a chunk that straddles a span boundary and the whole prefill give the same bits, for
// a GQA group the kernel packs into rows (G = 4) and one it cannot (G = 3).
TEST_F(CudaAttention, SplitKvDecodeEqualsPrefillAcrossSpans) {
  for (const Shape& s : {Shape{DType::bf16, 8, 2, 128, 2600}, Shape{DType::f16, 6, 2, 64, 2200}}) {
    const std::string what = std::string(dtype_name(s.dt)) + " Hq=" + std::to_string(s.hq) + " D=" + std::to_string(s.d);
    Rng r(83 + s.d);
    const int32_t L = int32_t(s.len);
    const HostTensor q = r.tensor(s.dt, {L, s.hq, s.d}, -2, 2), k = r.tensor(s.dt, {L, s.hkv, s.d}, -2, 2),
                     v = r.tensor(s.dt, {L, s.hkv, s.d}, -1, 1);
    const Fwd whole = run_gpu(q, k, v, {{0, L, 0, L}});
    const std::vector<int32_t> steps = {0, 1022, 1023, 1024, 1025, 2047, 2048, L - 1};
    HostTensor qb(s.dt, {int64_t(steps.size()), s.hq, s.d});
    std::vector<SeqRow> batch;
    for (size_t i = 0; i < steps.size(); ++i) {
      const int32_t t = steps[i];
      const Fwd one = run_gpu(q.slice_rows(t, t + 1), k, v, {{0, 1, 0, t + 1}});
      expect_same_bits(one.out, whole.out.slice_rows(t, t + 1), what + ": decode at " + std::to_string(t));
      expect_same_bits(one.lse, whole.lse.slice_rows(t, t + 1), what + ": decode lse at " + std::to_string(t));
      qb.copy_rows_from(q, t, int64_t(i), 1);
      batch.push_back({int32_t(i), 1, 0, t + 1});
    }
    const Fwd batched = run_gpu(qb, k, v, batch);
    for (size_t i = 0; i < steps.size(); ++i) {
      const int32_t t = steps[i];
      expect_same_bits(batched.out.slice_rows(int64_t(i), int64_t(i) + 1), whole.out.slice_rows(t, t + 1),
                       what + ": batched decode at " + std::to_string(t));
    }
    // A decode batch too large for O-column parts (one CTA an item, a span's 8 blocks through the
    // single-span kernel's ring): the steps 12 times over.
    HostTensor qm(s.dt, {int64_t(steps.size()) * 12, s.hq, s.d});
    std::vector<SeqRow> many;
    for (int rep = 0; rep < 12; ++rep)
      for (size_t i = 0; i < steps.size(); ++i) {
        const int64_t row = int64_t(rep) * int64_t(steps.size()) + int64_t(i);
        qm.copy_rows_from(q, steps[i], row, 1);
        many.push_back({int32_t(row), 1, 0, steps[i] + 1});
      }
    // The single-span kernel is persistent (a CTA an SM walking items in turn, its ring and Q buffers
    // running on across them): here ~360 items over the SMs, then over 5 CTAs and over 1, whose
    // barrier phases wrap many times — the same bits.
    for (int ctas : {0, 5, 1}) {
      const detail::ScopedOverride<int> forced(detail::attention_persistent_ctas_override(), ctas);
      const Fwd wide = run_gpu(qm, k, v, many);
      for (size_t i = 0; i < many.size(); ++i) {
        const int32_t t = steps[i % steps.size()];
        expect_same_bits(wide.out.slice_rows(int64_t(i), int64_t(i) + 1), whole.out.slice_rows(t, t + 1),
                         what + ": decode among 96 at " + std::to_string(t) + ", CTAs " +
                             (ctas ? std::to_string(ctas) : std::string("one an SM")));
      }
    }
    for (int32_t c0 : {1000, 2040}) {  // chunks across a span boundary, and decode-sized ones (q_len · G <= 128)
      for (int32_t n : {100, 7, 4, 3, 2}) {
        const Fwd part = run_gpu(q.slice_rows(c0, c0 + n), k, v, {{0, n, 0, c0 + n}});
        expect_same_bits(part.out, whole.out.slice_rows(c0, c0 + n), what + ": chunk of " + std::to_string(n) + " at " + std::to_string(c0));
      }
    }
  }
}

// A decode-path variant forced on by its test hook (off by default until timed) gives the prefill's
// bits: decode one by one and batched across span boundaries, chunks, ~hundreds of items over the
// SMs, 5 CTAs and 1 (the persistent ring and Q buffers wrapping), paged caches with NaN in the unused
// pages. Its launch counter proves it ran.
namespace {
struct DecodeCase {
  Shape s;
  int32_t chunk;  // tokens of the chunked calls
};
void expect_decode_variant_gives_prefill_bits(int& hook, long long& launches_of, const std::vector<DecodeCase>& cases) {
  for (const DecodeCase& c : cases) {
    const Shape& s = c.s;
    const std::string what = describe(s);
    Rng r(97 + s.d + s.hq);
    const int32_t L = int32_t(s.len);
    const auto [q, k, v, g] = random_inputs(s, r);
    const Fwd whole = run_gpu(q, k, v, {{0, L, 0, L}});
    const detail::ScopedOverride<int> variant(hook, 1);
    const long long launches = launches_of;
    std::vector<int32_t> steps = {0, 1, 127, 128, 1023, 1024, 1025, L - 1};
    for (const int32_t t : steps) {
      const Fwd one = run_gpu(q.slice_rows(t, t + 1), k, v, {{0, 1, 0, t + 1}});
      expect_same_bits(one.out, whole.out.slice_rows(t, t + 1), what + ": decode at " + std::to_string(t));
      expect_same_bits(one.lse, whole.lse.slice_rows(t, t + 1), what + ": decode lse at " + std::to_string(t));
    }
    // Every case's five steps before 1024 are single-span calls (the unpackable group's later ones are
    // not: a query head an item over all spans, the general kernel).
    EXPECT_GE(launches_of - launches, 5) << what << ": the variant did not run";
    for (int32_t c0 : {1020, 2040 % L}) {  // chunks across a span boundary and inside one
      const int32_t n = c.chunk;
      const Fwd part = run_gpu(q.slice_rows(c0, c0 + n), k, v, {{0, n, 0, c0 + n}});
      expect_same_bits(part.out, whole.out.slice_rows(c0, c0 + n), what + ": chunk of " + std::to_string(n) + " at " + std::to_string(c0));
      expect_same_bits(part.lse, whole.lse.slice_rows(c0, c0 + n), what + ": chunk lse at " + std::to_string(c0));
    }
    // The steps 12 times over in one call: over the SMs, 5 CTAs and 1.
    const size_t n = 12 * steps.size();
    HostTensor qm(s.dt, {int64_t(n), s.hq, s.d});
    std::vector<SeqRow> many;
    for (size_t i = 0; i < n; ++i) {
      qm.copy_rows_from(q, steps[i % steps.size()], int64_t(i), 1);
      many.push_back({int32_t(i), 1, 0, steps[i % steps.size()] + 1});
    }
    for (int ctas : {0, 5, 1}) {
      const detail::ScopedOverride<int> forced(detail::attention_persistent_ctas_override(), ctas);
      const Fwd wide = run_gpu(qm, k, v, many);
      for (size_t i = 0; i < n; ++i) {
        const int32_t t = steps[i % steps.size()];
        expect_same_bits(wide.out.slice_rows(int64_t(i), int64_t(i) + 1), whole.out.slice_rows(t, t + 1),
                         what + ": decode among " + std::to_string(n) + " at " + std::to_string(t) + ", CTAs " + std::to_string(ctas));
      }
    }
    // Paged: the sequence's pages shuffled over a pool whose other pages hold NaN.
    for (int32_t ps : {16, 64}) {
      const int32_t pages = (L + ps - 1) / ps, pool = (pages + 3) % 5 == 0 ? pages + 4 : pages + 3;  // 5 i + 2 a bijection
      HostTensor pk(s.dt, {int64_t(pool) * ps, s.hkv, s.d}), pv(s.dt, {int64_t(pool) * ps, s.hkv, s.d});
      for (int64_t i = 0; i < pk.numel(); ++i) pk.set(i, NAN), pv.set(i, NAN);
      HostTensor table(DType::i32, {int64_t(steps.size()), pages});
      for (int32_t i = 0; i < pages; ++i) {
        const int32_t at = (5 * i + 2) % pool, rows = std::min(ps, L - i * ps);
        pk.copy_rows_from(k, int64_t(i) * ps, int64_t(at) * ps, rows);
        pv.copy_rows_from(v, int64_t(i) * ps, int64_t(at) * ps, rows);
        for (size_t b = 0; b < steps.size(); ++b) table.set(int64_t(b) * pages + i, at);
      }
      HostTensor qb(s.dt, {int64_t(steps.size()), s.hq, s.d});
      std::vector<SeqRow> batch;
      for (size_t i = 0; i < steps.size(); ++i) {
        qb.copy_rows_from(q, steps[i], int64_t(i), 1);
        batch.push_back({int32_t(i), 1, 0, steps[i] + 1});
      }
      const Fwd paged = run_gpu(qb, pk, pv, batch, &table, ps);
      for (size_t i = 0; i < steps.size(); ++i) {
        const std::string at = what + ", page size " + std::to_string(ps) + ": decode at " + std::to_string(steps[i]);
        expect_same_bits(paged.out.slice_rows(int64_t(i), int64_t(i) + 1), whole.out.slice_rows(steps[i], steps[i] + 1), at);
        expect_same_bits(paged.lse.slice_rows(int64_t(i), int64_t(i) + 1), whole.lse.slice_rows(steps[i], steps[i] + 1), at + " (lse)");
      }
    }
  }
}
}  // namespace

// The decode kernel's 16-row consumer (mma.sync instead of 64-row wgmma tiles): GQA groups of 4 and 16
// packed into the rows, 8 with two tokens an item, 3 (not packable: a query head an item) and 1; bf16
// and f16, D 128 and 64; chunks of up to 16 rows.
TEST_F(CudaAttention, NarrowDecodeGivesThePrefillsBits) {
  expect_decode_variant_gives_prefill_bits(detail::narrow_decode_override(), detail::narrow_decode_launches(),
                                           {{{DType::bf16, 8, 2, 128, 2600}, 4}, {{DType::f16, 6, 2, 64, 1300}, 16},
                                            {{DType::bf16, 32, 2, 128, 1100}, 1}, {{DType::bf16, 16, 2, 128, 1100}, 2},
                                            {{DType::f16, 4, 4, 64, 1100}, 16}});
}

// The single-span kernel issuing a block's P·V during the next block's softmax (overlap): the same
// shapes, chunks of up to 64 rows.
TEST_F(CudaAttention, OverlappedDecodeGivesThePrefillsBits) {
  const detail::ScopedOverride<int> no_narrow(detail::narrow_decode_override(), -1);  // (SAMEBITS_NARROW_DECODE=1 would take the ≤ 16-row calls)
  expect_decode_variant_gives_prefill_bits(detail::attention_overlap_override(), detail::attention_overlap_launches(),
                                           {{{DType::bf16, 8, 2, 128, 2600}, 16}, {{DType::f16, 6, 2, 64, 1300}, 21},
                                            {{DType::bf16, 32, 2, 128, 1100}, 2}, {{DType::bf16, 16, 2, 128, 1100}, 4},
                                            {{DType::f16, 4, 4, 64, 1100}, 64}});
}

// The prefill variants (on by default since session 28; forced on and off here by their test hooks)
// give the general kernel's bits (a CTA an item, no overlap): the paired persistent kernel (two consumers a CTA
// for every item, the CTAs walking the items), the overlap (a block's P·V during the next block's
// softmax, K and V released apart), and both. Packed prefill of sequences whose items are all one
// span (1 … 1024 tokens: the single-span layout, items of 1 to 128 rows, GQA-packed short ones among
// them) and past a span (1500, 2600: the general layout's running O), chunks against caches, and
// a cache whose rows between two sequences' keys hold NaN (the tail zeroing, in both layouts; calls
// of enough items that no O-column split takes them); over the SMs, 5 CTAs and 1 (the ring, the Q
// buffers and the ping-pong running on across items); GQA 4, 1 and 3 (not packable), bf16 and f16,
// D 128 and 64. The launch counters prove each variant ran.
TEST_F(CudaAttention, PrefillVariantsGiveTheGeneralKernelsBits) {
  for (const Shape& s : {Shape{DType::bf16, 8, 2, 128, 0}, Shape{DType::f16, 4, 4, 64, 0}, Shape{DType::bf16, 6, 2, 128, 0}}) {
    const std::string what = describe(s);
    Rng r(131 + s.d + s.hq);
    struct Call {
      std::string name;
      std::vector<SeqRow> rows;
      int64_t q_rows = 0, k_rows = 0, nan_from = 0, nan_to = 0;  // k / v rows [nan_from, nan_to) hold NaN
    };
    auto packed = [](const std::vector<int32_t>& lens) {
      std::vector<SeqRow> rows;
      int32_t at = 0;
      for (int32_t n : lens) rows.push_back({at, n, at, n}), at += n;
      return rows;
    };
    std::vector<Call> calls;
    calls.push_back({"one-span sequences", packed({1, 50, 64, 65, 127, 128, 129, 300, 1000, 1024, 3})});
    calls.push_back({"past a span", packed({1500, 7, 2600, 300})});
    // (five: with one, GQA 1's 8 split-KV items would take an O-column split, never the paired kernel)
    std::vector<SeqRow> chunks;
    for (int32_t i = 0; i < 5; ++i) chunks.push_back({100 * i, 100, 1600 * i, 1600});
    calls.push_back({"five chunks of 100, each against its cache of 1600", chunks, 500, 8000});
    calls.push_back({"NaN between the keys", {{0, 300, 0, 300}, {300, 1000, 400, 1000}}, 1300, 1400, 300, 400});
    calls.push_back({"NaN between the keys, past a span", {{0, 300, 0, 300}, {300, 1500, 400, 1500}}, 1800, 1900, 300, 400});
    for (Call& c : calls) {
      if (c.q_rows == 0) c.q_rows = c.k_rows = c.rows.back().q_row + c.rows.back().q_len;
      const HostTensor q = r.tensor(s.dt, {c.q_rows, s.hq, s.d}, -2, 2);
      HostTensor k = r.tensor(s.dt, {c.k_rows, s.hkv, s.d}, -2, 2), v = r.tensor(s.dt, {c.k_rows, s.hkv, s.d}, -1, 1);
      for (int64_t i = c.nan_from * s.hkv * s.d; i < c.nan_to * s.hkv * s.d; ++i) k.set(i, NAN), v.set(i, NAN);
      Fwd want;
      {
        const detail::ScopedOverride<int> no_pair(detail::persistent_prefill_override(), -1);
        const detail::ScopedOverride<int> no_overlap(detail::attention_overlap_override(), -1);
        want = run_gpu(q, k, v, c.rows);
      }
      for (const auto& [paired, overlap] : {std::pair{1, -1}, std::pair{1, 1}, std::pair{-1, 1}})
        for (int ctas : {0, 5, 1}) {
          const detail::ScopedOverride<int> pair(detail::persistent_prefill_override(), paired);
          const detail::ScopedOverride<int> ov(detail::attention_overlap_override(), overlap);
          const detail::ScopedOverride<int> forced(detail::attention_persistent_ctas_override(), ctas);
          const long long launches = detail::persistent_prefill_launches(), overlapped = detail::attention_overlap_launches();
          const Fwd got = run_gpu(q, k, v, c.rows);
          const std::string at = what + ", " + c.name + ", CTAs " + std::to_string(ctas) + (paired > 0 ? ", paired" : "") +
                                 (overlap > 0 ? ", overlap" : "");
          EXPECT_EQ(detail::persistent_prefill_launches() - launches, paired > 0 ? 1 : 0) << at << ": paired kernel launches";
          EXPECT_EQ(detail::attention_overlap_launches() - overlapped, overlap > 0 ? 1 : 0) << at << ": overlap launches";
          expect_same_bits(got.out, want.out, at);
          expect_same_bits(got.lse, want.lse, at + " (lse)");
        }
    }
  }
}

// Cache rows past a sequence's keys may hold anything, NaN included (an unwritten slot): the result
// is the same as with finite values there.
TEST_F(CudaAttention, CacheRowsPastTheKeysNeverReachTheResult) {
  Rng r(89);
  const int32_t L = 300, cap = 400;
  const HostTensor q = r.tensor(DType::bf16, {L, 8, 128}, -2, 2);
  HostTensor k = r.tensor(DType::bf16, {cap, 2, 128}, -2, 2), v = r.tensor(DType::bf16, {cap, 2, 128}, -1, 1);
  const Fwd clean = run_gpu(q, k, v, {{0, L, 0, L}});
  const Fwd clean_decode = run_gpu(q.slice_rows(L - 1, L), k, v, {{0, 1, 0, L}});
  for (int64_t i = int64_t(L) * 2 * 128; i < k.numel(); ++i) {
    k.set(i, NAN);
    v.set(i, NAN);
  }
  expect_same_bits(run_gpu(q, k, v, {{0, L, 0, L}}).out, clean.out, "prefill with NaN past the keys");
  expect_same_bits(run_gpu(q.slice_rows(L - 1, L), k, v, {{0, 1, 0, L}}).out, clean_decode.out, "decode with NaN past the keys");
  for (int64_t i = 0; i < clean.out.numel(); ++i) ASSERT_TRUE(std::isfinite(clean.out.get(i)));
}

// A paged KV cache gives the bits of the contiguous one: the sequence's pages shuffled over a pool
// (NaN in the pages it does not use), page sizes below, at and above the 128-key block, for a
// whole prefill, a chunk straddling a span boundary, and decode steps batched in one call (split-KV
// over spans, every sequence sharing the same pages).
TEST_F(CudaAttention, PagedCacheGivesTheSameBits) {
  const Shape s{DType::bf16, 8, 2, 128, 1100};
  Rng r(103);
  const auto [q, k, v, g] = random_inputs(s, r);
  const int32_t L = int32_t(s.len);
  const Fwd whole = run_gpu(q, k, v, {{0, L, 0, L}});
  const std::vector<int32_t> steps = {0, 127, 128, 1023, 1024, L - 1};
  HostTensor qb(s.dt, {int64_t(steps.size()), s.hq, s.d});
  for (size_t i = 0; i < steps.size(); ++i) qb.copy_rows_from(q, steps[i], int64_t(i), 1);
  for (int32_t ps : {16, 64, 128, 256}) {
    const std::string what = "page size " + std::to_string(ps);
    const int32_t pages = (L + ps - 1) / ps, pool = pages + 3;
    HostTensor pk(s.dt, {int64_t(pool) * ps, s.hkv, s.d}), pv(s.dt, {int64_t(pool) * ps, s.hkv, s.d});
    for (int64_t i = 0; i < pk.numel(); ++i) {
      pk.set(i, NAN);
      pv.set(i, NAN);
    }
    // Page i of the sequence in pool page (5 i + 2) mod pool (pool is never a multiple of 5 here).
    ASSERT_NE(pool % 5, 0);
    std::vector<int32_t> page_of(static_cast<size_t>(pages));
    for (int32_t i = 0; i < pages; ++i) {
      page_of[size_t(i)] = (5 * i + 2) % pool;
      const int32_t n = std::min(ps, L - i * ps);
      pk.copy_rows_from(k, int64_t(i) * ps, int64_t(page_of[size_t(i)]) * ps, n);
      pv.copy_rows_from(v, int64_t(i) * ps, int64_t(page_of[size_t(i)]) * ps, n);
    }
    auto table_for = [&](size_t n_seqs) {
      HostTensor t(DType::i32, {int64_t(n_seqs), pages});
      for (size_t b = 0; b < n_seqs; ++b)
        for (int32_t i = 0; i < pages; ++i) t.set(int64_t(b) * pages + i, page_of[size_t(i)]);
      return t;
    };
    const HostTensor one = table_for(1), many = table_for(steps.size());
    const Fwd paged = run_gpu(q, pk, pv, {{0, L, 0, L}}, &one, ps);
    expect_same_bits(paged.out, whole.out, what + ": prefill");
    expect_same_bits(paged.lse, whole.lse, what + ": prefill lse");
    const Fwd chunk = run_gpu(q.slice_rows(1000, 1100), pk, pv, {{0, 100, 0, 1100}}, &one, ps);
    expect_same_bits(chunk.out, whole.out.slice_rows(1000, 1100), what + ": chunk at 1000");
    std::vector<SeqRow> batch;
    for (size_t i = 0; i < steps.size(); ++i) batch.push_back({int32_t(i), 1, 0, steps[i] + 1});
    const Fwd decode = run_gpu(qb, pk, pv, batch, &many, ps);
    for (size_t i = 0; i < steps.size(); ++i)
      expect_same_bits(decode.out.slice_rows(int64_t(i), int64_t(i) + 1), whole.out.slice_rows(steps[i], steps[i] + 1),
                       what + ": decode at " + std::to_string(steps[i]));
    // The steps 12 times over (too many items for O-column parts): the persistent kernel, its CTAs
    // walking many paged items each — over the SMs and over 2 CTAs.
    const size_t reps = 12, n = reps * steps.size();
    HostTensor qr(s.dt, {int64_t(n), s.hq, s.d});
    std::vector<SeqRow> rows;
    for (size_t i = 0; i < n; ++i) {
      qr.copy_rows_from(q, steps[i % steps.size()], int64_t(i), 1);
      rows.push_back({int32_t(i), 1, 0, steps[i % steps.size()] + 1});
    }
    const HostTensor tables = table_for(n);
    for (int ctas : {0, 2}) {
      const detail::ScopedOverride<int> forced(detail::attention_persistent_ctas_override(), ctas);
      const Fwd wide = run_gpu(qr, pk, pv, rows, &tables, ps);
      for (size_t i = 0; i < n; ++i) {
        const int32_t t = steps[i % steps.size()];
        expect_same_bits(wide.out.slice_rows(int64_t(i), int64_t(i) + 1), whole.out.slice_rows(t, t + 1),
                         what + ": decode among " + std::to_string(n) + " at " + std::to_string(t) + ", CTAs " +
                             std::to_string(ctas));
      }
    }
  }
}

// Work tables reach the GPU through a ring of page-locked memory (src/cuda/common/host_upload.cu),
// so a call returns without waiting for the GPU: calls queued back to back — tables from a few KiB to
// over 2 MiB (the ring grows), more bytes in flight than the ring holds (it wraps and waits), each
// host table overwritten as soon as its call returns — give each call's own bits.
TEST_F(CudaAttention, TablesUploadedAheadOfTheGpuKeepEachCallsBits) {
  const Shape s{DType::bf16, 8, 2, 64, 24000};
  Rng r(5);
  const Inputs in = random_inputs(s, r);
  const int32_t T = int32_t(s.len);
  const std::vector<int32_t> lengths = {1, 3, 1, 17, 1, 64, 1, 300};
  auto packing = [&](int32_t len) {
    std::vector<SeqRow> rows;
    for (int32_t at = 0; at < T; at += len) rows.push_back({at, std::min(len, T - at), at, std::min(len, T - at)});
    return rows;
  };
  std::vector<Fwd> alone;
  for (const int32_t len : lengths) alone.push_back(run_gpu(in.q, in.k, in.v, packing(len)));
  const DeviceBuffer dq(in.q), dk(in.k), dv(in.v);
  // ~10 ms of GEMMs ahead on the same stream, so the calls below queue behind them.
  const DeviceBuffer x(DType::bf16, {8192, 8192}), w(DType::bf16, {8192, 8192}), y(DType::bf16, {8192, 8192});
  for (int i = 0; i < 6; ++i) linear_forward(cuda_ctx(), {x.view(), w.view(), {}, y.view()});
  std::vector<std::unique_ptr<DeviceBuffer>> outs, lses;
  for (int round = 0; round < 2; ++round)
    for (const int32_t len : lengths) {
      outs.push_back(std::make_unique<DeviceBuffer>(s.dt, std::vector<int64_t>{T, s.hq, s.d}));
      lses.push_back(std::make_unique<DeviceBuffer>(DType::f32, std::vector<int64_t>{T, s.hq}));
      HostTensor seqs = seq_table(packing(len));
      attention_forward(cuda_ctx(), forward_args(dq.view(), dk.view(), dv.view(), seqs, outs.back()->view(), lses.back()->view()));
      for (int64_t e = 0; e < seqs.numel(); ++e) seqs.set(e, -1);  // the call has returned: its table is free
    }
  for (size_t c = 0; c < outs.size(); ++c) {
    const std::string what = "call " + std::to_string(c) + ", sequences of " + std::to_string(lengths[c % lengths.size()]);
    expect_same_bits(outs[c]->host(), alone[c % lengths.size()].out, what);
    expect_same_bits(lses[c]->host(), alone[c % lengths.size()].lse, what + ": lse");
  }
}

// Rows no sequence covers: out = 0, lse = −inf (not stale memory).
TEST_F(CudaAttention, UncoveredRowsAreZeroWithMinusInfinityLse) {
  Rng r(73);
  const HostTensor q = r.tensor(DType::bf16, {20, 2, 64}, -2, 2), k = r.tensor(DType::bf16, {20, 2, 64}, -2, 2),
                   v = r.tensor(DType::bf16, {20, 2, 64}, -1, 1);
  const Fwd f = run_gpu(q, k, v, {{3, 5, 3, 5}, {12, 4, 12, 4}});
  for (int64_t row : {0, 2, 8, 11, 16, 19})
    for (int64_t i = 0; i < 2 * 64; ++i) {
      ASSERT_EQ(f.out.get(row * 128 + i), 0.0) << "row " << row;
      if (i < 2) ASSERT_TRUE(std::isinf(f.lse.get(row * 2 + i)) && f.lse.get(row * 2 + i) < 0) << "lse row " << row;
    }
}

// Against the CPU's fp64 truth on the same inputs: out within the contract's attention tolerance
// for the dtype, lse within the fp32 one.
TEST_F(CudaAttention, AccurateAgainstFp64) {
  for (const Shape& s : {Shape{DType::bf16, 8, 2, 128, 700}, Shape{DType::f16, 4, 2, 64, 300}, Shape{DType::bf16, 4, 1, 128, 2600}}) {
    Rng r(79 + s.d + s.len);
    const int32_t L = int32_t(s.len);
    const HostTensor q = r.tensor(s.dt, {L, s.hq, s.d}, -2, 2), k = r.tensor(s.dt, {L, s.hkv, s.d}, -2, 2),
                     v = r.tensor(s.dt, {L, s.hkv, s.d}, -1, 1);
    const Fwd gpu = run_gpu(q, k, v, {{0, L, 0, L}});
    HostTensor out(DType::f64, {L, s.hq, s.d}), lse(DType::f64, {L, s.hq});
    Context truth;
    truth.precision = Precision::truth_fp64;
    attention_forward(truth, forward_args(q.view(), k.view(), v.view(), seq_table({{0, L, 0, L}}), out.view(), lse.view()));
    const Tolerance tol = Contract::builtin().tolerance("attention", s.dt);
    double worst = 0, worst_lse = 0;
    for (int64_t i = 0; i < out.numel(); ++i)
      worst = std::max(worst, std::fabs(gpu.out.get(i) - out.get(i)) / (tol.atol + tol.rtol * std::fabs(out.get(i))));
    const Tolerance tol32 = Contract::builtin().tolerance("attention", DType::f32);
    for (int64_t i = 0; i < lse.numel(); ++i)
      worst_lse = std::max(worst_lse, std::fabs(gpu.lse.get(i) - lse.get(i)) / (tol32.atol + tol32.rtol * std::fabs(lse.get(i))));
    std::printf("ACCURACY attention %s D=%lld: worst error / tolerance: out %.3g, lse %.3g\n", dtype_name(s.dt),
                static_cast<long long>(s.d), worst, worst_lse);
    EXPECT_LE(worst, 1.0) << dtype_name(s.dt);
    EXPECT_LE(worst_lse, 1.0) << dtype_name(s.dt);
  }
}

namespace {

struct Grads {
  HostTensor dq, dk, dv;
};

// attention_backward on the GPU (dq / dk / dv in q's dtype; lse from the forward unless `recompute`).
Grads run_gpu_backward(const HostTensor& q, const HostTensor& k, const HostTensor& v, const HostTensor& dout,
                       const std::vector<SeqRow>& rows, bool recompute = false) {
  const HostTensor seqs = seq_table(rows);
  const Fwd f = run_gpu(q, k, v, rows);
  const DeviceBuffer dq_(q), dk_(k), dv_(v), out(f.out), lse(f.lse), g(dout), dq(HostTensor(q.dtype(), q.shape())),
      dk(HostTensor(k.dtype(), k.shape())), dv(HostTensor(v.dtype(), v.shape()));
  AttentionBackwardArgs a;
  a.q = dq_.view(), a.k = dk_.view(), a.v = dv_.view(), a.seqs = seqs.view(), a.out = out.view();
  if (!recompute) a.lse = lse.view();
  a.dout = g.view(), a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view();
  attention_backward(cuda_ctx(), a);
  return {dq.host(), dk.host(), dv.host()};
}

}  // namespace

// A captured copy of a host table would read the host memory again at every replay, after the call
// has freed it: an attention call whose table goes up while its stream is captured (here the
// backward, outside the forward's own graph recording) is an error naming that, never a graph that
// replays stale tables.
TEST_F(CudaAttention, AHostTableUnderACaptureIsAnError) {
  const Shape s{DType::bf16, 4, 2, 64, 200};
  Rng r(9);
  const Inputs in = random_inputs(s, r);
  const std::vector<SeqRow> rows = {{0, 120, 0, 120}, {120, 80, 120, 80}};
  const HostTensor seqs = seq_table(rows);
  const Fwd f = run_gpu(in.q, in.k, in.v, rows);
  const DeviceBuffer dq_(in.q), dk_(in.k), dv_(in.v), out(f.out), lse(f.lse), g(in.g), dq(DType::bf16, {s.len, s.hq, s.d}),
      dk(DType::bf16, {s.len, s.hkv, s.d}), dv(DType::bf16, {s.len, s.hkv, s.d});
  AttentionBackwardArgs a;
  a.q = dq_.view(), a.k = dk_.view(), a.v = dv_.view(), a.seqs = seqs.view(), a.out = out.view(), a.lse = lse.view();
  a.dout = g.view(), a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view();
  const DeviceStream stream(Backend::cuda);
  Context ctx = cuda_ctx();
  ctx.stream = stream.get();
  GraphAttentionShape shape;
  shape.seqs = 2, shape.max_k_len = 200, shape.q_heads = s.hq, shape.kv_heads = s.hkv, shape.head_dim = s.d;
  try {
    const CapturedGraph graph(stream.get(), [&] { attention_backward(ctx, a); }, shape);
    FAIL() << "the backward was captured";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be captured into a CUDA graph"), std::string::npos) << e.what();
  }
  attention_backward(ctx, a);  // outside the capture it runs
  stream.synchronize();
}

// dq / dk / dv of a sequence are the same bits alone, packed among other sequences at another
// offset, with the forward's lse or a recomputed one, and run again; key rows no sequence covers
// get dk = dv = 0.
TEST_F(CudaAttention, BackwardIsInvariantToPackingAndRepeats) {
  for (const Shape& s : {Shape{DType::bf16, 32, 8, 128, 300}, Shape{DType::f16, 4, 2, 64, 130}}) {
    const std::string what = describe(s);
    Rng r(97 + s.d);
    const int32_t L = int32_t(s.len);
    const auto [q, k, v, g] = random_inputs(s, r);
    const Grads alone = run_gpu_backward(q, k, v, g, {{0, L, 0, L}});
    const Grads again = run_gpu_backward(q, k, v, g, {{0, L, 0, L}}, true);
    for (auto [x, y, name] : {std::tuple{&again.dq, &alone.dq, "dq"}, {&again.dk, &alone.dk, "dk"}, {&again.dv, &alone.dv, "dv"}})
      expect_same_bits(*x, *y, what + ": recomputed lse, " + name);
    const int32_t pre = 70, post = 9, gap = 3, T = pre + L + post + gap;
    HostTensor qp = r.tensor(s.dt, {T, s.hq, s.d}, -2, 2), kp = r.tensor(s.dt, {T, s.hkv, s.d}, -2, 2),
               vp = r.tensor(s.dt, {T, s.hkv, s.d}, -1, 1), gp = r.tensor(s.dt, {T, s.hq, s.d}, -1, 1);
    qp.copy_rows_from(q, 0, pre, L);
    kp.copy_rows_from(k, 0, pre, L);
    vp.copy_rows_from(v, 0, pre, L);
    gp.copy_rows_from(g, 0, pre, L);
    const Grads packed = run_gpu_backward(qp, kp, vp, gp, {{0, pre, 0, pre}, {pre + L, post, pre + L, post}, {pre, L, pre, L}});
    expect_same_bits(packed.dq.slice_rows(pre, pre + L), alone.dq, what + ": packed dq");
    expect_same_bits(packed.dk.slice_rows(pre, pre + L), alone.dk, what + ": packed dk");
    expect_same_bits(packed.dv.slice_rows(pre, pre + L), alone.dv, what + ": packed dv");
    for (int64_t i = int64_t(pre + L + post) * s.hkv * s.d; i < packed.dk.numel(); ++i) {
      ASSERT_EQ(packed.dk.get(i), 0.0) << what;
      ASSERT_EQ(packed.dv.get(i), 0.0) << what;
      ASSERT_EQ(packed.dq.get(i * (s.hq / s.hkv)), 0.0) << what;
    }
  }
}

// Against the CPU's fp64 truth: dq, dk, dv within the contract's attention tolerance.
TEST_F(CudaAttention, BackwardAccurateAgainstFp64) {
  for (const Shape& s : {Shape{DType::bf16, 8, 2, 128, 300}, Shape{DType::f16, 4, 2, 64, 200}}) {
    Rng r(101 + s.d);
    const int32_t L = int32_t(s.len);
    const auto [q, k, v, g] = random_inputs(s, r);
    const Grads gpu = run_gpu_backward(q, k, v, g, {{0, L, 0, L}});
    Context truth;
    truth.precision = Precision::truth_fp64;
    const HostTensor seqs = seq_table({{0, L, 0, L}});
    HostTensor out(DType::f64, {L, s.hq, s.d}), lse(DType::f64, {L, s.hq});
    const HostTensor q64 = q.converted(DType::f64), k64 = k.converted(DType::f64), v64 = v.converted(DType::f64),
                     g64 = g.converted(DType::f64);
    attention_forward(truth, forward_args(q64.view(), k64.view(), v64.view(), seqs, out.view(), lse.view()));
    HostTensor dq(DType::f64, q.shape()), dk(DType::f64, k.shape()), dv(DType::f64, v.shape());
    AttentionBackwardArgs a;
    a.q = q64.view(), a.k = k64.view(), a.v = v64.view(), a.seqs = seqs.view(), a.out = out.view(), a.lse = lse.view();
    a.dout = g64.view(), a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view();
    attention_backward(truth, a);
    const Tolerance tol = Contract::builtin().tolerance("attention", s.dt);
    for (auto [got, want, name] : {std::tuple{&gpu.dq, &dq, "dq"}, {&gpu.dk, &dk, "dk"}, {&gpu.dv, &dv, "dv"}}) {
      double worst = 0;
      for (int64_t i = 0; i < want->numel(); ++i)
        worst = std::max(worst, std::fabs(got->get(i) - want->get(i)) / (tol.atol + tol.rtol * std::fabs(want->get(i))));
      std::printf("ACCURACY attention backward %s D=%lld %s: worst error / tolerance %.3g\n", dtype_name(s.dt),
                  static_cast<long long>(s.d), name, worst);
      EXPECT_LE(worst, 1.0) << dtype_name(s.dt) << " " << name;
    }
  }
}
