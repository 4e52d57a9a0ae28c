#include "plugin/launch/mpi_bootstrap.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <sstream>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "plugin/core/deadline.h"
#include "plugin/core/env.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/launch/free_port.h"

namespace sfsync {

namespace {

// The two handle ABIs: Open MPI's handles are pointers to predefined
// objects, MPICH's (and Intel MPI's) are ints with fixed values (mpi.h).
constexpr int kThreadMultiple = 3;        // MPI_THREAD_MULTIPLE in both
constexpr int kMpichCommWorld = 0x44000000;
constexpr int kMpichByte = 0x4c00010d;
constexpr int kAddressBytes = 256;

struct Mpi {
  void* lib = nullptr;
  std::string name;
  bool openmpi = false;
  void* ompiCommWorld = nullptr;  // &ompi_mpi_comm_world
  void* ompiByte = nullptr;       // &ompi_mpi_byte
  int (*initialized)(int*) = nullptr;
  int (*finalized)(int*) = nullptr;
  int (*initThread)(int*, char***, int, int*) = nullptr;
  int (*finalize)() = nullptr;
  void* commRank = nullptr;  // int(MPI_Comm, int*)
  void* ibcast = nullptr;    // int(void*, int, MPI_Datatype, int, MPI_Comm, MPI_Request*)
  void* test = nullptr;      // int(MPI_Request*, int*, MPI_Status*)

  int rankOfWorld(int* out) const {
    if (openmpi) return reinterpret_cast<int (*)(void*, int*)>(commRank)(ompiCommWorld, out);
    return reinterpret_cast<int (*)(int, int*)>(commRank)(kMpichCommWorld, out);
  }
  // `request` holds either ABI's MPI_Request (a pointer or an int).
  int startBcast(char* buf, void* request) const {
    if (openmpi) {
      return reinterpret_cast<int (*)(void*, int, void*, int, void*, void**)>(ibcast)(
          buf, kAddressBytes, ompiByte, 0, ompiCommWorld, static_cast<void**>(request));
    }
    return reinterpret_cast<int (*)(void*, int, int, int, int, int*)>(ibcast)(
        buf, kAddressBytes, kMpichByte, 0, kMpichCommWorld, static_cast<int*>(request));
  }
  int testDone(void* request, int* flag) const {
    alignas(8) char status[256] = {0};  // larger than either MPI_Status
    return reinterpret_cast<int (*)(void*, int*, void*)>(test)(request, flag, status);
  }
};

std::vector<std::string> candidates(const std::string& launcher, const char* setting) {
  if (setting && *setting) return {setting};
  if (launcher == "openmpi") return {"libmpi.so.40", "libmpi.so"};
  return {"libmpi.so.12", "libmpich.so.12", "libmpi.so"};
}

// Loads libmpi once per launcher kind; `why` says why not. `setting`: the
// value of SF_MPI_LIBRARY (nullptr when unset).
Mpi* loadMpi(const std::string& launcher, const char* setting, std::string& why) {
  static std::mutex m;
  static Mpi loaded;
  std::lock_guard<std::mutex> lock(m);
  // SF_MPI_LIBRARY is read on every call: a library loaded before does not
  // override a later "none" or another name.
  if (setting && std::strcmp(setting, "none") == 0) {
    why = "SF_MPI_LIBRARY=none";
    return nullptr;
  }
  if (loaded.lib && (!setting || !*setting || loaded.name == setting)) return &loaded;
  std::string tried;
  for (const auto& name : candidates(launcher, setting)) {
    void* lib = ::dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (!lib) lib = ::dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      const char* e = ::dlerror();
      tried += (tried.empty() ? "" : "; ") + std::string(e ? e : name.c_str());
      continue;
    }
    Mpi mpi;
    mpi.lib = lib;
    mpi.name = name;
    mpi.ompiCommWorld = ::dlsym(lib, "ompi_mpi_comm_world");
    mpi.ompiByte = ::dlsym(lib, "ompi_mpi_byte");
    mpi.openmpi = mpi.ompiCommWorld != nullptr;
    mpi.initialized = reinterpret_cast<int (*)(int*)>(::dlsym(lib, "MPI_Initialized"));
    mpi.finalized = reinterpret_cast<int (*)(int*)>(::dlsym(lib, "MPI_Finalized"));
    mpi.initThread = reinterpret_cast<int (*)(int*, char***, int, int*)>(::dlsym(lib, "MPI_Init_thread"));
    mpi.finalize = reinterpret_cast<int (*)()>(::dlsym(lib, "MPI_Finalize"));
    mpi.commRank = ::dlsym(lib, "MPI_Comm_rank");
    mpi.ibcast = ::dlsym(lib, "MPI_Ibcast");
    mpi.test = ::dlsym(lib, "MPI_Test");
    if (!mpi.initialized || !mpi.finalized || !mpi.initThread || !mpi.finalize || !mpi.commRank ||
        !mpi.ibcast || !mpi.test || (mpi.openmpi && !mpi.ompiByte)) {
      tried += (tried.empty() ? "" : "; ") + name + " lacks MPI_Init_thread, MPI_Ibcast or MPI_Test";
      continue;
    }
    loaded = mpi;
    return &loaded;
  }
  why = "cannot load " + tried;
  return nullptr;
}

std::string launcherOfEnvironment() {
  return envValue("OMPI_COMM_WORLD_SIZE") ? "openmpi" : "pmi";
}

bool everyRankLocal(int worldSize) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    if (const char* v = envValue(name)) return std::atoi(v) == worldSize;
  }
  return false;
}

