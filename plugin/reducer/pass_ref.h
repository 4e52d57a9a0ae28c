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
// The reducer never asks the clock: every call is handed its PassRef. Two
// moments can race, on hook threads and the training thread: a grad-ready
// reading its pass from the clock (the Context asks it, then hands the pass
// down) and a synchronization closing that pass. The reducer refuses a
// grad-ready's pass once it synchronized that pass (Reducer::markReady
// returns false, changing nothing), and the Context asks the clock again
// until the synchronization has closed it there too: a grad-ready is never
// counted in a closed pass, and the passes never run backwards between two
// hooks.

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

}  // namespace sfsync
