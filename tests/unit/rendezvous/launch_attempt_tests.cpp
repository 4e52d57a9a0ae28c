#include <boost/test/unit_test.hpp>

#include <cstdlib>
#include <string>

#include "plugin/core/error.h"
#include "plugin/rendezvous/launch_attempt.h"
#include "plugin/rendezvous/memory_store.h"
#include "plugin/rendezvous/store_factory.h"
#include "tests/support/thread_ranks.h"

using namespace sfsync;

namespace {

// Clears the launcher variables around each case (the environment is the
// process's: these cases run on one thread).
struct CleanLauncherEnvironment {
  CleanLauncherEnvironment() { clear(); }
  ~CleanLauncherEnvironment() { clear(); }
  static void clear() {
    for (const char* v : {"TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                          "SLURM_RESTART_COUNT", "SLURM_JOB_ID"}) {
      ::unsetenv(v);
    }
  }
};

std::string failureOf(sf_status expected, const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    BOOST_TEST(e.status() == expected);
    return e.what();
  }
  BOOST_FAIL("no error");
  return "";
}

}  // namespace

BOOST_FIXTURE_TEST_SUITE(launch_attempt_tests, CleanLauncherEnvironment)

BOOST_AUTO_TEST_CASE(no_launcher_is_unscoped) {
  BOOST_TEST(!LaunchAttempt::fromEnvironment().scoped());
}

BOOST_AUTO_TEST_CASE(torchrun_and_slurm_scopes) {
  ::setenv("SLURM_RESTART_COUNT", "2", 1);
  ::setenv("SLURM_JOB_ID", "77", 1);
  LaunchAttempt slurm = LaunchAttempt::fromEnvironment();
  BOOST_TEST(slurm.scoped());
  BOOST_TEST(slurm.count() == 2);
  BOOST_TEST(slurm.attemptScope() == "slurm/77/attempt/2");
  BOOST_TEST(slurm.describe() == "attempt 2 of slurm run '77' (SLURM_RESTART_COUNT=2)");
  // torchrun's variables come first (a torchrun inside a Slurm job).
  ::setenv("TORCHELASTIC_RESTART_COUNT", "0", 1);
  LaunchAttempt torchrun = LaunchAttempt::fromEnvironment();
  BOOST_TEST(torchrun.attemptScope() == "torchrun/none/attempt/0");
  ::setenv("TORCHELASTIC_RUN_ID", "job5", 1);
  BOOST_TEST(LaunchAttempt::fromEnvironment().runScope() == "torchrun/job5");
}

BOOST_AUTO_TEST_CASE(a_bad_count_names_the_variable) {
  for (const char* bad : {"-1", "x", "1x", "99999999999999999999"}) {
    ::setenv("TORCHELASTIC_RESTART_COUNT", bad, 1);
    const std::string m =
        failureOf(SF_ERR_INVALID_ARGUMENT, [] { LaunchAttempt::fromEnvironment(); });
    BOOST_TEST(m.find(std::string("TORCHELASTIC_RESTART_COUNT='") + bad + "'") !=
               std::string::npos, m);
  }
}

BOOST_AUTO_TEST_CASE(a_new_attempt_supersedes_the_earlier_ones) {
  auto store = MemoryStore::named(sftest::uniqueName("attempts"));
  const std::chrono::milliseconds timeout(1000);
  auto run = prefixedStore("torchrun/r", store, timeout);
  AttemptGuard third(LaunchAttempt("torchrun", "r", 3, "TORCHELASTIC_RESTART_COUNT"), run);
  AttemptGuard first(LaunchAttempt("torchrun", "r", 1, "TORCHELASTIC_RESTART_COUNT"), run);
  BOOST_TEST(first.supersededBy().empty());
  third.supersedeEarlier();
  third.supersedeEarlier();  // again (a write-once store): markers stay as they are
  BOOST_TEST(third.supersededBy().empty());
  const std::string m = first.supersededBy();
  BOOST_TEST(m.find("belongs to attempt 1 of torchrun run 'r' (TORCHELASTIC_RESTART_COUNT=1), "
                    "but attempt 3 of that run has started") != std::string::npos, m);
  for (int a = 0; a < 3; ++a) {
    const auto v = store->get("torchrun/r/superseded/" + std::to_string(a));
    BOOST_TEST(std::string(v.begin(), v.end()) == "3");
  }
  // Another run in the same store is not touched.
  AttemptGuard other(LaunchAttempt("torchrun", "s", 0, "TORCHELASTIC_RESTART_COUNT"),
                     prefixedStore("torchrun/s", store, timeout));
  BOOST_TEST(other.supersededBy().empty());
}

BOOST_AUTO_TEST_SUITE_END()
