#pragma once
// The LD_PRELOAD shim's decisions. For every interposed all-reduce:
// whether it is a gradient all-reduce, whether it is sent (passed through)
// or deferred (inside a window; the host gets the local result), the
// accounting, the warnings about misuse (at the call where it becomes
// visible) and the report. Not responsible for reading the call's arguments
// or writing results (the interposers), nor for the window state itself,
// which libsfsync.so publishes (plugin/api/sfsync_internal.h) and this class
// reads through a WindowSource.
//
// Windows come from the default context (explicit mode: the host calls
// sf_begin_accumulation / sf_end_accumulation), or from SF_ACCUMULATION_STEPS
// (automatic mode: PassTracker counts backward passes; every pass but the
// last of each window is deferred once the pass pattern is learned).
//
// What "a window" means to the guard: the deferred gradient all-reduces
// since the last real synchronization (a gradient all-reduce passed outside
// a window). Consecutive windows with no such pass between them are one
// window: a host may bracket each non-final micro-batch on its own. Said at
// once (the call where it becomes visible), an error with SF_STRICT=1:
//  - a window whose deferred bytes grow past those of the longest window
//    that did synchronize, or past N - 1 passes with SF_ACCUMULATION_STEPS=N;
//  - a refused sf_begin_accumulation (a forgotten end) is said by libsfsync
//    at that call; under SF_STRICT=1 the next gradient all-reduce fails.
//  - automatic mode losing its pass track inside a window with deferred
//    passes: exact only if the host did not step its optimizer meanwhile,
//    which a host that synchronizes once per step itself (no_sync()) did;
//    said at that call, naming the window (shim/README.md, "the rule when
//    the track is lost").
// A window still open at exit is said at exit (nothing earlier shows it when
// no window ever synchronized).

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "plugin/api/sfsync_internal.h"
#include "shim/policy/pass_tracker.h"
#include "shim/policy/reduce_probe.h"
#include "shim/policy/shim_call.h"

namespace sfshim {

constexpr int64_t kDefaultShimMinBytes = 65536;

struct ShimConfig {
  int64_t minBytes = kDefaultShimMinBytes;  // SF_SHIM_MIN_BYTES: smaller all-reduces always pass
  int64_t accumulationSteps = 0;  // SF_ACCUMULATION_STEPS; 0: windows from the default context
  bool stepsInvalid = false;      // SF_ACCUMULATION_STEPS did not parse: pass everything
  bool strict = false;            // SF_STRICT=1 (libsfsync reads it; see sfsync_internal.h)
  std::string reportPath;         // SF_SHIM_REPORT; %p: pid, %r: rank
  std::vector<std::string> problems;  // variables that did not parse, said once
  // Made at a call from a host whose Gloo is not the system libgloo.so.0 the
  // shim was built against (shim/gloo_host.h): nothing can be deferred, so
  // the mode is off and automatic windows are not announced.
  bool foreignGloo = false;
};

// Reads SF_SHIM_MIN_BYTES, SF_ACCUMULATION_STEPS, SF_SHIM_REPORT (not
// SF_STRICT: the caller takes it from libsfsync's window state).
ShimConfig shimConfigFromEnvironment();

// Byte counts saturate at INT64_MAX; a negative call size counts 0.
struct ShimCounters {
  int64_t calls = 0;                 // every interposed all-reduce
  int64_t callsGloo = 0;
  int64_t callsNccl = 0;
  int64_t foreignGlooCalls = 0;      // Gloo all-reduces of a foreign Gloo: passed unread
  int64_t deferred = 0;              // gradient all-reduces not sent
  int64_t passed = 0;                // all-reduces forwarded (gradient or not)
  int64_t bytesDeferred = 0;
  int64_t bytesSent = 0;             // bytes of every forwarded all-reduce
  int64_t gradientCallsSent = 0;     // forwarded gradient all-reduces
  int64_t gradientBytesSent = 0;
  int64_t windows = 0;               // windows begun (explicit) or started (automatic)
  int64_t refusedBegins = 0;         // sf_begin_accumulation refused inside a window
  std::vector<int64_t> unsynchronizedWindows;  // first window of each one warned about
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
  // One message line (no prefix, no newline) at SF_LOG_WARN or SF_LOG_INFO.
  using Sink = std::function<void(int level, const std::string& line)>;
  // Fills the default context's window state (struct_size set by the
  // caller); false if it cannot be had (then: no explicit windows).
  using WindowSource = std::function<bool(sf_window_state_v1* state)>;
  enum class Mode { kExplicit, kAutomatic, kOff, kPython };

