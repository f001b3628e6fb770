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

}  // namespace samebits::harness
