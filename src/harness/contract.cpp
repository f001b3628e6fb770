// The numerical contract: tolerance classes loaded from docs/contract.json (compiled in).
#include <nlohmann/json.hpp>

#include "samebits/error.hpp"
#include "samebits/harness.hpp"

namespace samebits::harness {

extern const char* const kEmbeddedContractJson;

Contract Contract::builtin() { return from_json(kEmbeddedContractJson); }

Contract Contract::from_json(const std::string& text) {
  Contract c;
  c.json_ = text;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
    for (auto& [cls, by_dtype] : j.at("accuracy").at("classes").items())
      for (auto& [dt, tol] : by_dtype.items())
        c.classes_[cls][dt] = Tolerance{tol.at("atol").get<double>(), tol.at("rtol").get<double>()};
    if (j.contains("chain")) {
      const auto& ch = j.at("chain");
      for (const char* m : {"max_abs_dlogp", "grad_rel_l2"})
        if (ch.contains(m))
          for (auto& [dt, v] : ch.at(m).items()) c.chain_[m][dt] = v.get<double>();
      if (ch.contains("approx_kl")) c.chain_["approx_kl"]["*"] = ch.at("approx_kl").at("max").get<double>();
      if (ch.contains("clip_fraction")) {
        const auto& cf = ch.at("clip_fraction");
        c.chain_["clip_fraction"]["*"] = cf.at("max").get<double>();
        c.chain_["clip_low"]["*"] = cf.at("low").get<double>();
        c.chain_["clip_high"]["*"] = cf.at("high").get<double>();
      }
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error("Contract::from_json", "contract", std::string("malformed contract: ") + e.what());
  }
  return c;
}

Tolerance Contract::tolerance(const std::string& cls, DType dtype) const {
  auto it = classes_.find(cls);
  if (it == classes_.end()) throw Error("Contract::tolerance", "class", "unknown tolerance class '" + cls + "'");
  auto jt = it->second.find(dtype_name(dtype));
  if (jt == it->second.end())
    throw Error("Contract::tolerance", "dtype",
                std::string("class '") + cls + "' has no tolerance for " + dtype_name(dtype));
  return jt->second;
}

double Contract::chain_bound(const std::string& metric, DType dtype) const {
  auto it = chain_.find(metric);
  if (it == chain_.end()) throw Error("Contract::chain_bound", "metric", "no chain bound '" + metric + "'");
  auto jt = it->second.find("*");
  if (jt == it->second.end()) jt = it->second.find(dtype_name(dtype));
  if (jt == it->second.end())
    throw Error("Contract::chain_bound", "dtype",
                "chain bound '" + metric + "' has no value for " + std::string(dtype_name(dtype)) + " models");
  return jt->second;
}

}  // namespace samebits::harness
