#pragma once
// Where a TCP-store rendezvous meets: the host and port of rank 0's store
// for "env://" (MASTER_ADDR, MASTER_PORT), "tcp://host:port" (as written,
// e.g. Slurm's first host, launcher_env.h) and "mpi://" (broadcast through
// MPI, mpi_bootstrap.h). Not responsible for the store itself.

#include <string>

#include "plugin/launch/mpi_bootstrap.h"
#include "sfsync.h"

namespace sfsync {

// True for the three forms above.
bool isTcpRendezvous(const std::string& url);

// The store's address. mpi:// is collective on its first call in a process
// (mpiBootstrap). Throws SF_ERR_INVALID_ARGUMENT naming a bad MASTER_PORT or
// a malformed tcp:// URL.
MeetingAddress meetingAddress(const sf_options& opts);

}  // namespace sfsync
