// CPU selected logprob and the fused LM head -> logprob, forward and backward.
//
// Row statistics over the vocab, in blocks of logprob_vocab_block(V) columns:
//   per block (sequential in the block): m_b = max z, s_b = Σ e^(z−m_b), a_b = Σ e^(z−m_b)(m_b−z)
//   blocks merged in ascending order into (M, S, A); lse = M + log S; entropy = log S + A/S.
// A ≥ 0 and log S ≥ 0, so the entropy is a sum of non-negative terms (no cancellation).
// The fused LM head computes each block's logits with the linear kernel's dot_fixed (so they are
// bitwise the logits of linear_forward with an fp32 output) and never stores a [T, V] buffer.
#include <algorithm>
#include <limits>

#include "cpu/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits::cpu {
namespace {

template <class Acc>
struct RowStats {
  Acc m = -std::numeric_limits<Acc>::infinity(), s = 0, a = 0;

  void merge(Acc mb, Acc sb, Acc ab) {
    if (s == Acc(0)) { m = mb; s = sb; a = ab; return; }
    const Acc nm = std::max(m, mb);
    const Acc alpha = exp_acc(m - nm), beta = exp_acc(mb - nm);
    a = alpha * (a + (nm - m) * s) + beta * (ab + (nm - mb) * sb);
    s = s * alpha + sb * beta;
    m = nm;
  }
  // One block of logits z[0..n).
  void add_block(const Acc* z, int64_t n) {
    Acc mb = z[0];
    for (int64_t j = 1; j < n; ++j) mb = std::max(mb, z[j]);
    Acc sb = 0, ab = 0;
    for (int64_t j = 0; j < n; ++j) {
      const Acc e = exp_acc(z[j] - mb);
      sb += e;
      ab += e * (mb - z[j]);
    }
    merge(mb, sb, ab);
  }
  Acc lse() const { return m + log_acc(s); }
  Acc entropy() const { return log_acc(s) + a / s; }
};

bool token_active(const TensorView& mask, const int32_t* targets, int32_t ignore, int64_t t) {
  return row_active(mask, t) && targets[t] != ignore;
}

// Writes logp / entropy / lse of row t from its statistics and target logit.
template <class Acc>
void write_row(const TensorView& logp, const TensorView& entropy, const TensorView& lse_out,
               int64_t t, bool active, const RowStats<Acc>& st, Acc target_logit) {
  const Acc lse = st.lse();
  logp.as<Acc>()[t] = active ? target_logit - lse : Acc(0);
  if (entropy.present()) entropy.as<Acc>()[t] = active ? st.entropy() : Acc(0);
  if (lse_out.present()) lse_out.as<Acc>()[t] = lse;
}

// dlogits of one row from its logits z (all V of them) and statistics.
template <class Acc>
void dlogits_row(const Acc* z, int64_t V, int32_t target, const RowStats<Acc>& st, Acc glogp,
                 Acc gent, Acc* dz) {
  const Acc lse = st.lse(), H = st.entropy();
  for (int64_t j = 0; j < V; ++j) {
    const Acc logp = z[j] - lse;
    const Acc p = exp_acc(logp);
    Acc g = -glogp * p;
    if (j == target) g += glogp;
    if (gent != Acc(0)) g += gent * (-p * (logp + H));
    dz[j] = g;
  }
}

template <class Acc>
RowStats<Acc> stats_of(const Acc* z, int64_t V) {
  RowStats<Acc> st;
  const int64_t blk = logprob_vocab_block(V);
  for (int64_t b = 0; b < V; b += blk) st.add_block(z + b, std::min(blk, V - b));
  return st;
}

void logprob_forward(const Context& ctx, const LogprobForwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t T = a.logits.shape[0], V = a.logits.shape[1];
    const auto* tg = a.targets.as<const int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<Acc> z(static_cast<size_t>(V));
      load(a.logits, t * V, V, z.data());
      const bool active = token_active(a.loss_mask, tg, a.ignore_index, t);
      write_row<Acc>(a.logp, a.entropy, a.lse, t, active, stats_of(z.data(), V),
                     active ? z[tg[t]] : Acc(0));
    }
  });
}

