// plugin/launch/launcher_env.cpp: the launchers' precedence, contradictions,
// meeting points and Slurm's node lists, through a map instead of the
// process's environment.
#include <boost/test/unit_test.hpp>

#include <map>
#include <string>
#include <vector>

#include "plugin/core/error.h"
#include "plugin/launch/launcher_env.h"

using namespace sfsync;

namespace {

using Env = std::map<std::string, std::string>;

LauncherEnv discover(const Env& env, const std::string& mpiWhy = "") {
  return discoverLauncher(
      [&](const char* name) -> const char* {
        auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      [&](const std::string&) { return mpiWhy; });
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string nodelistError(const std::string& list) {
  try {
    expandNodelist(list);
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_INVALID_ARGUMENT);
    return e.what();
  }
  return "";
}

const Env kOmpi = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "3"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}};
const Env kPmi = {{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}};
const Env kSlurm = {{"SLURM_PROCID", "1"},          {"SLURM_NTASKS", "2"},     {"SLURM_LOCALID", "1"},
                    {"SLURM_NODEID", "0"},          {"SLURM_JOB_ID", "4242"}, {"SLURM_STEP_ID", "3"},
                    {"SLURM_JOB_NODELIST", "node[07-08]"}};

Env merged(std::vector<Env> parts) {
  Env out;
  for (auto& p : parts) out.insert(p.begin(), p.end());
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(launch_env_tests)

BOOST_AUTO_TEST_CASE(nothing_set_is_a_world_of_one_without_meeting_point) {
  const LauncherEnv l = discover({});
  BOOST_TEST(l.launcher == "none");
  BOOST_TEST(l.rank == 0);
  BOOST_TEST(l.worldSize == 1);
  BOOST_TEST(l.rendezvous.empty());
  BOOST_TEST(l.error.empty());
  BOOST_TEST(l.unmet.empty());
}

BOOST_AUTO_TEST_CASE(each_launcher_alone) {
  LauncherEnv l = discover(kOmpi);
  BOOST_TEST(l.launcher == "openmpi");
  BOOST_TEST((l.rank == 1 && l.worldSize == 3 && l.localRank == 1));
  l = discover(kPmi);
  BOOST_TEST(l.launcher == "pmi");
  BOOST_TEST((l.rank == 2 && l.worldSize == 4 && l.localRank == 0));
  l = discover(kSlurm);
  BOOST_TEST(l.launcher == "slurm");
  BOOST_TEST((l.rank == 1 && l.worldSize == 2 && l.localRank == 1));
  l = discover({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "h"}});
  BOOST_TEST(l.launcher == "torchrun");
  BOOST_TEST((l.rank == 5 && l.worldSize == 8 && l.localRank == 1));
  l = discover({{"SF_RANK", "0"}, {"SF_WORLD_SIZE", "1"}});
  BOOST_TEST(l.launcher == "sfsync");
  BOOST_TEST((l.rank == 0 && l.worldSize == 1 && l.localRank == 0));
}

BOOST_AUTO_TEST_CASE(precedence_sf_torchrun_openmpi_pmi_slurm) {
  const Env sf = {{"SF_RANK", "0"}, {"SF_WORLD_SIZE", "6"}, {"SF_LOCAL_RANK", "0"}};
  const Env torch = {{"RANK", "4"}, {"WORLD_SIZE", "5"}, {"LOCAL_RANK", "2"}};
  LauncherEnv l = discover(merged({sf, torch, kOmpi, kPmi, kSlurm}));
  BOOST_TEST(l.launcher == "sfsync");
  BOOST_TEST((l.rank == 0 && l.worldSize == 6));
  l = discover(merged({torch, kOmpi, kPmi, kSlurm}));
  BOOST_TEST(l.launcher == "torchrun");
  BOOST_TEST((l.rank == 4 && l.worldSize == 5 && l.localRank == 2));
  l = discover(merged({kOmpi, kPmi, kSlurm}));
  BOOST_TEST(l.launcher == "openmpi");
  BOOST_TEST((l.rank == 1 && l.worldSize == 3));
  l = discover(merged({kPmi, kSlurm}));
  BOOST_TEST(l.launcher == "pmi");
  BOOST_TEST((l.rank == 2 && l.worldSize == 4));
}

