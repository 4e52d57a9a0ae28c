#include "tests/chaos/chaos_rank.h"

#include <dirent.h>
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "sfsync.h"
#include "toy_model.h"

namespace sfchaos {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kGuardBytes = 64;
constexpr unsigned char kGuard = 0xA5;

double msSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

long countDir(const char* path) {
  DIR* d = ::opendir(path);
  if (!d) return -1;
  long n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n - (std::strcmp(path, "/proc/self/fd") == 0 ? 1 : 0);  // the DIR's own descriptor
}

// A host gradient buffer with guard bytes on both sides.
struct Guarded {
  std::vector<unsigned char> bytes;
  size_t size = 0;
  void alloc(size_t n) {
    size = n;
    bytes.assign(n + 2 * kGuardBytes, kGuard);
    std::memset(bytes.data() + kGuardBytes, 0, n);
  }
  void* data() { return bytes.data() + kGuardBytes; }
  bool intact() const {
    if (bytes.empty()) return true;
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (bytes[i] != kGuard || bytes[kGuardBytes + size + i] != kGuard) return false;
    }
    return true;
  }
};

// The host's side of the CUDA ordering rules (sfsync.h, "Ordering"):
// sf_zero_gradients runs on the host's stream, so a host that writes
// gradients from the CPU (the toy model, on the stand-in's host "device"
// memory) waits for the device first. Loaded at run time: the rank program
// links no CUDA.
void deviceSynchronize() {
  using Fn = int (*)();
  static Fn fn = [] {
    void* lib = ::dlopen("libcudart.so.13", RTLD_NOW | RTLD_GLOBAL);
    return lib ? reinterpret_cast<Fn>(::dlsym(lib, "cudaDeviceSynchronize")) : nullptr;
  }();
  if (fn) fn();
}

// Thrown to leave the rank body once a call failed (the outcome holds why).
struct Stop {};

class Rank {
 public:
  Rank(const Plan& plan, int rank, Mode mode, std::string rendezvous)
      : plan_(plan), rank_(rank), mode_(mode), rendezvous_(std::move(rendezvous)),
        rng_(plan.seed * 1000003u + uint64_t(rank)) {
    model_ = toy_model{plan.in, plan.rows, plan.blocks, plan.batch};
    out_.rank = rank;
    target_ = plan.target == rank && plan.fault != Fault::kNone && plan.fault != Fault::kGarbage &&
              plan.fault != Fault::kStranger;
  }

  Outcome run() {
    try {
      body();
    } catch (const Stop&) {
    }
    if (ctx_) sf_destroy(ctx_);
    ctx_ = nullptr;
    for (const Guarded& g : guarded_) out_.guardsOk = out_.guardsOk && g.intact();
    return out_;
  }

 private:
  bool is(Fault f) const { return target_ && plan_.fault == f; }
  bool faultAt(Point p) const {
    return target_ && (plan_.fault == Fault::kKill || plan_.fault == Fault::kStop) && plan_.point == p;
  }

  // Acts out a kill or stop fault; in thread mode leaves the rank body.
  void act() {
    if (mode_ == Mode::kProcess) {
      ::raise(plan_.fault == Fault::kKill ? SIGKILL : SIGSTOP);
      ::pause();  // a stopped process is killed by the driver; never continue
    }
    out_.faulted = true;
    if (plan_.fault == Fault::kStop) {
      std::this_thread::sleep_for(std::chrono::milliseconds(plan_.timeoutMs * 2 + 1000));
    }
    throw Stop{};  // kill: run() destroys the context at once (peers see it closed)
  }

  // Every sfsync call goes through here: counts calls (kRandomCall), makes
  // garbage calls before it, records the first failure and leaves.
  void call(const char* name, const std::function<sf_status()>& fn, bool allowFail = false) {
    if (faultAt(Point::kRandomCall) && calls_ == plan_.callIndex) act();
    ++calls_;
    if (plan_.fault == Fault::kGarbage && ctx_ && std::uniform_int_distribution<int>(0, 2)(rng_) == 0) {
      garbage();
    }
    const auto t0 = Clock::now();
    const sf_status st = fn();
    const double ms = msSince(t0);
    if (st == SF_OK || allowFail) return;
    out_.status = st;
    out_.call = name;
    out_.error = sf_last_error();
    out_.errMs = ms;
    throw Stop{};
  }

