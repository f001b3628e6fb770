// samebits/chain.hpp — the Qwen3 / Llama-3 chain built from samebits ops, forward and backward,
// over packed or padded batches, with a KV cache for prefill, chunked prefill and decode.
//
//   embedding → L × [RMSNorm → Q/K/V → (QK-norm) → RoPE → attention (GQA) → O → residual
//   (+ fused RMSNorm) → gate/up → SiLU·mul → down → residual] → final RMSNorm → LM head → logprob
//
// Residual adds are fused with the RMSNorm that follows them (the sum is stored in the model dtype,
// as an unfused bf16 model stores it). Activations are in the model dtype (fp64 in truth mode);
// weight gradients go to fp32 accumulators that micro-batches add into, in token order. On the CUDA
// backend every activation, the KV cache, the accumulators and a copy of the weights live in device
// memory; only the sequence tables and the per-row logprobs cross to the host. Its device work is
// ordered on Context::stream (null: the legacy default stream). A stream of the caller's must be
// a blocking one (ordered with the legacy default stream, where KvCache, ModelGrads and the
// caller's own tensors are made and freed), or the caller orders those tensors with it.
#pragma once
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "samebits/device_tensor.hpp"
#include "samebits/host_tensor.hpp"
#include "samebits/model.hpp"

namespace samebits {

// One sequence of a batch: rows [row, row + len) of the batch hold its tokens. With a KV cache,
// `slot` names its cache slot and `cached` how many of its earlier tokens the cache already holds.
struct ChainSequence {
  int64_t row = 0, len = 0;
  int64_t slot = -1, cached = 0;
};

// Token rows. Rows covered by no sequence are padding: they hold any valid token and are masked
// out of the loss and out of every weight gradient.
struct ChainBatch {
  std::vector<int32_t> tokens;     // [rows]
  std::vector<int32_t> positions;  // [rows]
  std::vector<int32_t> targets;    // [rows]: the token whose logprob the row scores; -100 = none
  std::vector<uint8_t> loss_mask;  // [rows]: 0 = not scored (padding rows are always 0)
  std::vector<ChainSequence> seqs;
  int64_t rows() const { return int64_t(tokens.size()); }

  // Sequences packed back to back; targets are the next tokens (the last token scores nothing).
  static ChainBatch packed(const std::vector<std::vector<int32_t>>& sequences);
  // Padded dense: every sequence in a slot of `slot_len` rows (>= its length), padding on the
  // right or the left; `empty_slots` adds all-padding slots (fully masked rows) after slot 0.
  static ChainBatch padded(const std::vector<std::vector<int32_t>>& sequences, int64_t slot_len, bool left,
                           int empty_slots = 0, int32_t pad_token = 0);
};

// Per-layer KV cache for a fixed number of sequence slots of up to `capacity` tokens each, in the
// memory of the chain's backend. Contiguous (slot s owns rows [s·capacity, (s + 1)·capacity)) or
// paged (a pool of pages of `page_size` token rows; a slot takes pages as it grows and gives them
// back when reset; the attention reads keys through the slot's block table). Either holds the same
// bits for the same tokens: where a key lives never changes a reduction.
class DecodeGraphs;

class KvCache {
 public:
  KvCache(const ModelConfig& config, int64_t slots, int64_t capacity, DType dtype, Backend backend = Backend::cpu);
  static KvCache paged(const ModelConfig& config, int64_t slots, int64_t capacity, int64_t pages, int64_t page_size,
                       DType dtype, Backend backend = Backend::cpu);
  int64_t capacity() const { return capacity_; }
  int64_t slots() const { return int64_t(lengths_.size()); }
  int64_t length(int64_t slot) const { return lengths_.at(size_t(slot)); }
  bool is_paged() const { return page_size_ > 0; }
  int64_t page_size() const { return page_size_; }
  int64_t pages() const { return int64_t(users_.size()); }
  int64_t free_pages() const { return int64_t(free_.size()); }
  int64_t pages_for(int64_t tokens) const { return is_paged() ? (tokens + page_size_ - 1) / page_size_ : 0; }
  // Room for `tokens` tokens in `slot`: paged, the pages it lacks come from the pool, and false (taking
  // nothing) when the pool is short; contiguous, whether they fit its capacity.
  bool reserve(int64_t slot, int64_t tokens);
  // Empties the slot; paged, its pages go back to the pool (a shared page when its last user lets go).
  void reset(int64_t slot);
  // Slot `to` (empty) holds the first `len` cached tokens of slot `from` (a prompt's keys and values,
  // shared by its samples): the same bits the slot would hold had it run those tokens itself. Paged,
  // the full pages are shared and the last partial page is copied into a page of its own (each slot
  // writes only past its length, into pages it alone holds): false, changing nothing, when the pool
  // has no page for that copy.
  bool copy_prefix(int64_t from, int64_t to, int64_t len);
  // Paged: the slot's pages, in token order.
  const std::vector<int32_t>& block_table(int64_t slot) const { return tables_.at(size_t(slot)); }

