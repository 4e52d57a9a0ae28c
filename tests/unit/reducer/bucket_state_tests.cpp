// BucketCycle on its own (plugin/reducer/bucket_state.h): the transition
// table, cell by cell, and each transition method in every state, with a
// Work stand-in that records its waits (no backend: the cycle only holds the
// handle). An illegal transition must be SF_ERR_INTERNAL naming the bucket
// and both states, and must leave the state unchanged.

#include <boost/test/unit_test.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/expect_error.h"
#include "plugin/core/error.h"
#include "plugin/reducer/bucket_state.h"

using namespace sfsync;
using S = BucketState;

namespace {

struct CountingWork : Work {
  int* waits;
  explicit CountingWork(int* w) : waits(w) {}
  void wait() override { ++*waits; }
};

std::unique_ptr<Work> work(int* waits) { return std::make_unique<CountingWork>(waits); }

const S kAll[] = {S::kIdle, S::kFilling, S::kReducing, S::kReduced, S::kGathering,
                  S::kGatheringGradients};

// A cycle of bucket 7 with 2 gradients brought into `target` through legal
// transitions only (reduced in pass 3).
BucketCycle cycleIn(S target, int* waits) {
  BucketCycle c(7, 2);
  if (target == S::kIdle) return c;
  if (target == S::kFilling) {
    c.gradientReported();
    return c;
  }
  c.startReduction(work(waits));
  if (target == S::kReducing) return c;
  c.reductionDone(3);
  if (target == S::kReduced) return c;
  if (target == S::kGatheringGradients) {
    c.startGradientGather(work(waits));
    return c;
  }
  c.startGather(work(waits));
  return c;
}

// Runs `f`, which must fail with SF_ERR_INTERNAL naming bucket 7.
void expectInternal(const std::function<void()>& f, const std::string& mentions) {
  sftest::expectError(f, SF_ERR_INTERNAL, {"bucket 7", mentions});
}

}  // namespace

BOOST_AUTO_TEST_SUITE(bucket_state_tests)

// The whole table: exactly these eleven transitions are allowed.
BOOST_AUTO_TEST_CASE(the_table_allows_exactly_the_cycle) {
  const std::vector<std::pair<S, S>> allowed = {
      {S::kIdle, S::kFilling},      {S::kIdle, S::kReducing},    {S::kFilling, S::kReducing},
      {S::kReducing, S::kReduced},  {S::kReducing, S::kIdle},    {S::kReduced, S::kGathering},
      {S::kReduced, S::kIdle},      {S::kGathering, S::kReducing},
      {S::kReduced, S::kGatheringGradients}, {S::kGatheringGradients, S::kReduced},
      {S::kGatheringGradients, S::kIdle}};
  int count = 0;
  for (S from : kAll) {
    for (S to : kAll) {
      bool want = false;
      for (const auto& p : allowed) want = want || (p.first == from && p.second == to);
      BOOST_TEST(bucketTransitionAllowed(from, to) == want,
                 bucketStateName(from) << " -> " << bucketStateName(to));
      count += bucketTransitionAllowed(from, to) ? 1 : 0;
    }
  }
  BOOST_TEST(count == 11);
  // Not a state: refused, no read past the table.
  BOOST_TEST(!bucketTransitionAllowed(S(9), S::kIdle));
  BOOST_TEST(std::string(bucketStateName(S::kGathering)) == "gathering");
  BOOST_TEST(std::string(bucketStateName(S::kGatheringGradients)) == "gathering_gradients");
  BOOST_TEST(std::string(bucketStateName(S(9))) == "not a bucket state");
}

