#include "tools/logprobs_io.hpp"

#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "samebits/chain.hpp"
#include "samebits/error.hpp"
#include "src/model/safetensors.hpp"

namespace samebits::tools {

namespace {

struct Line {
  int64_t number;
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
};

Line parse_line(const std::string& text, int64_t number, int64_t vocab) {
  const std::string where = fmt::format("line {}", number);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error("logprobs", where, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array())
    throw Error("logprobs", where, "needs an object with a \"tokens\" array");
  Line l{number, {}, {}};
  for (auto& t : j["tokens"]) {
    if (!t.is_number_integer()) throw Error("logprobs", where, "token ids must be integers, got " + t.dump());
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= vocab)
      throw Error("logprobs", where, fmt::format("token id {} is outside the vocab [0, {})", id, vocab));
    l.tokens.push_back(int32_t(id));
  }
  if (l.tokens.empty()) throw Error("logprobs", where, "zero-length sequence");
  if (j.contains("loss_mask")) {
    const auto& m = j["loss_mask"];
    if (!m.is_array() || m.size() != l.tokens.size())
      throw Error("logprobs", where, "loss_mask must be an array with one 0/1 per token");
    for (auto& x : m) {
      if (!x.is_number_integer() || (x.get<int64_t>() != 0 && x.get<int64_t>() != 1))
        throw Error("logprobs", where, "loss_mask entries must be 0 or 1");
      l.mask.push_back(uint8_t(x.get<int64_t>()));
    }
  }
  return l;
}

// The lines packed into one batch; row i scores token i + 1, a masked token (loss_mask 0) is not scored.
ChainBatch batch_of(const std::vector<Line>& lines) {
  std::vector<std::vector<int32_t>> seqs;
  for (auto& l : lines) seqs.push_back(l.tokens);
  ChainBatch b = ChainBatch::packed(seqs);
  for (size_t k = 0; k < lines.size(); ++k)
    if (!lines[k].mask.empty())
      for (int64_t i = 0; i + 1 < b.seqs[k].len; ++i) b.loss_mask[size_t(b.seqs[k].row + i)] = lines[k].mask[size_t(i + 1)];
  return b;
}

// Every non-blank line of `in`, parsed, handed to `take` in groups of `batch_size`.
template <class Take>
void read_lines(std::istream& in, int64_t vocab, int batch_size, Take take) {
  std::vector<Line> pending;
  std::string text;
  int64_t number = 0;
  while (std::getline(in, text)) {
    ++number;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    pending.push_back(parse_line(text, number, vocab));
    if (int(pending.size()) == batch_size) {
      take(pending);
      pending.clear();
    }
  }
  if (!pending.empty()) take(pending);
}

void flush(const Chain& chain, std::vector<Line>& lines, std::ostream& out, bool entropy) {
  if (lines.empty()) return;
  const ChainBatch b = batch_of(lines);
  const ChainForward f = chain.forward(b);
  for (size_t k = 0; k < lines.size(); ++k) {
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
  }
  lines.clear();
}

}  // namespace

void write_logprobs(const Model& model, Backend backend, std::istream& in, std::ostream& out, bool entropy,
                    int batch_size) {
  Context ctx;
  ctx.backend = backend;
  const Chain chain(model, ctx);
  read_lines(in, model.config().vocab_size, batch_size, [&](std::vector<Line>& lines) { flush(chain, lines, out, entropy); });
}

int64_t write_activations(const Model& model, Backend backend, std::istream& in, const std::string& path) {
  Context ctx;
  ctx.backend = backend;
  const Chain chain(model, ctx);
  std::vector<Line> all;
  read_lines(in, model.config().vocab_size, std::numeric_limits<int>::max(), [&](std::vector<Line>& lines) {
    for (auto& l : lines) all.push_back(std::move(l));
    lines.clear();
  });
  if (all.empty()) throw Error("activations", "--input", "no sequences");
  const ChainBatch b = batch_of(all);
  const ChainForward f = chain.forward(b);
  std::vector<harness::HostTensor> host;
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const auto& [name, t] : f.trace) host.push_back(t.to_host());
  for (size_t i = 0; i < host.size(); ++i) tensors.push_back({f.trace[i].first, host[i].view()});
  write_safetensors(path, tensors);
  return b.rows();
}

int64_t write_gradients(const Model& model, Backend backend, std::istream& in, const std::string& path, int batch_size) {
  Context ctx;
  ctx.backend = backend;
  const Chain chain(model, ctx);
  ModelGrads grads(model, DType::f32, backend);
  int64_t scored = 0;
  read_lines(in, model.config().vocab_size, batch_size, [&](std::vector<Line>& lines) {
    const ChainBatch b = batch_of(lines);
    std::vector<double> dlogp(size_t(b.rows()), 0.0);
    for (size_t i = 0; i < dlogp.size(); ++i)
      if (b.loss_mask[i]) {
        dlogp[i] = 1.0;
        ++scored;
      }
    chain.backward(b, chain.forward(b), dlogp, grads);
  });
  std::vector<harness::HostTensor> host;
  const std::vector<std::string> names = grads.names();
  for (const std::string& name : names) host.push_back(grads.gradient(name));
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (size_t i = 0; i < names.size(); ++i) tensors.push_back({names[i], host[i].view()});
  write_safetensors(path, tensors);
  return scored;
}

}  // namespace samebits::tools
