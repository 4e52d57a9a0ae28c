#pragma once
// PassRef: the pass a reducer call belongs to, as the Context's WindowClock
// numbers it (plugin/orchestrator/window_clock.h). The reducer keeps no pass
// or window count of its own: each call that starts, waits for or checks a
// window's collectives is handed the pass, and each bucket's BucketCycle
// records the pass its state belongs to (bucket_state.h).
//
// A pass is what one synchronization completes: the reductions of every
// bucket. It opens at the first sf_begin_accumulation, sf_grad_ready outside
// a window or synchronization (sf_synchronize, sf_synchronize_start) since
// the last successful synchronization, and closes when that synchronization
// succeeds. Passes are numbered 1, 2, ... in this process (a restored run
// renumbers windows, not passes).
//
// The two moments that hook threads and the training thread can race on, a
// grad-ready opening a pass and a synchronization closing it, happen under
// the reducer's lock, through PassClock: a grad-ready can then never be
// handed a pass that a synchronization closed after the hook read the clock
// (its reduction would go to the closed pass, or the passes would run
// backwards between two hooks). The other calls come from the host's
// window calls, which the Context serializes (only a synchronization closes
// a pass), and take a PassRef.

#include <cstdint>

namespace sfsync {

struct PassRef {
  // The pass under way (open) or, when !open, the last one, whose results
  // stay in place until the next opens; 0: no pass yet.
  int64_t number = 0;
  bool open = false;
  // The window number its synchronization sends (checked across ranks by
  // the window check), or the last synchronized window's when !open.
  int64_t window = 0;
};

// The clock as the reducer sees it (WindowClock implements it).
class PassClock {
 public:
  // The pass under way, opened if none is (a grad-ready outside a window).
  virtual PassRef openPass() = 0;
  // The synchronization of `pass` succeeded: the pass closes.
  virtual void passSynchronized(const PassRef& pass) = 0;

 protected:
  ~PassClock() = default;
};

}  // namespace sfsync
