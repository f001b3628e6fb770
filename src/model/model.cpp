// Model weights: loading from Hugging Face directories (memory-mapped), the built-in seeded model,
// random models of any config, export, and the fp64-widened copy the truth chain runs.
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/json_text.hpp"
#include "core/output_file.hpp"
#include "model/safetensors.hpp"
#include "samebits/error.hpp"
#include "samebits/rng.hpp"
#include "samebits/model.hpp"

namespace fs = std::filesystem;

namespace samebits {

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  if (!in) throw Error("Model::load", p.string(), "cannot be read (missing?)");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Tensors some checkpoints carry that the model does not use.
bool ignorable(const std::string& name, const ModelConfig& c) {
  return name.find("rotary_emb.inv_freq") != std::string::npos ||
         (c.tie_word_embeddings && name == "lm_head.weight");
}

// A checkpoint's tensor against the config: a name it expects (`want`: name → shape), its shape,
// its torch_dtype. `where` says where the tensor came from, for the error.
void check_tensor(const ModelConfig& c, const std::map<std::string, std::vector<int64_t>>& want, const char* who,
                  const std::string& name, const std::vector<int64_t>& shape, DType dtype, const std::string& where) {
  auto w = want.find(name);
  if (w == want.end()) throw Error(who, name, "unexpected tensor" + where + " for this config");
  if (shape != w->second)
    throw Error(who, name,
                fmt::format("shape [{}] does not match the config's [{}]", fmt::join(shape, ", "), fmt::join(w->second, ", ")));
  if (dtype != c.dtype)
    throw Error(who, name,
                fmt::format("dtype {} does not match the config's torch_dtype {}", dtype_name(dtype), dtype_name(c.dtype)));
}

void check_complete(const ModelConfig& c, const std::map<std::string, TensorView>& weights, const char* who) {
  for (auto& [name, shape] : c.expected_tensors())
    if (!weights.count(name)) throw Error(who, name, "missing tensor (expected by the config)");
}

}  // namespace

const TensorView& Model::weight(const std::string& name) const {
  auto it = weights_.find(name);
  if (it == weights_.end()) throw Error("Model::weight", name, "no such tensor in the model");
  return it->second;
}

Model Model::load(const std::string& dir) {
  Model m;
  m.source_ = dir;
  m.config_ = ModelConfig::from_json(read_text(fs::path(dir) / "config.json"));
  std::vector<std::string> files;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    const nlohmann::json j = parse_json(read_text(index), "Model::load", index.string());
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw Error("Model::load", index.string(), "has no weight_map object");
    std::set<std::string> unique;
    for (auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) throw Error("Model::load", index.string(), "weight_map value for '" + name + "' is not a file name");
      const std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f.find("..") != std::string::npos)
        throw Error("Model::load", index.string(), "weight_map names a file outside the directory: " + f);
      unique.insert(f);
    }
    files.assign(unique.begin(), unique.end());
  } else {
    files.push_back("model.safetensors");
  }
  const auto expected = m.config_.expected_tensors();
  std::map<std::string, std::vector<int64_t>> want(expected.begin(), expected.end());
  for (auto& f : files) {
    const std::string path = (fs::path(dir) / f).string();
    if (!fs::exists(path)) throw Error("Model::load", path, "is missing");
    auto mapped = std::make_shared<MappedFile>(path);
    m.storage_.push_back(mapped);
    uint64_t data_start = 0;
    for (auto& e : parse_safetensors_header(mapped->data(), mapped->size(), path, &data_start)) {
      if (ignorable(e.name, m.config_)) continue;
      check_tensor(m.config_, want, "Model::load", e.name, e.shape, e.dtype, " in " + path);
      if (m.weights_.count(e.name)) throw Error("Model::load", e.name, "appears twice");
      const uint8_t* p = mapped->data() + data_start + e.begin;
      void* data = const_cast<uint8_t*>(p);
      if (reinterpret_cast<uintptr_t>(p) % uintptr_t(dtype_size(e.dtype)) != 0) {  // misaligned: copy
        auto copy = std::shared_ptr<uint8_t[]>(new uint8_t[e.end - e.begin]);
        std::memcpy(copy.get(), p, e.end - e.begin);
        data = copy.get();
        m.storage_.push_back(std::shared_ptr<void>(copy, copy.get()));
      }
      m.weights_[e.name] = TensorView::of(data, e.dtype, e.shape.data(), int(e.shape.size()));
    }
  }
  check_complete(m.config_, m.weights_, "Model::load");
  return m;
}

