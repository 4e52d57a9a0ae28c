#pragma once
// The trace (SF_TRACE=path.json): what a context did and when, as a
// Chrome / Perfetto trace ("traceEvents" JSON), one process per rank
// (pid = rank), one track for the host's calls (tid 0: windows, backward
// passes seen through grad-ready, bucket launches and finishes, the
// synchronize wait) and one per transport lane (tid 1 + lane: each bucket
// piece on the wire). Timestamps are microseconds of the system clock, so
// files of ranks on one machine line up. Events are kept in memory (bounded)
// and written when the context is destroyed, or at exit for contexts that
// live until then (the default context); a tracer that recorded nothing
// writes no file. Two contexts of one rank in one process write the same
// file: the last one written wins. Not responsible for what is traced.
//
// Path: "%r" in SF_TRACE becomes the rank; without it, a world of more than
// one rank writes <stem>.rank<r><ext> (trace.json -> trace.rank1.json).

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace sfsync {

class Tracer {
 public:
  // Events kept at most; later ones are counted and dropped.
  static constexpr size_t kMaxEvents = 1 << 20;

  // The tracer SF_TRACE asks for, or nullptr when it is unset or empty.
  static std::unique_ptr<Tracer> fromEnvironment(int rank, int worldSize);
  // The file a rank writes for `pattern` (see above).
  static std::string pathFor(const std::string& pattern, int rank, int worldSize);

  Tracer(std::string path, int rank);
  ~Tracer();  // writes the file (once)
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // Microseconds of the system clock.
  static double nowUs();
  // A complete event ("X") on track `tid`; `args` is a JSON object body
  // (without braces) or empty. Thread-safe.
  void span(int tid, const char* name, double startUs, double endUs, const std::string& args = "");
  // An instant event ("i") on track `tid`.
  void instant(int tid, const char* name, const std::string& args = "");
  // Names a track (tid 0 "host", 1 + k "lane k").
  void nameTrack(int tid, const std::string& name);
  // Writes the file now (later events are not written); false if it cannot.
  bool write() noexcept;

  const std::string& path() const { return path_; }

 private:
  struct Event {
    char phase;
    int tid;
    const char* name;
    double ts, dur;
    std::string args;
  };

  const std::string path_;
  const int rank_;
  std::mutex mutex_;
  std::vector<Event> events_;
  std::vector<std::pair<int, std::string>> tracks_;
  int64_t dropped_ = 0;
  bool written_ = false;
};

}  // namespace sfsync
