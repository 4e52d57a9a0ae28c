// The CUDA stand-in's strictness about streams and events (tests/standin,
// README "Strict streams and events"): each misuse the stand-in must catch
// is made on purpose here and must come back as a failing status, a counted
// misuse with a message naming it, and (untaken) a failing exit status;
// what CUDA defines (destroying an event a stream waits on) stays allowed
// and keeps its order. No GPU, no sfsync: the stand-in alone.

#include <boost/test/unit_test.hpp>
#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

extern "C" {
int64_t sfStandinCudaCounter(const char* name);
int64_t sfStandinCudaTakeMisuse(char* last, size_t cap);
}

namespace {

// The misuses since the last take, and the last one's message.
std::string lastMisuse;
int64_t takeMisuse() {
  char buf[512];
  const int64_t n = sfStandinCudaTakeMisuse(buf, sizeof buf);
  lastMisuse = buf;
  return n;
}

void contains(const std::string& text, const std::string& part) {
  BOOST_TEST_INFO("message: " << text);
  BOOST_CHECK(text.find(part) != std::string::npos);
}

// A host function that blocks its stream until `release` is set.
struct Gate {
  std::atomic<bool> release{false};
  static void hold(void* p) {
    auto* g = static_cast<Gate*>(p);
    while (!g->release.load()) std::this_thread::yield();
  }
};

void setFlag(void* p) { static_cast<std::atomic<bool>*>(p)->store(true); }

}  // namespace

BOOST_AUTO_TEST_SUITE(cudart_standin_tests)

