// Files samebits writes (safetensors, config.json, JSONL, status matrices): a write that fails must
// fail loudly, never exit 0 with the output lost. The open names why it failed, every write is
// checked, and so is the close (a full disk often shows only when the buffer is flushed); a file
// left half-written by a failure is removed rather than left to pass for a result.
#pragma once
#include <fstream>
#include <string>

namespace samebits {

class OutputFile {
 public:
  // Throws samebits::Error(op, path, "cannot be written: …") when the file cannot be opened.
  OutputFile(std::string path, std::string op, bool binary = false);
  ~OutputFile();  // without commit() (an exception on the way): closes and removes the partial file
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  std::ostream& stream() { return out_; }
  void write(const void* data, size_t bytes);
  void check() const;  // throws if a write so far failed
  void commit();       // flushes and closes; throws if any of it failed
  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail(const std::string& what) const;
  std::string path_, op_;
  std::ofstream out_;
  bool committed_ = false;
};

// Throws samebits::Error(op, path, …) if `path` could not be written as a file (a directory, a
// missing or non-directory parent, no permission): checked before a long run, not after it.
void check_writable(const std::string& path, const std::string& op);

// Creates `dir` and its parents; throws samebits::Error(op, dir, …) naming what stood in the way.
void create_output_directory(const std::string& dir, const std::string& op);

// Throws samebits::Error(op, what, …) if `out` has failed (e.g. standard output on a full disk).
void check_stream(std::ostream& out, const std::string& op, const std::string& what);

}  // namespace samebits
