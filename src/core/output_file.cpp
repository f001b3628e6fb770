#include "core/output_file.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "samebits/error.hpp"

namespace samebits {

namespace fs = std::filesystem;

namespace {
std::string reason(int err) { return err ? std::string(": ") + std::strerror(err) : std::string(); }
}  // namespace

void check_writable(const std::string& path, const std::string& op) {
  std::error_code ec;
  if (path.empty()) throw Error(op, path, "cannot be written: the path is empty");
  if (fs::is_directory(path, ec)) throw Error(op, path, "cannot be written: it is a directory");
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec))
    throw Error(op, path, "cannot be written: its directory " + parent.string() +
                              (fs::exists(parent, ec) ? " is not a directory" : " does not exist"));
  const bool exists = fs::exists(path, ec);
  const std::string target = exists ? path : (parent.empty() ? std::string(".") : parent.string());
  if (::access(target.c_str(), W_OK) != 0) throw Error(op, path, "cannot be written" + reason(errno));
}

OutputFile::OutputFile(std::string path, std::string op, bool binary) : path_(std::move(path)), op_(std::move(op)) {
  check_writable(path_, op_);
  errno = 0;
  out_.open(path_, binary ? std::ios::out | std::ios::binary | std::ios::trunc : std::ios::out | std::ios::trunc);
  if (!out_) throw Error(op_, path_, "cannot be written" + reason(errno));
}

OutputFile::~OutputFile() {
  if (committed_) return;
  out_.close();
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && S_ISREG(st.st_mode)) ::unlink(path_.c_str());
}

void OutputFile::fail(const std::string& what) const { throw Error(op_, path_, what); }

void OutputFile::write(const void* data, size_t bytes) {
  errno = 0;
  out_.write(static_cast<const char*>(data), std::streamsize(bytes));
  if (!out_) fail("write failed" + reason(errno));
}

void OutputFile::check() const {
  if (!out_) fail("write failed" + reason(errno));
}

void OutputFile::commit() {
  check();
  errno = 0;
  out_.flush();
  if (!out_) fail("write failed" + reason(errno));
  out_.close();
  if (out_.fail()) fail("write failed when closing" + reason(errno));
  committed_ = true;
}

void create_output_directory(const std::string& dir, const std::string& op) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(op, dir, "cannot create the directory: " + ec.message());
  if (!fs::is_directory(dir, ec)) throw Error(op, dir, "cannot create the directory: a file is in the way");
}

void check_stream(std::ostream& out, const std::string& op, const std::string& what) {
  errno = 0;
  out.flush();
  if (!out) throw Error(op, what, "write failed" + reason(errno));
}

}  // namespace samebits
