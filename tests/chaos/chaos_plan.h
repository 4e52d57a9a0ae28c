#pragma once
// One chaos session's plan: the training run every rank does (the toy model
// of samples/c, windows, caps, buffers) and the one fault injected into it.
// The driver (sfsync-chaos) draws plans; ranks receive one as a single
// "key=value,..." argument, so that any session can be replayed exactly.
// Responsible for the plan and its text form; not for running or judging it.

#include <cstdint>
#include <string>
#include <vector>

namespace sfchaos {

enum class Fault : int {
  kNone = 0,     // a plain session: every rank completes, weights equal the reference
  kKill,         // the target rank dies (SIGKILL; abandons its context in thread mode)
  kStop,         // the target rank stops (SIGSTOP; sleeps past the timeout in thread mode)
  kLate,         // the target rank starts delayMs late
  kExtraSync,    // the target calls sf_synchronize once more after window atWindow
  kMissingSync,  // the target skips sf_synchronize of window atWindow
  kLayout,       // the target registers a different layout (see LayoutDiff)
  kGarbage,      // every rank makes invalid calls between valid ones
  kStranger,     // a stranger connects to the env:// store (process mode)
  kCount
};

enum class Point : int {
  kRendezvous = 0,  // while the peers connect (the target's first synchronization)
  kWindow,          // inside window atWindow, half-way through its micro-batches
  kMidBucket,       // after grad-ready of half the gradients outside the window (buckets in flight)
  kTeardown,        // after the last synchronization, before sf_destroy
  kRandomCall,      // before the callIndex-th sfsync call
  kTimer,           // delayMs after start, wherever the rank is (process mode)
  kCount
};

enum class LayoutDiff : int { kNumel = 0, kDtype, kCount, kCap, kReduceOp, kNum };

const char* faultName(Fault f);
const char* pointName(Point p);

struct Plan {
  uint64_t seed = 1;
  int world = 2;
  std::vector<int> micro = {2, 3};  // micro-batches per window, the same on every rank
  int blocks = 6, rows = 8, in = 16, batch = 4;
  double capMb = 25, firstCapMb = 1;
  bool flat = true;       // plugin-owned flat buffer, else host buffers with guard bytes
  bool gradReady = true;  // report grad-ready in every micro-batch
  int reduceOp = 0;       // SF_REDUCE_AVERAGE or SF_REDUCE_SUM
  bool cuda = false;      // SF_DEVICE_CUDA gradients (NCCL; the stand-in of tests/standin): flat only
  int64_t timeoutMs = 1500;
  Fault fault = Fault::kNone;
  Point point = Point::kWindow;
  int target = 0;      // the faulty rank
  int atWindow = 0;    // the window a fault refers to
  int64_t delayMs = 0; // kLate, kTimer
  int callIndex = 0;   // kRandomCall
  LayoutDiff layout = LayoutDiff::kNumel;

  // The fault's kind as a table row: "kill@window", "layout", ... (with
  // "/nccl" for device gradients).
  std::string kind() const;
};

std::string encode(const Plan& p);
// Throws std::runtime_error naming the key that does not parse.
Plan decode(const std::string& text);

}  // namespace sfchaos
