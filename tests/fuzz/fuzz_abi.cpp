// libFuzzer target: the C ABI driven by a byte string decoded into a
// sequence of calls on world-size-1 contexts (create with fuzzed options,
// register/add gradients of fuzzed sizes and dtypes, the window calls,
// synchronize, zero, bucket info, stats and options with fuzzed struct
// sizes, caps, destroy). Checks: no crash, no memory error (ASan), no UB
// (UBSan), every status a defined one with a message, and at world size 1
// a synchronized sum or average leaves the gradients as they were, with one
// collective per bucket per window counted.
//
// SF_FUZZ_ABI_SMALL=1 leaves out sizes near 2^63 (to look past the overflow
// of summed sizes while it is open).

#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "sfsync.h"

namespace {

bool gSmall = false;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_abi: invariant broken: %s (last error: %s)\n", what, sf_last_error());
    std::abort();
  }
}

sf_status checkedStatus(sf_status st) {
  check(st >= SF_OK && st <= SF_ERR_INTERNAL, "a defined status");
  check(st != SF_ERR_INTERNAL, "no internal error");
  if (st != SF_OK) check(sf_last_error() && *sf_last_error(), "a failure has a message");
  return st;
}

size_t dtypeSize(sf_dtype d) { return d == SF_DTYPE_FLOAT64 ? 8 : d == SF_DTYPE_FLOAT32 ? 4 : 2; }

double fuzzedDouble(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return std::nan("");
    case 1: return INFINITY;
    case 2: return -1;
    case 3: return 0;
    case 4: return 1e300;
    case 5: return 5e-324;
    case 6: return in.ConsumeFloatingPointInRange<double>(1e-7, 64);
    default: return in.ConsumeFloatingPoint<double>();
  }
}

int64_t fuzzedNumel(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, gSmall ? 3 : 7)) {
    case 0: return in.ConsumeIntegralInRange<int64_t>(1, 64);
    case 1: return in.ConsumeIntegralInRange<int64_t>(1, 1 << 12);
    case 2: return in.ConsumeIntegralInRange<int64_t>(-3, 0);
    case 3: return in.ConsumeIntegralInRange<int64_t>(1, 1 << 16);
    case 4: return std::numeric_limits<int64_t>::max();
    case 5: return (int64_t(1) << 62) + in.ConsumeIntegralInRange<int64_t>(-4, 4);
    case 6: return (int64_t(1) << 61) + in.ConsumeIntegralInRange<int64_t>(-4, 4);
    default: return in.ConsumeIntegral<int64_t>();
  }
}

// libFuzzer's -malloc_limit_mb (4096 in run.sh) reports any allocation above
// it as an out-of-memory finding, a legal one too (fuzz_abi once failed a
// ctest run on a 5.6 GB flat buffer). So a context's plugin-owned bytes stay
// within kOwnedBudget, or reach kRefusedBytes, above the largest allocation
// ASan makes at all (2^40 bytes: the allocation fails, never reaching the
// limit's hook, and sf_build_buckets must say SF_ERR_OUT_OF_MEMORY), never in
// between. Sizes near 2^61..2^63 elements keep testing the overflow checks.
constexpr int64_t kOwnedBudget = int64_t(1) << 24;
constexpr int64_t kRefusedBytes = int64_t(1) << 41;

// `numel` as fuzzed, or, where the flat buffer would become a legal
// allocation above the budget, a size that fits the budget (or, with the
// budget spent, one that is refused).
int64_t boundedNumel(int64_t ownedBytes, int64_t numel, sf_dtype dt) {
  if (numel <= 0) return numel;
  const int64_t esize = int64_t(dtypeSize(dt));
  int64_t bytes = 0, total = 0;
  if (__builtin_mul_overflow(numel, esize, &bytes) || __builtin_add_overflow(ownedBytes, bytes, &total) ||
      total >= kRefusedBytes || total <= kOwnedBudget) {
    return numel;
  }
  const int64_t room = (kOwnedBudget - ownedBytes) / esize;
  return room > 0 ? 1 + numel % room : kRefusedBytes / esize;
}