  // One invalid call chosen at random, with the statuses it may return. A
  // garbage call that succeeds or returns anything else is recorded.
  void garbage() {
    const int np = toy_param_count(&model_);
    const bool inWindow = sf_in_accumulation(ctx_) == 1;
    void* p = nullptr;
    int64_t i64 = 0;
    sf_dtype dt = 0;
    std::vector<sf_status> ok;
    sf_status st = SF_OK;
    const char* what = "";
    switch (std::uniform_int_distribution<int>(0, 10)(rng_)) {
      case 0: what = "grad_ready(-1)"; st = sf_grad_ready(ctx_, -1); ok = {SF_ERR_INVALID_ARGUMENT}; break;
      case 1: what = "grad_ready(count)"; st = sf_grad_ready(ctx_, np + 7); ok = {SF_ERR_INVALID_ARGUMENT}; break;
      case 2: what = "gradient_data(count)"; st = sf_gradient_data(ctx_, np + 3, &p); ok = {SF_ERR_INVALID_ARGUMENT}; break;
      case 3:
        what = "bucket_info(2^40)";
        st = sf_bucket_info(ctx_, int64_t(1) << 40, &i64, &i64, &dt);
        ok = {SF_ERR_INVALID_ARGUMENT, SF_ERR_INVALID_STATE};
        break;
      case 4:
        what = "set_bucket_cap_mb(NaN)";
        st = sf_set_bucket_cap_mb(ctx_, std::nan(""));
        ok = {SF_ERR_INVALID_ARGUMENT, SF_ERR_INVALID_STATE};
        break;
      case 5:
        what = inWindow ? "begin_accumulation(inside)" : "end_accumulation(outside)";
        st = inWindow ? sf_begin_accumulation(ctx_) : sf_end_accumulation(ctx_);
        ok = {SF_ERR_INVALID_STATE};
        break;
      case 6:
        what = "register_gradient(NULL)";
        st = sf_register_gradient(ctx_, nullptr, 4, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "g", &i64);
        ok = {SF_ERR_INVALID_ARGUMENT, SF_ERR_INVALID_STATE};
        break;
      case 7:
        what = "add_gradient(-5)";
        st = sf_add_gradient(ctx_, -5, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "g", &i64);
        ok = {SF_ERR_INVALID_ARGUMENT, SF_ERR_INVALID_STATE};
        break;
      case 8: {
        what = "get_stats(struct_size=8)";
        sf_stats s{};
        s.struct_size = 8;
        st = sf_get_stats(ctx_, &s);
        ok = {SF_ERR_INVALID_ARGUMENT};
        break;
      }
      case 9: what = "synchronize(NULL)"; st = sf_synchronize(nullptr); ok = {SF_ERR_INVALID_ARGUMENT}; break;
      default:
        what = inWindow ? "synchronize(inside)" : "register_gradient(dtype=77)";
        if (inWindow) {
          st = sf_synchronize(ctx_);
          ok = {SF_ERR_INVALID_STATE};
        } else {
          static float dummy[4];
          st = sf_register_gradient(ctx_, dummy, 4, 77, SF_DEVICE_HOST, "g", &i64);
          ok = {SF_ERR_INVALID_ARGUMENT, SF_ERR_INVALID_STATE};
        }
        break;
    }
    ++out_.garbageCalls;
    bool expected = false;
    for (sf_status s : ok) expected = expected || s == st;
    if (!expected && out_.garbage.empty()) {
      out_.garbage = std::string(what) + " returned " + sf_status_string(st);
    }
  }

