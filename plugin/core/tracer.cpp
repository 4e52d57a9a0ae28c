#include "plugin/core/tracer.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>

#include "plugin/core/env.h"
#include "plugin/core/log.h"

namespace sfsync {

namespace {

// Tracers alive now, written at exit if still alive (leaked contexts).
std::mutex& liveMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}
std::set<Tracer*>& live() {
  static std::set<Tracer*>* s = new std::set<Tracer*>;
  return *s;
}
void writeLiveAtExit() {
  std::lock_guard<std::mutex> lock(liveMutex());
  for (Tracer* t : live()) t->write();
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

}  // namespace

std::string Tracer::pathFor(const std::string& pattern, int rank, int worldSize) {
  const size_t at = pattern.find("%r");
  if (at != std::string::npos) {
    return pattern.substr(0, at) + std::to_string(rank) + pattern.substr(at + 2);
  }
  if (worldSize <= 1) return pattern;
  const size_t slash = pattern.rfind('/');
  const size_t dot = pattern.rfind('.');
  const bool hasExt = dot != std::string::npos && (slash == std::string::npos || dot > slash + 1);
  const std::string stem = hasExt ? pattern.substr(0, dot) : pattern;
  const std::string ext = hasExt ? pattern.substr(dot) : "";
  return stem + ".rank" + std::to_string(rank) + ext;
}

std::unique_ptr<Tracer> Tracer::fromEnvironment(int rank, int worldSize) {
  const char* v = envValue("SF_TRACE");
  if (!v) return nullptr;
  return std::make_unique<Tracer>(pathFor(v, rank, worldSize), rank);
}

Tracer::Tracer(std::string path, int rank) : path_(std::move(path)), rank_(rank) {
  nameTrack(0, "host");
  static const bool registered = [] { return std::atexit(writeLiveAtExit) == 0; }();
  (void)registered;
  std::lock_guard<std::mutex> lock(liveMutex());
  live().insert(this);
}

Tracer::~Tracer() {
  {
    std::lock_guard<std::mutex> lock(liveMutex());
    live().erase(this);
  }
  write();
}

double Tracer::nowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void Tracer::span(int tid, const char* name, double startUs, double endUs,
                  const std::string& args) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_.size() >= kMaxEvents) {
    ++dropped_;
    return;
  }
  events_.push_back({'X', tid, name, startUs, endUs - startUs, args});
}

void Tracer::instant(int tid, const char* name, const std::string& args) {
  const double now = nowUs();
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_.size() >= kMaxEvents) {
    ++dropped_;
    return;
  }
  events_.push_back({'i', tid, name, now, 0, args});
}

void Tracer::nameTrack(int tid, const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& t : tracks_) {
    if (t.first == tid) return;
  }
  tracks_.emplace_back(tid, name);
}

bool Tracer::write() noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    if (written_) return true;
    written_ = true;
    // A context that recorded nothing (such as the default context that
    // sf_destroy consults) must not overwrite the file of one that did.
    if (events_.empty()) return true;
    std::ofstream f(path_, std::ios::trunc);
    if (!f) {
      SF_LOG(kWarn, "trace", "SF_TRACE: cannot write '" << path_ << "'");
      return false;
    }
    char buf[128];
    f << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"rank\":" << rank_
      << ",\"dropped_events\":" << dropped_ << "},\"traceEvents\":[\n";
    f << "{\"ph\":\"M\",\"pid\":" << rank_ << ",\"tid\":0,\"name\":\"process_name\",\"args\":{\"name\":\"rank "
      << rank_ << "\"}},\n";
    f << "{\"ph\":\"M\",\"pid\":" << rank_ << ",\"tid\":0,\"name\":\"process_sort_index\",\"args\":{\"sort_index\":"
      << rank_ << "}}";
    for (const auto& t : tracks_) {
      f << ",\n{\"ph\":\"M\",\"pid\":" << rank_ << ",\"tid\":" << t.first
        << ",\"name\":\"thread_name\",\"args\":{\"name\":\"" << escape(t.second) << "\"}}";
    }
    for (const auto& e : events_) {
      std::snprintf(buf, sizeof buf, "%.3f", e.ts);
      f << ",\n{\"ph\":\"" << e.phase << "\",\"pid\":" << rank_ << ",\"tid\":" << e.tid
        << ",\"name\":\"" << e.name << "\",\"ts\":" << buf;
      if (e.phase == 'X') {
        std::snprintf(buf, sizeof buf, "%.3f", e.dur);
        f << ",\"dur\":" << buf;
      } else {
        f << ",\"s\":\"t\"";
      }
      f << ",\"args\":{" << e.args << "}}";
    }
    f << "\n]}\n";
    f.close();
    if (!f) {
      SF_LOG(kWarn, "trace", "SF_TRACE: writing '" << path_ << "' failed");
      return false;
    }
    SF_LOG(kInfo, "trace", "wrote " << events_.size() << " events to " << path_);
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace sfsync
