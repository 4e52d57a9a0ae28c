#include "shim/policy/shim_policy.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "plugin/core/dtype.h"
#include "plugin/core/env.h"

namespace sfshim {

namespace {

using sfsync::dtypeValid;
using sfsync::floatToBf16;
using sfsync::floatToHalf;

// A whole decimal integer in [min, max], or false.
bool parseInt(const char* text, int64_t min, int64_t max, int64_t* out) {
  if (!text || !*text) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < min || v > max) return false;
  *out = v;
  return true;
}

void encodeScalar(double factor, sf_dtype dtype, unsigned char* out) {
  std::memset(out, 0, 8);
  switch (dtype) {
    case SF_DTYPE_FLOAT32: {
      const float f = float(factor);
      std::memcpy(out, &f, 4);
      break;
    }
    case SF_DTYPE_FLOAT64: std::memcpy(out, &factor, 8); break;
    case SF_DTYPE_FLOAT16: {
      const uint16_t h = floatToHalf(float(factor));
      std::memcpy(out, &h, 2);
      break;
    }
    case SF_DTYPE_BFLOAT16: {
      const uint16_t b = floatToBf16(float(factor));
      std::memcpy(out, &b, 2);
      break;
    }
    default: break;
  }
}

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

const char* modeName(ShimPolicy::Mode m) {
  switch (m) {
    case ShimPolicy::Mode::kExplicit: return "explicit";
    case ShimPolicy::Mode::kAutomatic: return "automatic";
    case ShimPolicy::Mode::kPython: return "python";
    default: return "off";
  }
}

const char* stateName(PassTracker::State s) {
  switch (s) {
    case PassTracker::State::kLearning: return "learning";
    case PassTracker::State::kTracking: return "tracking";
    default: return "lost";
  }
}

// Byte counts (finding F2 of tests/fuzz/README.md): a negative count (a size
// that wrapped) counts as 0, and a sum stops at INT64_MAX instead of
// overflowing.
void addBytes(int64_t& total, int64_t bytes) {
  if (bytes < 0) bytes = 0;
  if (__builtin_add_overflow(total, bytes, &total)) total = INT64_MAX;
}

}  // namespace

ShimConfig shimConfigFromEnvironment() {
  ShimConfig c;
  if (const char* v = sfsync::envRawValue("SF_SHIM_MIN_BYTES")) {
    if (!parseInt(v, 0, INT64_MAX, &c.minBytes)) {
      c.minBytes = kDefaultShimMinBytes;
      c.problems.push_back(std::string("SF_SHIM_MIN_BYTES=") + v +
                           " is not a byte count; using " + std::to_string(c.minBytes));
    }
  }
  if (const char* v = sfsync::envValue("SF_ACCUMULATION_STEPS")) {
    if (!parseInt(v, 1, INT32_MAX, &c.accumulationSteps)) {
      c.accumulationSteps = 0;
      c.stepsInvalid = true;
      c.problems.push_back(std::string("SF_ACCUMULATION_STEPS=") + v +
                           " is not a positive integer: passing every call through");
    }
  }
  if (const char* v = sfsync::envRawValue("SF_SHIM_REPORT")) c.reportPath = v;
  return c;
}

ShimPolicy::ShimPolicy(ShimConfig config, WindowSource windows, Sink sink)
    : config_(std::move(config)), windows_(std::move(windows)), sink_(std::move(sink)) {
  if (!sink_) {
    sink_ = [](int, const std::string& line) {
      std::fputs(("sfsync shim: " + line + "\n").c_str(), stderr);
    };
  }
  mode_ = config_.stepsInvalid || config_.foreignGloo ? Mode::kOff
          : config_.accumulationSteps > 0 ? Mode::kAutomatic
                                          : Mode::kExplicit;
  for (const auto& p : config_.problems) say(p);
  if (mode_ == Mode::kAutomatic) {
    const int64_t n = config_.accumulationSteps;
    say("SF_ACCUMULATION_STEPS=" + std::to_string(n) + ": automatic windows of " +
            std::to_string(n) + " backward passes, learned from the first " +
            std::to_string(PassTracker::kCopies + 1) +
            " passes; then every pass but the last of each " + std::to_string(n) +
            " is deferred. The shim sees all-reduces only, not the optimizer step nor the "
            "weights: if the host steps more often than every " + std::to_string(n) +
            " passes, ranks drift apart and nothing here can tell. Check the replicas: "
            "verify_every=K in the Python package (sfsync.torch), or sf_check_replicas from "
            "any language",
        SF_LOG_INFO);
  }
}