  void body() {
    if (is(Fault::kLate)) std::this_thread::sleep_for(std::chrono::milliseconds(plan_.delayMs));
    if (faultAt(Point::kTimer) && mode_ == Mode::kProcess) {
      std::thread([this] {
        std::this_thread::sleep_for(std::chrono::milliseconds(plan_.delayMs));
        act();
      }).detach();
    }
    sf_options o;
    call("sf_options_init", [&] { return sf_options_init(&o, sizeof o); });
    if (mode_ == Mode::kThread) {
      o.rank = rank_;
      o.world_size = plan_.world;
      o.local_rank = rank_;  // one (stand-in) GPU per rank
    }
    if (!rendezvous_.empty()) std::strncpy(o.rendezvous, rendezvous_.c_str(), SF_RENDEZVOUS_MAX - 1);
    o.timeout_ms = plan_.timeoutMs;
    o.bucket_cap_mb = plan_.capMb;
    o.first_bucket_cap_mb = plan_.firstCapMb;
    o.reduce_op = plan_.reduceOp;
    if (is(Fault::kLayout) && plan_.layout == LayoutDiff::kCap) o.bucket_cap_mb *= 2;
    if (is(Fault::kLayout) && plan_.layout == LayoutDiff::kReduceOp) o.reduce_op = 1 - o.reduce_op;
    call("sf_create", [&] { return sf_create(&o, &ctx_); });

    const int np = toy_param_count(&model_);
    std::vector<float*> grads(static_cast<size_t>(np)), params(static_cast<size_t>(np));
    std::vector<std::vector<float>> weights(static_cast<size_t>(np));
    guarded_.resize(size_t(np) + 1);
    for (int p = 0; p < np; ++p) {
      int64_t numel = toy_param_numel(&model_, p);
      sf_dtype dtype = SF_DTYPE_FLOAT32;
      if (is(Fault::kLayout) && p == 0 && plan_.layout == LayoutDiff::kNumel) numel += 1;
      if (is(Fault::kLayout) && p == 0 && plan_.layout == LayoutDiff::kDtype) dtype = SF_DTYPE_FLOAT64;
      int64_t id = -1;
      if (plan_.flat) {
        // Device memory is host memory under the stand-in: the toy model writes it directly.
        const sf_device dev = plan_.cuda ? SF_DEVICE_CUDA : SF_DEVICE_HOST;
        call("sf_add_gradient", [&] { return sf_add_gradient(ctx_, numel, dtype, dev, nullptr, &id); });
      } else {
        guarded_[size_t(p)].alloc(size_t(numel) * (dtype == SF_DTYPE_FLOAT64 ? 8 : 4));
        void* data = guarded_[size_t(p)].data();
        call("sf_register_gradient",
             [&] { return sf_register_gradient(ctx_, data, numel, dtype, SF_DEVICE_HOST, nullptr, &id); });
      }
      weights[size_t(p)].assign(size_t(toy_param_numel(&model_, p)), 0.0f);
      params[size_t(p)] = weights[size_t(p)].data();
    }
    if (is(Fault::kLayout) && plan_.layout == LayoutDiff::kCount) {
      int64_t id = -1;
      const sf_device dev = plan_.cuda ? SF_DEVICE_CUDA : SF_DEVICE_HOST;
      call("sf_add_gradient(extra)", [&] { return sf_add_gradient(ctx_, 3, SF_DTYPE_FLOAT32, dev, "extra", &id); });
    }
    for (int p = 0; p < np; ++p) {
      void* data = nullptr;
      call("sf_gradient_data", [&] { return sf_gradient_data(ctx_, p, &data); });
      grads[size_t(p)] = static_cast<float*>(data);
    }
    toy_init_params(&model_, params.data());

    const int windows = int(plan_.micro.size());
    auto ready = [&](int from, int to) {  // grad-ready for gradients (from, to], last first
      for (int p = to; p > from && plan_.gradReady; --p) call("sf_grad_ready", [&] { return sf_grad_ready(ctx_, p); });
    };
    for (int w = 0; w < windows; ++w) {
      const int n = plan_.micro[size_t(w)];
      const bool here = w == plan_.atWindow;
      call("sf_zero_gradients", [&] { return sf_zero_gradients(ctx_); });
      if (plan_.cuda) deviceSynchronize();
      if (n > 1) call("sf_begin_accumulation", [&] { return sf_begin_accumulation(ctx_); });
      for (int k = 0; k < n - 1; ++k) {
        if (here && k == (n - 1) / 2 && faultAt(Point::kWindow)) act();
        toy_accumulate_grads(&model_, params.data(), toy_seed(w, k, rank_), grads.data());
        ready(-1, np - 1);
      }
      if (n > 1) call("sf_end_accumulation", [&] { return sf_end_accumulation(ctx_); });
      if (here && n == 1 && faultAt(Point::kWindow)) act();
      toy_accumulate_grads(&model_, params.data(), toy_seed(w, n - 1, rank_), grads.data());
      if (here && faultAt(Point::kMidBucket)) {
        ready(np / 2, np - 1);
        act();
      }
      ready(-1, np - 1);
      if (here && is(Fault::kMissingSync)) {
        // Everything as usual but the synchronization: with grad-ready
        // reports the buckets are in flight and the next zero/begin must say
        // so; without, the next synchronization carries two windows' begins.
        toy_sgd_step(&model_, params.data(), grads.data(), 0.05f);
        continue;
      }
      if (w == 0 && faultAt(Point::kRendezvous)) {
        if (mode_ == Mode::kProcess) {
          const int64_t delay = plan_.delayMs % 50;
          std::thread([this, delay] {
            std::this_thread::sleep_for(std::chrono::milliseconds(delay));
            act();
          }).detach();
        } else {
          act();
        }
      }
      call("sf_synchronize", [&] { return sf_synchronize(ctx_); });
      if (here && is(Fault::kExtraSync)) call("sf_synchronize(extra)", [&] { return sf_synchronize(ctx_); });
      out_.windows = w + 1;
      toy_sgd_step(&model_, params.data(), grads.data(), 0.05f);
    }
    out_.completed = true;
    if (faultAt(Point::kTeardown)) act();

    // The reference: averages (sum: world times the average, the same math).
    std::vector<std::vector<float>> ref(static_cast<size_t>(np));
    std::vector<float*> refp(static_cast<size_t>(np));
    for (int p = 0; p < np; ++p) {
      ref[size_t(p)].assign(size_t(toy_param_numel(&model_, p)), 0.0f);
      refp[size_t(p)] = ref[size_t(p)].data();
    }
    const float lr = 0.05f * (plan_.reduceOp == SF_REDUCE_SUM ? float(plan_.world) : 1.0f);
    toy_reference(&model_, plan_.world, windows, plan_.micro.data(), lr, refp.data());
    double worst = 0;
    for (int p = 0; p < np; ++p) {
      for (size_t i = 0; i < ref[size_t(p)].size(); ++i) {
        const double d = std::fabs(double(ref[size_t(p)][i]) - double(weights[size_t(p)][i]));
        if (!(d <= worst)) worst = std::isnan(d) ? INFINITY : d;
      }
    }
    out_.maxDiff = worst;
  }

