#include "plugin/launch/launcher_env.h"

#include <cerrno>
#include <cstdlib>
#include <sstream>

#include "plugin/core/error.h"

namespace sfsync {

namespace {

struct Group {
  const char* launcher;
  const char* title;  // for messages
  const char* rank;
  const char* size;
  const char* local;
};

// The precedence, first to last (launcher_env.h).
const Group kGroups[] = {
    {"sfsync", "sfsync", "SF_RANK", "SF_WORLD_SIZE", "SF_LOCAL_RANK"},
    {"torchrun", "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {"openmpi", "Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"pmi", "MPICH/Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
    {"slurm", "Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

constexpr long kMaxRanks = 1L << 30;

const char* lookup(const EnvLookup& env, const char* name) { return envValue(env, name); }

// Parses a decimal integer in [lo, hi]; false (with `error` set) otherwise.
bool parseInt(const char* name, const char* value, long lo, long hi, int32_t& out,
              std::string& error) {
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(value, &end, 10);
  if (errno || end == value || *end || x < lo || x > hi) {
    std::ostringstream s;
    s << "environment variable " << name << "='" << value << "' is not an integer in [" << lo
      << ", " << hi << "]";
    error = s.str();
    return false;
  }
  out = int32_t(x);
  return true;
}

std::string assignment(const char* name, const char* value) {
  return std::string(name) + "=" + value;
}

// Reads one group's variables into `out`; sets out.error on a contradiction.
void readGroup(const EnvLookup& env, const Group& g, LauncherEnv& out) {
  const char* rank = lookup(env, g.rank);
  const char* size = lookup(env, g.size);
  const char* local = lookup(env, g.local);
  out.launcher = g.launcher;
  out.rankVars = rank ? assignment(g.rank, rank) : std::string(g.rank) + " unset";
  out.rankVars += size ? ", " + assignment(g.size, size) : std::string(", ") + g.size + " unset";
  if (local) out.rankVars += ", " + assignment(g.local, local);
  if (!rank || !size) {
    out.error = std::string(g.title) + "'s variables are incomplete: " + out.rankVars + " (set both " +
                g.rank + " and " + g.size + ", or neither)";
    return;
  }
  if (!parseInt(g.rank, rank, 0, kMaxRanks, out.rank, out.error)) return;
  if (!parseInt(g.size, size, 1, kMaxRanks, out.worldSize, out.error)) return;
  if (local && !parseInt(g.local, local, 0, kMaxRanks, out.localRank, out.error)) return;
  if (out.rank >= out.worldSize) {
    out.error = std::string(g.title) + "'s variables contradict each other: " + g.rank + "=" + rank +
                " is not below " + g.size + "=" + size;
  } else if (local && out.localRank >= out.worldSize) {
    out.error = std::string(g.title) + "'s variables contradict each other: " + g.local + "=" +
                local + " is not below " + g.size + "=" + size;
  }
}

// Slurm's meeting point, or "" (with `why` saying what is missing).
std::string slurmMeeting(const EnvLookup& env, LauncherEnv& out, std::string& why) {
  const char* stepList = lookup(env, "SLURM_STEP_NODELIST");
  const char* jobList = lookup(env, "SLURM_JOB_NODELIST");
  const char* listVar = stepList ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
  const char* list = stepList ? stepList : jobList;
  const char* job = lookup(env, "SLURM_JOB_ID");
  if (!job) job = lookup(env, "SLURM_JOBID");
  const char* step = lookup(env, "SLURM_STEP_ID");
  if (!step) step = lookup(env, "SLURM_STEPID");
  const char* masterPort = lookup(env, "MASTER_PORT");
  if (!list || (!job && !masterPort)) {
    why = std::string("no Slurm meeting point (") + (list ? "" : "SLURM_JOB_NODELIST unset") +
          (!list && !job ? ", " : "") + (job ? "" : "SLURM_JOB_ID unset") + ")";
    return "";
  }
  std::string host;
  try {
    host = firstNodelistHost(list);
  } catch (const Error& e) {
    out.error = e.what();
    return "";
  }
  int32_t port = 0;
  std::string portHow;
  if (masterPort) {
    if (!parseInt("MASTER_PORT", masterPort, 1, 65535, port, out.error)) return "";
    portHow = assignment("MASTER_PORT", masterPort);
  } else {
    int32_t jobId = 0, stepId = 0;
    if (!parseInt("SLURM_JOB_ID", job, 0, 0x7fffffffL, jobId, out.error)) return "";
    // The batch step has no numeric step id; srun's steps do.
    if (step && !parseInt("SLURM_STEP_ID", step, 0, 0x7fffffffL, stepId, out.error)) return "";
    port = slurmPort(uint64_t(jobId), uint64_t(stepId));
    portHow = "port from " + assignment("SLURM_JOB_ID", job) +
              (step ? ", " + assignment("SLURM_STEP_ID", step) : std::string());
  }
  out.meeting = "Slurm: first host of " + std::string(listVar) + "='" + list + "' (" + host + "), " +
                portHow;
  return "tcp://" + host + ":" + std::to_string(port);
}

// The bracket group "[01-04,07]" (without brackets) as its values: at most
// `limit` of them in `values`, all of them counted in the return value.
size_t expandRange(const std::string& list, const std::string& inner, size_t limit,
                   std::vector<std::string>& values) {
  size_t count = 0;
  size_t start = 0;
  for (;;) {
    const size_t comma = inner.find(',', start);
    const std::string part = inner.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t dash = part.find('-');
    const std::string lo = part.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : part.substr(dash + 1);
    auto digits = [](const std::string& s) {
      return !s.empty() && s.size() <= 9 && s.find_first_not_of("0123456789") == std::string::npos;
    };
    if (!digits(lo) || !digits(hi)) {
      fail(SF_ERR_INVALID_ARGUMENT, "node list '" + list + "': '[" + inner +
                                        "]' is not a list of numbers and ranges such as [01-04,07]");
    }
    const long a = std::stol(lo), b = std::stol(hi);
    if (b < a) {
      fail(SF_ERR_INVALID_ARGUMENT, "node list '" + list + "': range " + part + " is descending");
    }
    if (b - a >= 1000000 || count + size_t(b - a) >= 1000000) {
      fail(SF_ERR_INVALID_ARGUMENT, "node list '" + list + "' expands past 1000000 hosts");
    }
    const size_t width = lo.size();  // "01-10": zero padding to lo's width
    count += size_t(b - a + 1);
    for (long x = a; x <= b && values.size() < limit; ++x) {
      std::string s = std::to_string(x);
      if (s.size() < width) s.insert(0, width - s.size(), '0');
      values.push_back(s);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return count;
}

// One host pattern (no top-level comma): the product of its bracket groups.
void expandItem(const std::string& list, const std::string& item, std::vector<std::string>& out,
                size_t limit) {
  std::vector<std::string> hosts = {""};
  size_t i = 0;
  while (i < item.size()) {
    const size_t open = item.find('[', i);
    const std::string text = item.substr(i, open == std::string::npos ? std::string::npos : open - i);
    if (text.find(']') != std::string::npos) {
      fail(SF_ERR_INVALID_ARGUMENT, "node list '" + list + "': unbalanced ']' in '" + item + "'");
    }
    for (auto& h : hosts) h += text;
    if (open == std::string::npos) break;
    const size_t close = item.find(']', open);
    if (close == std::string::npos || item.find('[', open + 1) < close) {
      fail(SF_ERR_INVALID_ARGUMENT, "node list '" + list + "': unbalanced '[' in '" + item + "'");
    }
    std::vector<std::string> values;
    const size_t count = expandRange(list, item.substr(open + 1, close - open - 1), limit, values);
    if (hosts.size() * count > 1000000) {
      fail(SF_ERR_INVALID_ARGUMENT, "node list '" + list + "' expands past 1000000 hosts");
    }
    std::vector<std::string> next;
    for (const auto& h : hosts) {
      for (const auto& v : values) next.push_back(h + v);
      if (next.size() >= limit) break;
    }
    hosts.swap(next);
    i = close + 1;
  }
  for (auto& h : hosts) {
    if (out.size() >= limit) return;
    out.push_back(std::move(h));
  }
}

std::vector<std::string> expand(const std::string& list, size_t limit) {
  std::vector<std::string> out;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    const char c = i < list.size() ? list[i] : ',';
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (depth < 0 || depth > 1) {
      fail(SF_ERR_INVALID_ARGUMENT, "node list '" + list + "': unbalanced or nested brackets");
    }
    if (c != ',' || depth != 0) continue;
    const std::string item = list.substr(start, i - start);
    if (item.empty() || item[0] == '[') {
      fail(SF_ERR_INVALID_ARGUMENT, "node list '" + list + "': empty host name at offset " +
                                        std::to_string(start));
    }
    expandItem(list, item, out, limit);
    if (out.size() >= limit) return out;
    if (out.size() > 1000000) fail(SF_ERR_INVALID_ARGUMENT, "node list '" + list + "' expands past 1000000 hosts");
    start = i + 1;
  }
  if (depth != 0) fail(SF_ERR_INVALID_ARGUMENT, "node list '" + list + "': unbalanced '['");
  return out;
}

}  // namespace

std::vector<std::string> expandNodelist(const std::string& list) {
  if (list.empty()) fail(SF_ERR_INVALID_ARGUMENT, "node list is empty");
  return expand(list, size_t(-1));
}

std::string firstNodelistHost(const std::string& list) {
  if (list.empty()) fail(SF_ERR_INVALID_ARGUMENT, "node list is empty");
  return expand(list, 1).at(0);
}

int slurmPort(uint64_t jobId, uint64_t stepId) {
  return 20000 + int(jobId % 1000) * 10 + int(stepId % 10);
}

LauncherEnv discoverLauncher(const EnvLookup& env, const MpiProbe& mpiProbe) {
  LauncherEnv out;
  for (const Group& g : kGroups) {
    if (lookup(env, g.rank) || lookup(env, g.size)) {
      readGroup(env, g, out);
      break;
    }
  }
  if (!out.error.empty()) return out;

  if (const char* rdv = lookup(env, "SF_RENDEZVOUS")) {
    out.rendezvous = rdv;
    out.meeting = assignment("SF_RENDEZVOUS", rdv);
    return out;
  }
  if (const char* addr = lookup(env, "MASTER_ADDR")) {
    const char* port = lookup(env, "MASTER_PORT");
    out.rendezvous = "env://";
    out.meeting = assignment("MASTER_ADDR", addr) + ", " +
                  (port ? assignment("MASTER_PORT", port) : std::string("MASTER_PORT unset (29500)"));
    return out;
  }
  if (out.worldSize <= 1) return out;  // a world of one meets nobody

  std::string mpiWhy, slurmWhy;
  if (out.launcher == "openmpi" || out.launcher == "pmi") {
    mpiWhy = mpiProbe(out.launcher);
    if (mpiWhy.empty()) {
      out.rendezvous = "mpi://";
      out.meeting = "MPI bootstrap: rank 0's address broadcast through MPI";
      return out;
    }
  }
  if (out.launcher == "slurm" || ((out.launcher == "openmpi" || out.launcher == "pmi") &&
                                  lookup(env, "SLURM_JOB_ID"))) {  // mpirun inside an allocation
    out.rendezvous = slurmMeeting(env, out, slurmWhy);
    if (!out.error.empty() || !out.rendezvous.empty()) return out;
  }
  std::ostringstream s;
  s << out.rankVars << " say this process is rank " << out.rank << " of " << out.worldSize
    << ", but there is no way to meet the others: MASTER_ADDR and SF_RENDEZVOUS are unset";
  if (!mpiWhy.empty()) s << ", the MPI bootstrap is unavailable (" << mpiWhy << ")";
  if (!slurmWhy.empty()) s << ", " << slurmWhy;
  s << ". Set MASTER_ADDR and MASTER_PORT (mpirun: -x MASTER_ADDR=host -x MASTER_PORT=port) or "
       "SF_RENDEZVOUS";
  out.unmet = s.str();
  return out;
}

}  // namespace sfsync
