#pragma once
// One rank of a chaos session: the toy trainer of samples/c on an sfsync
// context, with the plan's fault injected at its point, and what an oracle
// needs to judge it (first failing call, its status and duration, weights
// against the single-process reference, guard bytes around host buffers,
// the result of every garbage call). Responsible for running and
// measuring one rank; not for judging it (the driver does).

#include <cstdint>
#include <string>

#include "tests/chaos/chaos_plan.h"

namespace sfchaos {

enum class Mode { kProcess, kThread };

struct Outcome {
  int rank = 0;
  int status = 0;           // the first failing call's sf_status, 0 if none failed
  std::string call;         // its name
  std::string error;        // sf_last_error() after it
  double errMs = 0;         // how long that call took
  bool completed = false;   // every window synchronized
  int windows = 0;          // windows synchronized
  double maxDiff = -1;      // largest |weight - reference| when completed
  bool guardsOk = true;     // bytes around host gradient buffers intact
  std::string garbage;      // first garbage call with an unexpected result, "" if none
  int garbageCalls = 0;
  bool faulted = false;     // this rank acted out the fault (thread mode kill/stop)
  long fdBefore = -1, fdAfter = -1, tasksBefore = -1, tasksAfter = -1;
};

// Runs rank `rank` of the plan on `rendezvous` ("" = from the environment).
// In process mode a kill or stop fault raises SIGKILL / SIGSTOP on this
// process; in thread mode the rank abandons its context (kill) or sleeps
// past the timeout (stop) and returns with faulted set.
Outcome runRank(const Plan& plan, int rank, Mode mode, const std::string& rendezvous);

// Open file descriptors and threads of this process (/proc/self/fd, /proc/self/task).
long countFds();
long countTasks();

// The one-line report: "CHAOS rank=R status=S ... error=<message>".
std::string formatOutcome(const Outcome& o);
// Parses formatOutcome's line; false if `line` is not one.
bool parseOutcome(const std::string& line, Outcome& o);

// The reference weights of the plan (single process), flattened.
std::string describePlanForHumans(const Plan& plan);

}  // namespace sfchaos