  const Plan& plan_;
  const int rank_;
  const Mode mode_;
  const std::string rendezvous_;
  std::mt19937_64 rng_;
  toy_model model_{};
  bool target_ = false;
  sf_context* ctx_ = nullptr;
  int calls_ = 0;
  std::vector<Guarded> guarded_;
  Outcome out_;
};

std::string oneLine(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

}  // namespace

long countFds() { return countDir("/proc/self/fd"); }
long countTasks() { return countDir("/proc/self/task"); }

Outcome runRank(const Plan& plan, int rank, Mode mode, const std::string& rendezvous) {
  return Rank(plan, rank, mode, rendezvous).run();
}

std::string formatOutcome(const Outcome& o) {
  std::ostringstream s;
  s << "CHAOS rank=" << o.rank << " status=" << o.status << " call=" << (o.call.empty() ? "-" : o.call)
    << " errms=" << o.errMs << " completed=" << o.completed << " windows=" << o.windows
    << " maxdiff=" << o.maxDiff << " guards=" << o.guardsOk << " faulted=" << o.faulted
    << " garbage_calls=" << o.garbageCalls << " fd0=" << o.fdBefore << " fd1=" << o.fdAfter
    << " task0=" << o.tasksBefore << " task1=" << o.tasksAfter
    << " garbage=" << (o.garbage.empty() ? "-" : oneLine(o.garbage)) << " | error=" << oneLine(o.error);
  return s.str();
}

bool parseOutcome(const std::string& line, Outcome& o) {
  if (line.rfind("CHAOS rank=", 0) != 0) return false;
  const size_t bar = line.find(" | error=");
  if (bar == std::string::npos) return false;
  o.error = line.substr(bar + 9);
  std::string head = line.substr(6, bar - 6);
  const size_t g = head.find(" garbage=");
  if (g != std::string::npos) {
    o.garbage = head.substr(g + 9);
    if (o.garbage == "-") o.garbage.clear();
    head = head.substr(0, g);
  }
  std::istringstream in(head);
  std::string item;
  while (in >> item) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "rank") o.rank = std::atoi(v.c_str());
    else if (k == "status") o.status = std::atoi(v.c_str());
    else if (k == "call") o.call = v == "-" ? "" : v;
    else if (k == "errms") o.errMs = std::atof(v.c_str());
    else if (k == "completed") o.completed = v == "1";
    else if (k == "windows") o.windows = std::atoi(v.c_str());
    else if (k == "maxdiff") o.maxDiff = std::atof(v.c_str());
    else if (k == "guards") o.guardsOk = v == "1";
    else if (k == "faulted") o.faulted = v == "1";
    else if (k == "garbage_calls") o.garbageCalls = std::atoi(v.c_str());
    else if (k == "fd0") o.fdBefore = std::atol(v.c_str());
    else if (k == "fd1") o.fdAfter = std::atol(v.c_str());
    else if (k == "task0") o.tasksBefore = std::atol(v.c_str());
    else if (k == "task1") o.tasksAfter = std::atol(v.c_str());
  }
  return true;
}

std::string describePlanForHumans(const Plan& plan) {
  std::ostringstream s;
  s << plan.kind() << " target=" << plan.target << " world=" << plan.world << " windows=" << plan.micro.size()
    << " timeout_ms=" << plan.timeoutMs;
  return s.str();
}

}  // namespace sfchaos
