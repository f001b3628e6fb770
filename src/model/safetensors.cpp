// safetensors: header parsing with every offset bounds-checked, memory-mapped loading, writing.
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
// then the data section; offsets are relative to the start of the data section.
#include "model/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/json_text.hpp"
#include "core/output_file.hpp"
#include "samebits/error.hpp"

namespace samebits {

namespace {
constexpr uint64_t kMaxHeader = 100ull << 20;  // 100 MiB: far above any real header

[[noreturn]] void bad(const std::string& where, const std::string& problem) {
  throw Error("safetensors", where, problem);
}

DType dtype_of(const std::string& s, const std::string& where) {
  if (s == "BF16") return DType::bf16;
  if (s == "F16") return DType::f16;
  if (s == "F32") return DType::f32;
  if (s == "F64") return DType::f64;
  if (s == "I32") return DType::i32;
  if (s == "U8") return DType::u8;
  bad(where, "unsupported dtype '" + s + "'");
}

const char* dtype_tag(DType d) {
  switch (d) {
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::i32: return "I32";
    case DType::u8: return "U8";
    case DType::i64: return "I64";
  }
  return "?";
}
}  // namespace

std::vector<SafetensorsEntry> parse_safetensors_header(const uint8_t* file, uint64_t file_size,
                                                       const std::string& where, uint64_t* data_start) {
  if (file_size < 8) bad(where, fmt::format("truncated: {} bytes, shorter than the 8-byte header length", file_size));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | file[i];
  if (n > kMaxHeader) bad(where, fmt::format("header length {} is implausibly large", n));
  if (n > file_size - 8) bad(where, fmt::format("truncated: header of {} bytes but only {} follow", n, file_size - 8));
  const uint64_t data_size = file_size - 8 - n;
  const char* header = reinterpret_cast<const char*>(file + 8);
  const nlohmann::json j = parse_json(header, header + n, "safetensors", where + ": header");
  if (!j.is_object()) bad(where, "header is not a JSON object");
  std::vector<SafetensorsEntry> entries;
  for (auto& [name, v] : j.items()) {
    if (name == "__metadata__") continue;
    const std::string at = where + ": tensor '" + name + "'";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      bad(at, "needs dtype, shape and data_offsets");
    SafetensorsEntry e;
    e.name = name;
    if (!v["dtype"].is_string()) bad(at, "dtype is not a string");
    e.dtype = dtype_of(v["dtype"].get<std::string>(), at);
    if (!v["shape"].is_array() || v["shape"].size() > 8) bad(at, "shape is not an array of at most 8 dims");
    uint64_t numel = 1;
    for (auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) bad(at, "shape holds a value that is not a non-negative integer");
      const uint64_t x = d.get<uint64_t>();
      if (x != 0 && numel > (uint64_t(1) << 48) / x) bad(at, "shape is too large");
      numel *= x;
      e.shape.push_back(int64_t(x));
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad(at, "data_offsets must be two non-negative integers");
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.begin > e.end) bad(at, fmt::format("data_offsets [{}, {}] are reversed", e.begin, e.end));
    if (e.end > data_size)
      bad(at, fmt::format("data_offsets [{}, {}] run past the data section ({} bytes): out of range or truncated file",
                          e.begin, e.end, data_size));
    if (e.end - e.begin != numel * uint64_t(dtype_size(e.dtype)))
      bad(at, fmt::format("holds {} bytes but shape and dtype need {}", e.end - e.begin,
                          numel * uint64_t(dtype_size(e.dtype))));
    entries.push_back(std::move(e));
  }
  std::vector<const SafetensorsEntry*> sorted;
  for (auto& e : entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  const SafetensorsEntry* reach = nullptr;  // the entry ending furthest so far
  for (auto* e : sorted) {
    if (e->end == e->begin) continue;  // empty tensors occupy nothing
    if (reach && e->begin < reach->end)
      bad(where, "tensors '" + reach->name + "' and '" + e->name + "' overlap");
    if (!reach || e->end > reach->end) reach = e;
  }
  if (data_start) *data_start = 8 + n;
  return entries;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw Error("safetensors", path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw Error("safetensors", path, "cannot stat");
  }
  size_ = uint64_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw Error("safetensors", path, std::string("cannot map: ") + std::strerror(errno));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (auto& [name, t] : tensors) {
    const uint64_t bytes = uint64_t(t.bytes());
    header[name] = {{"dtype", dtype_tag(t.dtype)},
                    {"shape", std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim)},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "pt"}, {"writer", "samebits"}};
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');  // keeps the data 8-byte aligned
  OutputFile out(path, "safetensors", true);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(text.size()) >> (8 * i));
  out.write(len, 8);
  out.write(text.data(), text.size());
  for (auto& [name, t] : tensors) out.write(t.data, size_t(t.bytes()));
  out.commit();
}

}  // namespace samebits