 private:
  friend class Chain;
  friend class DecodeGraphs;
  KvCache(const ModelConfig& config, int64_t slots, int64_t capacity, int64_t rows, DType dtype, Backend backend);
  int64_t capacity_, page_size_ = 0;
  std::vector<int64_t> lengths_;
  std::vector<DeviceTensor> k_, v_;          // per layer: [rows, kv_heads, head_dim]
  std::vector<std::vector<int32_t>> tables_; // paged: each slot's pages, in token order
  std::vector<int32_t> users_;               // paged: slots holding each page
  std::vector<int32_t> free_;                // paged: free pages, the lowest at the back
  // The cache row of token `pos` of `slot`.
  int64_t row_of(int64_t slot, int64_t pos) const;
  // A step's paged tables (the same for every layer): each sequence's pages, int32 [S, cols ≥
  // min_cols] (unused columns repeat page 0); and where the step's rows go, int32 [2, rows]: the
  // cache row of each row (sequence by sequence), then its batch row.
  HostTensor block_table_of(const std::vector<ChainSequence>& seqs, int64_t min_cols) const;
  HostTensor write_rows_of(const std::vector<ChainSequence>& seqs) const;
  // The same rows by batch row: int32 [rows], each batch row's cache row, -1 for a row of no
  // sequence (padding). The QK-norm pair's cache write takes this form.
  HostTensor cache_rows_of(const std::vector<ChainSequence>& seqs, int64_t rows) const;
};

// Gradient accumulators, one fp32 (fp64 in truth mode) buffer per weight. A tied embedding has two
// accumulators (the LM head's and the embedding's) summed once, in that order, by gradient().
class ModelGrads {
 public:
  ModelGrads(const Model& model, DType acc, Backend backend = Backend::cpu);
  HostTensor gradient(const std::string& weight) const;  // on the host
  std::vector<std::string> names() const;
  DeviceTensor& accumulator(const std::string& name) { return acc_.at(name); }
  const std::map<std::string, DeviceTensor>& accumulators() const { return acc_; }