BOOST_AUTO_TEST_CASE(groups_are_never_mixed) {
  // RANK from torchrun and the size from Open MPI would be a made-up world.
  const LauncherEnv l = discover({{"RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}});
  BOOST_TEST(l.launcher == "torchrun");
  BOOST_TEST(contains(l.error, "RANK=1, WORLD_SIZE unset"), l.error);
}

BOOST_AUTO_TEST_CASE(partial_and_contradictory_variables_are_errors_naming_them) {
  LauncherEnv l = discover({{"OMPI_COMM_WORLD_RANK", "1"}});
  BOOST_TEST(contains(l.error, "OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE unset"), l.error);
  l = discover({{"SLURM_NTASKS", "2"}});
  BOOST_TEST(contains(l.error, "SLURM_PROCID unset, SLURM_NTASKS=2"), l.error);
  l = discover({{"PMI_RANK", "abc"}, {"PMI_SIZE", "2"}});
  BOOST_TEST(contains(l.error, "PMI_RANK='abc' is not an integer"), l.error);
  l = discover({{"PMI_RANK", "1"}, {"PMI_SIZE", "2x"}});
  BOOST_TEST(contains(l.error, "PMI_SIZE='2x' is not an integer"), l.error);
  l = discover({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}});
  BOOST_TEST(contains(l.error, "SLURM_PROCID=2 is not below SLURM_NTASKS=2"), l.error);
  l = discover({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "0"}});
  BOOST_TEST(contains(l.error, "OMPI_COMM_WORLD_SIZE='0' is not an integer in [1, "), l.error);
  l = discover({{"SF_RANK", "0"}, {"SF_WORLD_SIZE", "2"}, {"SF_LOCAL_RANK", "-1"}});
  BOOST_TEST(contains(l.error, "SF_LOCAL_RANK='-1'"), l.error);
  l = discover({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"MASTER_ADDR", "h"}});
  BOOST_TEST(contains(l.error, "LOCAL_RANK=2 is not below WORLD_SIZE=2"), l.error);
  l = discover({{"RANK", "99999999999"}, {"WORLD_SIZE", "2"}});
  BOOST_TEST(contains(l.error, "RANK='99999999999'"), l.error);
}

BOOST_AUTO_TEST_CASE(meeting_point_order) {
  Env env = merged({kOmpi, kSlurm, {{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}}});
  LauncherEnv l = discover(env);
  BOOST_TEST(l.rendezvous == "env://");
  BOOST_TEST(contains(l.meeting, "MASTER_ADDR=10.0.0.1, MASTER_PORT=1234"), l.meeting);
  env["SF_RENDEZVOUS"] = "file:///tmp/x";
  l = discover(env);
  BOOST_TEST(l.rendezvous == "file:///tmp/x");
  l = discover(merged({kOmpi, kSlurm}));  // libmpi loads: MPI before Slurm
  BOOST_TEST(l.rendezvous == "mpi://");
  l = discover(merged({kOmpi, kSlurm}), "no libmpi");  // else the allocation's first host
  BOOST_TEST(l.rendezvous == "tcp://node07:" + std::to_string(slurmPort(4242, 3)));
  BOOST_TEST(l.unmet.empty());
  l = discover(merged({kPmi}));
  BOOST_TEST(l.rendezvous == "mpi://");
}

BOOST_AUTO_TEST_CASE(slurm_meets_at_the_first_host_and_a_port_from_the_job) {
  Env env = kSlurm;
  LauncherEnv l = discover(env, "libmpi is not consulted under Slurm");
  BOOST_TEST(l.rendezvous == "tcp://node07:22423");  // 20000 + 242 * 10 + 3
  BOOST_TEST(contains(l.meeting, "SLURM_JOB_NODELIST='node[07-08]' (node07)"), l.meeting);
  env["SLURM_STEP_NODELIST"] = "gpu[3-4]";  // the step's nodes, when given, over the job's
  env["MASTER_PORT"] = "29999";             // MASTER_PORT over the derived port
  l = discover(env);
  BOOST_TEST(l.rendezvous == "tcp://gpu3:29999");
  env.erase("MASTER_PORT");
  env.erase("SLURM_STEP_ID");  // the batch step has no numeric step id
  l = discover(env);
  BOOST_TEST(l.rendezvous == "tcp://gpu3:22420");
  env["SLURM_STEP_NODELIST"] = "gpu[3-";
  l = discover(env);
  BOOST_TEST(contains(l.error, "node list 'gpu[3-'"), l.error);
}

