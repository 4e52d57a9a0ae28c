#include "plugin/rendezvous/file_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "plugin/core/error.h"
#include "plugin/rendezvous/deadline.h"
#include "plugin/rendezvous/job_token.h"

namespace sfsync {

namespace {

bool readFile(const std::string& path, std::string& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::stringstream s;
  s << f.rdbuf();
  out = s.str();
  return true;
}

std::string hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += d[c >> 4];
    out += d[c & 15];
  }
  return out;
}

}  // namespace

FileStore::FileStore(const std::string& dir, std::chrono::milliseconds timeout)
    : dir_(dir), timeout_(timeout) {}

std::string FileStore::pathOf(const std::string& key) const {
  std::string name;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '-' || c == '_') {
      name += char(c);
    } else {
      char b[4];
      std::snprintf(b, sizeof b, "%%%02x", c);
      name += b;
    }
  }
  return dir_ + "/" + name;
}

void FileStore::set(const std::string& key, const std::vector<char>& data) {
  const std::string path = pathOf(key);
  const std::string tmp = path + ".tmp-" + hex(randomBytes(8));
  const std::string where = "rendezvous file://" + dir_ + ": key '" + key + "'";
  {
    std::ofstream f(tmp, std::ios::binary);
    f.write(data.data(), std::streamsize(data.size()));
    f.close();
    if (!f) {
      ::unlink(tmp.c_str());
      fail(SF_ERR_BACKEND, where + ": cannot write '" + tmp + "': " + std::strerror(errno));
    }
  }
  const int rc = ::link(tmp.c_str(), path.c_str());
  const int err = errno;
  ::unlink(tmp.c_str());
  if (rc == 0) return;
  std::string old;
  if (err == EEXIST && readFile(path, old)) {
    if (old == std::string(data.begin(), data.end())) return;
    fail(SF_ERR_MISMATCH, where + " is already set and keys are written once (a previous job in the "
                                  "same directory, or two processes with the same RANK?): use a fresh "
                                  "directory per job");
  }
  fail(SF_ERR_BACKEND, where + ": cannot create '" + path + "': " + std::strerror(err));
}

std::vector<char> FileStore::get(const std::string& key) {
  wait({key}, timeout_);
  std::string value;
  if (!readFile(pathOf(key), value)) {
    fail(SF_ERR_BACKEND, "rendezvous file://" + dir_ + ": cannot read key '" + key + "': " + std::strerror(errno));
  }
  return {value.begin(), value.end()};
}

void FileStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void FileStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  const auto deadline = deadlineAfter(timeout);
  for (const auto& key : keys) {
    const std::string path = pathOf(key);
    auto backoff = std::chrono::milliseconds(1);
    while (::access(path.c_str(), F_OK) != 0) {
      if (Clock::now() >= deadline) {
        fail(SF_ERR_TIMEOUT, "rendezvous file://" + dir_ + ": timed out after " +
                                 std::to_string(timeout.count()) + " ms waiting for key '" + key +
                                 "' (a rank did not arrive, or it uses another directory?)");
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(32));
    }
  }
}

}  // namespace sfsync
