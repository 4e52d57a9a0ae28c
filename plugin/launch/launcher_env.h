#pragma once
// Which launcher started this process, its rank, world size and local rank,
// and where its ranks meet, read from the launchers' environment variables
// with one precedence. Pure: it reads only through the lookups it is given,
// so every rule is tested without touching the process's environment. It
// does not meet anyone: the MPI bootstrap (mpi_bootstrap.h) and the stores
// do that.
//
// Rank precedence (the first group with its rank or size variable set wins;
// a group is all of its own variables, never mixed with another's):
//   SF_RANK, SF_WORLD_SIZE, SF_LOCAL_RANK                        "sfsync"
//   RANK, WORLD_SIZE, LOCAL_RANK (torchrun, sfsync-run)           "torchrun"
//   OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK (Open MPI)          "openmpi"
//   PMI_RANK, PMI_SIZE, MPI_LOCALRANKID (MPICH/Hydra, Intel MPI)  "pmi"
//   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (srun)              "slurm"
// Meeting point, for any world size (the first that applies):
//   SF_RENDEZVOUS                              as given
//   MASTER_ADDR (+ MASTER_PORT, default 29500) "env://"
//   an MPI launcher, libmpi loadable           "mpi://" (rank 0's address
//                                              broadcast through MPI)
//   SLURM_STEP_NODELIST or SLURM_JOB_NODELIST  "tcp://FIRST_HOST:PORT", PORT
//   and SLURM_JOB_ID                           MASTER_PORT if set, else
//                                              slurmPort(job id, step id)
// A world larger than one with none of these is an error naming the
// variables (`unmet`), never a world of one: sf_options_init leaves the
// rendezvous empty (explicit options win: the caller may still set one) and
// sf_create reports it.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "plugin/core/env.h"

namespace sfsync {

// EnvLookup (core/env.h): a variable's value, or nullptr when it is unset.
// "" when libmpi for `launcher` ("openmpi" or "pmi") can be loaded, else why not.
using MpiProbe = std::function<std::string(const std::string& launcher)>;

struct LauncherEnv {
  std::string launcher = "none";  // see the table above; "none": no group set
  std::string rankVars;           // e.g. "OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2"
  int32_t rank = 0;
  int32_t worldSize = 1;
  int32_t localRank = 0;
  std::string rendezvous;  // "" (no meeting point), or a rendezvous URL as above
  std::string meeting;     // how the meeting point was found, for people
  std::string error;       // non-empty: the first contradiction found (SF_ERR_INVALID_ARGUMENT)
  std::string unmet;       // non-empty: world > 1 and no meeting point; says which variables
};

LauncherEnv discoverLauncher(const EnvLookup& env, const MpiProbe& mpiProbe);

// Slurm's compressed host lists: "node[01-04,07],gpu3,big[1-2]x" ->
// node01..node04, node07, gpu3, big1x, big2x; ranges keep their zero
// padding. Throws sfsync::Error (SF_ERR_INVALID_ARGUMENT) naming the list on
// a malformed one (unbalanced brackets, an empty item, a descending range) or
// one that expands past 1,000,000 hosts.
std::vector<std::string> expandNodelist(const std::string& list);
// The first host of a list, without expanding the rest.
std::string firstNodelistHost(const std::string& list);

// The store port of a Slurm step: 20000 + (job % 1000) * 10 + step % 10, in
// [20000, 29999]: unprivileged and below Linux's ephemeral range (32768+).
int slurmPort(uint64_t jobId, uint64_t stepId);

}  // namespace sfsync
