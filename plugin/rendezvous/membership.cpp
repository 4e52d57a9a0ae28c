#include "plugin/rendezvous/membership.h"

#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <random>
#include <sstream>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "plugin/core/deadline.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"

namespace sfsync {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kRosterKey = "roster";
// How often a waiting rank asks whether its attempt was superseded.
constexpr std::chrono::milliseconds kGuardPoll(200);

std::string joinKey(int rank) { return "join/" + std::to_string(rank); }

std::vector<char> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }
std::string textOf(const std::vector<char>& v) { return {v.begin(), v.end()}; }

// Runs a store call, turning whatever the store throws into sfsync::Error
// that says what was being done.
template <typename F>
auto storeCall(const std::string& what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    throw Error(e.status(), what + ": " + e.what());
  } catch (const std::exception& e) {
    const std::string m = e.what();
    const bool timedOut = m.find("imeout") != std::string::npos ||
                          m.find("imed out") != std::string::npos;
    throw Error(timedOut ? SF_ERR_TIMEOUT : SF_ERR_BACKEND, what + ": " + m);
  }
}

std::string waitGet(gloo::rendezvous::Store& store, const std::string& key, milliseconds timeout,
                    const std::string& what) {
  return storeCall(what, [&] {
    store.wait({key}, timeout);
    return textOf(store.get(key));
  });
}

// timeout_ms as a duration that cannot overflow the clock ("forever" values
// such as INT64_MAX become about 100 years).
milliseconds bounded(int64_t timeoutMs) {
  constexpr int64_t kMaxMs = int64_t(100) * 365 * 24 * 3600 * 1000;
  return milliseconds(std::min<int64_t>(std::max<int64_t>(timeoutMs, 1), kMaxMs));
}