void ShimPolicy::say(const std::string& message, int level) { sink_(level, message); }

void ShimPolicy::followInProcess() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (mode_ == Mode::kPython) return;
  mode_ = Mode::kPython;
  say("the in-process layer follows this Python host's windows (its DistributedDataParallel "
      "models): every all-reduce passes through the shim from now on",
      SF_LOG_INFO);
}

void ShimPolicy::sayOnce(bool& said, const std::string& message) {
  if (said) return;
  said = true;
  say(message);
}

bool ShimPolicy::isGradient(const sf_shim_call& c) const {
  return dtypeValid(c.dtype) && (c.op == SF_SHIM_OP_SUM || c.op == SF_SHIM_OP_AVERAGE) &&
         c.bytes > 0 && c.bytes >= config_.minBytes && c.world_size >= 1;
}

sf_shim_decision ShimPolicy::decide(const sf_shim_call& c) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++counters_.calls;
  if (c.api == SF_SHIM_API_GLOO) ++counters_.callsGloo;
  if (c.api == SF_SHIM_API_NCCL) ++counters_.callsNccl;
  if (c.world_size > 0) worldSize_ = c.world_size;
  if (c.rank >= 0) rank_ = c.rank;
  if (!isGradient(c)) return pass(c);
  sf_window_state_v1 s{};
  s.struct_size = sizeof s;
  const bool haveWindows = windows_ && windows_(&s) && s.context_made;
  if (haveWindows && s.refused_begins > refusedSeen_) {
    // libsfsync said it at the refused call; SF_STRICT makes it an error here,
    // at the first gradient all-reduce after it.
    refusedSeen_ = s.refused_begins;
    counters_.refusedBegins = s.refused_begins;
    if (config_.strict) {
      return fail(s.windows_begun,
                  "sf_begin_accumulation was refused inside window " +
                      std::to_string(s.refused_begin_window) +
                      " (a forgotten sf_end_accumulation: the window never ended, so every "
                      "gradient all-reduce since stayed local) and SF_STRICT=1");
    }
  }
  if (mode_ == Mode::kAutomatic && haveWindows && s.windows_begun > 0) {
    mode_ = Mode::kExplicit;
    sayOnce(saidSwitch_,
            "SF_ACCUMULATION_STEPS is set but the host calls sf_begin_accumulation itself: "
            "following the host's windows");
  }
  switch (mode_) {
    case Mode::kExplicit:
      if (!haveWindows) {
        // Not made yet is legal (a host may open its first window later): INFO.
        if (!saidNoContext_) {
          saidNoContext_ = true;
          say(windows_ ? "gradient all-reduces, but the host has not made sfsync's default "
                         "context (yet): no windows, passing them through"
                       : "no window state from libsfsync.so: passing every call through",
              windows_ ? SF_LOG_INFO : SF_LOG_WARN);
        }
        return passGradient(c, 0);
      }
      return decideExplicit(c, s);
    case Mode::kAutomatic: return decideAutomatic(c);
    default: return passGradient(c, 0);
  }
}

sf_shim_decision ShimPolicy::decideExplicit(const sf_shim_call& c,
                                            const sf_window_state_v1& s) {
  const int64_t w = s.windows_begun;
  if (w > window_) window_ = w;
  if (!s.in_window) return passGradient(c, w);
  const sf_shim_decision d = defer(c, w);
  if (grewTooLong(true) && config_.strict) return fail(w, failure_);
  return d;
}