Model Model::from_views(const std::string& config_json, const std::map<std::string, TensorView>& weights,
                        std::shared_ptr<void> owner) {
  Model m;
  m.source_ = "(weights in memory)";
  m.config_ = ModelConfig::from_json(config_json);
  if (owner) m.storage_.push_back(std::move(owner));
  const auto expected = m.config_.expected_tensors();
  std::map<std::string, std::vector<int64_t>> want(expected.begin(), expected.end());
  for (const auto& [name, v] : weights) {
    if (ignorable(name, m.config_)) continue;
    check_tensor(m.config_, want, "Model::from_views", name,
                 std::vector<int64_t>(v.shape.begin(), v.shape.begin() + std::max(v.ndim, 0)), v.dtype, "");
    if (!v.is_contiguous()) throw Error("Model::from_views", name, "must be a contiguous tensor");
    if (!m.weights_.empty() && v.device != m.weights_.begin()->second.device)
      throw Error("Model::from_views", name,
                  std::string("is in ") + device_name(v.device) + " memory but the other weights are in " +
                      device_name(m.weights_.begin()->second.device) + " memory: keep a model on one device");
    m.weights_[name] = v;
  }
  check_complete(m.config_, m.weights_, "Model::from_views");
  return m;
}

Model Model::random(const ModelConfig& config, uint64_t seed) {
  config.validate();
  Model m;
  m.config_ = config;
  m.source_ = fmt::format("random(seed={})", seed);
  Rng rng(seed);
  for (auto& [name, shape] : config.expected_tensors()) {
    const bool norm = name.find("norm") != std::string::npos;
    const double bound = norm ? 0.0 : name.find("embed") != std::string::npos ? 1.0
                                                                            : std::sqrt(3.0 / double(shape.back()));
    auto t = std::make_shared<HostTensor>(config.dtype, shape);
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, norm ? rng.uniform(0.8, 1.2) : rng.uniform(-bound, bound));
    m.weights_[name] = t->view();
    m.storage_.push_back(t);
  }
  return m;
}

Model Model::builtin(bool tied, uint64_t seed) {
  ModelConfig c;
  c.architecture = "qwen3";
  c.qk_norm = true;
  c.vocab_size = 2560;  // two logprob vocab blocks, the second partial
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;  // a head_dim the CUDA attention kernels take (64, 128)
  c.rms_norm_eps = 1e-6;
  c.rope.theta = 1000000.0;
  c.rope.max_position = 40960;
  c.tie_word_embeddings = tied;
  c.dtype = DType::bf16;
  Model m = random(c, seed);
  m.source_ = fmt::format("builtin-{}(seed={})", tied ? "tied" : "untied", seed);
  return m;
}

void Model::require_host(const char* what) const {
  if (device() != Device::cpu)
    throw Error(what, "model", "its weights are in GPU memory (a model over a GPU framework's tensors): only a "
                               "chain on the cuda backend reads them");
}

Device Model::device() const { return weights_.empty() ? Device::cpu : weights_.begin()->second.device; }

void Model::save(const std::string& dir) const {
  require_host("Model::save");
  create_output_directory(dir, "Model::save");
  OutputFile config((fs::path(dir) / "config.json").string(), "Model::save");
  config.stream() << config_.to_json();
  config.commit();
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (auto& [name, shape] : config_.expected_tensors()) tensors.push_back({name, weight(name)});
  write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors);
}

Model Model::converted(DType dtype) const {
  require_host("Model::converted");
  Model m;
  m.config_ = config_;
  if (dtype != DType::f64) m.config_.dtype = dtype;  // fp64 is the truth mode's, not a model dtype
  m.source_ = fmt::format("{} ({})", source_, dtype_name(dtype));
  for (auto& [name, v] : weights_) {
    auto t = std::make_shared<HostTensor>(dtype, std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.ndim));
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, load_as_double(v.data, v.dtype, i));
    m.weights_[name] = t->view();
    m.storage_.push_back(t);
  }
  return m;
}

}  // namespace samebits
