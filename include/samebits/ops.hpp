// samebits/ops.hpp — every op of the transformer chain, forward and backward.
//
// Each op is a free function over tensor views plus a Context. Arguments travel in a small struct
// so optional inputs (views left as none) and scalars have names. Every op validates all of its
// arguments before it writes anything, and throws samebits::Error naming the op, the argument and
// the problem. The CPU and CUDA backends share these signatures (see ops/registry.hpp).
//
// Conventions
//  * Token-major 2-D / 3-D tensors: rows are tokens ([T, H] or [T, heads, head_dim]).
//  * "dweight" style outputs are fp32 gradient accumulators (fp64 in truth mode): ops ADD into
//    them, tokens in ascending row order, so micro-batches chain bitwise (design rule 6).
//  * row_mask (uint8 [T], optional): rows with 0 are padding. They contribute nothing to any
//    weight gradient and move no reduction boundary. Outputs of padding rows are unspecified
//    unless an op says otherwise.
//  * Reduction orders depend only on the reduced extent (K, hidden size, vocab, key position).
#pragma once
#include <cstdint>

#include "samebits/context.hpp"
#include "samebits/tensor.hpp"

namespace samebits {

// ---------------------------------------------------------------- linear (GEMM)
// y[M,N] = x[M,K] · weight[N,K]ᵀ (+ bias[N], added in fp32 after the K reduction)
// weight_settled: the weight was written before the kernel that runs just before this call on the
// stream (a model's weights; never an output of that kernel). Then, on Hopper, the call's weight
// loads may start while that kernel ends (programmatic dependent launch). Timing only: the same bits.
struct LinearForwardArgs {
  TensorView x, weight, bias, y;
  bool weight_settled = false;
};
// dx[M,K] = dy[M,N] · weight[N,K]
struct LinearBackwardInputArgs {
  TensorView dy, weight, dx;
};
// dweight[N,K] += dy[M,N]ᵀ · x[M,K];  dbias[N] += Σ_m dy[m,:]   (fp32 accumulators)
// segments (int32 [S, 2] {row, len}, on the host, optional): the rows of each sequence. Backends
// that sum tokens in groups (tensor cores) start a new group at every segment, so one batch and
// any split of it into micro-batches at sequence boundaries, packed or padded, group every token
// alike. Rows outside every segment are skipped. Without segments, all M rows form one segment.
// The CPU sums one token at a time, which no grouping can change.
struct LinearBackwardWeightArgs {
  TensorView dy, x, row_mask, dweight, dbias, segments;
};
// Several linears of one x: y_i = x · weight_iᵀ (+ bias_i) for the parts i < count (1 to 3; a layer's
// Q, K and V, or gate and up). Each y_i is bitwise what linear_forward(x, weight_i, bias_i, y_i)
// gives; where a backend can, the parts run as one launch whose tiles cover every part's columns (a
// decode's narrow K and V then stream their weights beside Q's instead of leaving the GPU idle).
struct LinearPart {
  TensorView weight, bias, y;
};
struct LinearGroupForwardArgs {
  TensorView x;
  LinearPart parts[3];
  int count = 0;
  bool weights_settled = false;  // every part's weight, as LinearForwardArgs::weight_settled
  // Given (two parts, gate and up, no bias, no y): only SwiGLU of the two goes out, into `swiglu`
  // [M, N] of x's dtype — bitwise swiglu_forward of the two parts' outputs (each rounded to x's
  // dtype first, as linear_forward rounds it). Where a backend can (a Hopper GPU, decode-sized M),
  // one launch: a tile multiplies N/2 gate columns and the same N/2 up columns, and its epilogue
  // writes silu(gate)·up, so the MLP's two outputs never leave the chip and no second kernel sits
  // between the gate + up GEMM and the down projection.
  TensorView swiglu;
};
void linear_forward(const Context&, const LinearForwardArgs&);
void linear_group_forward(const Context&, const LinearGroupForwardArgs&);
void linear_backward_input(const Context&, const LinearBackwardInputArgs&);
void linear_backward_weight(const Context&, const LinearBackwardWeightArgs&);

// ---------------------------------------------------------------- RoPE (its config; the op is below)
// Qwen3 / Llama convention (rotate_half): dims i and i + D/2 form a pair.
// inv_freq[i] = fp32(1 / theta^(2i/D)) (Llama-3 scaling applied to it when enabled);
// angle = fp32(float(position) * inv_freq[i]) — both in fp32 as Hugging Face computes them —
// and cos / sin of that fp32 angle evaluated in fp64, then rounded to fp32. So a position gives
// the same cos/sin bits on every path, whatever the batch.
struct RopeConfig {
  double theta = 1000000.0;
  int64_t max_position = 1 << 20;  // positions must be in [0, max_position)
  bool llama3_scaling = false;
  double factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

// ---------------------------------------------------------------- RMSNorm (+ fused residual add)
// Without residual: y = x * rsqrt(mean(x²) + eps) * weight.
// With residual:    s = round(x + residual) (stored in residual_out's dtype), y = rmsnorm(s).
// rstd[T] (fp32, optional) saves rsqrt(mean(s²) + eps) for the backward.
struct RmsNormForwardArgs {
  TensorView x, residual, weight, y, residual_out, rstd;
  double eps = 1e-6;
};
// x is the normed input (s when fused). dx = ∂y/∂x·dy (+ dresidual_out: the gradient arriving on
// the residual stream, when fused; dx is then also the gradient of both summands).
// dweight[H] += Σ_t dy[t]·x̂[t] over unmasked rows. The CPU adds one row at a time, ascending t. The
// GPU sums chunks of rows (a size set by H) that start at every segment, then chains them into
// dweight in row order: segments as linear_backward_weight's (rows outside every segment add
// nothing to dweight; their dx is computed), so splits into micro-batches at sequence boundaries,
// packed or padded, give the same bits.
struct RmsNormBackwardArgs {
  TensorView dy, dresidual_out, x, weight, rstd, row_mask, dx, dweight, segments;
  double eps = 1e-6;
};
void rmsnorm_forward(const Context&, const RmsNormForwardArgs&);
void rmsnorm_backward(const Context&, const RmsNormBackwardArgs&);

// QK-norm (Qwen3): RMSNorm over head_dim of every head; x, y: [T, heads, head_dim], weight[head_dim].
// Fused with RoPE when positions (int32 [T]) are given: y = rope(n), n = the normed rows rounded to
// y's dtype — the same bits as qk_norm_forward into y, then rope_forward (rope config) in place on
// y, in one pass over the rows (rstd is the norm's, as without).
struct QkNormForwardArgs {
  TensorView x, weight, y, rstd;  // rstd: [T, heads] fp32, optional
  double eps = 1e-6;
  TensorView positions;  // optional: fuse RoPE (see RopeArgs)
  RopeConfig rope;
};
// A layer's q and k in one call: each part bitwise what qk_norm_forward gives it alone, with the
// same eps, positions and RoPE (their x share T and head_dim; the heads may differ). The CUDA
// backend runs both in one launch. No part's y may overlap the other part's x or y.
// Optional cache write (a decode step's paged KV cache; all four or none): token t's k.y row — the
// very bits written to k.y — also goes to row cache_rows[t] of k_cache, and its v row, verbatim, to
// the same row of v_cache; cache_rows[t] = -1 writes nothing for t (a padding row). cache_rows: int32
// [T] on the op's device; k_cache, v_cache: [rows, k heads, head_dim]; v: [T, k heads, head_dim];
// all three of k.y's dtype. Two tokens may share a cache row only where they write the same bits.
// The CPU checks each cache row is in [-1, rows); on CUDA that is the caller's (the values live on
// the device). Other cache rows are left as they are; k.y is still written.
struct QkNormPart {
  TensorView x, weight, y, rstd;
};
struct QkNormPairForwardArgs {
  QkNormPart q, k;
  double eps = 1e-6;
  TensorView positions;
  RopeConfig rope;
  TensorView cache_rows, k_cache, v_cache, v;  // optional: the cache write (above)
};
// dweight[head_dim] += Σ over unmasked tokens (CPU: tokens ascending, each token's heads ascending;
// GPU: chunks of tokens from every segment, as rmsnorm_backward). segments: as rmsnorm_backward's.
// With positions (the fused forward's backward): dy is the gradient of the rotated output; it is
// rotated back (rope_backward's arithmetic) and kept in fp32 (fp64 in truth mode), not rounded to a
// storage dtype — the same bits as rope_backward of dy into an fp32 tensor, then qk_norm_backward on
// it, and more accurate than a bf16 round trip (dweight sums over every token). x is the norm's input.
struct QkNormBackwardArgs {
  TensorView dy, x, weight, rstd, row_mask, dx, dweight, segments;
  double eps = 1e-6;
  TensorView positions;  // optional: the fused forward's positions
  RopeConfig rope;
};
void qk_norm_forward(const Context&, const QkNormForwardArgs&);
void qk_norm_pair_forward(const Context&, const QkNormPairForwardArgs&);
void qk_norm_backward(const Context&, const QkNormBackwardArgs&);

// ---------------------------------------------------------------- RoPE
// x, y: [T, heads, head_dim] (y may alias x); positions: int32 [T].
struct RopeArgs {
  TensorView x, positions, y;
  RopeConfig config;
};
void rope_forward(const Context&, const RopeArgs&);
void rope_backward(const Context&, const RopeArgs&);  // x := dy, y := dx (the inverse rotation)

// ---------------------------------------------------------------- elementwise
// y = silu(gate) * up, silu(g) = g / (1 + exp(-g)), in fp32.
struct SwiGluForwardArgs {
  TensorView gate, up, y;
};
struct SwiGluBackwardArgs {
  TensorView dy, gate, up, dgate, dup;
};
void swiglu_forward(const Context&, const SwiGluForwardArgs&);
void swiglu_backward(const Context&, const SwiGluBackwardArgs&);

// y = a + b (the residual add), in fp32, rounded once. Backward: da = db = dy, converted to each
// gradient's dtype (residual_add_backward writes both; either may be none).
struct ResidualAddArgs {
  TensorView a, b, y;
};
struct ResidualAddBackwardArgs {
  TensorView dy, da, db;
};
void residual_add_forward(const Context&, const ResidualAddArgs&);
void residual_add_backward(const Context&, const ResidualAddBackwardArgs&);

// ---------------------------------------------------------------- embedding
// y[t,:] = table[ids[t], :]; ids int32 or int64 (torch's index type, read as they are) in [0, V).
// ids_checked: the caller vouches that every id is in [0, V) (it checked them on the host, as
// samebits.hf.patch does for ids that arrive in host memory), so the CUDA backend skips its own
// range check (Context::id_check: a stream synchronisation, or a deferred report). An id outside
// the range then gets a NaN row, reported by nothing: vouch only for checked ids.
struct EmbeddingForwardArgs {
  TensorView ids, table, y;
  bool ids_checked = false;
};
// dtable[v,:] += Σ dy[t,:] over unmasked t with ids[t] == v, ascending t. No atomics.
struct EmbeddingBackwardArgs {
  TensorView ids, dy, row_mask, dtable;
  bool ids_checked = false;  // as the forward's
};
void embedding_forward(const Context&, const EmbeddingForwardArgs&);
void embedding_backward(const Context&, const EmbeddingBackwardArgs&);

// ---------------------------------------------------------------- attention
// Causal attention with GQA over packed variable-length sequences and against a KV cache.
// seqs: int32 [B, 4], one row per sequence: {q_row, q_len, k_row, k_len}. The sequence's queries
// are rows [q_row, q_row + q_len) of q and its keys / values rows [k_row, k_row + k_len) of k / v;
// the queries are the LAST q_len tokens of the k_len tokens (prefill: q_len == k_len; chunked
// prefill: a chunk against the cache; decode: q_len == 1), so query i sits at absolute position
// k_len - q_len + i and sees keys 0 … that position. Keys are reduced in ascending absolute
// position, so prefill, chunked prefill and decode walk the same order.
// Query rows covered by no sequence (padding, a fully masked row) get out = 0 and lse = -inf.
// q, out: [Tq, Hq, D]; k, v: [Tk, Hkv, D] with Hq % Hkv == 0; lse: [Tq, Hq] fp32 (optional).
// Paged KV cache (optional): with block_table (int32 [B, pages], on the host), k / v are a pool of
// pages of page_size rows ([pages · page_size, Hkv, D], e.g. vLLM's [pages, page_size, Hkv, D]) and
// sequence b's key j is row block_table[b, j / page_size] · page_size + j % page_size; its k_row
// must be 0. Where the keys live changes no bit: paged and contiguous give the same result.
struct AttentionForwardArgs {
  TensorView q, k, v, seqs, out, lse;
  double scale = 0.0;  // 0: 1/sqrt(D)
  TensorView block_table;
  int64_t page_size = 0;
  // Optional: a copy of block_table already in q's device memory, which the CUDA kernels read instead
  // of uploading block_table themselves (one upload for every layer of a step; the only way inside a
  // captured CUDA graph). Ignored on the CPU. The caller keeps the two equal.
  TensorView block_table_device;
};
// dq, dk, dv: same shapes as q, k, v. Key rows covered by no sequence get dk = dv = 0; key ranges
// of different sequences must not overlap. dk/dv sum over the query heads of their group in
// ascending head order, each over queries in ascending position.
struct AttentionBackwardArgs {
  TensorView q, k, v, seqs, out, lse, dout, dq, dk, dv;
  double scale = 0.0;
};
void attention_forward(const Context&, const AttentionForwardArgs&);
void attention_backward(const Context&, const AttentionBackwardArgs&);
// The KV-cache page sizes a backend's paged attention takes: the CPU any ≥ 1; CUDA multiples of 8
// that divide 128 or are multiples of it (a page is whole key tiles, or a tile holds whole pages).
bool paged_attention_takes(Backend backend, int64_t page_size);

// ---------------------------------------------------------------- selected logprob
// logp[t] = logits[t, target[t]] - logsumexp(logits[t, :]) in fp32; entropy[t] = -Σ p log p.
// A token is masked when loss_mask[t] == 0 or target[t] == ignore_index: logp = entropy = 0 and
// its gradient is 0. Targets of unmasked tokens must be in [0, V). The vocab is reduced in blocks
// of logprob_vocab_block(V) columns, each block's (max, Σexp) combined in ascending block order.
struct LogprobForwardArgs {
  TensorView logits, targets, loss_mask, logp, entropy, lse;  // lse [T] fp32 optional (for backward)
  int32_t ignore_index = -100;
  bool targets_checked = false;  // as LmHeadLogprobForwardArgs'
};
// dlogits[t, j] = dlogp[t]·(onehot_j − p_j) + dentropy[t]·(−p_j·(log p_j + H_t)).
struct LogprobBackwardArgs {
  TensorView logits, targets, loss_mask, lse, dlogp, dentropy, dlogits;
  int32_t ignore_index = -100;
  bool targets_checked = false;  // as LmHeadLogprobForwardArgs'
};
void logprob_forward(const Context&, const LogprobForwardArgs&);
void logprob_backward(const Context&, const LogprobBackwardArgs&);
int64_t logprob_vocab_block(int64_t vocab);

// ---------------------------------------------------------------- fused LM head -> selected logprob
// logits = hidden[T,H] · weight[V,H]ᵀ computed in fp32, vocab block by vocab block, and never
// stored: bitwise equal to linear_forward with an fp32 y followed by logprob_forward.
// targets_checked: the caller vouches that every target is in [0, V), ignore_index or masked (they
// are ids that an embedding call over a table of at most V rows has just checked, as
// samebits.hf.patch's next-token targets are), so the CUDA backend skips its own range check, which
// reads a flag back (a stream synchronisation). A target outside that range is then not named: the
// fused kernels read no memory by it (no column matches it), but its logp is meaningless.
//
// logits_kept (optional, fp32 [C, V], C <= T): the first C rows' logits kept from the forward for the
// backward, which then derives those rows' dlogits from them instead of recomputing them — three
// GEMMs for those rows instead of four, for C·V·6 bytes (the logits and the backward's 16-bit
// dlogits). Give the backward the buffer the forward filled; C must be 0, T or where a segment of
// the backward starts or ends (with no segments: 0 or T), so the weight gradient groups the tokens
// as without it. The bits are those of the recompute, forward and backward. The caller picks C from
// a memory budget. Taken by the CUDA fused path (sm_90a, 16-bit, V a multiple of 8, aligned); both
// calls ignore it elsewhere (the same test on the same tensors).
struct LmHeadLogprobForwardArgs {
  TensorView hidden, weight, targets, loss_mask, logp, entropy, lse;
  int32_t ignore_index = -100;
  bool targets_checked = false;
  TensorView logits_kept;
};
// dhidden[T,H] = dlogits · weight; dweight[V,H] += dlogitsᵀ · hidden (fp32 accumulator), with
// dlogits recomputed block by block in fp32 (the CUDA backend rounds them to the 16-bit input dtype
// before its two GEMMs, as a stored dlogits tensor would be; lse from the forward when given; without it, or with
// dentropy, the statistics are recomputed first). segments: as linear_backward_weight's, so that
// micro-batches split at sequence boundaries chain dweight bit for bit.
// Tied embeddings: the LM head's dweight is its own accumulator; the tied matrix's gradient is
// embedding's accumulator + the LM head's, one fp32 add per element (ModelGrads::gradient).
// dweight is optional: without it (a frozen head) the weight-gradient GEMM — as large as the
// forward's — is not run, and dhidden's bits are those of the call with it.
struct LmHeadLogprobBackwardArgs {
  TensorView hidden, weight, targets, loss_mask, lse, dlogp, dentropy, dhidden, dweight, segments;
  int32_t ignore_index = -100;
  bool targets_checked = false;  // as the forward's
  TensorView logits_kept;         // the forward's (see above)
};
void lm_head_logprob_forward(const Context&, const LmHeadLogprobForwardArgs&);
// Whether the backend takes logits_kept for these tensors (the CUDA fused path): callers allocate
// the buffer only where it does.
bool lm_head_keeps_logits(Backend backend, const TensorView& hidden, const TensorView& weight);
// The rows C whose logits a budget of `budget_bytes` keeps (6 bytes a logit): all of hidden's rows
// where they fit, else the first whole segments that fit (segments: int32 [S, 2] {row, len} on the
// host, in row order, the backward's), else 0; 0 where the backend does not take logits_kept.
int64_t lm_head_rows_to_keep(Backend backend, const TensorView& hidden, const TensorView& weight, int64_t budget_bytes,
                             const TensorView& segments);
void lm_head_logprob_backward(const Context&, const LmHeadLogprobBackwardArgs&);

// ---------------------------------------------------------------- sampling
// tokens[r] = the token drawn from logits[r, :] (fp32 [R, V]) under row r's settings, params fp64
// [R, 5] = {temperature (0: greedy), top_k (0: off), top_p ((0, 1]; 1: off), min_p ([0, 1); 0: off),
// u (the row's uniform number in [0, 1))}; tokens int32 [R]; kept (optional) uint8 [R, V]: 1 for the
// candidates left by the cuts (one whose fp32 weight underflowed to 0 is kept but never drawn). A row's result depends only on its logits and params: the
// rule (samebits/sampling.hpp) sums in an order fixed by V, and both backends give the same token.
// A row with a NaN / +Inf logit (or only −Inf) gets token −1; a setting out of range, −2 (the
// values live on the device, so they are reported per row, not thrown).
// weights (optional) fp32 [R, 2]: {the drawn token's weight, the kept candidates' total weight}, the
// two numbers the draw used, so that the token's probability under the sampling distribution is
// their ratio (sampling_rule::sampling_logprob); greedy: {1, 1}; a bad row: {0, 0}.
struct SampleTokensArgs {
  TensorView logits, params, tokens, kept, weights;
};
void sample_tokens(const Context&, const SampleTokensArgs&);

}  // namespace samebits
