#pragma once
// The LD_PRELOAD shim's decisions. For every interposed all-reduce:
// whether it is a gradient all-reduce, whether it is sent (passed through)
// or deferred (inside a window; the host gets the local result), the
// accounting, the guard against windows that were never synchronized, and
// the report. Not responsible for reading the call's arguments or writing
// results (the shim and sf_shim_local_result).
//
// Windows come from the default context (explicit mode: the host calls
// sf_begin_accumulation / sf_end_accumulation), or from SF_ACCUMULATION_STEPS
// (automatic mode: PassTracker counts backward passes; every pass but the
// last of each window is deferred once the pass pattern is learned).

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "plugin/api/sfsync_shim_internal.h"
#include "plugin/shim_policy/pass_tracker.h"
#include "plugin/shim_policy/reduce_probe.h"

namespace sfsync {

class Context;

constexpr int64_t kDefaultShimMinBytes = 65536;

struct ShimConfig {
  int64_t minBytes = kDefaultShimMinBytes;  // SF_SHIM_MIN_BYTES: smaller all-reduces always pass
  int64_t accumulationSteps = 0;  // SF_ACCUMULATION_STEPS; 0: windows from the default context
  bool stepsInvalid = false;      // SF_ACCUMULATION_STEPS did not parse: pass everything
  bool strict = false;            // SF_STRICT=1: an unsynchronized window is fatal
  std::string reportPath;         // SF_SHIM_REPORT; %p: pid, %r: rank
  std::vector<std::string> problems;  // variables that did not parse, said once
};

// Reads SF_SHIM_MIN_BYTES, SF_ACCUMULATION_STEPS, SF_STRICT, SF_SHIM_REPORT.
ShimConfig shimConfigFromEnvironment();

struct ShimCounters {
  int64_t calls = 0;                 // every interposed all-reduce
  int64_t callsGloo = 0;
  int64_t callsNccl = 0;
  int64_t deferred = 0;              // gradient all-reduces not sent
  int64_t passed = 0;                // all-reduces forwarded (gradient or not)
  int64_t bytesDeferred = 0;
  int64_t bytesSent = 0;             // bytes of every forwarded all-reduce
  int64_t gradientCallsSent = 0;     // forwarded gradient all-reduces
  int64_t gradientBytesSent = 0;
  int64_t windows = 0;               // windows begun (explicit) or started (automatic)
  std::vector<int64_t> unsynchronizedWindows;
};

// What happened in one window, including its synchronization.
struct WindowRecord {
  int64_t deferredCalls = 0;
  int64_t bytesDeferred = 0;
  int64_t gradientCallsSent = 0;  // automatic mode, passes before learning: not counted
  int64_t gradientBytesSent = 0;
};

class ShimPolicy {
 public:
  using Sink = std::function<void(const std::string& line)>;
  enum class Mode { kExplicit, kAutomatic, kOff };

  static constexpr size_t kMaxWindowRecords = 10000;

  // `windows`: the default context (may be null: then no explicit windows).
  // `sink` receives every message line (default: stderr).
  ShimPolicy(ShimConfig config, const Context* windows, Sink sink = nullptr);

  sf_shim_decision decide(const sf_shim_call& call);

  // At exit: report a window left unsynchronized, write the report file.
  // Idempotent. @return false when SF_STRICT and some window was left so.
  bool finish();

  std::string reportJson() const;
  ShimCounters counters() const;
  std::vector<WindowRecord> windowRecords() const;
  Mode mode() const;
  const PassTracker& tracker() const { return tracker_; }  // read under no lock: tests only
  ReduceClassifier& classifier() { return classifier_; }

 private:
  bool isGradient(const sf_shim_call& c) const;
  sf_shim_decision decideExplicit(const sf_shim_call& c);
  sf_shim_decision decideAutomatic(const sf_shim_call& c);
  sf_shim_decision pass(const sf_shim_call& c);
  sf_shim_decision passGradient(const sf_shim_call& c, int64_t window);
  sf_shim_decision defer(const sf_shim_call& c, int64_t window);
  // Moves to window `w`; reports the pending window if it was never
  // synchronized. @return true if the call must fail (SF_STRICT).
  bool enterWindow(int64_t w);
  void reportUnsynchronized(const std::string& before);
  WindowRecord* record(int64_t window);
  void say(const std::string& message);
  void sayOnce(bool& said, const std::string& message);
  std::string reportJsonLocked() const;
  std::string reportPath() const;

  const ShimConfig config_;
  const Context* const windows_;
  Sink sink_;
  ReduceClassifier classifier_;

  mutable std::mutex mutex_;
  Mode mode_;
  PassTracker tracker_;
  ShimCounters counters_;
  std::vector<WindowRecord> records_;
  int64_t window_ = 0;          // the latest window seen
  bool pending_ = false;        // deferred calls in pendingWindow_ not yet synchronized
  int64_t pendingWindow_ = 0;
  int64_t pendingCalls_ = 0;
  int64_t pendingBytes_ = 0;
  bool failed_ = false;          // SF_STRICT tripped
  int32_t worldSize_ = 0;
  int32_t rank_ = -1;
  bool finished_ = false;
  bool saidSwitch_ = false;
  bool saidLost_ = false;
  bool saidNoContext_ = false;
};

}  // namespace sfsync
