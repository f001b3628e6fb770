// Memory-mapped files and the safetensors writer (the header parser is public in model.hpp).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "samebits/model.hpp"

namespace samebits {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors);

}  // namespace samebits
