#include "plugin/core/log.h"

#include <strings.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "plugin/core/env.h"

namespace sfsync {

namespace {

std::atomic<int> gLevel{-1};  // -1: not read yet
std::atomic<int> gRank{-1};
std::mutex gMutex;            // one line at a time; guards gFile
FILE* gFile = nullptr;        // nullptr: stderr

int parseLevel(const char* v) {
  if (!v || !*v) return int(LogLevel::kWarn);
  if (!strcasecmp(v, "NONE") || !strcasecmp(v, "OFF")) return int(LogLevel::kNone);
  if (!strcasecmp(v, "INFO")) return int(LogLevel::kInfo);
  if (!strcasecmp(v, "TRACE")) return int(LogLevel::kTrace);
  return int(LogLevel::kWarn);  // WARN and anything unknown
}

std::string hostName() {
  char h[256] = {0};
  if (::gethostname(h, sizeof h - 1) != 0 || !h[0]) return "?";
  return h;
}

std::string rankText() {
  const int r = gRank.load(std::memory_order_relaxed);
  if (r >= 0) return std::to_string(r);
  const char* env = envValue("RANK");
  return env ? env : "-";
}

// Expands %h, %p and %r in SF_DEBUG_FILE.
std::string expandPath(const char* pattern) {
  std::string out;
  for (const char* p = pattern; *p; ++p) {
    if (*p == '%' && p[1]) {
      ++p;
      if (*p == 'h') out += hostName();
      else if (*p == 'p') out += std::to_string(::getpid());
      else if (*p == 'r') out += rankText();
      else out += *p;
    } else {
      out += *p;
    }
  }
  return out;
}

void configureLocked() {
  if (gFile) {
    std::fclose(gFile);
    gFile = nullptr;
  }
  const char* path = envValue("SF_DEBUG_FILE");
  if (path) gFile = std::fopen(expandPath(path).c_str(), "a");
  gLevel.store(parseLevel(envValue("SF_DEBUG")), std::memory_order_release);
}

int level() {
  int l = gLevel.load(std::memory_order_acquire);
  if (l >= 0) return l;
  std::lock_guard<std::mutex> lock(gMutex);
  if (gLevel.load(std::memory_order_acquire) < 0) configureLocked();
  return gLevel.load(std::memory_order_acquire);
}

const char* levelName(LogLevel l) {
  switch (l) {
    case LogLevel::kWarn: return "WARN";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kTrace: return "TRACE";
    default: return "NONE";
  }
}

}  // namespace

bool logEnabled(LogLevel l) noexcept {
  return l != LogLevel::kNone && int(l) <= level();
}

void logWrite(LogLevel l, const char* subsystem, const std::string& message) noexcept {
  try {
    static const std::string host = hostName();
    const std::string line = "sfsync " + host + ":" + std::to_string(::getpid()) + ":" +
                             rankText() + " " + levelName(l) + " " +
                             (subsystem && *subsystem ? subsystem : "-") + " " + message + "\n";
    std::lock_guard<std::mutex> lock(gMutex);
    FILE* f = gFile ? gFile : stderr;
    std::fwrite(line.data(), 1, line.size(), f);
    std::fflush(f);
  } catch (...) {
  }
}

void logSetRank(int rank) noexcept { gRank.store(rank, std::memory_order_relaxed); }

void logReconfigure() noexcept {
  try {
    std::lock_guard<std::mutex> lock(gMutex);
    configureLocked();
  } catch (...) {
  }
}

}  // namespace sfsync
