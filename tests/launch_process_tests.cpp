// Real launchers start real ranks (issue 18): Open MPI's mpirun runs the C
// trainer (samples/c) and a Python trainer (tests/launchers/py_trainer.py)
// on 2 and 3 ranks, and their RESULT lines must equal sfsync-run's; the
// variables srun sets meet at the node list's first host; a launcher that
// says the world is larger than one with no way to meet is an error naming
// its variables, from sf_create and from the default context (the shim's).

#include <boost/test/unit_test.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "tests/support/processes.h"

using namespace sftest;

namespace {

using Env = std::map<std::string, std::string>;

// Variables of the process running the tests that would change what the
// ranks discover: cleared for every child (an empty value counts as unset).
Env cleanEnv(Env extra = {}) {
  Env env;
  for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "SF_RANK", "SF_WORLD_SIZE", "SF_LOCAL_RANK",
                        "MASTER_ADDR", "MASTER_PORT", "SF_RENDEZVOUS", "SF_MPI_LIBRARY", "SLURM_PROCID",
                        "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID",
                        "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "PMI_RANK", "PMI_SIZE"}) {
    env[k] = "";
  }
  env["SF_TIMEOUT_MS"] = "30000";
  env["PYTHONPATH"] = SF_PY_PATH;
  env["SFSYNC_LIBRARY"] = SF_LIBRARY;
  env["PYTHONDONTWRITEBYTECODE"] = "1";
  for (auto& kv : extra) env[kv.first] = kv.second;
  return env;
}

std::vector<std::string> mpirun(int n, std::vector<std::string> command, std::vector<std::string> flags = {}) {
  std::vector<std::string> argv = {SF_MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", std::to_string(n)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), command.begin(), command.end());
  return argv;
}

std::vector<std::string> sfsyncRun(int n, std::vector<std::string> command) {
  std::vector<std::string> argv = {SF_LAUNCHER, "-n", std::to_string(n), "--"};
  argv.insert(argv.end(), command.begin(), command.end());
  return argv;
}

const std::vector<std::string> kCTrainer = {SF_TRAINER, "--windows", "3", "--micro", "3", "--quiet"};
const std::vector<std::string> kPyTrainer = {SF_PYTHON, SF_PY_TRAINER};
const char* const kResultKeys[] = {"world", "windows", "buckets", "collectives", "bytes", "max_abs_diff"};

// Every rank's RESULT in `got` equals `want`'s, with world = n and OK.
void sameResults(const std::string& got, const std::string& want, int n) {
  for (int r = 0; r < n; ++r) {
    const std::string prefix = "RESULT rank=" + std::to_string(r) + " ";
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST_REQUIRE(got.find(prefix) != std::string::npos, got);
      BOOST_TEST(field(got, prefix, "world") == std::to_string(n), got);
      for (const char* key : kResultKeys) {
        BOOST_TEST(field(got, prefix, key) == field(want, prefix, key), key << "\n" << got << "\n" << want);
      }
      const size_t line = got.find(prefix);
      BOOST_TEST(got.substr(line, got.find('\n', line) - line).find(" OK") != std::string::npos, got);
    }
  }
  BOOST_TEST(got.find("RESULT rank=" + std::to_string(n) + " ") == std::string::npos, got);
}

// The srun environment of task `rank` of `n` on one node (what srun sets
// for a step, see slurm_test.sh for the real one).
std::vector<std::string> srunTask(int rank, int n, const std::string& jobId, std::vector<std::string> command) {
  std::vector<std::string> argv = {"env",
                                   "SLURM_PROCID=" + std::to_string(rank),
                                   "SLURM_LOCALID=" + std::to_string(rank),
                                   "SLURM_NTASKS=" + std::to_string(n),
                                   "SLURM_NPROCS=" + std::to_string(n),
                                   "SLURM_NODEID=0",
                                   "SLURM_NNODES=1",
                                   "SLURM_JOB_ID=" + jobId,
                                   "SLURM_JOBID=" + jobId,
                                   "SLURM_STEP_ID=0",
                                   "SLURM_STEPID=0",
                                   "SLURM_JOB_NODELIST=localhost",
                                   "SLURM_STEP_NODELIST=localhost",
                                   "SLURM_STEP_NUM_TASKS=" + std::to_string(n),
                                   "SLURM_TASKS_PER_NODE=" + std::to_string(n)};
  argv.insert(argv.end(), command.begin(), command.end());
  return argv;
}

