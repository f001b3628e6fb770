// samebits/harness.hpp — the ground-truth harness: op cases, sweeps, raw-bit invariance,
// accuracy against the fp64 truth, gradient checks and the status matrix.
//
// An OpCase knows how to make one sequence's per-token inputs (and the upstream gradients of its
// outputs), the parameters shared by a batch, and how to run its op(s) on a laid-out batch. The
// harness owns everything else: it lays sequences out (packed, padded left / right, chunked), runs
// the case on a backend, cuts each sequence's rows back out ("logical unpadding") and compares raw
// bits across batch configurations (sweep transforms T1–T6), or values against the fp64 truth.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "samebits/context.hpp"
#include "samebits/dtype.hpp"
#include "samebits/host_tensor.hpp"
#include "samebits/rng.hpp"
#include "samebits/tensor.hpp"

namespace samebits::harness {

// ---------------------------------------------------------------- data
// HostTensor (samebits/host_tensor.hpp) and Rng (samebits/rng.hpp) are core types; the harness
// names them as it always has.
using samebits::HostTensor;
using samebits::Rng;
using TensorMap = std::map<std::string, HostTensor>;

// One sequence: every tensor in `tokens` has `length` rows (token-major).
struct Sequence {
  int64_t length = 0;
  TensorMap tokens;
};

enum class Layout { packed, padded_right, padded_left };
const char* layout_name(Layout l);

// Rows [row, row + len) of the batch tensors hold tokens [begin, begin + len) of sequence `seq`.
struct Piece {
  int64_t seq = 0, row = 0, begin = 0, len = 0;
};

struct Batch {
  std::vector<const Sequence*> seqs;
  std::vector<Piece> pieces;
  Layout layout = Layout::packed;
  int64_t rows = 0;
  TensorMap tokens;     // each sequence tensor, laid out over `rows` rows; padding rows hold filler
  HostTensor row_mask;  // uint8 [rows]: 1 on real tokens
};

// What a case's run() sees and fills.
class CaseIO {
 public:
  CaseIO(const Batch& batch, const TensorMap& params, TensorMap& param_grads, bool backward,
         bool truth, Backend backend = Backend::cpu)
      : batch(batch), params(params), param_grads(param_grads), backward(backward), truth(truth),
        backend(backend) {}
  ~CaseIO();
  CaseIO(const CaseIO&) = delete;
  CaseIO& operator=(const CaseIO&) = delete;

  const Batch& batch;
  const TensorMap& params;
  TensorMap& param_grads;  // accumulators (fp32, fp64 in truth mode); run() adds into them
  const bool backward;     // run the backward too
  const bool truth;        // fp64 truth mode: every floating tensor is fp64
  const Backend backend;   // where the op runs: views of tensors are mirrored there

  // The dtype a floating output of dtype d takes in this run (fp64 in truth mode).
  DType out_dtype(DType d) const { return truth ? DType::f64 : d; }
  DType acc_dtype() const { return truth ? DType::f64 : DType::f32; }
  // A per-token output of `rows` x row_shape, poisoned (NaN) before the op writes it.
  // Backward outputs are the gradients of inputs; their names are given by grad_pairs().
  HostTensor& output(const std::string& name, DType dtype, std::vector<int64_t> row_shape);
  const HostTensor& in(const std::string& name) const;  // a batch token tensor
  const HostTensor& param(const std::string& name) const;
  // The view an op gets of `t` on the run's backend: the tensor itself on the CPU; on a device, a
  // mirror (guards included) that is copied back after the run when `t` is an output or a
  // gradient accumulator of this CaseIO, so guard checks cover device writes too.
  TensorView view(const HostTensor& t);
  // The accumulator of a trained parameter, as a view on the run's backend (none if absent).
  TensorView grad(const std::string& name);
  // Copies device outputs back and releases the mirrors (the harness calls it after run()).
  void finish_device_run();

  TensorMap outputs;

