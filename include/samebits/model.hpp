// samebits/model.hpp — Qwen3 / Llama-3 dense models: config, weights (Hugging Face safetensors,
// memory-mapped), the built-in seeded model, and export back to the Hugging Face format.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "samebits/ops.hpp"
#include "samebits/tensor.hpp"

namespace samebits {

struct ModelConfig {
  std::string architecture = "qwen3";  // "qwen3" (QK-norm) or "llama"
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_layers = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;                      // theta, max_position, Llama-3 scaling
  bool tie_word_embeddings = false;
  bool qk_norm = true;                  // Qwen3
  DType dtype = DType::bf16;            // torch_dtype of the weights

  // Parses a Hugging Face config.json; every value is checked (throws samebits::Error).
  static ModelConfig from_json(const std::string& text);
  std::string to_json() const;
  void validate() const;
  // The tensor names and shapes this config expects, in a fixed order.
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected_tensors() const;
};

// One tensor of a safetensors file: where its bytes are and what they hold.
struct SafetensorsEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // offsets into the data section
};

// Parses and bounds-checks a safetensors header: `file` holds the whole file (or at least the
// header, with `file_size` the real size). Throws samebits::Error naming `where` and the problem:
// truncation, bad JSON, unknown dtype, offsets out of range, overlapping or size-mismatched data.
std::vector<SafetensorsEntry> parse_safetensors_header(const uint8_t* file, uint64_t file_size,
                                                       const std::string& where, uint64_t* data_start);

class Model {
 public:
  // Loads config.json + model.safetensors, or model-*.safetensors with model.safetensors.index.json.
  // Weights are memory-mapped, not copied (unless a tensor is misaligned in its file).
  static Model load(const std::string& dir);
  // The built-in Qwen3-shaped model (2 layers, GQA, QK-norm), weights drawn from `seed`.
  static Model builtin(bool tied, uint64_t seed = 1234);
  // A model with the given config and seeded random weights.
  static Model random(const ModelConfig& config, uint64_t seed);
  // A model over weights that live elsewhere (e.g. a PyTorch model's parameters): `config_json` is a
  // Hugging Face config.json text, `weights` contiguous views named as in a checkpoint, checked
  // against the config (names, shapes, the config's torch_dtype); not copied. `owner` is kept alive
  // with the model. The views may all be in GPU memory: a cuda chain then reads them in place (it
  // sees the framework's in-place updates; nothing is uploaded), and only such a chain takes them.
  static Model from_views(const std::string& config_json, const std::map<std::string, TensorView>& weights,
                          std::shared_ptr<void> owner = {});
  // Writes config.json and model.safetensors in the Hugging Face format.
  void save(const std::string& dir) const;

  const ModelConfig& config() const { return config_; }
  const TensorView& weight(const std::string& name) const;  // throws for an unknown name
  bool has(const std::string& name) const { return weights_.count(name) > 0; }
  const std::map<std::string, TensorView>& weights() const { return weights_; }
  // The weights converted to another dtype (RNE when narrowing); config().dtype follows.
  Model converted(DType dtype) const;
  // The weights converted to fp64 (exactly): the model the truth-mode chain runs.
  Model widened() const { return converted(DType::f64); }
  const std::string& source() const { return source_; }
  // Where the weights are: cpu, or cuda for a from_views model over GPU tensors.
  Device device() const;

 private:
  ModelConfig config_;
  std::map<std::string, TensorView> weights_;
  std::vector<std::shared_ptr<void>> storage_;  // mappings and owned buffers behind the views
  std::string source_;
  void require_host(const char* what) const;  // throws for GPU-resident weights
};

}  // namespace samebits