 private:
  bool tied_;
  std::map<std::string, DeviceTensor> acc_;
};

// Named activations in the order the forward made them.
using ActivationTrace = std::deque<std::pair<std::string, DeviceTensor>>;

// What a forward keeps for the backward.
//   all           every activation (the fastest backward; memory grows with layers × rows).
//   layer_inputs  per layer only what rerunning it needs (its input residual stream `embed` /
//                 `layerN.x_in`, its normed input `layerN.n1` and `layerN.rstd1`) plus the final
//                 norm's and the LM head's. The backward reruns each layer's forward (the same code,
//                 so the same bits) just before that layer's backward and frees it after: about one
//                 layer's activations at a time for one more forward of the layers' time. The
//                 gradients are those of `all`, bit for bit.
//   none          logprobs and entropies only (Chain::score); no backward takes it.
enum class ForwardKeep { all, layer_inputs, none };

struct ChainForward {
  std::vector<double> logp, entropy;  // [rows]; 0 where not scored
  // The chain that made it: a backward refuses a forward of another model or backend.
  const Model* model = nullptr;
  Backend backend = Backend::cpu;
  // The activations kept (every one unless `keep` says otherwise), in forward order, for the
  // backward and for drift reports.
  ActivationTrace trace;
  ForwardKeep keep = ForwardKeep::all;
  // false: made by Chain::score (or a cached step); no backward takes it.
  bool activations_kept() const { return keep != ForwardKeep::none; }
  const DeviceTensor& at(const std::string& name) const;
};

class Chain {
 public:
  // ctx.precision == truth_fp64 requires a widened (fp64) model.
  Chain(const Model& model, Context ctx);
  // Scores a batch in one call; keys are the batch's own rows (training / rescoring). `keep` says
  // which activations stay for backward() (ForwardKeep above); every choice gives the same logprob,
  // entropy and, where a backward takes it, gradient bits.
  ChainForward forward(const ChainBatch& batch, ForwardKeep keep = ForwardKeep::all) const;
  // forward(batch, ForwardKeep::none): forward()'s logprobs and entropies, bit for bit, without the
  // activations a backward needs: each layer's are freed as the next one begins, so scoring holds
  // about two layers' activations, not all of them (the result's trace holds the final norm's rows
  // only; no backward can take it).
  ChainForward score(const ChainBatch& batch) const;
  // Runs a step against the cache: each sequence's rows are appended to its slot (after `cached`
  // tokens, which must equal the slot's length) and attend to everything cached before them. A step
  // keeps no activations for a backward: a layer's are freed as the next begins, and the result's
  // trace holds only the final norm's (final.x_in, final.n1, final.rstd1) and the LM head's.
  // `last_logits` (optional) receives each sequence's last-row logits (fp32 / fp64), for sampling.
  // score_rows = false skips the LM head over the batch's rows (logp / entropy stay 0): a generation
  // step that needs only some rows' logits and logprobs (row_logits, row_logprobs) saves a rows ×
  // vocab GEMM; no other bit changes.
  ChainForward forward_cached(const ChainBatch& batch, KvCache& cache,
                              std::vector<std::vector<double>>* last_logits = nullptr, bool score_rows = true) const;
  // The logprob of `tokens[i]` (one per sequence, e.g. just sampled from `last_logits`) at the last
  // row of sequence i of a forward: the fused LM-head logprob a trainer's rescoring computes, so a
  // rollout's reported logprobs equal the trainer's bit for bit.
  std::vector<double> last_logprobs(const ChainBatch& batch, const ChainForward& f, const std::vector<int32_t>& tokens) const;
  // The same for any rows of a forward: the fused LM-head logprob of tokens[i] at row rows[i] (a row
  // may repeat: the samples of one prompt drawn from its last row).
  std::vector<double> row_logprobs(const ChainForward& f, const std::vector<int64_t>& rows,
                                   const std::vector<int32_t>& tokens) const;
  // The fp32 (fp64 in truth mode) logits of rows of a forward, one LM-head GEMM for all of them (its
  // bits do not depend on how many rows it takes), copied to the host: what sampling reads.
  std::vector<std::vector<double>> row_logits(const ChainForward& f, const std::vector<int64_t>& rows) const;
  // Sampling on the chain's backend (no logits leave the device): for each i, the token drawn at row
  // rows[i] (a row may repeat) under params[5·i … 5·i + 4] = {temperature, top_k, top_p, min_p, u}
  // (the op sample_tokens), and its fused LM-head logprob, from one LM-head GEMM over the rows (the
  // logprob is logprob_forward of those fp32 logits: the trainer's bits), and its logprob under the
  // sampling distribution (temperature and cuts applied: sampling_rule::sampling_logprob of the
  // draw's own weights; 0 for greedy). A row whose logits hold NaN / Inf gets token −1 and NaNs.
  struct RowDraws {
    std::vector<int32_t> tokens;
    std::vector<double> logprobs;
    std::vector<double> sampling_logprobs;
  };
  RowDraws sample_rows(const ChainForward& f, const std::vector<int64_t>& rows, const std::vector<double>& params) const;
  // Backward of L = Σ dlogp[row]·logp[row] (`fwd` from this chain's forward() of `batch`): adds every weight's gradient into `grads` (on the
  // chain's backend; a forward that kept layer inputs alone has each layer rerun first) and returns the gradient of the input embeddings [rows, hidden] (in the
  // activation dtype, on the chain's backend: to_host() it when wanted, a trainer seldom does).
  DeviceTensor backward(const ChainBatch& batch, const ChainForward& fwd, const std::vector<double>& dlogp,
                        ModelGrads& grads) const;

