#include "tools/generate_io.hpp"

#include "tools/jsonl.hpp"

#include <iostream>
#include <map>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "samebits/error.hpp"
#include "src/core/json_text.hpp"

namespace samebits::tools {

namespace {

template <class T>
T setting(const nlohmann::json& j, const char* key, T fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  const nlohmann::json& v = j[key];
  if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) throw Error("generate", key, "must be an integer, got " + quote_json(v));
  } else {
    if (!v.is_number()) throw Error("generate", key, "must be a number, got " + quote_json(v));
  }
  return v.get<T>();
}

GenerationRequest parse_prompt(const std::string& text, const std::string& where, const SamplingParams& defaults) {
  const nlohmann::json j = parse_json(text, "generate", where);
  if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array())
    throw Error("generate", where, "needs an object with a \"tokens\" array");
  GenerationRequest r;
  for (auto& t : j["tokens"]) {
    if (!t.is_number_integer()) throw Error("generate", where, "token ids must be integers, got " + quote_json(t));
    const int64_t id = t.get<int64_t>();
    r.prompt.push_back(id < INT32_MIN || id > INT32_MAX ? -1 : int32_t(id));  // the engine names it
  }
  SamplingParams& s = r.sampling;
  s = defaults;
  s.n = setting<int64_t>(j, "n", defaults.n);
  s.temperature = setting<double>(j, "temperature", defaults.temperature);
  s.top_k = setting<int64_t>(j, "top_k", defaults.top_k);
  s.top_p = setting<double>(j, "top_p", defaults.top_p);
  s.min_p = setting<double>(j, "min_p", defaults.min_p);
  s.max_new_tokens = setting<int64_t>(j, "max_new_tokens", defaults.max_new_tokens);
  s.seed = setting<uint64_t>(j, "seed", defaults.seed);
  if (j.contains("stop") && !j["stop"].is_null()) {
    if (!j["stop"].is_array()) throw Error("generate", "stop", "must be an array of token ids");
    s.stop_token_ids.clear();
    for (auto& t : j["stop"]) {
      if (!t.is_number_integer()) throw Error("generate", "stop", "ids must be integers, got " + quote_json(t));
      s.stop_token_ids.push_back(int32_t(t.get<int64_t>()));
    }
  }
  return r;
}

}  // namespace

std::vector<PromptLine> read_prompts(std::istream& in, const SamplingParams& defaults) {
  std::vector<PromptLine> out;
  for_each_jsonl_line(in, "generate", [&](const std::string& text, int64_t number) {
    PromptLine p;
    p.line = number;
    try {
      p.request = parse_prompt(text, fmt::format("line {}", number), defaults);
    } catch (const Error& e) {
      p.error = e.what();
    }
    out.push_back(std::move(p));
  });
  if (out.empty()) throw Error("generate", "--input", "holds no prompts (every line blank, or no lines)");
  return out;
}

int64_t write_generations(const Model& model, const EngineOptions& options, const std::vector<PromptLine>& prompts,
                          std::ostream& out, const std::function<void(int64_t, int64_t)>& progress,
                          bool sampling_logprobs) {
  Engine engine(model, options);
  if (progress) engine.on_progress(progress);
  std::map<int64_t, int64_t> prompt_of;  // engine request id -> prompt index
  std::map<int64_t, std::string> failed;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (!prompts[i].error.empty()) failed[int64_t(i)] = prompts[i].error;
    else prompt_of[engine.submit(prompts[i].request)] = int64_t(i);
  }
  std::map<int64_t, std::vector<Completion>> by_prompt;
  std::vector<Completion> done = engine.run();
  if (!engine.graphs_off_reason().empty())  // the output is right; the speed is an eager run's
    std::cerr << "samebits generate: decode steps ran eagerly (the same tokens and logprobs, slower): a CUDA graph "
                 "capture failed: "
              << engine.graphs_off_reason() << "\n";
  for (Completion& c : done) {
    const int64_t i = prompt_of.at(c.request);
    if (c.finish_reason == "error") failed[i] = fmt::format("line {}: {}", prompts[size_t(i)].line, c.error);
    else by_prompt[i].push_back(std::move(c));
  }
  for (int64_t i = 0; i < int64_t(prompts.size()); ++i) {
    if (failed.count(i)) {
      out << nlohmann::json{{"prompt", i}, {"error", failed[i]}}.dump() << "\n";
    } else {
      for (const Completion& c : by_prompt[i]) {
        nlohmann::json lp = nlohmann::json::array();
        for (double x : c.logprobs) lp.push_back(float(x));
        nlohmann::json line{{"prompt", i}, {"sample", c.sample}, {"tokens", c.tokens}, {"logprobs", lp}};
        if (sampling_logprobs) line["sampling_logprobs"] = c.sampling_logprobs;
        line["finish_reason"] = c.finish_reason;
        out << line.dump() << "\n";
      }
    }
    if (!out) throw Error("generate", "--output", fmt::format("write failed at prompt {}", i));
  }
  return int64_t(failed.size());
}

}  // namespace samebits::tools
