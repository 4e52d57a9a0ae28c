#pragma once
// The "mpi://" meeting point: rank 0's store address (host and a free port)
// broadcast through MPI itself, for jobs that mpirun/mpiexec started without
// MASTER_ADDR. libmpi is loaded lazily with dlopen (never a link dependency)
// and carries only those few bytes, as NCCL's own tests do; the gradients
// still travel through sfsync's backends. Not responsible for choosing
// mpi:// (launcher_env.h) or for the store (rendezvous/).
//
// Libraries tried, first to last: SF_MPI_LIBRARY (a file name or path;
// "none" turns the bootstrap off), else for Open MPI libmpi.so.40 and
// libmpi.so, for MPICH/Intel MPI libmpi.so.12, libmpich.so.12 and libmpi.so.
// Open MPI's ABI is recognised by its ompi_mpi_comm_world symbol, anything
// else is taken as MPICH's ABI.

#include <chrono>
#include <string>

namespace sfsync {

// "" when libmpi for `launcher` ("openmpi" or "pmi") loads, else why not.
// `setting` is SF_MPI_LIBRARY's value (nullptr when unset), from whichever
// environment the caller discovers (options.h). Loads the library
// (RTLD_GLOBAL, kept for the life of the process) but does not initialize MPI.
std::string mpiProbe(const std::string& launcher, const char* setting);

struct MeetingAddress {
  std::string host;
  int port = 0;
};

// Collective over MPI_COMM_WORLD, once per process, on a thread of its own
// that the caller waits for at most `timeout` (MPI_Init_thread has no
// timeout; later calls return the first result or keep waiting for it):
// MPI_Init_thread unless MPI is initialized already (then MPI_Finalize at
// exit, after a successful bootstrap), checks that MPI's
// rank is `rank`, and broadcasts rank 0's address with MPI_Ibcast, polled
// until `timeout`. Rank 0 offers 127.0.0.1 when the launcher says every rank
// is on this machine (OMPI_COMM_WORLD_LOCAL_SIZE or MPI_LOCALNRANKS equal
// to the world size), else its host name, with a port that was free a moment
// ago. Throws SF_ERR_BACKEND (no libmpi, MPI failed, rank disagrees) or
// SF_ERR_TIMEOUT.
MeetingAddress mpiBootstrap(int rank, int worldSize, std::chrono::milliseconds timeout);

}  // namespace sfsync
