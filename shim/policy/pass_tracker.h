#pragma once
// Finds backward-pass boundaries in a stream of gradient all-reduces, for
// SF_ACCUMULATION_STEPS (automatic windows). Responsible for "which pass does
// this call belong to, and is that certain"; not for what to do with it
// (ShimPolicy).
//
// The model it learns and then checks, that of PyTorch DDP (and of any host
// that all-reduces fixed buckets once per backward pass and waits for them
// before the next pass):
//  - every pass all-reduces the same total number of bytes T;
//  - the first pass may use other buffers (DDP rebuilds its buckets once,
//    after the first backward, and the allocator may reuse old addresses for
//    new buckets of other sizes), with distinct buffers;
//  - from the second pass on, every pass all-reduces the same set of buffers
//    (comm, address, bytes, dtype), each exactly once, in any order;
//  - the calls of one pass all arrive before any call of the next.
// Learning accepts T when the stream so far is exactly one first pass of T
// bytes followed by kCopies identical passes: the call that completes pass
// kCopies + 1 (cumulative bytes (kCopies + 1) x T). No other split of such a
// stream satisfies this (see shim/README.md), and the moment depends only on
// the pass structure, not on the order of calls inside a pass nor on buffer
// addresses, so every rank learns at the same pass and their decisions agree.
// Anything else (a foreign call, a buffer twice in a pass, no pattern within
// kMaxLearningCalls calls, a running byte count past INT64_MAX) loses the
// track for good: then every call passes.

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "sfsync.h"

namespace sfshim {

class PassTracker {
 public:
  struct Key {
    const void* comm;
    const void* buffer;
    int64_t bytes;
    sf_dtype dtype;
    bool operator==(const Key& o) const {
      return comm == o.comm && buffer == o.buffer && bytes == o.bytes && dtype == o.dtype;
    }
    bool operator<(const Key& o) const;
  };
  enum class State { kLearning, kTracking, kLost };
  struct Position {
    State state = State::kLearning;
    int64_t pass = 0;      // 1-based pass of this call; 0 while learning or lost
    bool trusted = false;  // the pass began after the pattern was learned
  };

  static constexpr int kCopies = 4;
  static constexpr size_t kMaxLearningCalls = 4096;

  Position observe(const Key& key);

  State state() const { return state_; }
  int64_t passBytes() const { return passBytes_; }           // T; 0 until learned
  size_t callsPerPass() const { return passKeys_.size(); }   // 0 until learned
  int64_t passesCompleted() const { return passesDone_; }    // 0 until learned
  int64_t learnedAfterPasses() const { return learnedAfter_; }
  const std::string& lostReason() const { return lostReason_; }

 private:
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  bool tryLearn(int64_t passBytes);
  void lose(std::string reason);

  State state_ = State::kLearning;
  // Learning: every call so far and the running byte count after it.
  std::vector<Key> history_;
  std::vector<int64_t> prefix_;
  int64_t cum_ = 0;
  // Tracking: the buffers of one pass and which of them this pass has seen.
  std::vector<Key> passKeys_;
  std::unordered_map<Key, size_t, KeyHash> slot_;
  std::vector<uint64_t> seenIn_;  // pass generation in which each slot was seen
  uint64_t generation_ = 1;
  size_t seenThisPass_ = 0;
  int64_t passBytes_ = 0;
  int64_t passesDone_ = 0;
  int64_t learnedAfter_ = 0;
  std::string lostReason_;
};

}  // namespace sfshim