BOOST_AUTO_TEST_CASE(a_window_walks_the_cycle_and_counts_its_gradients) {
  int waits = 0;
  BucketCycle c(7, 3);
  BOOST_TEST(int(c.state()) == int(S::kIdle));
  BOOST_TEST(c.pending() == 3);
  c.gradientReported();
  BOOST_TEST(int(c.state()) == int(S::kFilling));
  c.gradientReported();
  BOOST_TEST(!c.complete());
  c.gradientReported();
  BOOST_TEST(c.complete());
  BOOST_TEST(int(c.state()) == int(S::kFilling));
  c.startReduction(work(&waits));
  BOOST_TEST(int(c.state()) == int(S::kReducing));
  BOOST_REQUIRE(c.inFlight() != nullptr);
  c.reduction().wait();
  BOOST_TEST(waits == 1);
  BOOST_TEST(!c.reducedIn(1));
  c.reductionDone(1);
  BOOST_TEST(int(c.state()) == int(S::kReduced));
  BOOST_TEST(c.inFlight() == nullptr);
  BOOST_TEST(c.reducedIn(1));
  BOOST_TEST(!c.reducedIn(2));
  c.startGather(work(&waits));
  BOOST_TEST(c.gathering());
  BOOST_TEST(c.reducedIn(1));  // still pass 1's reduction in place
  c.inFlight()->wait();
  c.gatherDone();
  BOOST_TEST(waits == 2);
  BOOST_TEST(c.gathering());  // started in this window, waited
  BOOST_TEST(c.inFlight() == nullptr);
  c.reportsCleared();
  BOOST_TEST(c.pending() == 3);
}

// The gather of window 1 overlaps window 2's forward: the new window keeps
// it, its reduction is no longer the current pass's, reports are counted,
// and the next reduction starts from gathering.
BOOST_AUTO_TEST_CASE(a_gather_outlives_its_window_until_the_next_reduction) {
  int waits = 0;
  BucketCycle c(7, 2);
  c.startReduction(work(&waits));
  c.reductionDone(1);
  c.startGather(work(&waits));
  c.newWindow();
  BOOST_TEST(c.gathering());
  BOOST_TEST(!c.reducedIn(2));
  BOOST_TEST(c.inFlight() != nullptr);  // the gather, still in flight
  c.gradientReported();
  c.gradientReported();
  BOOST_TEST(c.gathering());  // reports do not move it
  BOOST_TEST(c.complete());
  // The reducer waits for the gather before the reduction starts.
  expectInternal([&] { c.startReduction(work(&waits)); }, "in flight");
  BOOST_TEST(c.gathering());
  c.gatherDone();
  c.startReduction(work(&waits));
  BOOST_TEST(int(c.state()) == int(S::kReducing));
  c.reductionDone(2);
  BOOST_TEST(c.reducedIn(2));
}

BOOST_AUTO_TEST_CASE(a_new_window_resets_reduced_and_keeps_idle) {
  int waits = 0;
  BucketCycle idle = cycleIn(S::kIdle, &waits);
  idle.newWindow();
  BOOST_TEST(int(idle.state()) == int(S::kIdle));
  BucketCycle reduced = cycleIn(S::kReduced, &waits);
  reduced.newWindow();
  BOOST_TEST(int(reduced.state()) == int(S::kIdle));
  BOOST_TEST(!reduced.reducedIn(3));
  // Filling or reducing at a new window is a bug in the reducer.
  for (S s : {S::kFilling, S::kReducing}) {
    BucketCycle c = cycleIn(s, &waits);
    expectInternal([&] { c.newWindow(); }, bucketStateName(s));
    BOOST_TEST(int(c.state()) == int(s));
  }
}

// Every transition method, in every state it is illegal in: SF_ERR_INTERNAL
// naming the bucket and the state, and the state unchanged.
BOOST_AUTO_TEST_CASE(illegal_transitions_are_internal_errors_and_change_nothing) {
  int waits = 0;
  for (S s : kAll) {
    const std::string name = bucketStateName(s);
    if (s != S::kIdle && s != S::kFilling && s != S::kGathering) {
      BucketCycle c = cycleIn(s, &waits);
      expectInternal([&] { c.startReduction(work(&waits)); }, name);
      BOOST_TEST(int(c.state()) == int(s), name);
    }
    if (s != S::kReducing) {
      BucketCycle c = cycleIn(s, &waits);
      expectInternal([&] { c.reductionDone(4); }, "illegal transition to reduced");
      BOOST_TEST(int(c.state()) == int(s), name);
      expectInternal([&] { c.reduction(); }, "not in flight");
    }
    if (s != S::kReduced) {
      BucketCycle c = cycleIn(s, &waits);
      expectInternal([&] { c.startGather(work(&waits)); }, name);
      BOOST_TEST(int(c.state()) == int(s), name);
    }
    if (s != S::kGathering) {
      BucketCycle c = cycleIn(s, &waits);
      expectInternal([&] { c.gatherDone(); }, "never started");
      BOOST_TEST(int(c.state()) == int(s), name);
    }
    if (s != S::kReduced) {
      BucketCycle c = cycleIn(s, &waits);
      expectInternal([&] { c.startGradientGather(work(&waits)); }, name);
      BOOST_TEST(int(c.state()) == int(s), name);
    }
    if (s != S::kGatheringGradients) {
      BucketCycle c = cycleIn(s, &waits);
      expectInternal([&] { c.gradientGatherDone(); }, "never started");
      BOOST_TEST(int(c.state()) == int(s), name);
      expectInternal([&] { c.gradientGather(); }, "not in flight");
    }
  }
  BOOST_TEST(waits == 0);  // the cycle never waits itself
}