BOOST_AUTO_TEST_CASE(slurm_port_formula_stays_in_its_range) {
  BOOST_TEST(slurmPort(0, 0) == 20000);
  BOOST_TEST(slurmPort(999, 9) == 29999);
  BOOST_TEST(slurmPort(1000, 10) == 20000);
  BOOST_TEST(slurmPort(123456789, 2) == 27892);
  BOOST_TEST(slurmPort(uint64_t(-1), uint64_t(-1)) <= 29999);
}

BOOST_AUTO_TEST_CASE(world_above_one_without_meeting_point_names_the_variables) {
  LauncherEnv l = discover(kOmpi, "SF_MPI_LIBRARY=none");
  BOOST_TEST(l.rendezvous.empty());
  BOOST_TEST(l.error.empty());
  BOOST_TEST(contains(l.unmet, "OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=3"), l.unmet);
  BOOST_TEST(contains(l.unmet, "rank 1 of 3"), l.unmet);
  BOOST_TEST(contains(l.unmet, "MPI bootstrap is unavailable (SF_MPI_LIBRARY=none)"), l.unmet);
  BOOST_TEST(contains(l.unmet, "MASTER_ADDR"), l.unmet);

  l = discover(kPmi, "cannot load libmpi.so.12");
  BOOST_TEST(contains(l.unmet, "PMI_RANK=2, PMI_SIZE=4"), l.unmet);
  BOOST_TEST(contains(l.unmet, "cannot load libmpi.so.12"), l.unmet);

  l = discover({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}});
  BOOST_TEST(contains(l.unmet, "SLURM_PROCID=0, SLURM_NTASKS=2"), l.unmet);
  BOOST_TEST(contains(l.unmet, "SLURM_JOB_NODELIST unset, SLURM_JOB_ID unset"), l.unmet);

  l = discover({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  BOOST_TEST(contains(l.unmet, "RANK=0, WORLD_SIZE=2"), l.unmet);

  l = discover({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});  // one rank: nothing to meet
  BOOST_TEST(l.unmet.empty());
  BOOST_TEST(l.launcher == "slurm");
}

BOOST_AUTO_TEST_CASE(nodelist_expansion) {
  using V = std::vector<std::string>;
  BOOST_TEST(expandNodelist("node01") == V({"node01"}), boost::test_tools::per_element());
  BOOST_TEST(expandNodelist("node[01-04,07]") == V({"node01", "node02", "node03", "node04", "node07"}),
             boost::test_tools::per_element());
  BOOST_TEST(expandNodelist("a[8-10],b,c[1,3]") == V({"a8", "a9", "a10", "b", "c1", "c3"}),
             boost::test_tools::per_element());
  BOOST_TEST(expandNodelist("gpu3x[1-2]-r[01-02]") ==
                 V({"gpu3x1-r01", "gpu3x1-r02", "gpu3x2-r01", "gpu3x2-r02"}),
             boost::test_tools::per_element());
  BOOST_TEST(expandNodelist("rack2node[098-101]") == V({"rack2node098", "rack2node099", "rack2node100", "rack2node101"}),
             boost::test_tools::per_element());
  BOOST_TEST(expandNodelist("10.0.0.1,localhost") == V({"10.0.0.1", "localhost"}),
             boost::test_tools::per_element());
  BOOST_TEST(expandNodelist("n[0-99999]").size() == 100000u);
  BOOST_TEST(firstNodelistHost("n[0-999999]") == "n0");  // the largest range, not expanded
  BOOST_TEST(firstNodelistHost("big[5-999999],x") == "big5");
  BOOST_TEST(firstNodelistHost("x[1-2]y[3-4],z") == "x1y3");
}

BOOST_AUTO_TEST_CASE(malformed_nodelists_name_the_list) {
  for (const char* bad : {"", "node[01-04", "node01-04]", "a,,b", ",a", "a[]", "a[x-y]", "a[4-2]",
                          "a[[1]]", "[1-2]", "a[1--2]", "a[1-2,]"}) {
    const std::string e = nodelistError(bad);
    BOOST_TEST(!e.empty(), bad);
    BOOST_TEST(contains(e, "node list"), e);
  }
  BOOST_TEST(contains(nodelistError("a[4-2]"), "range 4-2 is descending"));
  BOOST_TEST(contains(nodelistError("n[0-1000000]"), "past 1000000 hosts"));
  BOOST_TEST(contains(nodelistError("a[0-999],b[0-999]x[0-1000]"), "past 1000000 hosts"));
}

BOOST_AUTO_TEST_SUITE_END()