// What is left of `deadline`, at least kStoreProbe (never 0: "no timeout" to Gloo).
milliseconds left(Clock::time_point deadline) {
  return std::max<milliseconds>(kStoreProbe,
                                std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

std::string makeNonce() {
  std::random_device device;
  std::seed_seq seq{device(), device(), device(), device(), unsigned(::getpid()),
                    unsigned(Clock::now().time_since_epoch().count())};
  std::mt19937_64 gen(seq);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016" PRIx64 "%016" PRIx64, uint64_t(gen()), uint64_t(gen()));
  return buf;
}

std::string hostName() {
  char name[256] = {0};
  if (::gethostname(name, sizeof name - 1) != 0 || !name[0]) return "?";
  return name;
}

// world_size=W from a claim, or -1 when it does not parse.
int64_t claimedWorldSize(const std::string& claim) {
  long long w = -1;
  if (std::sscanf(claim.c_str(), "world_size=%lld", &w) != 1) return -1;
  return w;
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

}  // namespace

Membership::Membership(const sf_options& opts, std::string where, AttemptGuard* guard)
    : opts_(opts), where_(std::move(where)), guard_(guard) {
  claim_ = "world_size=" + std::to_string(opts.world_size) + " nonce=" + makeNonce() +
           " host=" + hostName() + " pid=" + std::to_string(::getpid());
}

void Membership::refuseIfSuperseded() {
  if (!guard_) return;
  const std::string why = guard_->supersededBy();
  if (why.empty()) return;
  refused_ = true;
  fail(SF_ERR_MISMATCH, "rank " + std::to_string(opts_.rank) + " refused by " + where_ + ": " + why);
}

std::string Membership::waitGetGuarded(gloo::rendezvous::Store& store, const std::string& key,
                                       milliseconds timeout, const std::string& what) {
  if (!guard_) return waitGet(store, key, timeout, what);
  const Deadline deadline(timeout);
  for (;;) {
    const milliseconds slice = std::min(kGuardPoll, left(deadline.at()));
    try {
      return waitGet(store, key, slice, what);
    } catch (const Error& e) {
      if (e.status() != SF_ERR_TIMEOUT || deadline.expired()) throw;
    }
    refuseIfSuperseded();
  }
}

void Membership::join(gloo::rendezvous::Store& store) {
  const std::string me = "rank " + std::to_string(opts_.rank);
  refuseIfSuperseded();
  if (opts_.rank == 0 && guard_) guard_->supersedeEarlier();
  if (opts_.rank == 0) {
    // A fresh job has no roster before rank 0 publishes one: a store that
    // holds one already is an earlier job's (keys are never deleted) or
    // another rank 0's. Its other keys (claims, Gloo addresses) would lead
    // this job to dead peers, so refuse now; the other ranks then read that
    // old roster, do not find their claims in it, and fail the same way.
    bool stale = false;
    try {
      waitGet(store, kRosterKey, kStoreProbe, "roster");
      stale = true;
    } catch (const Error& e) {
      if (e.status() != SF_ERR_TIMEOUT) throw;
    }
    if (stale) {
      fail(SF_ERR_MISMATCH, "rank 0 is claimed by two processes, or " + where_ +
                                " was used by an earlier job: it already holds a roster (use a "
                                "rendezvous or store prefix per job)");
    }
  }
  try {
    storeCall(me + " could not publish its claim in " + where_,
              [&] { store.set(joinKey(opts_.rank), bytesOf(claim_)); });
  } catch (const Error& e) {
    // A store whose keys are written once refuses a second claim itself.
    if (e.status() != SF_ERR_MISMATCH) throw;
    fail(SF_ERR_MISMATCH, me + " is claimed by two processes: " + where_ +
                              " already holds a claim for it (this one is '" + claim_ +
                              "'; check RANK and the launcher, or a rendezvous reused from an "
                              "earlier job): " + e.what());
  }
  if (opts_.rank == 0) {
    joinAsRoot(store);
  } else {
    joinAsPeer(store);
  }
  SF_LOG(kInfo, "rendezvous", "rank " << opts_.rank << " of " << opts_.world_size
                                      << " admitted through " << where_);
}

void Membership::joinAsRoot(gloo::rendezvous::Store& store) {
  const int world = opts_.world_size;
  const auto deadline = Clock::now() + bounded(opts_.timeout_ms);
  std::vector<std::string> claims{claim_};
  sf_status status = SF_OK;
  std::string error;
  for (int r = 1; r < world && status == SF_OK; ++r) {
    try {
      claims.push_back(waitGetGuarded(store, joinKey(r), left(deadline), "join"));
    } catch (const Error& e) {
      if (refused_) throw;
      status = e.status();
      if (status != SF_ERR_TIMEOUT) {
        error = "rank 0 could not read rank " + std::to_string(r) + "'s claim from " + where_ +
                ": " + e.what();
        break;
      }
      // Name every rank that is missing, not only the first.
      std::vector<int> missing{r};
      for (int m = r + 1; m < world && missing.size() < 16; ++m) {
        try {
          waitGet(store, joinKey(m), kStoreProbe, "join");
        } catch (const Error&) {
          missing.push_back(m);
        }
      }
      std::ostringstream s;
      s << "rank" << (missing.size() > 1 ? "s " : " ");
      for (size_t i = 0; i < missing.size(); ++i) s << (i ? ", " : "") << missing[i];
      if (missing.size() == 16) s << ", ...";
      s << " of world_size " << world << " did not join " << where_ << " within timeout_ms = "
        << opts_.timeout_ms << " (are they running, with the same rendezvous and WORLD_SIZE?)";
      error = s.str();
      break;
    }
    const int64_t w = claimedWorldSize(claims.back());
    if (w != world) {
      status = SF_ERR_MISMATCH;
      error = "ranks disagree on world_size: rank 0 has " + std::to_string(world) + ", rank " +
              std::to_string(r) + " has " + std::to_string(w) + " (claim '" + claims.back() + "')";
    }
  }
  if (status == SF_OK) {
    roster_ = "ok\n";
    for (const auto& c : claims) roster_ += c + "\n";
  } else {
    roster_ = "error " + std::to_string(status) + "\n" + error;
  }
  // Published also on failure: the other ranks then fail with this reason now
  // instead of timing out on their own.
  storeCall("rank 0 could not publish the roster in " + where_,
            [&] { store.set(kRosterKey, bytesOf(roster_)); });
  if (status != SF_OK) fail(status, error);
}

void Membership::joinAsPeer(gloo::rendezvous::Store& store) {
  const std::string me = "rank " + std::to_string(opts_.rank);
  roster_ = waitGetGuarded(store, kRosterKey, bounded(opts_.timeout_ms),
                           me + " did not receive rank 0's roster from " + where_ + " within timeout_ms = " +
                        std::to_string(opts_.timeout_ms) + " (is rank 0 running, with the same "
                        "rendezvous?)");
  const std::vector<std::string> l = lines(roster_);
  if (l.empty()) fail(SF_ERR_BACKEND, "the roster in " + where_ + " is empty");
  if (l[0].compare(0, 6, "error ") == 0) {
    const sf_status status = sf_status(std::atoi(l[0].c_str() + 6));
    fail(status == SF_OK ? SF_ERR_BACKEND : status,
         "rank 0 refused the job: " + roster_.substr(l[0].size() + 1));
  }
  const int64_t listed = int64_t(l.size()) - 1;
  if (l[0] != "ok" || listed < 1) {
    fail(SF_ERR_BACKEND, "the roster in " + where_ + " is malformed: '" + roster_ + "'");
  }
  if (listed != opts_.world_size || opts_.rank >= listed) {
    fail(SF_ERR_MISMATCH, "ranks disagree on world_size: rank 0 has " + std::to_string(listed) +
                              ", " + me + " has " + std::to_string(opts_.world_size));
  }
  const std::string& listedClaim = l[size_t(opts_.rank) + 1];
  if (listedClaim != claim_) {
    // Rank 0 admitted another process as this rank. Say so where it will look
    // after connecting, then refuse.
    try {
      store.set(joinKey(opts_.rank), bytesOf(claim_));
    } catch (...) {
    }
    fail(SF_ERR_MISMATCH, me + " is claimed by two processes: rank 0 admitted '" + listedClaim +
                              "', this one is '" + claim_ + "' (check RANK and the launcher, or a "
                              "rendezvous or store prefix reused from an earlier job)");
  }
}

std::string Membership::recheck(gloo::rendezvous::Store& store) const {
  const std::string me = "rank " + std::to_string(opts_.rank);
  if (guard_) {
    const std::string why = guard_->supersededBy();
    if (!why.empty()) return me + " refused by " + where_ + ": " + why;
  }
  const std::string now = storeCall(me + " could not re-read its claim", [&] {
    return textOf(store.get(joinKey(opts_.rank)));
  });
  if (now != claim_) {
    return me + " is claimed by two processes: this one is '" + claim_ + "', another wrote '" +
           now + "' (check RANK and the launcher)";
  }
  if (opts_.rank == 0) {
    const std::string roster =
        storeCall("rank 0 could not re-read the roster", [&] { return textOf(store.get(kRosterKey)); });
    if (roster != roster_) {
      return "rank 0 is claimed by two processes: another one published a different roster "
             "(check RANK and the launcher)";
    }
  }
  return "";
}

}  // namespace sfsync