void logprob_backward(const Context& ctx, const LogprobBackwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t T = a.logits.shape[0], V = a.logits.shape[1];
    const auto* tg = a.targets.as<const int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<Acc> z(static_cast<size_t>(V)), dz(static_cast<size_t>(V), Acc(0));
      if (token_active(a.loss_mask, tg, a.ignore_index, t)) {
        load(a.logits, t * V, V, z.data());
        const Acc gent = a.dentropy.present() ? a.dentropy.as<const Acc>()[t] : Acc(0);
        dlogits_row(z.data(), V, tg[t], stats_of(z.data(), V), a.dlogp.as<const Acc>()[t], gent,
                    dz.data());
      }
      store(a.dlogits, t * V, V, dz.data());
    }
  });
}

// Vocab blocks outermost: each block of weight rows is converted once and scored against every
// token; each token merges its block statistics in ascending block order, as logprob_forward does.
void lm_head_logprob_forward(const Context& ctx, const LmHeadLogprobForwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t T = a.hidden.shape[0], H = a.hidden.shape[1], V = a.weight.shape[0];
    const auto hid = load_all<Acc>(a.hidden);
    const auto* tg = a.targets.as<const int32_t>();
    const int64_t blk = logprob_vocab_block(V);
    std::vector<RowStats<Acc>> stats(static_cast<size_t>(T));
    std::vector<Acc> target_logit(static_cast<size_t>(T), Acc(0)), w(static_cast<size_t>(blk * H));
    for (int64_t b = 0; b < V; b += blk) {
      const int64_t n = std::min(blk, V - b);
      load(a.weight, b * H, n * H, w.data());
#pragma omp parallel
      {
        std::vector<Acc> z(static_cast<size_t>(blk));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t v = 0; v < n; ++v) z[v] = dot_fixed(&hid[t * H], &w[v * H], H);
          if (tg[t] >= b && tg[t] < b + n) target_logit[t] = z[tg[t] - b];
          stats[t].add_block(z.data(), n);
        }
      }
    }
    for (int64_t t = 0; t < T; ++t)
      write_row<Acc>(a.logp, a.entropy, a.lse, t, token_active(a.loss_mask, tg, a.ignore_index, t), stats[t],
                     target_logit[t]);
  });
}

void lm_head_logprob_backward(const Context& ctx, const LmHeadLogprobBackwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t T = a.hidden.shape[0], H = a.hidden.shape[1], V = a.weight.shape[0];
    const auto hid = load_all<Acc>(a.hidden), w = load_all<Acc>(a.weight);
    const auto wt = transposed(w, V, H);  // [H, V]: dhidden reduces over V with dot_fixed
    const auto* tg = a.targets.as<const int32_t>();
    auto* dw = a.dweight.present() ? a.dweight.as<Acc>() : nullptr;  // absent: a frozen head
    std::vector<Acc> z(static_cast<size_t>(V)), dz(static_cast<size_t>(V)), dh(static_cast<size_t>(H));
    for (int64_t t = 0; t < T; ++t) {  // tokens ascending: the dweight order
      std::fill(dh.begin(), dh.end(), Acc(0));
      const bool active = token_active(a.loss_mask, tg, a.ignore_index, t);
      if (active) {
#pragma omp parallel for schedule(static)
        for (int64_t v = 0; v < V; ++v) z[v] = dot_fixed(&hid[t * H], &w[v * H], H);
        const Acc gent = a.dentropy.present() ? a.dentropy.as<const Acc>()[t] : Acc(0);
        dlogits_row(z.data(), V, tg[t], stats_of(z.data(), V), a.dlogp.as<const Acc>()[t], gent,
                    dz.data());
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < H; ++k) dh[k] = dot_fixed(dz.data(), &wt[k * V], V);
        if (dw) {
#pragma omp parallel for schedule(static)
          for (int64_t v = 0; v < V; ++v)
            for (int64_t k = 0; k < H; ++k) dw[v * H + k] += dz[v] * hid[t * H + k];
        }
      }
      store(a.dhidden, t * H, H, dh.data());
    }
  });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(logprob_forward, Backend::cpu, LogprobForwardArgs, logprob_forward);
SAMEBITS_REGISTER_KERNEL(logprob_backward, Backend::cpu, LogprobBackwardArgs, logprob_backward);
SAMEBITS_REGISTER_KERNEL(lm_head_logprob_forward, Backend::cpu, LmHeadLogprobForwardArgs, lm_head_logprob_forward);
SAMEBITS_REGISTER_KERNEL(lm_head_logprob_backward, Backend::cpu, LmHeadLogprobBackwardArgs, lm_head_logprob_backward);

}  // namespace samebits::cpu