BOOST_AUTO_TEST_CASE(a_report_with_none_pending_is_an_internal_error) {
  BucketCycle c(7, 1);
  c.gradientReported();
  expectInternal([&] { c.gradientReported(); }, "none pending");
  BOOST_TEST(c.pending() == 0);
}

BOOST_AUTO_TEST_CASE(reports_after_the_start_are_counted_and_change_nothing) {
  int waits = 0;
  for (S s : {S::kReducing, S::kReduced, S::kGathering, S::kGatheringGradients}) {
    BucketCycle c = cycleIn(s, &waits);
    c.gradientReported();
    BOOST_TEST(int(c.state()) == int(s));
    BOOST_TEST(c.pending() == 1);
  }
}

BOOST_AUTO_TEST_CASE(abandon_ends_a_reduction_and_keeps_a_gather_started) {
  int waits = 0;
  BucketCycle r = cycleIn(S::kReducing, &waits);
  r.abandon();
  BOOST_TEST(int(r.state()) == int(S::kIdle));
  BOOST_TEST(r.inFlight() == nullptr);
  BucketCycle g = cycleIn(S::kGathering, &waits);
  g.abandon();
  BOOST_TEST(g.gathering());
  BOOST_TEST(g.inFlight() == nullptr);
  BucketCycle gg = cycleIn(S::kGatheringGradients, &waits);
  gg.abandon();  // a failed gradient gather: the gradients are no longer whole
  BOOST_TEST(int(gg.state()) == int(S::kIdle));
  BOOST_TEST(gg.inFlight() == nullptr);
  for (S s : {S::kIdle, S::kFilling, S::kReduced}) {
    BucketCycle c = cycleIn(s, &waits);
    c.abandon();
    BOOST_TEST(int(c.state()) == int(s));
  }
}

// sf_gather_gradients' all-gather is the cycle's own Work: the reduction
// stays this pass's while it runs, the handle is the one inFlight() names,
// and waiting brings the bucket back to reduced with nothing in flight.
BOOST_AUTO_TEST_CASE(a_gradient_gather_is_held_by_the_cycle) {
  int waits = 0;
  BucketCycle c = cycleIn(S::kGatheringGradients, &waits);
  BOOST_TEST(c.reducedIn(3));
  BOOST_TEST(!c.gathering());  // not a parameter gather
  BOOST_REQUIRE(c.inFlight() != nullptr);
  BOOST_TEST(c.inFlight() == &c.gradientGather());
  c.gradientGather().wait();
  BOOST_TEST(waits == 1);
  c.gradientGatherDone();
  BOOST_TEST(int(c.state()) == int(S::kReduced));
  BOOST_TEST(c.inFlight() == nullptr);
  BOOST_TEST(c.reducedIn(3));
  // Then the parameter gather may start, as after a reduction.
  c.startGather(work(&waits));
  BOOST_TEST(c.gathering());
  // A new window while the gradient gather runs is a bug in the reducer.
  BucketCycle g = cycleIn(S::kGatheringGradients, &waits);
  expectInternal([&] { g.newWindow(); }, "gathering_gradients");
}

BOOST_AUTO_TEST_SUITE_END()
