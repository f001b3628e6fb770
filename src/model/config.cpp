// Hugging Face config.json for Qwen3 / Llama-3 dense models: parsing, validation, writing.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/json_text.hpp"
#include "samebits/error.hpp"
#include "samebits/model.hpp"

namespace samebits {

namespace {

[[noreturn]] void bad(const std::string& key, const std::string& problem) {
  throw Error("model config", key, problem);
}

template <class T>
T get(const nlohmann::json& j, const char* key) {
  if (!j.contains(key)) bad(key, "is missing");
  const nlohmann::json& v = j.at(key);
  // A size must be an integer in the file: nlohmann would truncate 64.9 to 64 without a word.
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    if (!v.is_number_integer()) bad(key, "must be an integer, got " + quote_json(v));
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) bad(key, "must be true or false, got " + quote_json(v));
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) bad(key, "must be a number, got " + quote_json(v));
  } else {
    if (!v.is_string()) bad(key, "must be a string, got " + quote_json(v));
  }
  return v.get<T>();
}

// The architecture a model_type or an architectures entry names ("" when it names none we know).
std::string architecture_of(const std::string& name) {
  if (name == "qwen3" || name == "Qwen3ForCausalLM") return "qwen3";
  if (name == "llama" || name == "LlamaForCausalLM") return "llama";
  return "";
}

template <class T>
T get_or(const nlohmann::json& j, const char* key, T fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  return get<T>(j, key);
}

}  // namespace

ModelConfig ModelConfig::from_json(const std::string& text) {
  const nlohmann::json j = parse_json(text, "model config", "config.json");
  if (!j.is_object()) bad("config.json", "is not a JSON object");
  ModelConfig c;
  const std::string type = get_or<std::string>(j, "model_type", "");
  std::string arch;
  if (j.contains("architectures") && !j["architectures"].is_null()) {
    const nlohmann::json& a = j["architectures"];
    if (!a.is_array() || a.size() > 1 || (a.size() == 1 && !a[0].is_string()))
      bad("architectures", "must be a list of one class name, got " + quote_json(a));
    if (a.size() == 1) arch = a[0].get<std::string>();
  }
  // model_type and architectures, when both are given, must name the same model.
  const std::string from_type = architecture_of(type), from_arch = architecture_of(arch);
  if (type.empty() && arch.empty()) bad("model_type", "is missing (and no architectures entry names the model)");
  if (!type.empty() && !arch.empty() && from_type != from_arch)
    bad("model_type", "'" + type + "' disagrees with architectures ['" + arch + "']" +
                          (from_type.empty() || from_arch.empty() ? " (supported: qwen3, llama; dense only)" : ""));
  c.architecture = !from_type.empty() ? from_type : from_arch;
  if (c.architecture.empty())
    bad("model_type", "unsupported architecture '" + (type.empty() ? arch : type) +
                          "' (supported: qwen3, llama; dense only)");
  c.qk_norm = c.architecture == "qwen3";
  c.vocab_size = get<int64_t>(j, "vocab_size");
  c.hidden_size = get<int64_t>(j, "hidden_size");
  c.intermediate_size = get<int64_t>(j, "intermediate_size");
  c.num_layers = get<int64_t>(j, "num_hidden_layers");
  c.num_heads = get<int64_t>(j, "num_attention_heads");
  c.num_kv_heads = get_or<int64_t>(j, "num_key_value_heads", c.num_heads);
  c.head_dim = get_or<int64_t>(j, "head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  c.rms_norm_eps = get_or<double>(j, "rms_norm_eps", 1e-6);
  // RoPE: transformers 4 writes rope_theta and rope_scaling; transformers 5 one rope_parameters
  // object holding rope_theta and rope_type ("default" = no scaling).
  const nlohmann::json* rope_params = nullptr;
  for (const char* key : {"rope_parameters", "rope_scaling"})
    if (!rope_params && j.contains(key) && j[key].is_object()) rope_params = &j[key];
  c.rope.theta = get_or<double>(j, "rope_theta", rope_params ? get_or<double>(*rope_params, "rope_theta", 10000.0) : 10000.0);
  c.rope.max_position = get_or<int64_t>(j, "max_position_embeddings", 1 << 20);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false);
  const std::string act = get_or<std::string>(j, "hidden_act", "silu");
  if (act != "silu") bad("hidden_act", "'" + act + "' is not supported (silu only)");
  if (get_or<bool>(j, "attention_bias", false)) bad("attention_bias", "true is not supported");
  if (get_or<bool>(j, "mlp_bias", false)) bad("mlp_bias", "true is not supported");
  const std::string dt = get_or<std::string>(j, "torch_dtype", get_or<std::string>(j, "dtype", "bfloat16"));
  if (dt == "bfloat16") c.dtype = DType::bf16;
  else if (dt == "float16") c.dtype = DType::f16;
  else if (dt == "float32") c.dtype = DType::f32;
  else bad("torch_dtype", "'" + dt + "' is not supported (bfloat16, float16, float32)");
  if (rope_params && get_or<std::string>(*rope_params, "rope_type", get_or<std::string>(*rope_params, "type", "")) != "default") {
    const auto& rs = *rope_params;
    const std::string kind = get_or<std::string>(rs, "rope_type", get_or<std::string>(rs, "type", ""));
    if (kind != "llama3") bad("rope_scaling", "rope_type '" + kind + "' is not supported (default, llama3)");
    c.rope.llama3_scaling = true;
    c.rope.factor = get<double>(rs, "factor");
    c.rope.low_freq_factor = get<double>(rs, "low_freq_factor");
    c.rope.high_freq_factor = get<double>(rs, "high_freq_factor");
    c.rope.original_max_position = get<int64_t>(rs, "original_max_position_embeddings");
  }
  c.validate();
  return c;
}