sf_shim_decision ShimPolicy::decideAutomatic(const sf_shim_call& c) {
  const PassTracker::State before = tracker_.state();
  const PassTracker::Position pos = tracker_.observe({c.comm, c.buffer, c.bytes, c.dtype});
  if (pos.state == PassTracker::State::kLost) {
    if (!saidLost_ && open_) {
      // Passes of the current window were deferred, and the pass that would
      // have carried them may never come. That is exact only if the host did
      // not step its optimizer in between; a host that synchronizes once per
      // step itself (no_sync()) did, and nothing the shim sees tells the two
      // apart: say it now, naming the window (SF_STRICT=1: this call fails).
      saidLost_ = true;
      std::ostringstream s;
      s << "SF_ACCUMULATION_STEPS=" << config_.accumulationSteps
        << ": cannot tell where backward passes start (" << tracker_.lostReason()
        << "); passing every call through from now on. " << windowName() << " (backward passes "
        << (openFrom_ - 1) * config_.accumulationSteps + 1 << "-"
        << openTo_ * config_.accumulationSteps << " as the shim counts them) had "
        << openCalls_ << " gradient all-reduces (" << openBytes_
        << " bytes) deferred before this call, which is correct only if the host did not step "
           "its optimizer since its last synchronization. A host that synchronizes once per "
           "optimizer step itself (DDP with no_sync(), or no accumulation) did: those were its "
           "real synchronizations and their gradients were not averaged across the ranks, so "
           "the replicas may differ from "
        << windowName()
        << " on. Do not set SF_ACCUMULATION_STEPS for a host that uses no_sync(); check the "
           "replicas with verify_every=K (sfsync.torch) or sf_check_replicas"
        << (config_.strict ? " (SF_STRICT=1: this all-reduce fails)"
                           : " (SF_STRICT=1 makes this an error)");
      if (!openSaid_) counters_.unsynchronizedWindows.push_back(openFrom_);
      open_ = false;  // said: not a synchronized window, not said again at exit
      say(s.str());
      if (config_.strict) return fail(openFrom_, s.str());
      failure_ = s.str();
      return passGradient(c, -1);
    }
    sayOnce(saidLost_, "SF_ACCUMULATION_STEPS=" + std::to_string(config_.accumulationSteps) +
                           ": cannot tell where backward passes start (" +
                           tracker_.lostReason() +
                           "); passing every call through from now on (correct, not faster)");
    return passGradient(c, -1);
  }
  if (pos.state == PassTracker::State::kLearning) return passGradient(c, -1);

  const int64_t n = config_.accumulationSteps;
  const int64_t w = (pos.pass - 1) / n + 1;
  if (before == PassTracker::State::kLearning) {
    // Just learned: the passes so far all went through, each of passBytes.
    for (int64_t p = 1; p <= tracker_.passesCompleted(); ++p) {
      if (WindowRecord* r = record((p - 1) / n + 1)) addBytes(r->gradientBytesSent, tracker_.passBytes());
    }
    passGradient(c, -1);
    window_ = w;
    sf_shim_decision d{};
    d.action = SF_SHIM_PASS;
    d.window = w;
    return d;
  }
  if (w > window_) window_ = w;
  // Never the last pass of a window: that one synchronizes it.
  if (pos.trusted && pos.pass % n != 0) {
    const sf_shim_decision d = defer(c, w);
    // Its own windows: only N bounds them (the first ones are shorter: learning).
    if (grewTooLong(false) && config_.strict) return fail(w, failure_);
    return d;
  }
  return passGradient(c, w);
}

std::string ShimPolicy::windowName() const {
  return openFrom_ == openTo_ ? "window " + std::to_string(openFrom_)
                              : "windows " + std::to_string(openFrom_) + "-" +
                                    std::to_string(openTo_) + " (consecutive, no pass between: one)";
}

bool ShimPolicy::grewTooLong(bool byLongest) {
  if (openSaid_) return false;
  // The unit of SF_ACCUMULATION_STEPS: the learned pass, else the bytes the
  // latest synchronization carried (a host's last micro-batch).
  const int64_t passBytes = tracker_.passBytes() > 0 ? tracker_.passBytes() : syncBytes_;
  const int64_t n = config_.accumulationSteps;
  int64_t stepsLimit = 0;
  if (n > 0 && passBytes > 0 && __builtin_mul_overflow(n - 1, passBytes, &stepsLimit)) {
    stepsLimit = INT64_MAX;
  }
  const bool pastLongest = byLongest && longestSynced_ > 0 && openBytes_ > longestSynced_;
  const bool pastSteps = stepsLimit > 0 && openBytes_ > stepsLimit;
  if (!pastLongest && !pastSteps) return false;
  openSaid_ = true;
  counters_.unsynchronizedWindows.push_back(openFrom_);
  std::ostringstream s;
  s << windowName() << " has deferred " << openCalls_ << " gradient all-reduces (" << openBytes_
    << " bytes) without a synchronization, more than ";
  if (pastSteps) {
    s << "the " << n - 1 << " passes of " << passBytes << " bytes that SF_ACCUMULATION_STEPS="
      << n << " allows";
  } else {
    s << "the longest window that did synchronize (" << longestSynced_ << " bytes)";
  }
  s << ": a window that never ends, or whose last micro-batch is inside it, steps the optimizer "
       "on local gradients"
    << (config_.strict ? " (SF_STRICT=1: this all-reduce fails)"
                       : " (SF_STRICT=1 makes this an error)");
  say(s.str());
  failure_ = s.str();
  return true;
}