// The bytes registered so far plus numel's, saturating.
int64_t addedBytes(int64_t ownedBytes, int64_t numel, sf_dtype dt) {
  int64_t bytes = 0, total = 0;
  if (__builtin_mul_overflow(numel, int64_t(dtypeSize(dt)), &bytes) ||
      __builtin_add_overflow(ownedBytes, bytes, &total)) {
    return std::numeric_limits<int64_t>::max();
  }
  return total;
}

struct Grad {
  int64_t numel;
  sf_dtype dtype;
  bool owned;                        // plugin-owned (sf_add_gradient)
  std::unique_ptr<unsigned char[]> host;  // host buffer (sf_register_gradient)
};

struct Session {
  sf_context* ctx = nullptr;
  std::vector<Grad> grads;
  sf_reduce_op op = SF_REDUCE_AVERAGE;
  double prescale = 1;
  int64_t syncs = 0;
  bool broken = false;  // a sync failed: counters are no longer predictable
  int64_t collectivesAtSync = 0;  // collectives_issued after the last synchronization
  bool readySinceSync = false;    // a bucket may have captured its gradients already
  int64_t ownedBytes = 0;         // plugin-owned bytes registered (saturating)

  void destroy() {
    sf_destroy(ctx);
    ctx = nullptr;
    ownedBytes = 0;
    grads.clear();
    syncs = collectivesAtSync = 0;
    readySinceSync = false;
    broken = false;
  }
};

