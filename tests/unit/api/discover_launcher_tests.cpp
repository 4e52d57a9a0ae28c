// sf_discover_launcher (plugin/core/options.cpp, through libsfsync.so): the
// report is what sf_options_init and sf_create do with the same
// environment, the launchers' precedence, the error and "unmet" cases, the
// caller's struct size, and envp-style environments.
#include <boost/test/unit_test.hpp>

#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "sfsync.h"

namespace {

using Vars = std::vector<std::pair<std::string, std::string>>;

// Every variable that discovery reads (launcher_env.cpp, mpi_bootstrap.cpp).
const char* const kAll[] = {
    "SF_RANK", "SF_WORLD_SIZE", "SF_LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK",
    "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST", "MASTER_ADDR", "MASTER_PORT", "SF_RENDEZVOUS", "SF_MPI_LIBRARY"};

// The process's environment holds exactly `vars` of kAll for one case.
struct ProcessEnv {
  std::vector<std::pair<std::string, std::string>> saved;
  explicit ProcessEnv(const Vars& vars) {
    for (const char* k : kAll) {
      if (const char* v = std::getenv(k)) saved.emplace_back(k, v);
      ::unsetenv(k);
    }
    for (const auto& kv : vars) ::setenv(kv.first.c_str(), kv.second.c_str(), 1);
  }
  ~ProcessEnv() {
    for (const char* k : kAll) ::unsetenv(k);
    for (const auto& kv : saved) ::setenv(kv.first.c_str(), kv.second.c_str(), 1);
  }
};

// An envp-style array of "NAME=VALUE" (NULL-terminated) that owns its strings.
struct Envp {
  std::vector<std::string> entries;
  std::vector<const char*> ptrs;
  explicit Envp(const Vars& vars) {
    for (const auto& kv : vars) entries.push_back(kv.first + "=" + kv.second);
    for (const auto& e : entries) ptrs.push_back(e.c_str());
    ptrs.push_back(nullptr);
  }
  const char* const* get() const { return ptrs.data(); }
};

sf_launch_info discover(const Vars& vars) {
  sf_launch_info info;
  std::memset(&info, 0x5a, sizeof info);
  Envp envp(vars);
  BOOST_REQUIRE(sf_discover_launcher(&info, sizeof info, envp.get()) == SF_OK);
  BOOST_TEST(info.struct_size == sizeof info);
  return info;
}

bool contains(const char* s, const std::string& part) { return std::string(s).find(part) != std::string::npos; }

// What sf_options_init and sf_create make of the same variables, set in the
// process's environment: status, message, and the options.
struct LibraryView {
  sf_status initStatus;
  std::string initError;
  sf_options opts;
  std::string createError;  // sf_create's message when it fails
};

LibraryView library(const Vars& vars) {
  ProcessEnv env(vars);
  LibraryView v;
  v.initStatus = sf_options_init(&v.opts, sizeof v.opts);
  v.initError = v.initStatus == SF_OK ? "" : sf_last_error();
  if (v.initStatus == SF_OK) {
    sf_context* ctx = nullptr;
    if (sf_create(&v.opts, &ctx) == SF_OK) {
      sf_destroy(ctx);
    } else {
      v.createError = sf_last_error();
    }
  }
  return v;
}

// The report for `vars` says what the library does with them.
void checkAgainstLibrary(const Vars& vars) {
  const sf_launch_info info = discover(vars);
  const LibraryView lib = library(vars);
  BOOST_TEST_CONTEXT("launcher " << info.launcher << ", error '" << info.error << "', unmet '"
                                 << info.unmet << "'") {
    BOOST_TEST(lib.opts.rank == info.rank);
    BOOST_TEST(lib.opts.world_size == info.world_size);
    BOOST_TEST(lib.opts.local_rank == info.local_rank);
    BOOST_TEST(std::string(lib.opts.rendezvous) == std::string(info.rendezvous));
    if (info.error[0]) {
      BOOST_TEST(lib.initStatus == SF_ERR_INVALID_ARGUMENT);
      BOOST_TEST(contains(lib.initError.c_str(), info.error), lib.initError);
    } else {
      BOOST_TEST(lib.initStatus == SF_OK, lib.initError);
    }
    if (info.unmet[0]) {
      BOOST_TEST(contains(lib.createError.c_str(), info.unmet), lib.createError);
    }
    BOOST_TEST(!(info.error[0] && info.unmet[0]));
  }
}

const Vars kOmpi = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "3"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}};
const Vars kSlurm = {{"SLURM_PROCID", "1"},    {"SLURM_NTASKS", "2"},  {"SLURM_LOCALID", "1"},
                     {"SLURM_JOB_ID", "4242"}, {"SLURM_STEP_ID", "3"}, {"SLURM_JOB_NODELIST", "node[07-08]"}};