 private:
  struct Mirror {
    const HostTensor* host;
    void* device;
  };
  std::vector<Mirror> mirrors_;
};

// ---------------------------------------------------------------- cases
class OpCase {
 public:
  virtual ~OpCase() = default;
  virtual std::string op() const = 0;          // status-matrix row, e.g. "linear"
  virtual std::string params_text() const = 0;  // e.g. "bf16 N=96 K=160 bias"
  virtual DType dtype() const = 0;              // the storage dtype under test
  virtual std::string forward_class() const = 0;   // tolerance class of forward outputs
  virtual std::string backward_class() const = 0;  // ... of gradients
  // The dtype column of the contract a tensor is judged by: by default its own storage dtype (the
  // truth sees the same, exactly widened inputs, so only the op's own arithmetic and output rounding
  // count). An op that rounds an intermediate to the storage dtype by definition (the fused residual
  // add + RMSNorm stores the sum) judges what follows that rounding by the storage dtype.
  virtual DType tolerance_dtype(const std::string& tensor, DType stored) const { (void)tensor; return stored; }
  virtual bool chunkable() const { return true; }  // T5: may run as chunks (all per-token ops)
  virtual int64_t min_length() const { return 1; }
  virtual int64_t max_length() const { return 24; }
  virtual TensorMap make_params(Rng&) const { return {}; }
  virtual Sequence make_sequence(Rng&, int64_t length) const = 0;
  // The loss whose gradient backward computes: Σ over pairs {output, upstream token tensor}.
  virtual std::vector<std::pair<std::string, std::string>> loss_terms() const = 0;
  // {differentiable per-token input, its gradient output}.
  virtual std::vector<std::pair<std::string, std::string>> grad_pairs() const = 0;
  // Parameters that get gradients (param_grads uses the same names).
  virtual std::vector<std::string> trained_params() const { return {}; }
  virtual void run(const Context& ctx, CaseIO& io) const = 0;

  std::string name() const { return op() + " " + params_text(); }
};

using CaseList = std::vector<std::shared_ptr<const OpCase>>;
CaseList builtin_cases();  // every op of the chain, several shapes and dtypes each

// ---------------------------------------------------------------- contract
struct Tolerance {
  double atol = 0, rtol = 0;
};
class Contract {
 public:
  static Contract builtin();                   // docs/contract.json, compiled in
  static Contract from_json(const std::string& text);
  Tolerance tolerance(const std::string& cls, DType dtype) const;  // throws for unknown
  // Chain bounds: "max_abs_dlogp" and "grad_rel_l2" per model dtype; "approx_kl", "clip_fraction"
  // (dtype ignored), and "clip_low" / "clip_high".
  double chain_bound(const std::string& metric, DType dtype) const;
  const std::string& json() const { return json_; }

 private:
  std::string json_;
  std::map<std::string, std::map<std::string, Tolerance>> classes_;
  std::map<std::string, std::map<std::string, double>> chain_;  // metric -> dtype (or "*") -> bound
};

// ---------------------------------------------------------------- results
// One comparison that failed (or, for accuracy, the worst element of one tensor).
struct Drift {
  std::string op;       // the op (the first failing op, in a chain)
  std::string check;    // e.g. "T1 batch=8 at 3", "accuracy", "guard"
  std::string tensor;   // e.g. "y", "dweight"
  int64_t count = 0;    // elements that differ / exceed the tolerance
  int64_t first_index = -1;
  std::string first_index_text;  // multi-dimensional, e.g. "[3, 17]" (row within the sequence)
  double first_a = 0, first_b = 0;
  double max_abs = 0, max_rel = 0;
  int64_t max_ulp = 0;
  double worst_ratio = 0;  // accuracy: max over elements of |a − t| / (atol + rtol|t|)
  std::string message() const;
};

enum class Status { pass, fail, not_applicable, not_built, error };
const char* status_name(Status s);

struct CellResult {
  Status status = Status::not_applicable;
  std::vector<Drift> drifts;  // failures (or worst-element accuracy summaries)
  int64_t comparisons = 0;
  double worst_ratio = 0;     // accuracy cells
  std::string note;           // error text for Status::error / not_built
};

struct CaseResult {
  std::string op, case_name;
  CellResult fwd_invariance, fwd_accuracy, bwd_invariance, bwd_accuracy;
};

struct SweepOptions {
  uint64_t seed = 1234;
  Backend backend = Backend::cpu;
  int batch_max = 8;
  std::vector<int64_t> chunk_sizes = {1, 7, 64, 100};
  std::function<void(const std::string&)> progress;  // called before each case
};

// Forward + backward raw-bit invariance of one case across T1–T6, micro-batching and repeats.
void check_invariance(const OpCase& c, const SweepOptions& opt, CaseResult& out);
// Accuracy of the backend against the fp64 truth, with the contract's tolerances.
void check_accuracy(const OpCase& c, const Contract& contract, const SweepOptions& opt,
                    CaseResult& out);
CaseResult run_case(const OpCase& c, const Contract& contract, const SweepOptions& opt);

// Gradient check of the truth-mode backward against central finite differences of the
// truth-mode forward (CPU). Returns the failures (empty: pass).
struct FdOptions {
  uint64_t seed = 7;
  int samples_per_tensor = 6;
  double step = 1e-6, atol = 1e-7, rtol = 1e-5;
};
std::vector<Drift> check_gradients_fd(const OpCase& c, const FdOptions& opt);

// ---------------------------------------------------------------- status matrix
struct Matrix {
  std::string backend;
  uint64_t seed = 0;
  std::vector<CaseResult> cases;
  bool all_pass() const;
  std::string markdown() const;
  std::string json() const;  // machine-readable, with every drift report
  std::string text() const;  // what `samebits verify` prints
};

}  // namespace samebits::harness
