#include "tools/logprobs_io.hpp"

#include <string>
#include <vector>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "samebits/chain.hpp"
#include "samebits/error.hpp"

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

void flush(const Chain& chain, std::vector<Line>& lines, std::ostream& out, bool entropy) {
  if (lines.empty()) return;
  std::vector<std::vector<int32_t>> seqs;
  for (auto& l : lines) seqs.push_back(l.tokens);
  ChainBatch b = ChainBatch::packed(seqs);
  // Row i scores token i + 1; a masked token (loss_mask 0) is not scored.
  for (size_t k = 0; k < lines.size(); ++k)
    if (!lines[k].mask.empty())
      for (int64_t i = 0; i + 1 < b.seqs[k].len; ++i) b.loss_mask[size_t(b.seqs[k].row + i)] = lines[k].mask[size_t(i + 1)];
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
  std::vector<Line> pending;
  std::string text;
  int64_t number = 0;
  while (std::getline(in, text)) {
    ++number;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    pending.push_back(parse_line(text, number, model.config().vocab_size));
    if (int(pending.size()) == batch_size) flush(chain, pending, out, entropy);
  }
  flush(chain, pending, out, entropy);
}

}  // namespace samebits::tools
