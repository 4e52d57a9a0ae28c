// WindowCheck on its own (plugin/reducer/window_check.h), built from bucket
// plans and driven without the C ABI: the carrier rule over plans of mixed
// dtypes, devices, shard layouts and world sizes (and the modulus each
// implies, the 16-bit wire included); the encoding into every segment's
// reserved tail of a BucketMemory; and the verification after the carrier's
// collective. The test plays the reducer (encode, start the collective with
// the scales limited to the gradients, wait, verify). The collective is a
// backend of this file, PeerWindows, that plays `world` ranks in one thread:
// every rank holds this rank's gradient values, and rank k synchronizes
// window w + delta[k] (delta[rank] = 0), so its tail carries
// ((w + delta[k]) mod p, its square), the encoding the header documents;
// the control collective sees rank k's number as w + delta[k]. Equal
// windows pass with no control collective; different ones are
// SF_ERR_MISMATCH naming the real numbers; a difference of exactly p is the
// documented blind spot of the modulus.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/expect_error.h"
#include "plugin/backend/backend.h"
#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/reducer/bucket_memory.h"
#include "plugin/reducer/bucket_plan.h"
#include "plugin/reducer/window_check.h"

using namespace sfsync;

namespace {

class DoneWork : public Work {
 public:
  void wait() override {}
};

// `world` ranks in one thread, this one `rank`; see the file's comment.
// Every dtype (the values are small integers, exact in each).
class PeerWindows : public Backend {
 public:
  PeerWindows(int world, int rank, int64_t modulus, std::vector<int64_t> delta)
      : world_(world), rank_(rank), p_(modulus), delta_(std::move(delta)) {
    delta_.resize(size_t(world), 0);
    delta_[size_t(rank)] = 0;
  }
  std::vector<std::string> log;  // "allreduce 258", "reduce_scatter 32", "max_int64 2"
  bool failControl = false;      // the control collective throws SF_ERR_TIMEOUT