Mpi* gFinalizeAtExit = nullptr;
void finalizeAtExit() {
  int done = 0;
  if (gFinalizeAtExit && gFinalizeAtExit->finalized(&done) == 0 && !done) gFinalizeAtExit->finalize();
}

MeetingAddress bootstrapOnce(int rank, int worldSize, std::chrono::milliseconds timeout) {
  std::string why;
  Mpi* mpi = loadMpi(launcherOfEnvironment(), envValue("SF_MPI_LIBRARY"), why);
  if (!mpi) fail(SF_ERR_BACKEND, "rendezvous mpi://: " + why);
  int initialized = 0, finalized = 0;
  mpi->initialized(&initialized);
  mpi->finalized(&finalized);
  if (finalized) fail(SF_ERR_BACKEND, "rendezvous mpi://: MPI is already finalized in this process");
  bool ours = false;
  if (!initialized) {
    int provided = 0;
    if (mpi->initThread(nullptr, nullptr, kThreadMultiple, &provided) != 0) {
      fail(SF_ERR_BACKEND, "rendezvous mpi://: MPI_Init_thread of " + mpi->name + " failed");
    }
    ours = true;
  }
  int mpiRank = -1;
  if (mpi->rankOfWorld(&mpiRank) != 0 || mpiRank != rank) {
    fail(SF_ERR_BACKEND, "rendezvous mpi://: MPI_Comm_rank(MPI_COMM_WORLD) = " + std::to_string(mpiRank) +
                             " differs from this process's rank " + std::to_string(rank) +
                             " (set rank from the MPI launcher's variables, or MASTER_ADDR)");
  }
  char buf[kAddressBytes] = {0};
  if (rank == 0) {
    std::string host = "127.0.0.1";
    if (!everyRankLocal(worldSize)) {
      char name[kAddressBytes - 16] = {0};
      if (::gethostname(name, sizeof name - 1) == 0 && name[0]) host = name;
    }
    const int port = freeLoopbackPort();
    if (port < 0) fail(SF_ERR_BACKEND, "rendezvous mpi://: rank 0 found no free port");
    std::snprintf(buf, sizeof buf, "%s %d", host.c_str(), port);
  }
  alignas(8) char request[16] = {0};  // MPI_Request: a pointer (Open MPI) or an int (MPICH)
  if (mpi->startBcast(buf, request) != 0) fail(SF_ERR_BACKEND, "rendezvous mpi://: MPI_Ibcast failed");
  const Deadline deadline(timeout);
  for (;;) {
    int flag = 0;
    if (mpi->testDone(request, &flag) != 0) fail(SF_ERR_BACKEND, "rendezvous mpi://: MPI_Test failed");
    if (flag) break;
    if (deadline.expired()) {
      fail(SF_ERR_TIMEOUT, "rendezvous mpi://: rank 0's address did not arrive through MPI within " +
                               std::to_string(timeout.count()) +
                               " ms (did every rank start, and reach sf_connect or its first synchronization?)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  MeetingAddress a;
  char host[kAddressBytes] = {0};
  if (std::sscanf(buf, "%239s %d", host, &a.port) != 2 || a.port <= 0 || a.port > 65535) {
    fail(SF_ERR_BACKEND, std::string("rendezvous mpi://: rank 0 sent '") + buf + "', not 'host port'");
  }
  a.host = host;
  if (ours) {
    gFinalizeAtExit = mpi;
    std::atexit(finalizeAtExit);
  }
  SF_LOG(kInfo, "launch", "mpi:// through " << mpi->name << ": rank 0's store at " << a.host << ":" << a.port);
  return a;
}

}  // namespace

std::string mpiProbe(const std::string& launcher, const char* setting) {
  std::string why;
  return loadMpi(launcher, setting, why) ? "" : why;
}

MeetingAddress mpiBootstrap(int rank, int worldSize, std::chrono::milliseconds timeout) {
  // MPI_Init_thread has no timeout (Open MPI waits in it for every rank), so
  // the bootstrap runs on a thread of its own and callers wait for it until
  // their deadline: a rank that never comes is SF_ERR_TIMEOUT on time, and
  // sf_destroy does not wait for MPI. Leaked on purpose: the thread may
  // still be inside MPI at exit.
  struct State {
    std::mutex m;
    std::condition_variable cv;
    bool started = false, done = false;
    MeetingAddress result;
    sf_status status = SF_OK;
    std::string error;
  };
  static State* s = new State;
  const Deadline deadline(timeout);
  std::unique_lock<std::mutex> lock(s->m);
  if (!s->started) {
    s->started = true;
    std::thread([rank, worldSize, timeout] {
      MeetingAddress a;
      sf_status status = SF_OK;
      std::string error;
      try {
        a = bootstrapOnce(rank, worldSize, timeout);
      } catch (const Error& e) {
        status = e.status();
        error = e.what();
      } catch (const std::exception& e) {
        status = SF_ERR_BACKEND;
        error = std::string("rendezvous mpi://: ") + e.what();
      }
      std::lock_guard<std::mutex> done(s->m);
      s->result = a;
      s->status = status;
      s->error = error;
      s->done = true;
      s->cv.notify_all();
    }).detach();
  }
  if (!s->cv.wait_until(lock, deadline.at(), [] { return s->done; })) {
    fail(SF_ERR_TIMEOUT, "rendezvous mpi://: MPI_Init_thread and rank 0's address broadcast did not "
                         "complete within " + std::to_string(timeout.count()) +
                         " ms (did every rank start, and reach sf_connect or its first synchronization?)");
  }
  if (s->status != SF_OK) fail(s->status, s->error);
  return s->result;
}

}  // namespace sfsync