void ModelConfig::validate() const {
  auto positive = [](const char* key, int64_t v, int64_t limit) {
    if (v <= 0 || v > limit) bad(key, fmt::format("{} is outside [1, {}]", v, limit));
  };
  positive("vocab_size", vocab_size, int64_t(1) << 31);
  positive("hidden_size", hidden_size, 1 << 20);
  positive("intermediate_size", intermediate_size, 1 << 22);
  positive("num_hidden_layers", num_layers, 4096);
  positive("num_attention_heads", num_heads, 4096);
  positive("num_key_value_heads", num_kv_heads, 4096);
  positive("head_dim", head_dim, 4096);
  if (num_heads % num_kv_heads != 0)
    bad("num_key_value_heads", fmt::format("{} does not divide num_attention_heads {}", num_kv_heads, num_heads));
  if (head_dim % 2 != 0) bad("head_dim", "must be even for RoPE");
  if (!(rms_norm_eps > 0 && rms_norm_eps < 1)) bad("rms_norm_eps", "must be in (0, 1)");
  if (!(rope.theta > 1)) bad("rope_theta", "must be > 1");
  if (rope.max_position <= 0) bad("max_position_embeddings", "must be positive");
  if (rope.llama3_scaling &&
      !(rope.factor > 0 && rope.low_freq_factor > 0 && rope.high_freq_factor > rope.low_freq_factor &&
        rope.original_max_position > 0))
    bad("rope_scaling", "needs factor > 0, 0 < low_freq_factor < high_freq_factor, original_max_position_embeddings > 0");
}

std::string ModelConfig::to_json() const {
  nlohmann::json j;
  const bool qwen = architecture == "qwen3";
  j["architectures"] = {qwen ? "Qwen3ForCausalLM" : "LlamaForCausalLM"};
  j["model_type"] = qwen ? "qwen3" : "llama";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_layers;
  j["num_attention_heads"] = num_heads;
  j["num_key_value_heads"] = num_kv_heads;
  j["head_dim"] = head_dim;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope.theta;
  j["max_position_embeddings"] = rope.max_position;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["torch_dtype"] = dtype == DType::bf16 ? "bfloat16" : dtype == DType::f16 ? "float16" : "float32";
  if (rope.llama3_scaling)
    j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", rope.factor},
                         {"low_freq_factor", rope.low_freq_factor},
                         {"high_freq_factor", rope.high_freq_factor},
                         {"original_max_position_embeddings", rope.original_max_position}};
  else
    j["rope_scaling"] = nullptr;
  return j.dump(2) + "\n";
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ModelConfig::expected_tensors() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> t;
  const int64_t H = hidden_size, I = intermediate_size, D = head_dim;
  t.push_back({"model.embed_tokens.weight", {vocab_size, H}});
  for (int64_t l = 0; l < num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    t.push_back({p + "input_layernorm.weight", {H}});
    t.push_back({p + "self_attn.q_proj.weight", {num_heads * D, H}});
    t.push_back({p + "self_attn.k_proj.weight", {num_kv_heads * D, H}});
    t.push_back({p + "self_attn.v_proj.weight", {num_kv_heads * D, H}});
    t.push_back({p + "self_attn.o_proj.weight", {H, num_heads * D}});
    if (qk_norm) {
      t.push_back({p + "self_attn.q_norm.weight", {D}});
      t.push_back({p + "self_attn.k_norm.weight", {D}});
    }
    t.push_back({p + "post_attention_layernorm.weight", {H}});
    t.push_back({p + "mlp.gate_proj.weight", {I, H}});
    t.push_back({p + "mlp.up_proj.weight", {I, H}});
    t.push_back({p + "mlp.down_proj.weight", {H, I}});
  }
  t.push_back({"model.norm.weight", {H}});
  if (!tie_word_embeddings) t.push_back({"lm_head.weight", {vocab_size, H}});
  return t;
}

}  // namespace samebits