  const char* name() const override { return "peer-windows"; }
  void connect() override { log.push_back("connect"); }
  std::unique_ptr<Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                       ReduceSpec spec) override {
    log.push_back("allreduce " + std::to_string(numel));
    reduce(static_cast<char*>(data), numel, dtype, spec);
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> startReduceScatter(void* data, int64_t segmentElems, sf_dtype dtype,
                                           ReduceSpec spec) override {
    log.push_back("reduce_scatter " + std::to_string(segmentElems));
    reduce(static_cast<char*>(data) + size_t(segmentElems * rank_) * dtypeSize(dtype),
           segmentElems, dtype, spec);
    return std::make_unique<DoneWork>();
  }
  void allreduceMaxInt64(int64_t* data, int64_t n) override {
    log.push_back("max_int64 " + std::to_string(n));
    if (failControl) fail(SF_ERR_TIMEOUT, "the control collective timed out (test)");
    // Pairs (v, -v) as agreement.h sends them: rank k holds v + delta[k].
    for (int64_t i = 0; i + 1 < n; i += 2) {
      const int64_t v = data[i];
      int64_t hi = v, lo = v;
      for (int64_t d : delta_) {
        hi = std::max(hi, v + d);
        lo = std::min(lo, v + d);
      }
      data[i] = hi;
      data[i + 1] = -lo;
    }
  }
  void barrierQuietly() noexcept override {}
  void broadcast(void*, size_t, int) override {}

 private:
  // One segment of `n` elements: the gradients (the leading scaledElems)
  // summed over mirror ranks and scaled; the tail after them summed as
  // each rank sent it (rank k: its own x and x^2).
  void reduce(char* seg, int64_t n, sf_dtype dtype, const ReduceSpec& spec) {
    const size_t es = dtypeSize(dtype);
    const int64_t scaled = spec.scaledElems < 0 ? n : std::min(n, spec.scaledElems);
    const double factor = spec.prescale * spec.postscale;
    for (int64_t i = 0; i < scaled; ++i) {
      storeAsDtype(seg + size_t(i) * es, dtype, loadFromDtype(seg + size_t(i) * es, dtype) * world_ * factor);
    }
    if (scaled == n) return;
    const int64_t x = int64_t(loadFromDtype(seg + size_t(scaled) * es, dtype));
    for (int64_t t = 0; scaled + t < n; ++t) {
      char* e = seg + size_t(scaled + t) * es;
      const double mine = loadFromDtype(e, dtype);
      double sum = 0;
      for (int k = 0; k < world_; ++k) {
        const int64_t xk = (((x + delta_[size_t(k)]) % p_) + p_) % p_;
        sum += t == 0 ? double(xk) : t == 1 ? double(xk * xk) : mine;
      }
      storeAsDtype(e, dtype, sum);
    }
  }

  int world_;
  int rank_;
  int64_t p_;
  std::vector<int64_t> delta_;
};

PlannedBucket bucket(sf_dtype dtype, sf_device device, std::vector<int64_t> grads, int64_t bytes) {
  return PlannedBucket{dtype, device, std::move(grads), bytes};
}

// The carrier WindowCheck::choose picks (and the check itself, for its modulus).
WindowCheck chosen(const std::vector<PlannedBucket>& plan, int64_t world,
                   sf_shard_layout shard = SF_SHARD_NONE, sf_dtype wire = SF_DTYPE_FLOAT32) {
  WindowCheck c;
  c.choose(plan, world, shard, wire);
  return c;
}

// One rank's buckets: plugin-owned host gradients of `numels` (one dtype),
// planned with `cap` bytes per bucket, the check chosen, the memory built
// with the check's reserve. Gradient (id, j) holds id * 100 + j + 1.
struct Rank {
  std::vector<Gradient> grads;
  std::vector<PlannedBucket> plan;
  WindowCheck check;
  BucketMemory memory{[](sf_device) -> MemoryOps& { return MemoryOps::host(); }};
  int world;
  int rank;
  sf_shard_layout shard;

  Rank(const std::vector<int64_t>& numels, sf_dtype dtype, int64_t cap, int world_, int rank_,
       sf_shard_layout shard_ = SF_SHARD_NONE)
      : world(world_), rank(rank_), shard(shard_) {
    std::vector<GradSpec> specs;
    for (size_t id = 0; id < numels.size(); ++id) {
      grads.push_back(Gradient{nullptr, numels[id], dtype, SF_DEVICE_HOST,
                               "g" + std::to_string(id), true});
      specs.push_back({numels[id], dtype, SF_DEVICE_HOST});
    }
    plan = planBuckets(specs, cap, cap);
    check.choose(plan, world, shard, SF_DTYPE_FLOAT32);
    memory.build(grads, plan, check.reserve(plan.size()), world, shard);
    for (size_t id = 0; id < grads.size(); ++id) {
      for (int64_t j = 0; j < grads[id].numel; ++j) {
        storeAsDtype(static_cast<char*>(grads[id].data) + size_t(j) * dtypeSize(dtype), dtype,
                     double(int64_t(id) * 100 + j + 1));
      }
    }
  }
  const BucketBuffers& carrier() const { return memory[size_t(check.carrier())]; }
  int64_t ownSegment() const { return shard == SF_SHARD_NONE ? 0 : rank; }