BOOST_AUTO_TEST_CASE(wait_on_an_event_never_recorded_is_a_misuse) {
  takeMisuse();
  cudaStream_t s = nullptr;
  cudaEvent_t e = nullptr;
  BOOST_REQUIRE_EQUAL(cudaStreamCreate(&s), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaStreamWaitEvent(s, e, 0), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(takeMisuse(), 1);
  contains(lastMisuse, "cudaStreamWaitEvent");
  contains(lastMisuse, "never recorded");
  BOOST_CHECK_EQUAL(cudaEventSynchronize(e), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(takeMisuse(), 1);
  contains(lastMisuse, "cudaEventSynchronize");
  BOOST_CHECK_EQUAL(cudaEventQuery(e), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(takeMisuse(), 1);
  contains(lastMisuse, "cudaEventQuery");
  BOOST_CHECK_EQUAL(cudaGetLastError(), cudaErrorInvalidResourceHandle);
  // Recorded, the same calls are fine.
  BOOST_REQUIRE_EQUAL(cudaEventRecord(e, s), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaStreamWaitEvent(s, e, 0), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaEventSynchronize(e), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaEventQuery(e), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaEventDestroy(e), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaStreamDestroy(s), cudaSuccess);
  BOOST_CHECK_EQUAL(takeMisuse(), 0);
}

BOOST_AUTO_TEST_CASE(a_destroyed_event_used_again_is_a_misuse) {
  takeMisuse();
  cudaEvent_t e = nullptr;
  BOOST_REQUIRE_EQUAL(cudaEventCreate(&e), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventRecord(e, nullptr), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventDestroy(e), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaEventQuery(e), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaEventSynchronize(e), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaStreamWaitEvent(nullptr, e, 0), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaEventRecord(e, nullptr), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaEventDestroy(e), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(takeMisuse(), 5);
  contains(lastMisuse, "already destroyed");
}

BOOST_AUTO_TEST_CASE(an_event_destroyed_while_a_host_thread_waits_is_a_misuse) {
  takeMisuse();
  cudaStream_t s = nullptr;
  cudaEvent_t e = nullptr;
  Gate gate;
  BOOST_REQUIRE_EQUAL(cudaStreamCreate(&s), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventCreate(&e), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaLaunchHostFunc(s, &Gate::hold, &gate), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventRecord(e, s), cudaSuccess);  // not reached until the gate opens
  const int64_t before = sfStandinCudaCounter("event_host_waiters");
  cudaError_t waited = cudaErrorUnknown;
  std::thread waiter([&] { waited = cudaEventSynchronize(e); });
  // Until the waiter is inside cudaEventSynchronize (bounded: 30 s).
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (sfStandinCudaCounter("event_host_waiters") == before &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::yield();
  }
  BOOST_REQUIRE_EQUAL(sfStandinCudaCounter("event_host_waiters"), before + 1);
  BOOST_CHECK_EQUAL(cudaEventDestroy(e), cudaErrorInvalidResourceHandle);
  gate.release = true;
  waiter.join();
  BOOST_CHECK_EQUAL(waited, cudaSuccess);  // the waiter itself is not harmed by the stand-in
  BOOST_CHECK_EQUAL(takeMisuse(), 1);
  contains(lastMisuse, "while 1 host thread(s) wait in cudaEventSynchronize");
  BOOST_CHECK_EQUAL(cudaStreamDestroy(s), cudaSuccess);
}

// CUDA: "Once this call has returned, any functions (including
// cudaEventRecord() and cudaEventDestroy()) may be called on event again,
// and subsequent calls will not have any effect on stream."
BOOST_AUTO_TEST_CASE(destroying_an_event_a_stream_waits_on_is_allowed_and_keeps_the_order) {
  takeMisuse();
  cudaStream_t first = nullptr, second = nullptr;
  cudaEvent_t e = nullptr;
  Gate gate;
  std::atomic<bool> ran{false};
  BOOST_REQUIRE_EQUAL(cudaStreamCreate(&first), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaStreamCreate(&second), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventCreate(&e), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaLaunchHostFunc(first, &Gate::hold, &gate), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventRecord(e, first), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaStreamWaitEvent(second, e, 0), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaEventDestroy(e), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaLaunchHostFunc(second, &setFlag, &ran), cudaSuccess);
  // `first` is held by the gate: `second`'s function cannot have run.
  BOOST_CHECK(!ran.load());
  BOOST_CHECK_EQUAL(cudaStreamQuery(second), cudaErrorNotReady);
  gate.release = true;
  BOOST_CHECK_EQUAL(cudaStreamSynchronize(second), cudaSuccess);
  BOOST_CHECK(ran.load());
  BOOST_CHECK_EQUAL(cudaStreamDestroy(first), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaStreamDestroy(second), cudaSuccess);
  BOOST_CHECK_EQUAL(takeMisuse(), 0);
}

BOOST_AUTO_TEST_CASE(a_destroyed_stream_used_again_is_a_misuse) {
  takeMisuse();
  cudaStream_t s = nullptr;
  cudaEvent_t e = nullptr, other = nullptr;
  int word = 0, copy = 0;
  BOOST_REQUIRE_EQUAL(cudaStreamCreate(&s), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventCreate(&e), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventCreate(&other), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventRecord(e, s), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaEventRecord(other, nullptr), cudaSuccess);
  BOOST_REQUIRE_EQUAL(cudaStreamDestroy(s), cudaSuccess);
  // An event recorded before the destroy still answers (its work completed).
  BOOST_CHECK_EQUAL(cudaEventSynchronize(e), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaEventQuery(e), cudaSuccess);
  BOOST_CHECK_EQUAL(takeMisuse(), 0);
  std::atomic<bool> ran{false};
  BOOST_CHECK_EQUAL(cudaLaunchHostFunc(s, &setFlag, &ran), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaEventRecord(e, s), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaStreamWaitEvent(s, other, 0), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaMemcpyAsync(&copy, &word, sizeof word, cudaMemcpyDefault, s),
                    cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaMemsetAsync(&word, 1, sizeof word, s), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaStreamSynchronize(s), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaStreamQuery(s), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(cudaStreamDestroy(s), cudaErrorInvalidResourceHandle);
  BOOST_CHECK_EQUAL(takeMisuse(), 8);
  contains(lastMisuse, "already destroyed");
  BOOST_CHECK(!ran.load());
  BOOST_CHECK_EQUAL(word, 0);
  BOOST_CHECK_EQUAL(cudaEventDestroy(e), cudaSuccess);
  BOOST_CHECK_EQUAL(cudaEventDestroy(other), cudaSuccess);
}

// A misuse whose status the caller ignored still fails the process: the
// stand-in's exit check turns exit(0) into status 86.
BOOST_AUTO_TEST_CASE(an_untaken_misuse_fails_the_process_at_exit) {
  takeMisuse();
  for (const bool take : {false, true}) {
    const pid_t child = fork();
    BOOST_REQUIRE(child >= 0);
    if (child == 0) {
      cudaEvent_t e = nullptr;
      cudaEventCreate(&e);
      (void)cudaEventQuery(e);  // never recorded; the status ignored
      cudaEventDestroy(e);
      if (take) sfStandinCudaTakeMisuse(nullptr, 0);
      std::exit(0);
    }
    int status = 0;
    BOOST_REQUIRE_EQUAL(waitpid(child, &status, 0), child);
    BOOST_REQUIRE(WIFEXITED(status));
    BOOST_TEST_INFO("taken: " << take);
    BOOST_CHECK_EQUAL(WEXITSTATUS(status), take ? 0 : 86);
  }
  BOOST_CHECK_EQUAL(takeMisuse(), 0);
}

BOOST_AUTO_TEST_SUITE_END()