void ShimPolicy::reportUnsynchronized(const std::string& when) {
  if (!openSaid_) counters_.unsynchronizedWindows.push_back(openFrom_);
  std::ostringstream s;
  s << windowName() << " ended with " << openCalls_ << " deferred gradient all-reduces ("
    << openBytes_ << " bytes) and no real synchronization " << when
    << ": the optimizer stepped on local gradients"
    << (config_.strict ? " (SF_STRICT=1: fatal)" : " (SF_STRICT=1 makes this fatal)");
  say(s.str());
  open_ = false;
}

sf_shim_decision ShimPolicy::decideForeignGloo(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++counters_.calls;
  ++counters_.callsGloo;
  ++counters_.foreignGlooCalls;
  if (mode_ == Mode::kPython) {  // expected: the in-process layer follows this host
    ++counters_.passed;
    return sf_shim_decision{};
  }
  const std::string said =
      why + (config_.strict ? " (SF_STRICT=1: this all-reduce fails)"
                            : " (they pass through untouched; SF_STRICT=1 makes this an error)");
  sayOnce(saidForeign_, said);
  if (config_.strict) return fail(window_, said);
  ++counters_.passed;
  return sf_shim_decision{};  // SF_SHIM_PASS
}

sf_shim_decision ShimPolicy::fail(int64_t window, const std::string& why) {
  failedStrict_ = true;
  failure_ = why;
  sf_shim_decision d{};
  d.action = SF_SHIM_FAIL;
  d.window = window;
  return d;
}

std::string ShimPolicy::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

WindowRecord* ShimPolicy::record(int64_t window) {
  if (window < 1 || size_t(window) > kMaxWindowRecords) return nullptr;
  if (records_.size() < size_t(window)) records_.resize(size_t(window));
  return &records_[size_t(window) - 1];
}

sf_shim_decision ShimPolicy::pass(const sf_shim_call& c) {
  ++counters_.passed;
  addBytes(counters_.bytesSent, c.bytes);
  sf_shim_decision d{};
  d.action = SF_SHIM_PASS;
  d.window = window_;
  return d;
}

sf_shim_decision ShimPolicy::passGradient(const sf_shim_call& c, int64_t window) {
  sf_shim_decision d = pass(c);
  ++counters_.gradientCallsSent;
  addBytes(counters_.gradientBytesSent, c.bytes);
  if (WindowRecord* r = record(window)) {
    ++r->gradientCallsSent;
    addBytes(r->gradientBytesSent, c.bytes);
  }
  // A real synchronization: what was deferred before is carried.
  if (open_) {
    if (openBytes_ > longestSynced_) longestSynced_ = openBytes_;
    open_ = false;
    syncing_ = true;
    syncBytes_ = 0;
  }
  if (syncing_) addBytes(syncBytes_, c.bytes);
  d.window = window > 0 ? window : 0;
  return d;
}

sf_shim_decision ShimPolicy::defer(const sf_shim_call& c, int64_t window) {
  ++counters_.deferred;
  addBytes(counters_.bytesDeferred, c.bytes);
  if (WindowRecord* r = record(window)) {
    ++r->deferredCalls;
    addBytes(r->bytesDeferred, c.bytes);
  }
  syncing_ = false;
  if (!open_) {
    open_ = true;
    openFrom_ = window;
    openCalls_ = 0;
    openBytes_ = 0;
    openSaid_ = false;
  }
  openTo_ = window;
  ++openCalls_;
  addBytes(openBytes_, c.bytes);
  sf_shim_decision d{};
  d.action = SF_SHIM_DEFER;
  d.factor = c.op == SF_SHIM_OP_SUM ? double(c.world_size) : 1.0;
  encodeScalar(d.factor, c.dtype, d.factor_scalar);
  d.window = window;
  return d;
}

