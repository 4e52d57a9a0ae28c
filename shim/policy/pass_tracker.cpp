#include "shim/policy/pass_tracker.h"

#include <algorithm>
#include <functional>
#include <sstream>
#include <tuple>

namespace sfshim {

bool PassTracker::Key::operator<(const Key& o) const {
  return std::tie(comm, buffer, bytes, dtype) < std::tie(o.comm, o.buffer, o.bytes, o.dtype);
}

size_t PassTracker::KeyHash::operator()(const Key& k) const {
  size_t h = std::hash<const void*>()(k.buffer);
  h ^= std::hash<const void*>()(k.comm) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= std::hash<uint64_t>()(uint64_t(k.bytes) * 4 + uint64_t(k.dtype)) + 0x9e3779b97f4a7c15ull +
       (h << 6) + (h >> 2);
  return h;
}

namespace {

// The keys of calls [begin, end), sorted; false if one repeats.
bool distinctSorted(const std::vector<PassTracker::Key>& calls, size_t begin, size_t end,
                    std::vector<PassTracker::Key>* out) {
  out->assign(calls.begin() + std::ptrdiff_t(begin), calls.begin() + std::ptrdiff_t(end));
  std::sort(out->begin(), out->end());
  return std::adjacent_find(out->begin(), out->end()) == out->end();
}

}  // namespace

PassTracker::Position PassTracker::observe(const Key& key) {
  Position pos;
  pos.state = state_;
  if (state_ == State::kLost) return pos;

  if (state_ == State::kLearning) {
    if (key.bytes < 0 || __builtin_add_overflow(cum_, key.bytes, &cum_)) {
      std::ostringstream s;
      s << "the running count of gradient bytes overflows at an all-reduce of " << key.bytes
        << " bytes";
      lose(s.str());
      pos.state = state_;
      return pos;
    }
    history_.push_back(key);
    prefix_.push_back(cum_);
    if (cum_ % (kCopies + 1) == 0 && tryLearn(cum_ / (kCopies + 1))) {
      pos.state = state_;
      pos.pass = passesDone_;  // this call completed the last learned pass
      return pos;
    }
    if (history_.size() >= kMaxLearningCalls) {
      std::ostringstream s;
      s << "no repeating per-pass pattern of gradient all-reduces within the first "
        << kMaxLearningCalls << " calls (" << cum_ << " bytes)";
      lose(s.str());
      pos.state = state_;
    }
    return pos;
  }

  // Tracking: the call must be one of the pass's buffers, not yet seen in it.
  const auto it = slot_.find(key);
  const int64_t pass = passesDone_ + 1;
  if (it == slot_.end() || seenIn_[it->second] == generation_) {
    std::ostringstream s;
    s << "pass " << pass << ": an all-reduce of " << key.bytes << " bytes at " << key.buffer
      << (it == slot_.end() ? " that is not one of the " : " repeated within the pass of ")
      << passKeys_.size() << " buffers (" << passBytes_ << " bytes) learned from passes 2-"
      << learnedAfter_;
    lose(s.str());
    pos.state = state_;
    return pos;
  }
  seenIn_[it->second] = generation_;
  pos.pass = pass;
  pos.trusted = true;
  if (++seenThisPass_ == passKeys_.size()) {
    ++passesDone_;
    ++generation_;
    seenThisPass_ = 0;
  }
  return pos;
}

bool PassTracker::tryLearn(int64_t passBytes) {
  if (passBytes <= 0) return false;
  // The first pass ends where the running count reaches passBytes exactly.
  const auto first = std::lower_bound(prefix_.begin(), prefix_.end(), passBytes);
  if (first == prefix_.end() || *first != passBytes) return false;
  size_t begin = size_t(first - prefix_.begin()) + 1;
  std::vector<Key> keys, pass;
  if (!distinctSorted(history_, 0, begin, &keys)) return false;
  // Then kCopies passes of exactly passBytes each, over the same buffers.
  for (int copy = 0; copy < kCopies; ++copy) {
    const int64_t target = prefix_[begin - 1] + passBytes;
    const auto end = std::lower_bound(prefix_.begin() + std::ptrdiff_t(begin), prefix_.end(), target);
    if (end == prefix_.end() || *end != target) return false;
    const size_t stop = size_t(end - prefix_.begin()) + 1;
    if (!distinctSorted(history_, begin, stop, copy == 0 ? &pass : &keys)) return false;
    if (copy > 0 && keys != pass) return false;
    begin = stop;
  }
  if (begin != history_.size()) return false;

  passKeys_ = pass;
  for (size_t i = 0; i < passKeys_.size(); ++i) slot_[passKeys_[i]] = i;
  seenIn_.assign(passKeys_.size(), 0);
  passBytes_ = passBytes;
  passesDone_ = kCopies + 1;
  learnedAfter_ = passesDone_;
  state_ = State::kTracking;
  history_.clear();
  history_.shrink_to_fit();
  prefix_.clear();
  prefix_.shrink_to_fit();
  return true;
}

void PassTracker::lose(std::string reason) {
  state_ = State::kLost;
  lostReason_ = std::move(reason);
  history_.clear();
  prefix_.clear();
}

}  // namespace sfshim