  // The reducer's part for the carrier: encode, the collective (scales on
  // the gradients only), verify. Throws what verify throws.
  void synchronize(Backend& backend, int64_t window) {
    const BucketBuffers& b = carrier();
    check.encode(b, MemoryOps::host(), window);
    ReduceSpec spec;
    spec.postscale = 1.0 / world;
    spec.scaledElems = b.layout.shardElems;
    if (shard == SF_SHARD_NONE) {
      backend.startAllreduce(b.storage, b.layout.gradientElems(), b.plan->dtype, spec)->wait();
    } else {
      backend.startReduceScatter(b.storage, b.layout.segmentElems, b.plan->dtype, spec)->wait();
    }
    check.verify(b, ownSegment(), MemoryOps::host(), backend, world);
  }
};

// `f` must throw SF_ERR_MISMATCH whose message contains every fragment.
template <typename F>
std::string expectMismatch(F f, const std::vector<std::string>& fragments) {
  return sftest::expectError(f, SF_ERR_MISMATCH, fragments);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(window_check_tests)

// ---- The carrier ------------------------------------------------------------

BOOST_AUTO_TEST_CASE(world_size_one_has_no_carrier) {
  const std::vector<PlannedBucket> plan = {bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {1}, 40),
                                           bucket(SF_DTYPE_FLOAT64, SF_DEVICE_HOST, {0}, 80)};
  const WindowCheck c = chosen(plan, 1);
  BOOST_TEST(c.carrier() == -1);
  BOOST_TEST(c.modulus() == 0);
  BOOST_TEST(!c.carries(0));
  BOOST_TEST(!c.carries(1));
  BOOST_TEST(c.reserve(2) == (std::vector<int64_t>{0, 0}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(equal_buckets_carry_in_the_last_and_reserve_two_elements_there) {
  const std::vector<PlannedBucket> plan = {bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {2}, 40),
                                           bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {1}, 400),
                                           bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {0}, 40)};
  const WindowCheck c = chosen(plan, 2);
  BOOST_TEST(c.carrier() == 2);
  BOOST_TEST(c.carries(2));
  BOOST_TEST(!c.carries(1));
  BOOST_TEST(WindowCheck::kElems == 2);
  BOOST_TEST(c.reserve(3) == (std::vector<int64_t>{0, 0, 2}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(the_most_exact_dtype_carries_whatever_its_place) {
  // float64 (53 exact bits) > float32 (24) > float16 (11) > bfloat16 (8).
  const std::vector<PlannedBucket> plan = {bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {4}, 40),
                                           bucket(SF_DTYPE_FLOAT64, SF_DEVICE_HOST, {3}, 80),
                                           bucket(SF_DTYPE_BFLOAT16, SF_DEVICE_HOST, {2}, 20),
                                           bucket(SF_DTYPE_FLOAT16, SF_DEVICE_HOST, {1}, 20),
                                           bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {0}, 40)};
  BOOST_TEST(chosen(plan, 2).carrier() == 1);
  // Without the float64 bucket: the later float32 one.
  std::vector<PlannedBucket> noDouble = plan;
  noDouble[1].dtype = SF_DTYPE_BFLOAT16;
  BOOST_TEST(chosen(noDouble, 2).carrier() == 4);
  // Only 16-bit buckets: float16 over bfloat16, even before it.
  const std::vector<PlannedBucket> half = {bucket(SF_DTYPE_FLOAT16, SF_DEVICE_HOST, {1}, 20),
                                           bucket(SF_DTYPE_BFLOAT16, SF_DEVICE_HOST, {0}, 20)};
  BOOST_TEST(chosen(half, 2).carrier() == 0);
}

BOOST_AUTO_TEST_CASE(a_host_bucket_beats_a_device_bucket_of_the_same_dtype) {
  const std::vector<PlannedBucket> plan = {bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {2}, 40),
                                           bucket(SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, {1}, 40),
                                           bucket(SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, {0}, 40)};
  BOOST_TEST(chosen(plan, 4).carrier() == 0);
  // A more exact device bucket still wins unsharded (a 16-bit host bucket
  // must not shrink a float32 device layout's modulus).
  const std::vector<PlannedBucket> mixed = {bucket(SF_DTYPE_BFLOAT16, SF_DEVICE_HOST, {1}, 20),
                                            bucket(SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, {0}, 40)};
  const WindowCheck c = chosen(mixed, 2);
  BOOST_TEST(c.carrier() == 1);
  BOOST_TEST(c.modulus() == 2897);  // float32's, not bfloat16's
  // Device buckets alone carry unsharded: the later.
  const std::vector<PlannedBucket> device = {bucket(SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, {1}, 40),
                                             bucket(SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, {0}, 40)};
  BOOST_TEST(chosen(device, 2).carrier() == 1);
}

BOOST_AUTO_TEST_CASE(sharded_layouts_never_carry_in_a_device_bucket) {
  const std::vector<PlannedBucket> plan = {bucket(SF_DTYPE_BFLOAT16, SF_DEVICE_HOST, {2}, 20),
                                           bucket(SF_DTYPE_FLOAT64, SF_DEVICE_CUDA, {1}, 80),
                                           bucket(SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, {0}, 40)};
  for (sf_shard_layout shard : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
    BOOST_TEST_CONTEXT("layout " << shard) {
      const WindowCheck c = chosen(plan, 2, shard);
      BOOST_TEST(c.carrier() == 0);     // the only host bucket, however inexact
      BOOST_TEST(c.modulus() == 12);    // bfloat16, 2 ranks: 2 * 11^2 <= 2^8 < 2 * 12^2
    }
  }
  const std::vector<PlannedBucket> device = {bucket(SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, {1}, 40),
                                             bucket(SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, {0}, 40)};
  const WindowCheck off = chosen(device, 2, SF_SHARD_FLAT);
  BOOST_TEST(off.carrier() == -1);
  BOOST_TEST(off.reserve(2) == (std::vector<int64_t>{0, 0}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(flat_sharded_takes_the_smaller_bucket_parameter_the_later) {
  const std::vector<PlannedBucket> plan = {bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {3}, 400),
                                           bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {2}, 64),
                                           bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {1}, 128),
                                           bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {0}, 64)};
  BOOST_TEST(chosen(plan, 3, SF_SHARD_FLAT).carrier() == 3);       // the smaller; ties: the later
  BOOST_TEST(chosen(plan, 3, SF_SHARD_PARAMETER).carrier() == 3);  // the later
  std::vector<PlannedBucket> lastLarge = plan;
  lastLarge[3].bytes = 1000;
  BOOST_TEST(chosen(lastLarge, 3, SF_SHARD_FLAT).carrier() == 1);
  BOOST_TEST(chosen(lastLarge, 3, SF_SHARD_PARAMETER).carrier() == 3);
  BOOST_TEST(chosen(lastLarge, 3, SF_SHARD_NONE).carrier() == 3);
}