bool ShimPolicy::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_) return !(config_.strict && (failedStrict_ || !counters_.unsynchronizedWindows.empty()));
  finished_ = true;
  if (open_) reportUnsynchronized("before exit");
  if (mode_ == Mode::kAutomatic && tracker_.state() == PassTracker::State::kLearning &&
      counters_.gradientCallsSent > 0) {
    say("SF_ACCUMULATION_STEPS=" + std::to_string(config_.accumulationSteps) + ": " +
        std::to_string(counters_.gradientCallsSent) +
        " gradient all-reduces, but no per-pass pattern learned (it takes " +
        std::to_string(PassTracker::kCopies + 1) +
        " backward passes): every call was passed through");
  }
  if (!config_.reportPath.empty()) {
    const std::string path = reportPath();
    std::ofstream f(path, std::ios::trunc);
    f << reportJsonLocked() << "\n";
    f.close();
    if (!f) say("cannot write SF_SHIM_REPORT=" + path + ": " + std::strerror(errno));
  }
  return !(config_.strict && (failedStrict_ || !counters_.unsynchronizedWindows.empty()));
}

std::string ShimPolicy::reportPath() const {
  std::string out;
  const std::string& in = config_.reportPath;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == '%' && i + 1 < in.size() && (in[i + 1] == 'p' || in[i + 1] == 'r')) {
      if (in[i + 1] == 'p' || rank_ < 0) {
        out += (in[i + 1] == 'r' ? "pid" : "") + std::to_string(long(getpid()));
      } else {
        out += std::to_string(rank_);
      }
      ++i;
    } else {
      out += in[i];
    }
  }
  return out;
}

std::string ShimPolicy::reportJson() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reportJsonLocked();
}

std::string ShimPolicy::reportJsonLocked() const {
  const ShimCounters& k = counters_;
  int64_t windows = window_;
  if (mode_ == Mode::kExplicit) windows = window_;
  std::ostringstream s;
  s << "{\"pid\": " << long(getpid()) << ", \"rank\": " << rank_
    << ", \"world_size\": " << worldSize_ << ", \"mode\": \"" << modeName(mode_)
    << "\", \"accumulation_steps\": " << config_.accumulationSteps
    << ", \"min_bytes\": " << config_.minBytes << ", \"strict\": " << (config_.strict ? 1 : 0)
    << ",\n \"calls\": " << k.calls << ", \"calls_gloo\": " << k.callsGloo
    << ", \"calls_nccl\": " << k.callsNccl << ", \"foreign_gloo_calls\": " << k.foreignGlooCalls
    << ", \"deferred\": " << k.deferred
    << ", \"passed\": " << k.passed << ", \"bytes_deferred\": " << k.bytesDeferred
    << ", \"bytes_sent\": " << k.bytesSent << ", \"gradient_calls_sent\": " << k.gradientCallsSent
    << ", \"gradient_bytes_sent\": " << k.gradientBytesSent << ",\n \"windows\": " << windows
    << ", \"refused_begins\": " << k.refusedBegins
    << ", \"longest_synchronized_window_bytes\": " << longestSynced_
    << ", \"unsynchronized_windows\": [";
  for (size_t i = 0; i < k.unsynchronizedWindows.size(); ++i) {
    s << (i ? ", " : "") << k.unsynchronizedWindows[i];
  }
  s << "],\n \"automatic\": {\"state\": \"" << stateName(tracker_.state())
    << "\", \"pass_bytes\": " << tracker_.passBytes()
    << ", \"calls_per_pass\": " << tracker_.callsPerPass()
    << ", \"learned_after_passes\": " << tracker_.learnedAfterPasses()
    << ", \"passes\": " << tracker_.passesCompleted()
    << ", \"reason\": " << jsonString(tracker_.lostReason()) << "},\n \"per_window\": [";
  for (size_t i = 0; i < records_.size(); ++i) {
    const WindowRecord& r = records_[i];
    s << (i ? ",\n  " : "\n  ") << "{\"window\": " << i + 1
      << ", \"deferred_calls\": " << r.deferredCalls << ", \"bytes_deferred\": " << r.bytesDeferred
      << ", \"gradient_calls_sent\": " << r.gradientCallsSent
      << ", \"gradient_bytes_sent\": " << r.gradientBytesSent << "}";
  }
  s << "]}";
  return s.str();
}

ShimCounters ShimPolicy::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ShimCounters k = counters_;
  k.windows = window_;
  return k;
}

std::vector<WindowRecord> ShimPolicy::windowRecords() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return records_;
}

ShimPolicy::Mode ShimPolicy::mode() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mode_;
}

}  // namespace sfshim