// `a` with `b`'s variables added or replacing a's.
Vars plus(Vars a, const Vars& b) {
  for (const auto& kv : b) {
    bool replaced = false;
    for (auto& old : a) {
      if (old.first == kv.first) old.second = kv.second, replaced = true;
    }
    if (!replaced) a.push_back(kv);
  }
  return a;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(discover_launcher_tests)

BOOST_AUTO_TEST_CASE(nothing_set_is_a_world_of_one) {
  const sf_launch_info info = discover({});
  BOOST_TEST(std::string(info.launcher) == "none");
  BOOST_TEST((info.rank == 0 && info.world_size == 1 && info.local_rank == 0));
  BOOST_TEST((info.rank_vars[0] == 0 && info.rendezvous[0] == 0 && info.meeting[0] == 0));
  BOOST_TEST((info.error[0] == 0 && info.unmet[0] == 0 && info.truncated == 0));
}

BOOST_AUTO_TEST_CASE(precedence_sf_torchrun_openmpi_pmi_slurm) {
  const Vars sf = {{"SF_RANK", "0"}, {"SF_WORLD_SIZE", "6"}, {"SF_LOCAL_RANK", "0"}};
  const Vars torch = {{"RANK", "4"}, {"WORLD_SIZE", "5"}, {"LOCAL_RANK", "2"}};
  const Vars pmi = {{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}};
  const Vars addr = {{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}};
  sf_launch_info info = discover(plus(plus(plus(plus(plus(sf, torch), kOmpi), pmi), kSlurm), addr));
  BOOST_TEST(std::string(info.launcher) == "sfsync");
  BOOST_TEST((info.rank == 0 && info.world_size == 6));
  BOOST_TEST(std::string(info.rank_vars) == "SF_RANK=0, SF_WORLD_SIZE=6, SF_LOCAL_RANK=0");
  info = discover(plus(plus(plus(plus(torch, kOmpi), pmi), kSlurm), addr));
  BOOST_TEST(std::string(info.launcher) == "torchrun");
  BOOST_TEST((info.rank == 4 && info.world_size == 5 && info.local_rank == 2));
  info = discover(plus(plus(plus(kOmpi, pmi), kSlurm), addr));
  BOOST_TEST(std::string(info.launcher) == "openmpi");
  BOOST_TEST((info.rank == 1 && info.world_size == 3 && info.local_rank == 1));
  info = discover(plus(plus(pmi, kSlurm), addr));
  BOOST_TEST(std::string(info.launcher) == "pmi");
  info = discover(plus(kSlurm, addr));
  BOOST_TEST(std::string(info.launcher) == "slurm");
  // The meeting point: SF_RENDEZVOUS, then MASTER_ADDR, then the launcher's.
  BOOST_TEST(std::string(info.rendezvous) == "env://");
  BOOST_TEST(std::string(info.meeting) == "MASTER_ADDR=10.0.0.1, MASTER_PORT=1234");
  info = discover(plus(plus(kSlurm, addr), {{"SF_RENDEZVOUS", "file:///tmp/j"}}));
  BOOST_TEST(std::string(info.rendezvous) == "file:///tmp/j");
  BOOST_TEST(std::string(info.meeting) == "SF_RENDEZVOUS=file:///tmp/j");
  info = discover(kSlurm);
  BOOST_TEST(std::string(info.rendezvous) == "tcp://node07:22423");
  BOOST_TEST(contains(info.meeting, "SLURM_JOB_NODELIST='node[07-08]' (node07)"), info.meeting);
}

BOOST_AUTO_TEST_CASE(contradictions_are_the_error_sf_options_init_fails_with) {
  for (const Vars& vars : std::vector<Vars>{
           {{"OMPI_COMM_WORLD_RANK", "1"}},
           {{"SLURM_NTASKS", "2"}},
           {{"PMI_RANK", "x"}, {"PMI_SIZE", "2"}},
           {{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}},
           {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"MASTER_ADDR", "h"}},
           {{"RANK", "1 "}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}},  // one answer for spaces
           plus(kSlurm, {{"SLURM_JOB_NODELIST", "x[1-"}}),
       }) {
    const sf_launch_info info = discover(vars);
    BOOST_TEST(info.error[0] != 0, vars.front().first);
    // sf_options_init applies none of the rank variables: the defaults.
    BOOST_TEST((info.rank == 0 && info.world_size == 1 && info.local_rank == 0));
    BOOST_TEST((info.rendezvous[0] == 0 && info.meeting[0] == 0 && info.unmet[0] == 0));
    checkAgainstLibrary(vars);
  }
  sf_launch_info info = discover({{"OMPI_COMM_WORLD_RANK", "1"}});
  BOOST_TEST(std::string(info.launcher) == "openmpi");
  BOOST_TEST(std::string(info.rank_vars) == "OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE unset");
  BOOST_TEST(contains(info.error, "Open MPI's variables are incomplete"), info.error);
  info = discover({{"RANK", "1 "}, {"WORLD_SIZE", "2"}});
  BOOST_TEST(contains(info.error, "RANK='1 ' is not an integer"), info.error);
  info = discover({{"RANK", " 1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}});  // strtol's leading blanks
  BOOST_TEST((info.error[0] == 0 && info.rank == 1));
}

BOOST_AUTO_TEST_CASE(a_rendezvous_that_does_not_fit_is_an_error_and_the_ranks_still_apply) {
  const Vars vars = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SF_RENDEZVOUS", "file:///" + std::string(300, 'd')}};
  const sf_launch_info info = discover(vars);
  BOOST_TEST(contains(info.error, "SF_RENDEZVOUS='file:///ddd"), info.error);
  BOOST_TEST(contains(info.error, "is not shorter than 256 bytes"), info.error);
  BOOST_TEST((info.rank == 1 && info.world_size == 2 && info.rendezvous[0] == 0));
  checkAgainstLibrary(vars);
}

BOOST_AUTO_TEST_CASE(a_world_above_one_without_meeting_point_is_unmet) {
  for (const Vars& vars : std::vector<Vars>{
           {{"RANK", "0"}, {"WORLD_SIZE", "2"}},
           plus(kOmpi, {{"SF_MPI_LIBRARY", "none"}}),
           plus(kSlurm, {{"SLURM_JOB_NODELIST", ""}}),
           {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"SF_MPI_LIBRARY", "/nonexistent/libmpi.so.12"}},
       }) {
    const sf_launch_info info = discover(vars);
    BOOST_TEST(info.unmet[0] != 0, vars.front().first);
    BOOST_TEST((info.error[0] == 0 && info.rendezvous[0] == 0));
    BOOST_TEST(info.world_size > 1);
    checkAgainstLibrary(vars);
  }
  sf_launch_info info = discover({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  BOOST_TEST(contains(info.unmet, "RANK=0, WORLD_SIZE=2 say this process is rank 0 of 2"), info.unmet);
  // SF_MPI_LIBRARY comes from the given environment, not the process's.
  info = discover(plus(kOmpi, {{"SF_MPI_LIBRARY", "none"}}));
  BOOST_TEST(contains(info.unmet, "the MPI bootstrap is unavailable (SF_MPI_LIBRARY=none)"), info.unmet);
  info = discover({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});  // a world of one meets nobody
  BOOST_TEST((info.unmet[0] == 0 && info.error[0] == 0 && info.rendezvous[0] == 0));
}

BOOST_AUTO_TEST_CASE(the_process_environment_when_env_is_null) {
  const Vars vars = {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "127.0.0.1"}};
  ProcessEnv env(vars);
  sf_launch_info info;
  BOOST_REQUIRE(sf_discover_launcher(&info, sizeof info, nullptr) == SF_OK);
  BOOST_TEST(std::string(info.launcher) == "torchrun");
  BOOST_TEST((info.rank == 3 && info.world_size == 4 && info.local_rank == 1));
  BOOST_TEST(std::string(info.meeting) == "MASTER_ADDR=127.0.0.1, MASTER_PORT unset (29500)");
  sf_options o;
  BOOST_REQUIRE(sf_options_init(&o, sizeof o) == SF_OK);
  BOOST_TEST((o.rank == info.rank && o.world_size == info.world_size && o.local_rank == info.local_rank));
  BOOST_TEST(std::string(o.rendezvous) == std::string(info.rendezvous));
}

BOOST_AUTO_TEST_CASE(envp_first_entry_wins_and_entries_without_equals_are_ignored) {
  const char* const envp[] = {"RANKLESS", "RANK", "RANK=1", "RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=h", nullptr};
  sf_launch_info info;
  BOOST_REQUIRE(sf_discover_launcher(&info, sizeof info, envp) == SF_OK);
  BOOST_TEST((info.rank == 1 && info.world_size == 2));
  const char* const empty[] = {"RANK=", "WORLD_SIZE=", nullptr};  // empty counts as unset
  BOOST_REQUIRE(sf_discover_launcher(&info, sizeof info, empty) == SF_OK);
  BOOST_TEST(std::string(info.launcher) == "none");
}

BOOST_AUTO_TEST_CASE(long_texts_are_cut_to_fit_and_said_so) {
  const std::string host(3000, 'h');
  const sf_launch_info info = discover({{"MASTER_ADDR", host}});
  BOOST_TEST(info.truncated == 1);
  BOOST_TEST(std::strlen(info.meeting) == SF_LAUNCH_TEXT_MAX - 1);
  BOOST_TEST(std::string(info.meeting).substr(SF_LAUNCH_TEXT_MAX - 4) == "...");
  BOOST_TEST(std::string(info.meeting).compare(0, 15, "MASTER_ADDR=hhh") == 0);
}

BOOST_AUTO_TEST_CASE(struct_size_and_null_are_checked) {
  sf_launch_info info;
  BOOST_TEST(sf_discover_launcher(nullptr, sizeof info, nullptr) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(contains(sf_last_error(), "sf_discover_launcher: out is NULL"), sf_last_error());
  BOOST_TEST(sf_discover_launcher(&info, sizeof info - 1, nullptr) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(contains(sf_last_error(), "struct_size = 4391 is smaller than sizeof(sf_launch_info) = 4392"),
             sf_last_error());
  BOOST_TEST(sizeof(sf_launch_info) == 4392u);
  // A caller built against a later header (a larger struct): the library
  // writes what it knows and leaves the rest alone.
  struct Later {
    sf_launch_info known;
    char more[64];
  } later;
  std::memset(&later, 0x7f, sizeof later);
  const char* const envp[] = {"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=h", nullptr};
  BOOST_REQUIRE(sf_discover_launcher(&later.known, sizeof later, envp) == SF_OK);
  BOOST_TEST(later.known.struct_size == sizeof later);
  BOOST_TEST(later.known.rank == 1);
  BOOST_TEST((later.more[0] == 0x7f && later.more[63] == 0x7f));
}

BOOST_AUTO_TEST_SUITE_END()