BOOST_AUTO_TEST_CASE(the_modulus_is_the_largest_whose_sums_stay_exact) {
  // p - 1 = the largest q with world * q^2 <= 2^bits, p at most 2^20.
  struct Case {
    sf_dtype dtype;
    int64_t world;
    int64_t p;
  };
  const Case cases[] = {{SF_DTYPE_FLOAT32, 2, 2897},   {SF_DTYPE_FLOAT32, 4, 2049},
                        {SF_DTYPE_FLOAT32, 3, 2365},   {SF_DTYPE_FLOAT16, 2, 33},
                        {SF_DTYPE_BFLOAT16, 4, 9},     {SF_DTYPE_BFLOAT16, 256, 2},
                        {SF_DTYPE_FLOAT64, 2, 1 << 20}, {SF_DTYPE_FLOAT64, 1 << 20, 92682}};
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT(dtypeName(c.dtype) << ", world " << c.world) {
      const WindowCheck w = chosen({bucket(c.dtype, SF_DEVICE_HOST, {0}, 64)}, c.world);
      BOOST_TEST(w.carrier() == 0);
      BOOST_TEST(w.modulus() == c.p);
      // The sums of x and x^2 stay exact: world * (p - 1)^2 <= 2^bits < world * p^2
      // (unless capped).
      const double limit = double(int64_t(1) << exactIntegerBits(c.dtype));
      BOOST_TEST(double(c.world) * double(c.p - 1) * double(c.p - 1) <= limit);
      if (c.p < (1 << 20)) BOOST_TEST(double(c.world) * double(c.p) * double(c.p) > limit);
    }
  }
  // bfloat16 on 257 ranks: no modulus of at least 2, no check.
  const WindowCheck none = chosen({bucket(SF_DTYPE_BFLOAT16, SF_DEVICE_HOST, {0}, 64)}, 257);
  BOOST_TEST(none.carrier() == -1);
  BOOST_TEST(none.reserve(1) == (std::vector<int64_t>{0}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(a_16_bit_wire_shrinks_a_float32_carriers_modulus_only) {
  const std::vector<PlannedBucket> f32 = {bucket(SF_DTYPE_FLOAT32, SF_DEVICE_HOST, {0}, 64)};
  BOOST_TEST(chosen(f32, 2, SF_SHARD_NONE, SF_DTYPE_BFLOAT16).modulus() == 12);  // 2 * 11^2 <= 256
  BOOST_TEST(chosen(f32, 2, SF_SHARD_NONE, SF_DTYPE_FLOAT16).modulus() == 33);
  BOOST_TEST(chosen(f32, 2, SF_SHARD_NONE, SF_DTYPE_FLOAT32).modulus() == 2897);
  const std::vector<PlannedBucket> f64 = {bucket(SF_DTYPE_FLOAT64, SF_DEVICE_HOST, {0}, 64)};
  BOOST_TEST(chosen(f64, 2, SF_SHARD_NONE, SF_DTYPE_BFLOAT16).modulus() == (1 << 20));
  // bfloat16 wire on 257 ranks: no check even for float32.
  BOOST_TEST(chosen(f32, 257, SF_SHARD_NONE, SF_DTYPE_BFLOAT16).carrier() == -1);
}

// ---- The encoding -------------------------------------------------------------

BOOST_AUTO_TEST_CASE(encode_writes_x_and_x_squared_after_the_gradients_only) {
  Rank r({10, 6}, SF_DTYPE_FLOAT32, 1 << 20, 2, 0);
  BOOST_REQUIRE_EQUAL(r.plan.size(), 1u);
  BOOST_REQUIRE_EQUAL(r.check.carrier(), 0);
  const BucketBuffers& b = r.carrier();
  BOOST_TEST(b.layout.shardElems == 16);
  BOOST_TEST(b.layout.reservedElems == 2);
  const float* s = reinterpret_cast<const float*>(b.storage);
  BOOST_TEST(reinterpret_cast<const float*>(b.reservedTail(0)) == s + 16);
  const int64_t p = r.check.modulus();
  for (int64_t w : {int64_t(0), int64_t(7), p - 1, p, p + 5, 3 * p + 2}) {
    BOOST_TEST_CONTEXT("window " << w) {
      r.check.encode(b, MemoryOps::host(), w);
      const float x = float(w % p);
      BOOST_TEST(s[16] == x);
      BOOST_TEST(s[17] == x * x);
      // The gradients (bucket order: g1 then g0) are untouched.
      for (int64_t j = 0; j < 6; ++j) BOOST_TEST(s[j] == float(100 + j + 1));
      for (int64_t j = 0; j < 10; ++j) BOOST_TEST(s[6 + j] == float(j + 1));
    }
  }
}

BOOST_AUTO_TEST_CASE(encode_fills_every_segments_tail_in_a_flat_sharded_bucket_3_ranks) {
  Rank r({40, 50}, SF_DTYPE_FLOAT32, 1 << 20, 3, 1, SF_SHARD_FLAT);
  const BucketBuffers& b = r.carrier();
  BOOST_REQUIRE_EQUAL(b.layout.world, 3);
  BOOST_TEST(b.layout.shardElems == 32);     // ceil(90 / 3) rounded up to 16 floats
  BOOST_TEST(b.layout.reservedElems == 16);  // 2 rounded up to 64 bytes
  r.check.encode(b, MemoryOps::host(), 12345);
  const float x = float(12345 % r.check.modulus());
  const float* s = reinterpret_cast<const float*>(b.storage);
  for (int64_t k = 0; k < 3; ++k) {
    BOOST_TEST_CONTEXT("segment " << k) {
      BOOST_TEST(reinterpret_cast<const float*>(b.reservedTail(k)) == s + k * 48 + 32);
      BOOST_TEST(s[k * 48 + 32] == x);
      BOOST_TEST(s[k * 48 + 33] == x * x);
      for (int64_t t = 2; t < 16; ++t) BOOST_TEST(s[k * 48 + 32 + t] == 0.0f);
    }
  }
}

// ---- The verification ---------------------------------------------------------

BOOST_AUTO_TEST_CASE(equal_windows_pass_with_no_control_collective_every_dtype_2_and_4_ranks) {
  for (sf_dtype d : {SF_DTYPE_FLOAT32, SF_DTYPE_FLOAT64, SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    for (int world : {2, 4}) {
      BOOST_TEST_CONTEXT(dtypeName(d) << ", " << world << " ranks") {
        Rank r({5, 3}, d, 1 << 20, world, 1);
        PeerWindows backend(world, 1, r.check.modulus(), {});
        for (int64_t w = 1; w <= 2 * r.check.modulus() + 3; w += std::max<int64_t>(1, r.check.modulus() / 3)) {
          r.synchronize(backend, w);
        }
        BOOST_TEST(std::count(backend.log.begin(), backend.log.end(), "max_int64 2") == 0);
        BOOST_TEST(backend.log.front() == "allreduce 10");  // 8 gradients + 2 check elements
        // The gradients were averaged over mirror ranks, the tail left out:
        // every gradient element is its own value again.
        const char* s = r.carrier().storage;
        const size_t es = dtypeSize(d);
        BOOST_TEST(loadFromDtype(s, d) == 101.0);
        BOOST_TEST(loadFromDtype(s + 7 * es, d) == 5.0);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(a_rank_one_window_ahead_is_a_mismatch_naming_the_numbers_2_ranks) {
  for (int rank : {0, 1}) {
    BOOST_TEST_CONTEXT("this rank " << rank) {
      Rank r({8}, SF_DTYPE_FLOAT32, 1 << 20, 2, rank);
      // The other rank synchronizes one window more (this rank skipped one)
      // or one fewer.
      const int64_t other = rank == 0 ? 1 : -1;
      std::vector<int64_t> delta(2, 0);
      delta[size_t(1 - rank)] = other;
      PeerWindows backend(2, rank, r.check.modulus(), delta);
      const std::string lo = rank == 0 ? "7" : "6", hi = rank == 0 ? "8" : "7";
      expectMismatch([&] { r.synchronize(backend, 7); },
                     {"ranks are out of step", "this rank is synchronizing window 7",
                      "window numbers range from " + lo + " to " + hi, "sf_restore_windows"});
      // Exactly one control collective, after the bucket's, with one pair.
      BOOST_TEST(backend.log == (std::vector<std::string>{"allreduce 10", "max_int64 2"}),
                 boost::test_tools::per_element());
    }
  }
}

BOOST_AUTO_TEST_CASE(four_ranks_one_skips_one_adds_the_range_spans_both) {
  Rank r({3, 4, 5}, SF_DTYPE_FLOAT64, 16, 4, 2);
  BOOST_REQUIRE_EQUAL(r.plan.size(), 3u);
  BOOST_TEST(r.check.carrier() == 2);  // float64 everywhere: the later
  PeerWindows backend(4, 2, r.check.modulus(), {0, -1, 0, 2});
  expectMismatch([&] { r.synchronize(backend, 40); },
                 {"synchronizing window 40", "range from 39 to 42"});
}

BOOST_AUTO_TEST_CASE(the_modulus_wraps_and_a_difference_of_p_is_not_seen) {
  // bfloat16 on 4 ranks: p = 9. Numbers past p are compared by residue: in
  // step they pass; one apart they fail naming the real numbers; exactly p
  // (or 2p) apart they share a residue, which is the modulus's blind spot
  // (the layout check compares the first window exactly).
  Rank r({6}, SF_DTYPE_BFLOAT16, 1 << 20, 4, 0);
  BOOST_REQUIRE_EQUAL(r.check.modulus(), 9);
  {
    PeerWindows inStep(4, 0, 9, {});
    for (int64_t w = 1; w <= 30; ++w) r.synchronize(inStep, w);
    BOOST_TEST(std::count(inStep.log.begin(), inStep.log.end(), "max_int64 2") == 0);
  }
  for (int64_t d : {int64_t(9), int64_t(18)}) {
    BOOST_TEST_CONTEXT("a rank " << d << " windows ahead") {
      PeerWindows blind(4, 0, 9, {0, 0, 0, d});
      r.synchronize(blind, 13);  // no throw
      BOOST_TEST(blind.log.size() == 1u);
    }
  }
  for (int64_t d : {int64_t(1), int64_t(8), int64_t(10), int64_t(-1)}) {
    BOOST_TEST_CONTEXT("a rank " << d << " windows ahead") {
      PeerWindows seen(4, 0, 9, {0, d, 0, 0});
      const int64_t w = 17;  // residue 8: the next window's residue wraps to 0
      expectMismatch([&] { r.synchronize(seen, w); },
                     {"synchronizing window 17", "range from " + std::to_string(std::min(w, w + d)) +
                                                     " to " + std::to_string(std::max(w, w + d))});
    }
  }
}

BOOST_AUTO_TEST_CASE(sharded_each_rank_checks_its_own_segment_3_ranks) {
  // Only this rank's segment is summed by a reduce-scatter: verify must read
  // that one (the others still hold this rank's unreduced x, x^2).
  for (int rank : {0, 1, 2}) {
    BOOST_TEST_CONTEXT("rank " << rank) {
      Rank r({40, 50}, SF_DTYPE_FLOAT32, 1 << 20, 3, rank, SF_SHARD_FLAT);
      PeerWindows inStep(3, rank, r.check.modulus(), {});
      r.synchronize(inStep, 5);
      r.synchronize(inStep, 6);
      BOOST_TEST(inStep.log == (std::vector<std::string>{"reduce_scatter 48", "reduce_scatter 48"}),
                 boost::test_tools::per_element());
      std::vector<int64_t> delta(3, 0);
      delta[size_t((rank + 1) % 3)] = 1;
      PeerWindows ahead(3, rank, r.check.modulus(), delta);
      expectMismatch([&] { r.synchronize(ahead, 7); }, {"synchronizing window 7", "from 7 to 8"});
    }
  }
}

BOOST_AUTO_TEST_CASE(a_failed_control_collective_says_the_ranks_were_out_of_step) {
  Rank r({8}, SF_DTYPE_FLOAT32, 1 << 20, 2, 0);
  PeerWindows backend(2, 0, r.check.modulus(), {0, 1});
  backend.failControl = true;
  try {
    r.synchronize(backend, 3);
    BOOST_ERROR("no error");
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_TIMEOUT);  // the backend's status, kept
    const std::string m = e.what();
    BOOST_TEST(m.find("ranks are out of step") != std::string::npos, m);
    BOOST_TEST(m.find("gathering the numbers failed") != std::string::npos, m);
    BOOST_TEST(m.find("timed out (test)") != std::string::npos, m);
  }
}

BOOST_AUTO_TEST_CASE(the_out_of_step_message_names_all_three_numbers) {
  BOOST_TEST(outOfStepMessage(12, 11, 14) ==
             "ranks are out of step: this rank is synchronizing window 12, the ranks' window "
             "numbers range from 11 to 14 (a rank skipped or added an sf_synchronize, began more "
             "windows than the others, or restored another count with sf_restore_windows)");
}

BOOST_AUTO_TEST_SUITE_END()
