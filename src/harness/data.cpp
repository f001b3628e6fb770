// Harness data: layouts and what a case's run() sees (CaseIO).
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "samebits/device.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"

namespace samebits::harness {

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::packed: return "packed";
    case Layout::padded_right: return "padded-right";
    case Layout::padded_left: return "padded-left";
  }
  return "?";
}

HostTensor& CaseIO::output(const std::string& name, DType dtype, std::vector<int64_t> row_shape) {
  std::vector<int64_t> shape{batch.rows};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  return outputs[name] = HostTensor::poisoned(dtype, shape);
}

const HostTensor& CaseIO::in(const std::string& name) const {
  auto it = batch.tokens.find(name);
  if (it == batch.tokens.end()) throw Error("harness", name, "no such token tensor in the batch");
  return it->second;
}

TensorView CaseIO::view(const HostTensor& t) {
  if (backend == Backend::cpu) return t.view();
  for (auto& m : mirrors_)
    if (m.host == &t) {
      TensorView v = t.view();
      v.data = static_cast<char*>(m.device) + HostTensor::kGuardBytes;
      v.device = Device::cuda;
      return v;
    }
  HostTensor& h = const_cast<HostTensor&>(t);
  void* dev = device_alloc(backend, h.storage_bytes());
  mirrors_.push_back({&t, dev});
  copy_to_device(backend, dev, h.storage(), h.storage_bytes());
  return view(t);
}

TensorView CaseIO::grad(const std::string& name) {
  auto it = param_grads.find(name);
  return it == param_grads.end() ? TensorView{} : view(it->second);
}

void CaseIO::finish_device_run() {
  if (backend == Backend::cpu) return;
  device_synchronize(backend);
  auto owned = [&](const HostTensor* t) {
    for (auto& [n, o] : outputs) if (&o == t) return true;
    for (auto& [n, g] : param_grads) if (&g == t) return true;
    return false;
  };
  for (auto& m : mirrors_)
    if (owned(m.host)) {
      HostTensor& h = const_cast<HostTensor&>(*m.host);
      copy_to_host(backend, h.storage(), m.device, h.storage_bytes());
    }
  for (auto& m : mirrors_) device_free(backend, m.device);
  mirrors_.clear();
}

CaseIO::~CaseIO() {
  for (auto& m : mirrors_) device_free(backend, m.device);
}

const HostTensor& CaseIO::param(const std::string& name) const {
  auto it = params.find(name);
  if (it == params.end()) throw Error("harness", name, "no such parameter");
  return it->second;
}

}  // namespace samebits::harness