// Fills every float32 gradient with a pattern, synchronizes, and checks
// that a world-size-1 sum or average changed nothing.
void syncAndCheck(Session& s) {
  std::vector<std::vector<float>> before(s.grads.size());
  std::vector<float*> where(s.grads.size(), nullptr);
  for (size_t i = 0; i < s.grads.size(); ++i) {
    const Grad& g = s.grads[i];
    if (g.dtype != SF_DTYPE_FLOAT32 || g.numel > (1 << 18)) continue;
    void* p = nullptr;
    if (sf_gradient_data(s.ctx, int64_t(i), &p) != SF_OK || !p) continue;
    where[i] = static_cast<float*>(p);
    before[i].resize(size_t(g.numel));
    for (int64_t k = 0; k < g.numel; ++k) before[i][size_t(k)] = where[i][k] = float(k % 97) * 0.25f - 3.0f;
  }
  sf_stats st0{};
  st0.struct_size = sizeof st0;
  const bool haveStats = sf_get_stats(s.ctx, &st0) == SF_OK;
  const sf_status st = checkedStatus(sf_synchronize(s.ctx));
  const bool launchedEarly = s.readySinceSync;
  s.readySinceSync = false;
  if (st != SF_OK) {
    s.broken = true;
    return;
  }
  ++s.syncs;
  sf_stats st1{};
  st1.struct_size = sizeof st1;
  check(sf_get_stats(s.ctx, &st1) == SF_OK, "stats after a synchronization");
  if (haveStats && !s.broken) {
    // Buckets started early by sf_grad_ready belong to the window too.
    check(st1.windows_completed == st0.windows_completed + 1, "one window completed per synchronization");
    check(st1.collectives_issued - s.collectivesAtSync == st1.bucket_count,
          "one collective per bucket per window");
  }
  s.collectivesAtSync = st1.collectives_issued;
  // A gradient reported ready was captured then (written after that, the
  // write is the host's loss, as in DDP): compare only windows without.
  if (launchedEarly || (s.op == SF_REDUCE_PRESCALED_SUM && s.prescale != 1)) return;
  for (size_t i = 0; i < s.grads.size(); ++i) {
    if (!where[i]) continue;
    if (std::memcmp(before[i].data(), where[i], before[i].size() * sizeof(float)) != 0) {
      for (size_t k = 0; k < before[i].size(); ++k) {
        if (before[i][k] != where[i][k]) {
          std::fprintf(stderr, "fuzz_abi: gradient %zu (%s, %lld elements, op %d, prescale %g) element %zu: %g became %g\n", i,
                       s.grads[i].owned ? "plugin-owned" : "host", (long long)s.grads[i].numel, s.op, s.prescale, k,
                       before[i][k], where[i][k]);
          break;
        }
      }
      check(false, "a world-size-1 sum/average leaves gradients unchanged");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* v = std::getenv("SF_FUZZ_ABI_SMALL");
  gSmall = v && *v == '1';
  for (const char* e : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SF_RENDEZVOUS",
                        "SF_NCCL_MODULE", "SF_DEBUG_FILE"}) {
    ::unsetenv(e);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Session s;
  int steps = 0;
  while (in.remaining_bytes() > 0 && steps++ < 256) {
    const int op = in.ConsumeIntegralInRange<int>(0, 19);
    if (!s.ctx && op != 0) {
      // Calls on NULL are a status, never a crash.
      check(sf_synchronize(nullptr) == SF_ERR_INVALID_ARGUMENT, "NULL context");
      continue;
    }
    switch (op) {
      case 0: {  // create
        if (s.ctx) s.destroy();
        sf_options o;
        const uint64_t sizes[] = {sizeof o, sizeof o - 8, 8, 0};
        const uint64_t asked = sizes[in.ConsumeIntegralInRange<int>(0, 3)];
        if (checkedStatus(sf_options_init(&o, asked)) != SF_OK) {
          check(asked < sizeof o, "sf_options_init accepts its own size");
          sf_options_init(&o, sizeof o);
        }
        o.world_size = 1;
        o.rank = in.ConsumeIntegralInRange<int>(0, 20) == 0 ? 1 : 0;
        o.backend = in.ConsumeIntegralInRange<int32_t>(-1, 3);
        o.reduce_op = in.ConsumeIntegralInRange<int32_t>(-1, 3);
        o.prescale = in.ConsumeBool() ? 1.0 : fuzzedDouble(in);
        if (in.ConsumeBool()) o.bucket_cap_mb = fuzzedDouble(in);
        if (in.ConsumeBool()) o.first_bucket_cap_mb = fuzzedDouble(in);
        if (in.ConsumeBool()) o.timeout_ms = in.ConsumeIntegral<int64_t>();
        o.rendezvous[0] = 0;
        if (in.ConsumeIntegralInRange<int>(0, 15) == 0) o.reserved0 = 1;
        sf_context* c = nullptr;
        if (checkedStatus(sf_create(&o, &c)) == SF_OK) {
          check(c != nullptr, "a created context");
          s.ctx = c;
          s.op = o.reduce_op;
          s.prescale = o.prescale;
        }
        break;
      }
      case 1: {  // register a host buffer
        const sf_dtype dt = in.ConsumeIntegralInRange<int32_t>(-1, 4);
        const int64_t numel = in.ConsumeIntegralInRange<int64_t>(-2, 1 << 12);
        std::unique_ptr<unsigned char[]> buf;
        if (numel > 0) buf.reset(new unsigned char[size_t(numel) * 8]());
        const bool nullData = in.ConsumeIntegralInRange<int>(0, 7) == 0;
        const sf_device dev = in.ConsumeIntegralInRange<int>(0, 31) == 0 ? SF_DEVICE_CUDA : SF_DEVICE_HOST;
        int64_t id = -1;
        const sf_status st = checkedStatus(
            sf_register_gradient(s.ctx, nullData ? nullptr : buf.get(), numel, dt, dev, "g", &id));
        if (st == SF_OK) {
          check(id == int64_t(s.grads.size()), "ids in registration order");
          s.grads.push_back(Grad{numel, dt, false, std::move(buf)});
        }
        break;
      }
      case 2: {  // a plugin-owned gradient
        const sf_dtype dt = in.ConsumeIntegralInRange<int32_t>(-1, 4);
        const int64_t numel = boundedNumel(s.ownedBytes, fuzzedNumel(in), dt);
        int64_t id = -1;
        if (checkedStatus(sf_add_gradient(s.ctx, numel, dt, SF_DEVICE_HOST, nullptr, &id)) == SF_OK) {
          s.ownedBytes = addedBytes(s.ownedBytes, numel, dt);
          check(id == int64_t(s.grads.size()), "ids in registration order");
          s.grads.push_back(Grad{numel, dt, true, nullptr});
        }
        break;
      }
      case 3: {  // the data of a gradient: every byte must be writable
        const int64_t id = in.ConsumeIntegralInRange<int64_t>(-1, int64_t(s.grads.size()));
        void* p = nullptr;
        if (checkedStatus(sf_gradient_data(s.ctx, id, &p)) == SF_OK) {
          check(id >= 0 && id < int64_t(s.grads.size()) && p, "data of a registered gradient");
          const Grad& g = s.grads[size_t(id)];
          const uint64_t bytes = uint64_t(g.numel) * dtypeSize(g.dtype);
          if (bytes <= (1u << 22)) std::memset(p, 0x41, size_t(bytes));
        }
        break;
      }
      case 4: checkedStatus(sf_build_buckets(s.ctx)); break;
      case 5: checkedStatus(sf_zero_gradients(s.ctx)); break;
      case 6: checkedStatus(sf_begin_accumulation(s.ctx)); break;
      case 7: checkedStatus(sf_end_accumulation(s.ctx)); break;
      case 8: {
        const int64_t id = in.ConsumeIntegralInRange<int64_t>(-2, int64_t(s.grads.size()) + 1);
        if (checkedStatus(sf_grad_ready(s.ctx, id)) == SF_OK) s.readySinceSync = true;
        break;
      }
      case 9: syncAndCheck(s); break;
      case 10: {
        const int64_t index = in.ConsumeIntegralInRange<int64_t>(-2, 40);
        int64_t bytes = -1, count = -1;
        sf_dtype dt = -1;
        const bool nulls = in.ConsumeBool();
        if (checkedStatus(sf_bucket_info(s.ctx, index, nulls ? nullptr : &bytes, nulls ? nullptr : &count,
                                         nulls ? nullptr : &dt)) == SF_OK && !nulls) {
          check(bytes > 0 && count > 0 && dt >= 0 && dt <= SF_DTYPE_BFLOAT16, "a described bucket");
        }
        break;
      }
      case 11: {
        std::vector<unsigned char> buf(sizeof(sf_stats) + 64, 0xEE);
        auto* st = reinterpret_cast<sf_stats*>(buf.data());
        const uint64_t sizes[] = {sizeof(sf_stats), sizeof(sf_stats) + 64, 8, 0, sizeof(sf_stats) - 8};
        const uint64_t asked = sizes[in.ConsumeIntegralInRange<int>(0, 4)];
        st->struct_size = asked;
        if (checkedStatus(sf_get_stats(s.ctx, st)) == SF_OK) {
          for (size_t k = std::min<uint64_t>(asked, sizeof(sf_stats)); k < buf.size(); ++k) {
            check(buf[k] == 0xEE, "sf_get_stats writes no more than struct_size");
          }
        }
        break;
      }
      case 12: checkedStatus(sf_set_bucket_cap_mb(s.ctx, fuzzedDouble(in))); break;
      case 13: checkedStatus(sf_set_first_bucket_cap_mb(s.ctx, fuzzedDouble(in))); break;
      case 14: check(sf_in_accumulation(s.ctx) == 0 || sf_in_accumulation(s.ctx) == 1, "0 or 1"); break;
      case 15: {
        std::vector<unsigned char> buf(sizeof(sf_options) + 64, 0xEE);
        auto* o = reinterpret_cast<sf_options*>(buf.data());
        const uint64_t sizes[] = {sizeof(sf_options), sizeof(sf_options) + 64, 8, 0};
        const uint64_t asked = sizes[in.ConsumeIntegralInRange<int>(0, 3)];
        o->struct_size = asked;
        if (checkedStatus(sf_get_options(s.ctx, o)) == SF_OK) {
          check(o->world_size == 1, "world size 1");
          for (size_t k = std::min<uint64_t>(asked, sizeof(sf_options)); k < buf.size(); ++k) {
            check(buf[k] == 0xEE, "sf_get_options writes no more than struct_size");
          }
        }
        break;
      }
      case 16: s.destroy(); break;
      case 17: {
        const char* text = sf_status_string(in.ConsumeIntegral<int32_t>());
        check(text && *text, "every status has a name");
        break;
      }
      case 18: {
        const int64_t id = in.ConsumeIntegralInRange<int64_t>(-1, int64_t(s.grads.size()));
        check(sf_gradient_data(s.ctx, id, nullptr) == SF_ERR_INVALID_ARGUMENT, "NULL out pointer");
        break;
      }
      default: {
        sf_stats* none = nullptr;
        check(sf_get_stats(s.ctx, none) == SF_ERR_INVALID_ARGUMENT, "NULL stats");
        break;
      }
    }
  }
  s.destroy();
  return 0;
}
