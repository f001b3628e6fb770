// Harness data: guarded host tensors and the deterministic generator.
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "samebits/device.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"

namespace samebits::harness {

namespace {
constexpr size_t kGuard = HostTensor::kGuardBytes;  // bytes on each side; keeps the data 64-byte offset
constexpr uint8_t kGuardByte = 0xA5;
}  // namespace

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  storage_.assign(bytes() + 2 * kGuard, 0);
  std::memset(storage_.data(), kGuardByte, kGuard);
  std::memset(storage_.data() + kGuard + bytes(), kGuardByte, kGuard);
}

HostTensor HostTensor::poisoned(DType dtype, std::vector<int64_t> shape) {
  HostTensor t(dtype, std::move(shape));
  std::memset(t.data(), 0xFF, t.bytes());
  return t;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (auto d : shape_) n *= d;
  return shape_.empty() && storage_.empty() ? 0 : n;
}

int64_t HostTensor::row_numel() const {
  int64_t n = 1;
  for (size_t d = 1; d < shape_.size(); ++d) n *= shape_[d];
  return n;
}

void* HostTensor::data() { return storage_.data() + kGuard; }
const void* HostTensor::data() const { return storage_.data() + kGuard; }

TensorView HostTensor::view() const {
  return TensorView::of(const_cast<void*>(data()), dtype_, shape_.data(), int(shape_.size()));
}

bool HostTensor::guards_intact() const {
  for (size_t i = 0; i < kGuard; ++i)
    if (storage_[i] != kGuardByte || storage_[kGuard + bytes() + i] != kGuardByte) return false;
  return true;
}

HostTensor HostTensor::converted(DType to) const {
  HostTensor out(to, shape_);
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) out.set(i, get(i));
  return out;
}

HostTensor HostTensor::slice_rows(int64_t begin, int64_t end) const {
  auto shape = shape_;
  shape[0] = end - begin;
  HostTensor out(dtype_, shape);
  out.copy_rows_from(*this, begin, 0, end - begin);
  return out;
}

void HostTensor::copy_rows_from(const HostTensor& src, int64_t src_row, int64_t dst_row, int64_t n) {
  if (src.dtype_ != dtype_ || src.row_numel() != row_numel() || src_row + n > src.rows() ||
      dst_row + n > rows())
    throw Error("HostTensor::copy_rows_from", "src",
                fmt::format("rows do not fit: {} [{}] rows {}+{} into {} [{}] at row {}",
                            dtype_name(src.dtype_), fmt::join(src.shape_, ","), src_row, n,
                            dtype_name(dtype_), fmt::join(shape_, ","), dst_row));
  const size_t row_bytes = size_t(row_numel()) * size_t(dtype_size(dtype_));
  std::memcpy(static_cast<char*>(data()) + size_t(dst_row) * row_bytes,
              static_cast<const char*>(src.data()) + size_t(src_row) * row_bytes, size_t(n) * row_bytes);
}

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Rng::uniform(double lo, double hi) {
  return lo + (hi - lo) * (double(next() >> 11) * 0x1.0p-53);
}

double Rng::normal() {  // Box–Muller
  const double u1 = (double(next() >> 11) + 1.0) * 0x1.0p-53, u2 = double(next() >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

int64_t Rng::integer(int64_t lo, int64_t hi) {
  return lo + int64_t(next() % uint64_t(hi - lo + 1));
}

HostTensor Rng::tensor(DType dtype, std::vector<int64_t> shape, double lo, double hi) {
  HostTensor t(dtype, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, uniform(lo, hi));
  return t;
}

HostTensor Rng::integers(std::vector<int64_t> shape, int64_t lo, int64_t hi) {
  HostTensor t(DType::i32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, double(integer(lo, hi)));
  return t;
}

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
      v.data = static_cast<char*>(m.device) + kGuard;
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
