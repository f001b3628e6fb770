#include "tools/logprobs_io.hpp"

#include "tools/jsonl.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "samebits/chain.hpp"
#include "samebits/error.hpp"
#include "src/core/json_text.hpp"
#include "src/core/output_file.hpp"
#include "src/model/safetensors.hpp"

namespace samebits::tools {

namespace {

InputSequence parse_line(const std::string& text, int64_t number, const ModelConfig& config, const std::string& command) {
  const std::string where = fmt::format("line {}", number);
  const nlohmann::json j = parse_json(text, command, where);
  if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array())
    throw Error(command, where, "needs an object with a \"tokens\" array");
  const nlohmann::json& tokens = j["tokens"];
  if (tokens.empty()) throw Error(command, where, "zero-length sequence");
  if (int64_t(tokens.size()) > config.rope.max_position)
    throw Error(command, where, fmt::format("{} tokens, more than the model's max_position_embeddings ({})",
                                            tokens.size(), config.rope.max_position));
  InputSequence s{number, {}, {}};
  s.tokens.reserve(tokens.size());
  for (auto& t : tokens) {
    if (!t.is_number_integer()) throw Error(command, where, "token ids must be integers, got " + quote_json(t));
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= config.vocab_size)
      throw Error(command, where, fmt::format("token id {} is outside the vocab [0, {})", id, config.vocab_size));
    s.tokens.push_back(int32_t(id));
  }
  if (j.contains("loss_mask")) {
    const auto& m = j["loss_mask"];
    if (!m.is_array() || m.size() != s.tokens.size())
      throw Error(command, where, "loss_mask must be an array with one 0/1 per token");
    for (auto& x : m) {
      if (!x.is_number_integer() || (x.get<int64_t>() != 0 && x.get<int64_t>() != 1))
        throw Error(command, where, "loss_mask entries must be 0 or 1, got " + quote_json(x));
      s.mask.push_back(uint8_t(x.get<int64_t>()));
    }
  }
  return s;
}

// The sequences packed into one batch; row i scores token i + 1, a masked token (loss_mask 0) is not scored.
ChainBatch batch_of(const InputSequence* first, size_t count) {
  std::vector<std::vector<int32_t>> seqs;
  for (size_t k = 0; k < count; ++k) seqs.push_back(first[k].tokens);
  ChainBatch b = ChainBatch::packed(seqs);
  for (size_t k = 0; k < count; ++k)
    if (!first[k].mask.empty())
      for (int64_t i = 0; i + 1 < b.seqs[k].len; ++i) b.loss_mask[size_t(b.seqs[k].row + i)] = first[k].mask[size_t(i + 1)];
  return b;
}

// Hands `take` the sequences in groups of `batch_size`, in order, reporting progress after each.
template <class Take>
void in_batches(const std::vector<InputSequence>& seqs, int batch_size, const ProgressFn& progress, Take take) {
  if (batch_size < 1) throw Error("batches", "batch_size", "must be at least 1");
  Progress p;
  p.sequences = int64_t(seqs.size());
  for (auto& s : seqs) p.tokens += int64_t(s.tokens.size());
  if (progress) progress(p);
  for (size_t at = 0; at < seqs.size(); at += size_t(batch_size)) {
    const size_t n = std::min(seqs.size() - at, size_t(batch_size));
    take(batch_of(seqs.data() + at, n), seqs.data() + at);
    p.sequences_done += int64_t(n);
    for (size_t k = at; k < at + n; ++k) p.tokens_done += int64_t(seqs[k].tokens.size());
    if (progress) progress(p);
  }
}

Chain chain_on(const Model& model, Backend backend) {
  Context ctx;
  ctx.backend = backend;
  return Chain(model, ctx);
}

}  // namespace

std::vector<InputSequence> read_sequences(std::istream& in, const ModelConfig& config, const std::string& command) {
  std::vector<InputSequence> seqs;
  for_each_jsonl_line(in, command, [&](const std::string& text, int64_t number) {
    seqs.push_back(parse_line(text, number, config, command));
  });
  if (seqs.empty()) throw Error(command, "--input", "holds no sequences (every line blank, or no lines)");
  return seqs;
}

