// CPU causal GQA attention over packed sequences / a KV cache, forward and backward.
//
// One query's softmax walks its keys in ascending absolute position: m = max_j s_j (exact, order
// free), l = Σ_j exp(s_j − m) and o = Σ_j p_j·v_j, both sequential in j, so the same query gives
// the same bits in a whole prefill, any chunked prefill and a decode step. The backward recomputes
// p_j = exp(s_j − lse); dq sums over keys ascending; dk/dv sum over the group's query heads in
// ascending order, each over queries in ascending position. Parallel over (sequence, kv head).
#include <algorithm>
#include <limits>

#include "cpu/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits::cpu {
namespace {

struct Seq { int64_t q_row, q_len, k_row, k_len; };

std::vector<Seq> read_seqs(const TensorView& seqs) {
  std::vector<Seq> out;
  const auto* s = seqs.as<const int32_t>();
  for (int64_t b = 0; b < seqs.shape[0]; ++b)
    out.push_back({s[4 * b], s[4 * b + 1], s[4 * b + 2], s[4 * b + 3]});
  return out;
}

// Where sequence b's key j lives: row k_row + j, or in its pages of a paged cache.
struct KeyRows {
  const int32_t* table = nullptr;
  int64_t cols = 0, page_size = 0;
  int64_t operator()(int64_t b, const Seq& s, int64_t j) const {
    return table ? int64_t(table[b * cols + j / page_size]) * page_size + j % page_size : s.k_row + j;
  }
};

template <class Acc>
Acc scale_of(double scale, int64_t d) { return scale > 0 ? Acc(scale) : Acc(1) / std::sqrt(Acc(d)); }

// Scores s_j = (q·k_j)·scale of one query against keys 0..last_key of a sequence whose keys lie
// back to back from `keys` (key j, head hk at keys + (j·hkv + hk)·d); returns their maximum.
template <class Acc>
Acc scores(const Acc* qi, const Acc* keys, int64_t last_key, int64_t hkv, int64_t hk, int64_t d, Acc scale,
           std::vector<Acc>& s) {
  Acc m = -std::numeric_limits<Acc>::infinity();
  for (int64_t j = 0; j <= last_key; ++j) {
    s[j] = dot_fixed(qi, keys + (j * hkv + hk) * d, d) * scale;
    if (s[j] > m) m = s[j];
  }
  return m;
}

// Each sequence's key (or value) rows, converted once and laid back to back: a KV cache holds far
// more rows than a call reads (free slots, the rest of each slot), so nothing else is loaded.
template <class Acc>
std::vector<std::vector<Acc>> rows_of_each(const TensorView& t, const std::vector<Seq>& seqs, const KeyRows& rows) {
  const int64_t row_elems = t.numel() / std::max<int64_t>(t.shape[0], 1);
  std::vector<std::vector<Acc>> out(seqs.size());
#pragma omp parallel for schedule(dynamic)
  for (int64_t b = 0; b < int64_t(seqs.size()); ++b) {
    const Seq& sq = seqs[size_t(b)];
    out[size_t(b)].resize(size_t(sq.k_len * row_elems));
    for (int64_t j = 0; j < sq.k_len; ++j)
      load(t, rows(b, sq, j) * row_elems, row_elems, &out[size_t(b)][size_t(j * row_elems)]);
  }
  return out;
}

template <class Acc>
void forward(const AttentionForwardArgs& a) {
  const int64_t Tq = a.q.shape[0], Hq = a.q.shape[1], D = a.q.shape[2], Hkv = a.k.shape[1];
  const int64_t group = Hq / Hkv;
  const Acc scale = scale_of<Acc>(a.scale, D);
  const auto q = load_all<Acc>(a.q);
  const auto seqs = read_seqs(a.seqs);
  KeyRows rows;
  if (a.block_table.present()) rows = {a.block_table.as<const int32_t>(), a.block_table.shape[1], a.page_size};
  const auto k = rows_of_each<Acc>(a.k, seqs, rows), v = rows_of_each<Acc>(a.v, seqs, rows);
  std::vector<Acc> out(static_cast<size_t>(Tq * Hq * D), Acc(0));
  std::vector<Acc> lse(static_cast<size_t>(Tq * Hq), -std::numeric_limits<Acc>::infinity());
  const int64_t jobs = int64_t(seqs.size()) * Hq;
#pragma omp parallel for schedule(dynamic)
  for (int64_t job = 0; job < jobs; ++job) {
    const int64_t b = job / Hq;
    const Seq& sq = seqs[size_t(b)];
    const int64_t h = job % Hq, hk = h / group;
    std::vector<Acc> s(static_cast<size_t>(sq.k_len));
    for (int64_t i = 0; i < sq.q_len; ++i) {
      const int64_t row = sq.q_row + i, last_key = sq.k_len - sq.q_len + i;
      const Acc* qi = &q[(row * Hq + h) * D];
      const Acc m = scores(qi, k[size_t(b)].data(), last_key, Hkv, hk, D, scale, s);
      Acc l = 0;
      Acc* o = &out[(row * Hq + h) * D];
      for (int64_t j = 0; j <= last_key; ++j) {
        const Acc p = exp_acc(s[j] - m);
        l += p;
        const Acc* vj = &v[size_t(b)][size_t((j * Hkv + hk) * D)];
        for (int64_t d = 0; d < D; ++d) o[d] += p * vj[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= l;
      lse[size_t(row * Hq + h)] = m + log_acc(l);
    }
  }
  store(a.out, 0, Tq * Hq * D, out.data());
  if (a.lse.present()) {
    auto* dst = a.lse.as<Acc>();
    for (size_t i = 0; i < lse.size(); ++i) dst[i] = lse[i];
  }
}

template <class Acc>
void backward(const AttentionBackwardArgs& a) {
  const int64_t Tq = a.q.shape[0], Hq = a.q.shape[1], D = a.q.shape[2];
  const int64_t Tk = a.k.shape[0], Hkv = a.k.shape[1], group = Hq / Hkv;
  const Acc scale = scale_of<Acc>(a.scale, D);
  const auto q = load_all<Acc>(a.q), k = load_all<Acc>(a.k), v = load_all<Acc>(a.v);
  const auto out = load_all<Acc>(a.out), dout = load_all<Acc>(a.dout);
  const auto seqs = read_seqs(a.seqs);
  std::vector<Acc> dq(static_cast<size_t>(Tq * Hq * D), Acc(0)), dk(static_cast<size_t>(Tk * Hkv * D), Acc(0)),
      dv(static_cast<size_t>(Tk * Hkv * D), Acc(0));
  const int64_t jobs = int64_t(seqs.size()) * Hkv;
#pragma omp parallel for schedule(dynamic)
  for (int64_t job = 0; job < jobs; ++job) {
    const Seq& sq = seqs[size_t(job / Hkv)];
    const int64_t hk = job % Hkv;
    std::vector<Acc> s(static_cast<size_t>(sq.k_len)), p(static_cast<size_t>(sq.k_len));
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t i = 0; i < sq.q_len; ++i) {
        const int64_t row = sq.q_row + i, last_key = sq.k_len - sq.q_len + i;
        const Acc* qi = &q[(row * Hq + h) * D];
        const Acc* doi = &dout[(row * Hq + h) * D];
        // Softmax statistics, recomputed exactly as the forward computes them.
        const Acc m = scores(qi, &k[size_t(sq.k_row * Hkv * D)], last_key, Hkv, hk, D, scale, s);
        Acc l = 0;
        for (int64_t j = 0; j <= last_key; ++j) l += exp_acc(s[j] - m);
        const Acc lse = m + log_acc(l);
        const Acc delta = dot_fixed(doi, &out[(row * Hq + h) * D], D);
        Acc* dqi = &dq[(row * Hq + h) * D];
        for (int64_t j = 0; j <= last_key; ++j) {
          const int64_t kv = ((sq.k_row + j) * Hkv + hk) * D;
          p[j] = exp_acc(s[j] - lse);
          const Acc dp = dot_fixed(doi, &v[kv], D);
          const Acc ds = p[j] * (dp - delta) * scale;
          for (int64_t d = 0; d < D; ++d) {
            dqi[d] += ds * k[kv + d];
            dk[kv + d] += ds * qi[d];
            dv[kv + d] += p[j] * doi[d];
          }
        }
      }
    }
  }
  store(a.dq, 0, Tq * Hq * D, dq.data());
  store(a.dk, 0, Tk * Hkv * D, dk.data());
  store(a.dv, 0, Tk * Hkv * D, dv.data());
}

void attention_forward(const Context& ctx, const AttentionForwardArgs& a) {
  with_precision(ctx, [&](auto acc) { forward<decltype(acc)>(a); });
}
void attention_backward(const Context& ctx, const AttentionBackwardArgs& a) {
  with_precision(ctx, [&](auto acc) { backward<decltype(acc)>(a); });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(attention_forward, Backend::cpu, AttentionForwardArgs, attention_forward);
SAMEBITS_REGISTER_KERNEL(attention_backward, Backend::cpu, AttentionBackwardArgs, attention_backward);

}  // namespace samebits::cpu