  // Memory a forward that keeps activations may spend keeping the LM head's fp32 logits for the
  // backward (LmHeadLogprobForwardArgs::logits_kept: three vocab GEMMs instead of four for those
  // rows), 6 bytes a logit, on the first whole sequences that fit (by row); the same bits whatever
  // the budget. 0 (the default): none. Taken on the CUDA backend.
  void set_lm_head_keep_bytes(int64_t bytes) { lm_head_keep_bytes_ = bytes; }

  const Model& model() const { return model_; }
  DType act_dtype() const { return act_; }
  Backend backend() const { return ctx_.backend; }

 private:
  friend class DecodeGraphs;
  // A step's tables already in device memory (a captured graph's inputs): run() uploads none of
  // them and leaves the cache's lengths to the caller.
  struct StepTables {
    void* rows = nullptr;    // the row tables (chain_tables::rows_in's layout) for the batch's rows
    TensorView kv_map;       // int32 [2, rows]: each row's cache row, then its batch row
    TensorView cache_rows;   // int32 [rows]: each batch row's cache row (-1: none), for the QK-norm pair
    TensorView block_table;  // int32 [seqs, cols]: a copy of the block table run() builds (cols wide)
  };
  // keep: what stays in the result's trace (a cached step keeps what ForwardKeep::none does).
  ChainForward run(const ChainBatch& batch, KvCache* cache, std::vector<std::vector<double>>* last_logits,
                   bool score_rows = true, const StepTables* given = nullptr,
                   ForwardKeep keep = ForwardKeep::all) const;
  // One layer's forward, from its input (x_in, and n1 = its input norm) to its SwiGLU output: the
  // forward and the backward's recomputation both run it, so a rerun layer has the forward's bits.
  // Every activation it makes is appended to `out`; `mlp_parts` false (no backward reads the layer):
  // gate and up are not made, only their SwiGLU (one launch where the backend fuses them).
  struct LayerStep;
  struct LayerOut {
    const DeviceTensor *x_mid, *swiglu;
  };
  LayerOut layer_forward(int64_t l, const DeviceTensor& x_in, const DeviceTensor& n1, const LayerStep& step,
                         ActivationTrace& out, bool mlp_parts = true) const;
  // RMSNorm of x (+ residual: the fused residual add, whose sum lands in residual_out).
  void norm(const DeviceTensor& x, const DeviceTensor* residual, const std::string& weight, DeviceTensor& y,
            DeviceTensor* residual_out, DeviceTensor& rstd) const;
  // A new activation named `name`, appended to `trace`.
  DeviceTensor& record(ActivationTrace& trace, std::string name, DType dtype, std::vector<int64_t> shape) const;
  // Sampling on the device: for every row of `hidden` [S, hidden] (final-norm rows), the token drawn
  // under params [S, 5] (f64) into tokens [S] (i32), its fused LM-head logprob into logp [S] (f32)
  // and the draw's {token weight, kept total} into weights [S, 2] (f32).
  void draw(const TensorView& hidden, const TensorView& params, const TensorView& tokens, const TensorView& logp,
            const TensorView& weights) const;
  // The draws' host side, shared by the eager step and a graph replay: the settings checked (five a
  // row, in range) before anything runs, and RowDraws from the copied-back tokens, logprobs and weights.
  static void check_draw_params(const char* op, const std::vector<double>& params, int64_t rows);
  static RowDraws draws_of(int64_t rows, const int32_t* tokens, const float* logp, const float* weights);
  TensorView weight(const std::string& name) const;
  TensorView head_weight() const;  // lm_head.weight, or the embedding when tied
  // The LM head's logits [rows, vocab] (in `dtype`) of final-norm rows: one GEMM.
  DeviceTensor logits_of(const TensorView& hidden, DType dtype) const;
  DeviceTensor activation(DType dtype, std::vector<int64_t> shape) const;  // poisoned if ctx asks
  const Model& model_;
  Context ctx_;
  DType act_, acc_;
  std::map<std::string, DeviceTensor> device_weights_;  // a copy of the weights off the CPU backend
  int64_t lm_head_keep_bytes_ = 0;
};

}  // namespace samebits