  static constexpr size_t kMaxWindowRecords = 10000;

  // `windows` may be empty: then no explicit windows. `sink` receives every
  // message (default: stderr).
  ShimPolicy(ShimConfig config, WindowSource windows, Sink sink = nullptr);

  sf_shim_decision decide(const sf_shim_call& call);
  // A Gloo all-reduce of a host whose Gloo is not the one the shim was built
  // against: its arguments are never read. `why` (said once, at WARN) names
  // the host's Gloo and the alternative. Passed (counted, no bytes), or with
  // SF_STRICT=1 failed (every such call, and finish() returns false).
  sf_shim_decision decideForeignGloo(const std::string& why);
  // The in-process layer follows this Python host's windows (its first DDP is
  // attached): from now on every call passes, counted (mode "python"), and a
  // foreign Gloo is expected. Said once at INFO.
  void followInProcess();
  // Why the latest SF_SHIM_FAIL failed (for the host's error).
  std::string failure() const;

  // At exit: report a window left unsynchronized, write the report file.
  // Idempotent. @return false when SF_STRICT and something was an error.
  bool finish();

  std::string reportJson() const;
  ShimCounters counters() const;
  std::vector<WindowRecord> windowRecords() const;
  Mode mode() const;
  const PassTracker& tracker() const { return tracker_; }  // read under no lock: tests only
  ReduceClassifier& classifier() { return classifier_; }

 private:
  bool isGradient(const sf_shim_call& c) const;
  sf_shim_decision decideExplicit(const sf_shim_call& c, const sf_window_state_v1& s);
  sf_shim_decision decideAutomatic(const sf_shim_call& c);
  sf_shim_decision pass(const sf_shim_call& c);
  sf_shim_decision passGradient(const sf_shim_call& c, int64_t window);
  sf_shim_decision defer(const sf_shim_call& c, int64_t window);
  sf_shim_decision fail(int64_t window, const std::string& why);
  // After a deferral: the open window past N - 1 passes (SF_ACCUMULATION_STEPS)
  // or, `byLongest`, past what any synchronized window held? Said once a window.
  bool grewTooLong(bool byLongest);
  void reportUnsynchronized(const std::string& when);
  WindowRecord* record(int64_t window);
  void say(const std::string& message, int level = SF_LOG_WARN);
  void sayOnce(bool& said, const std::string& message);
  std::string reportJsonLocked() const;
  std::string reportPath() const;
  std::string windowName() const;

  const ShimConfig config_;
  const WindowSource windows_;
  Sink sink_;
  ReduceClassifier classifier_;

  mutable std::mutex mutex_;
  Mode mode_;
  PassTracker tracker_;
  ShimCounters counters_;
  std::vector<WindowRecord> records_;
  int64_t window_ = 0;          // the latest window seen
  // The open window: deferred calls since the last real synchronization.
  bool open_ = false;
  int64_t openFrom_ = 0;        // first and latest (explicit) window in it
  int64_t openTo_ = 0;
  int64_t openCalls_ = 0;
  int64_t openBytes_ = 0;
  bool openSaid_ = false;       // warned about (grew too long)
  int64_t longestSynced_ = 0;   // deferred bytes of the longest window that synchronized
  int64_t syncBytes_ = 0;       // gradient bytes of the latest synchronization
  bool syncing_ = false;        // passed gradient calls since the window closed
  int64_t refusedSeen_ = 0;     // refused begins already acted on
  bool failedStrict_ = false;   // SF_STRICT tripped
  std::string failure_;
  int32_t worldSize_ = 0;
  int32_t rank_ = -1;
  bool finished_ = false;
  bool saidSwitch_ = false;
  bool saidLost_ = false;
  bool saidNoContext_ = false;
  bool saidForeign_ = false;
};

}  // namespace sfshim