// A Slurm job id whose derived store port (20000 + (id % 1000) * 10 for
// step 0, launcher_env.h) is free on loopback now.
std::string jobIdWithFreePort() {
  for (int k = 0; k < 1000; ++k) {
    const int j = (int(::getpid()) + k) % 1000;
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(uint16_t(20000 + j * 10));
    const bool free = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    if (fd >= 0) ::close(fd);
    if (free) return std::to_string(7000 + j);
  }
  BOOST_FAIL("no free port in 20000..29990");
  return "";
}

}  // namespace

BOOST_AUTO_TEST_SUITE(launch_process_tests)

BOOST_AUTO_TEST_CASE(mpirun_c_and_python_trainers_world_2_and_3_equal_sfsync_run) {
  for (int n : {2, 3}) {
    for (const auto* command : {&kCTrainer, &kPyTrainer}) {
      BOOST_TEST_CONTEXT("world " << n << ", " << (command == &kCTrainer ? "C" : "Python") << " trainer") {
        const ProcessResult want = runProcess(sfsyncRun(n, *command), cleanEnv(), 60);
        BOOST_TEST_REQUIRE(want.exitCode == 0, want.output);
        // No MASTER_ADDR: the ranks meet through MPI (mpi://).
        const ProcessResult got = runProcess(mpirun(n, *command), cleanEnv(), 60);
        BOOST_TEST_REQUIRE(got.exitCode == 0, got.output);
        sameResults(got.output, want.output, n);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(mpirun_with_master_addr_from_the_issue_is_world_2) {
  // mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT build/samples/c/sfsync-c-trainer
  // printed world=1 twice before issue 18.
  const Env env = cleanEnv({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(freePort())}});
  const ProcessResult got = runProcess(mpirun(2, {SF_TRAINER}, {"-x", "MASTER_ADDR", "-x", "MASTER_PORT"}), env, 60);
  BOOST_TEST_REQUIRE(got.exitCode == 0, got.output);
  const ProcessResult want = runProcess(sfsyncRun(2, {SF_TRAINER}), cleanEnv(), 60);
  BOOST_TEST_REQUIRE(want.exitCode == 0, want.output);
  sameResults(got.output, want.output, 2);
}

BOOST_AUTO_TEST_CASE(mpirun_rank_that_never_comes_is_a_timeout_not_a_hang) {
  // Rank 1 never reaches sfsync: rank 0 waits inside MPI_Init_thread (which
  // has no timeout). It must fail with SF_ERR_TIMEOUT after timeout_ms and
  // exit (sf_destroy must not wait for MPI), and mpirun then ends the job,
  // long before rank 1's sleep (100 s) or this test's bound (50 s).
  const std::string script = std::string("if [ \"$OMPI_COMM_WORLD_RANK\" = 0 ]; then exec ") + SF_TRAINER +
                             " --quiet; else exec sleep 100; fi";
  const ProcessResult res =
      runProcess(mpirun(2, {"sh", "-c", script}), cleanEnv({{"SF_TIMEOUT_MS", "1000"}}), 50);
  BOOST_TEST(!res.timedOut, res.output);
  BOOST_TEST(res.exitCode != 0, res.output);
  BOOST_TEST(res.output.find("rendezvous mpi://: MPI_Init_thread and rank 0's address broadcast did not "
                             "complete within 1000 ms") != std::string::npos,
             res.output);
  BOOST_TEST(res.output.find("world=1") == std::string::npos, res.output);
}

BOOST_AUTO_TEST_CASE(srun_variables_meet_at_the_first_host_world_2) {
  // The variables srun sets for `srun -n 2` on one node, no MASTER_*: the
  // ranks meet at localhost (SLURM_JOB_NODELIST) on a port from the job id.
  const std::string jobId = jobIdWithFreePort();
  for (const auto* command : {&kCTrainer, &kPyTrainer}) {
    BOOST_TEST_CONTEXT((command == &kCTrainer ? "C" : "Python") << " trainer") {
      const auto res = runProcesses({srunTask(0, 2, jobId, *command), srunTask(1, 2, jobId, *command)},
                                    cleanEnv(), 60, false);
      const ProcessResult want = runProcess(sfsyncRun(2, *command), cleanEnv(), 60);
      BOOST_TEST_REQUIRE(want.exitCode == 0, want.output);
      for (const auto& r : res) {
        BOOST_TEST_REQUIRE(r.exitCode == 0, r.output);
      }
      sameResults(res[0].output + res[1].output, want.output, 2);
    }
  }
}

BOOST_AUTO_TEST_CASE(launcher_world_above_one_without_meeting_point_is_an_error_naming_it) {
  struct Case {
    const char* name;
    Env env;
    std::vector<std::string> mustName;
  };
  const std::vector<Case> cases = {
      {"Open MPI", {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"SF_MPI_LIBRARY", "none"}},
       {"OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=2", "SF_MPI_LIBRARY=none", "MASTER_ADDR"}},
      {"PMI", {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"SF_MPI_LIBRARY", "/nonexistent/libmpi.so.12"}},
       {"PMI_RANK=1, PMI_SIZE=2", "/nonexistent/libmpi.so.12", "MASTER_ADDR"}},
      {"Slurm", {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}},
       {"SLURM_PROCID=1, SLURM_NTASKS=2", "SLURM_JOB_NODELIST unset", "MASTER_ADDR"}},
  };
  for (const auto& c : cases) {
    BOOST_TEST_CONTEXT(c.name) {
      // sf_options_init + sf_create (the C trainer exits 3 when a call fails)...
      const ProcessResult trainer = runProcess({SF_TRAINER, "--quiet"}, cleanEnv(c.env), 30);
      BOOST_TEST(trainer.exitCode == 3, trainer.output);
      BOOST_TEST(trainer.output.find("world=1") == std::string::npos, trainer.output);
      BOOST_TEST(trainer.output.find("sf_create") != std::string::npos, trainer.output);
      // ...and the default context, as the shim and Python's Context.default() make it.
      const ProcessResult probe = runProcess({SF_DEFAULT_PROBE}, cleanEnv(c.env), 30);
      BOOST_TEST(probe.exitCode == 3, probe.output);
      BOOST_TEST(probe.output.find("SF_ERR_INVALID_ARGUMENT") != std::string::npos, probe.output);
      for (const auto& name : c.mustName) {
        BOOST_TEST(trainer.output.find(name) != std::string::npos, name << " in\n" << trainer.output);
        BOOST_TEST(probe.output.find(name) != std::string::npos, name << " in\n" << probe.output);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(contradictory_launcher_variables_fail_sf_options_init) {
  const ProcessResult res = runProcess(
      {SF_TRAINER, "--quiet"}, cleanEnv({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}}), 30);
  BOOST_TEST(res.exitCode == 3, res.output);
  BOOST_TEST(res.output.find("sf_options_init") != std::string::npos, res.output);
  BOOST_TEST(res.output.find("OMPI_COMM_WORLD_RANK=2 is not below OMPI_COMM_WORLD_SIZE=2") != std::string::npos,
             res.output);
}

BOOST_AUTO_TEST_SUITE_END()