void write_logprobs(const Model& model, Backend backend, const std::vector<InputSequence>& seqs, std::ostream& out,
                    bool entropy, int batch_size, const ProgressFn& progress) {
  const Chain chain = chain_on(model, backend);
  in_batches(seqs, batch_size, progress, [&](const ChainBatch& b, const InputSequence* first) {
    const ChainForward f = chain.score(b);  // no backward: a layer's activations go as the next begins
    for (size_t k = 0; k < b.seqs.size(); ++k) {
      nlohmann::json lp = nlohmann::json::array(), en = nlohmann::json::array();
      lp.push_back(nullptr);
      en.push_back(nullptr);
      for (int64_t i = 0; i + 1 < b.seqs[k].len; ++i) {
        const size_t row = size_t(b.seqs[k].row + i);
        const bool scored = b.loss_mask[row] != 0;
        lp.push_back(scored ? nlohmann::json(float(f.logp[row])) : nlohmann::json(nullptr));
        en.push_back(scored ? nlohmann::json(float(f.entropy[row])) : nlohmann::json(nullptr));
      }
      nlohmann::json o{{"logprobs", lp}};
      if (entropy) o["entropy"] = en;
      out << o.dump() << "\n";
      if (!out) throw Error("logprobs", "--output", fmt::format("write failed at the result of line {}", first[k].line));
    }
  });
}

void write_logprobs(const Model& model, Backend backend, std::istream& in, std::ostream& out, bool entropy,
                    int batch_size) {
  write_logprobs(model, backend, read_sequences(in, model.config(), "logprobs"), out, entropy, batch_size);
}

int64_t write_activations(const Model& model, Backend backend, const std::vector<InputSequence>& seqs,
                          const std::string& path) {
  const Chain chain = chain_on(model, backend);
  const ChainBatch b = batch_of(seqs.data(), seqs.size());
  const ChainForward f = chain.forward(b);
  std::vector<HostTensor> host;
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const auto& [name, t] : f.trace) host.push_back(t.to_host());
  for (size_t i = 0; i < host.size(); ++i) tensors.push_back({f.trace[i].first, host[i].view()});
  write_safetensors(path, tensors);
  return b.rows();
}

int64_t write_activations(const Model& model, Backend backend, std::istream& in, const std::string& path) {
  return write_activations(model, backend, read_sequences(in, model.config(), "activations"), path);
}

int64_t write_gradients(const Model& model, Backend backend, const std::vector<InputSequence>& seqs,
                        const std::string& path, int batch_size, const ProgressFn& progress, ForwardKeep keep,
                        int64_t lm_head_keep_bytes) {
  Chain chain = chain_on(model, backend);
  chain.set_lm_head_keep_bytes(lm_head_keep_bytes);
  ModelGrads grads(model, DType::f32, backend);
  int64_t scored = 0;
  in_batches(seqs, batch_size, progress, [&](const ChainBatch& b, const InputSequence*) {
    std::vector<double> dlogp(size_t(b.rows()), 0.0);
    for (size_t i = 0; i < dlogp.size(); ++i)
      if (b.loss_mask[i]) {
        dlogp[i] = 1.0;
        ++scored;
      }
    chain.backward(b, chain.forward(b, keep), dlogp, grads);
  });
  std::vector<HostTensor> host;
  const std::vector<std::string> names = grads.names();
  for (const std::string& name : names) host.push_back(grads.gradient(name));
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (size_t i = 0; i < names.size(); ++i) tensors.push_back({names[i], host[i].view()});
  write_safetensors(path, tensors);
  return scored;
}

int64_t write_gradients(const Model& model, Backend backend, std::istream& in, const std::string& path, int batch_size) {
  return write_gradients(model, backend, read_sequences(in, model.config(), "grads"), path, batch_size);
}

}  // namespace samebits::tools
