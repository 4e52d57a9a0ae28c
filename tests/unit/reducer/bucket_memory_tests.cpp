// BucketMemory on its own (plugin/reducer/bucket_memory.h), built from
// bucket plans without the C ABI and without a backend: the memory of each
// device is a CountingMemory of this file (host memory that counts and
// sizes every allocation, and can refuse one). Checked by addresses and
// bytes: the flat buffer laid out bucket by bucket at 64-byte boundaries,
// zero-copy buckets as slices of it, every gradient's view and bucket and
// offset, the reserved tails (unsharded after the gradients, sharded after
// every segment), staging for host-owned gradients and for gradients a
// reserved tail cuts, the staging copies run by run around the tails, the
// parameter views, one flat buffer per device, and allocation failure
// (named, nothing left allocated).

#include <boost/test/unit_test.hpp>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/error.h"
#include "plugin/reducer/bucket_memory.h"
#include "plugin/reducer/bucket_plan.h"
#include "plugin/reducer/shard_plan.h"

using namespace sfsync;

namespace {

// Host memory that counts: allocations (with their sizes) and
// deallocations; allocation number `failAt` (1-based; 0: none) throws
// SF_ERR_OUT_OF_MEMORY.
class CountingMemory : public MemoryOps {
 public:
  std::vector<size_t> sizes;
  int freed = 0;
  int failAt = 0;
  void* allocate(size_t bytes) override {
    if (int(sizes.size()) + 1 == failAt) {
      ++failAt;  // refused, not counted
      fail(SF_ERR_OUT_OF_MEMORY, "refused " + std::to_string(bytes) + " bytes (test)");
    }
    sizes.push_back(bytes);
    return MemoryOps::allocate(bytes);
  }
  void deallocate(void* p) noexcept override {
    ++freed;
    MemoryOps::deallocate(p);
  }
  int live() const { return int(sizes.size()) - freed; }
};

struct Memories {
  CountingMemory host, cuda;
  BucketMemory::MemoryFor memoryFor() {
    return [this](sf_device d) -> MemoryOps& { return d == SF_DEVICE_HOST ? host : cuda; };
  }
};

// Plugin-owned gradients (data nullptr), or host-owned when `own` holds
// their storage.
Gradient owned(int64_t numel, const char* name, sf_device device = SF_DEVICE_HOST) {
  return Gradient{nullptr, numel, SF_DTYPE_FLOAT32, device, name, true};
}
Gradient hostOwned(std::vector<float>& storage, const char* name) {
  return Gradient{storage.data(), int64_t(storage.size()), SF_DTYPE_FLOAT32, SF_DEVICE_HOST, name, false};
}
// Sharded: every gradient with a plugin-owned parameter.
void withParameters(std::vector<Gradient>& grads) {
  for (auto& g : grads) {
    g.hasParam = true;
    g.paramOwned = true;
  }
}

std::vector<PlannedBucket> plan(const std::vector<Gradient>& grads, int64_t cap) {
  std::vector<GradSpec> specs;
  for (const auto& g : grads) specs.push_back({g.numel, g.dtype, g.device});
  return planBuckets(specs, cap, cap);
}

const char* at(const void* p) { return static_cast<const char*>(p); }

}  // namespace

BOOST_AUTO_TEST_SUITE(bucket_memory_tests)

BOOST_AUTO_TEST_CASE(plugin_owned_buckets_are_zero_copy_slices_of_one_flat_buffer) {
  // Reverse registration: bucket 0 = [#2 (27), #1 (5)] = 128 bytes, bucket 1 = [#0 (10)].
  std::vector<Gradient> grads = {owned(10, "g0"), owned(5, "g1"), owned(27, "g2")};
  const auto p = plan(grads, 128);
  BOOST_REQUIRE_EQUAL(p.size(), 2u);
  Memories m;
  {
    BucketMemory mem(m.memoryFor());
    mem.build(grads, p, {0, 0}, 1, SF_SHARD_NONE);
    BOOST_TEST(m.host.sizes == (std::vector<size_t>{128 + 64}), boost::test_tools::per_element());
    BOOST_TEST(m.cuda.sizes.empty());
    BOOST_REQUIRE_EQUAL(mem.size(), 2u);
    const BucketBuffers &b0 = mem[0], &b1 = mem[1];
    BOOST_TEST(!b0.staged);
    BOOST_TEST(!b1.staged);
    BOOST_TEST(b0.plan == &p[0]);
    BOOST_TEST(b0.numel == 32);
    BOOST_TEST(b1.numel == 10);
    BOOST_TEST(b0.layout.world == 1);
    BOOST_TEST(b0.layout.shardElems == 32);
    BOOST_TEST(b0.layout.reservedElems == 0);
    BOOST_TEST(at(b1.storage) - at(b0.storage) == 128);  // the next 64-byte boundary
    // Every view where its bucket's collective reads it.
    BOOST_TEST(grads[2].data == static_cast<void*>(b0.storage));
    BOOST_TEST(at(grads[1].data) - at(b0.storage) == 27 * 4);
    BOOST_TEST(grads[0].data == static_cast<void*>(b1.storage));
    BOOST_TEST(grads[2].bucket == 0);
    BOOST_TEST(grads[1].bucket == 0);
    BOOST_TEST(grads[0].bucket == 1);
    BOOST_TEST(grads[2].offset == 0);
    BOOST_TEST(grads[1].offset == 27);
    BOOST_TEST(grads[0].offset == 0);
    BOOST_TEST(b0.params == nullptr);  // unsharded: no parameter buffer
    // Zeroed.
    for (int i = 0; i < 48; ++i) BOOST_REQUIRE(reinterpret_cast<const float*>(b0.storage)[i] == 0.0f);
    mem.release();
    BOOST_TEST(mem.size() == 0u);
    BOOST_TEST(m.host.freed == 1);
    mem.release();  // twice: nothing more
    BOOST_TEST(m.host.freed == 1);
  }
  BOOST_TEST(m.host.live() == 0);
}

BOOST_AUTO_TEST_CASE(an_unsharded_reserved_tail_follows_its_buckets_gradients) {
  std::vector<Gradient> grads = {owned(10, "g0"), owned(5, "g1"), owned(27, "g2")};
  const auto p = plan(grads, 128);
  Memories m;
  BucketMemory mem(m.memoryFor());
  mem.build(grads, p, {2, 0}, 4, SF_SHARD_NONE);
  const BucketBuffers &b0 = mem[0], &b1 = mem[1];
  BOOST_TEST(b0.layout.world == 1);  // unsharded: one segment whatever the world size
  BOOST_TEST(b0.layout.shardElems == 32);
  BOOST_TEST(b0.layout.reservedElems == 2);
  BOOST_TEST(b0.layout.gradientElems() == 34);
  BOOST_TEST(b1.layout.reservedElems == 0);
  BOOST_TEST(!b0.staged);  // one segment: the tail cuts no gradient
  BOOST_TEST(at(b0.reservedTail(0)) - at(b0.storage) == 32 * 4);
  // 136 bytes: bucket 1 starts at the next boundary after the tail.
  BOOST_TEST(at(b1.storage) - at(b0.storage) == 192);
  BOOST_TEST(m.host.sizes == (std::vector<size_t>{192 + 64}), boost::test_tools::per_element());
  BOOST_TEST(b0.numel == 32);  // the tail is no gradient's
}

BOOST_AUTO_TEST_CASE(a_host_owned_gradient_stages_its_bucket) {
  std::vector<float> host0(10);
  for (int i = 0; i < 10; ++i) host0[size_t(i)] = float(i) + 0.5f;
  std::vector<Gradient> grads = {hostOwned(host0, "h0"), owned(5, "g1"), owned(27, "g2")};
  const auto p = plan(grads, 128);
  Memories m;
  BucketMemory mem(m.memoryFor());
  mem.build(grads, p, {0, 0}, 1, SF_SHARD_NONE);
  const BucketBuffers &b0 = mem[0], &b1 = mem[1];
  BOOST_TEST(!b0.staged);
  BOOST_TEST(b1.staged);
  BOOST_TEST(grads[0].data == static_cast<void*>(host0.data()));  // the host keeps its memory
  // The flat buffer, then bucket 1's staging of 40 bytes.
  BOOST_REQUIRE_EQUAL(m.host.sizes.size(), 2u);
  BOOST_TEST(m.host.sizes[1] == 40u);
  BOOST_TEST(b1.storage != nullptr);
  BOOST_TEST((at(b1.storage) < at(b0.storage) || at(b1.storage) >= at(b0.storage) + m.host.sizes[0]));
  mem.toStaging(b1, grads[0]);
  const float* s = reinterpret_cast<const float*>(b1.storage);
  for (int i = 0; i < 10; ++i) BOOST_TEST(s[i] == float(i) + 0.5f);
  // Back: only the range asked for.
  float* w = reinterpret_cast<float*>(b1.storage);
  for (int i = 0; i < 10; ++i) w[i] = -float(i);
  mem.fromStaging(b1, grads[0], ShardRange{2, 5});
  for (int i = 0; i < 10; ++i) {
    BOOST_TEST(host0[size_t(i)] == (i >= 2 && i < 7 ? -float(i) : float(i) + 0.5f), "element " << i);
  }
  // A part only, to staging.
  for (int i = 0; i < 10; ++i) w[i] = 99.0f;
  mem.toStaging(b1, grads[0], ShardRange{8, 2});
  BOOST_TEST(s[7] == 99.0f);
  BOOST_TEST(s[8] == 8.5f);
  BOOST_TEST(s[9] == 9.5f);
  mem.release();
  BOOST_TEST(m.host.live() == 0);  // staging and flat buffer
}

BOOST_AUTO_TEST_CASE(flat_sharded_tails_follow_every_segment_and_stage_a_cut_gradient_3_ranks) {
  // One bucket [#1 (50), #0 (40)], W = 3: U = 32 (90 / 3 rounded up to 16
  // floats), the 2 reserved elements rounded up to 16: S = 48. #1 straddles
  // segments 0 and 1, so the tails cut it: the bucket is staged.
  std::vector<Gradient> grads = {owned(40, "g0"), owned(50, "g1")};
  withParameters(grads);
  const auto p = plan(grads, 1 << 20);
  BOOST_REQUIRE_EQUAL(p.size(), 1u);
  Memories m;
  BucketMemory mem(m.memoryFor());
  mem.build(grads, p, {2}, 3, SF_SHARD_FLAT);
  const BucketBuffers& b = mem[0];
  BOOST_TEST(b.layout.world == 3);
  BOOST_TEST(b.layout.shardElems == 32);
  BOOST_TEST(b.layout.reservedElems == 16);
  BOOST_TEST(b.layout.segmentElems == 48);
  BOOST_TEST(b.staged);
  BOOST_TEST(grads[1].offset == 0);
  BOOST_TEST(grads[0].offset == 50);
  for (int64_t k = 0; k < 3; ++k) BOOST_TEST(at(b.reservedTail(k)) - at(b.storage) == (k * 48 + 32) * 4);
  // Parameters, flat gradients, staging: the parameter buffer is the
  // logical layout (W * U = 96 floats), staging the physical (W * S = 144).
  BOOST_TEST(m.host.sizes == (std::vector<size_t>{384, 576, 576}), boost::test_tools::per_element());
  BOOST_TEST(b.params != nullptr);
  BOOST_TEST(grads[1].param == static_cast<void*>(b.params));
  BOOST_TEST(at(grads[0].param) - at(b.params) == 50 * 4);
  // A staged bucket's own gradients keep the logical layout in the flat buffer.
  BOOST_TEST(at(grads[0].data) - at(grads[1].data) == 50 * 4);
  float* g1 = static_cast<float*>(grads[1].data);
  float* g0 = static_cast<float*>(grads[0].data);
  for (int j = 0; j < 50; ++j) g1[j] = float(1000 + j);
  for (int j = 0; j < 40; ++j) g0[j] = float(2000 + j);
  mem.toStaging(b, grads[1]);
  mem.toStaging(b, grads[0]);
  const float* s = reinterpret_cast<const float*>(b.storage);
  // Logical l at (l / 32) * 48 + l % 32; the tails (and the padding) stay zero.
  for (int64_t l = 0; l < 96; ++l) {
    const float want = l < 50 ? float(1000 + l) : l < 90 ? float(2000 + l - 50) : 0.0f;
    BOOST_REQUIRE_MESSAGE(s[(l / 32) * 48 + l % 32] == want, "logical " << l);
  }
  for (int64_t k = 0; k < 3; ++k) {
    for (int64_t t = 0; t < 16; ++t) BOOST_REQUIRE(s[k * 48 + 32 + t] == 0.0f);
  }
  // Rank 1 owns logical [32, 64): #1's elements 32..49 and #0's 0..13; only
  // those come back from staging.
  float* w = reinterpret_cast<float*>(b.storage);
  for (int64_t i = 0; i < 144; ++i) w[i] = -w[i];
  for (int id : {1, 0}) {
    const ShardRange r = ownedRange(b.layout, grads[size_t(id)].offset, grads[size_t(id)].numel, 1);
    mem.fromStaging(b, grads[size_t(id)], r);
  }
  for (int j = 0; j < 50; ++j) BOOST_TEST(g1[j] == (j >= 32 ? -float(1000 + j) : float(1000 + j)), "#1 " << j);
  for (int j = 0; j < 40; ++j) BOOST_TEST(g0[j] == (j < 14 ? -float(2000 + j) : float(2000 + j)), "#0 " << j);
}

BOOST_AUTO_TEST_CASE(parameter_layout_keeps_whole_gradients_zero_copy_around_the_tails_2_ranks) {
  // [#1 (16), #0 (16)] on 2 ranks: one gradient per segment, U = 16, the
  // tail 16: S = 32. No gradient is cut: zero copy, and each view sits at
  // its physical place (#0 after segment 0's tail).
  std::vector<Gradient> grads = {owned(16, "g0"), owned(16, "g1")};
  withParameters(grads);
  const auto p = plan(grads, 1 << 20);
  Memories m;
  BucketMemory mem(m.memoryFor());
  mem.build(grads, p, {2}, 2, SF_SHARD_PARAMETER);
  const BucketBuffers& b = mem[0];
  BOOST_TEST(b.layout.shardElems == 16);
  BOOST_TEST(b.layout.segmentElems == 32);
  BOOST_TEST(!b.staged);
  BOOST_TEST(grads[1].data == static_cast<void*>(b.storage));
  BOOST_TEST(at(grads[0].data) - at(b.storage) == 32 * 4);
  BOOST_TEST(at(b.reservedTail(0)) - at(b.storage) == 16 * 4);
  BOOST_TEST(at(b.reservedTail(1)) - at(b.storage) == 48 * 4);
  // Parameters in the logical layout: #0 right after #1.
  BOOST_TEST(at(grads[0].param) - at(b.params) == 16 * 4);
  BOOST_TEST(m.host.sizes == (std::vector<size_t>{128, 256}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(flat_sharded_without_a_tail_is_zero_copy_2_ranks) {
  std::vector<Gradient> grads = {owned(7, "g0"), owned(30, "g1")};
  withParameters(grads);
  const auto p = plan(grads, 1 << 20);
  Memories m;
  BucketMemory mem(m.memoryFor());
  mem.build(grads, p, {0}, 2, SF_SHARD_FLAT);
  const BucketBuffers& b = mem[0];
  BOOST_TEST(!b.staged);
  BOOST_TEST(b.layout.shardElems == 32);  // 37 / 2 rounded up to 16 floats
  BOOST_TEST(b.layout.segmentElems == 32);
  BOOST_TEST(grads[1].data == static_cast<void*>(b.storage));
  BOOST_TEST(at(grads[0].data) - at(b.storage) == 30 * 4);  // across the segment boundary, contiguous
  BOOST_TEST(b.layout.used == (std::vector<int64_t>{32, 5}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(each_device_has_its_own_flat_buffer_and_memory) {
  // [#3 #1] host, [#2 #0] cuda; #0 host-owned, so the cuda bucket is
  // staged, in cuda memory.
  std::vector<float> fake(8);  // stands for device memory the host registered
  std::vector<Gradient> grads = {
      Gradient{fake.data(), 8, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "c0", false}, owned(16, "h1"),
      owned(16, "c2", SF_DEVICE_CUDA), owned(16, "h3")};
  const auto p = plan(grads, 128);
  BOOST_REQUIRE_EQUAL(p.size(), 2u);
  BOOST_REQUIRE(p[0].device == SF_DEVICE_HOST);
  BOOST_REQUIRE(p[1].device == SF_DEVICE_CUDA);
  Memories m;
  {
    BucketMemory mem(m.memoryFor());
    mem.build(grads, p, {0, 0}, 2, SF_SHARD_NONE);
    BOOST_TEST(m.host.sizes == (std::vector<size_t>{128}), boost::test_tools::per_element());
    // cuda: its own flat buffer (the bucket's 96 bytes, aligned), then staging.
    BOOST_TEST(m.cuda.sizes == (std::vector<size_t>{128, 96}), boost::test_tools::per_element());
    BOOST_TEST(!mem[0].staged);
    BOOST_TEST(mem[1].staged);
    BOOST_TEST(&mem.memoryFor(SF_DEVICE_CUDA) == static_cast<MemoryOps*>(&m.cuda));
    BOOST_TEST(grads[3].data == static_cast<void*>(mem[0].storage));
    BOOST_TEST(at(grads[1].data) - at(grads[3].data) == 64);
    BOOST_TEST(grads[0].data == static_cast<void*>(fake.data()));
    BOOST_TEST(grads[2].data != static_cast<void*>(mem[1].storage));  // in the flat buffer, not staging
  }
  BOOST_TEST(m.host.live() == 0);  // the destructor releases per device
  BOOST_TEST(m.cuda.live() == 0);
}

BOOST_AUTO_TEST_CASE(a_refused_flat_buffer_is_named_and_nothing_stays_allocated) {
  std::vector<Gradient> grads = {owned(10, "first"), owned(10, "second")};
  withParameters(grads);
  const auto p = plan(grads, 1 << 20);
  Memories m;
  m.host.failAt = 2;  // the parameter buffer is allocated, the gradients' is refused
  BucketMemory mem(m.memoryFor());
  try {
    mem.build(grads, p, {0}, 2, SF_SHARD_FLAT);
    BOOST_ERROR("no error");
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_OUT_OF_MEMORY);
    const std::string msg = e.what();
    BOOST_TEST(msg.find("cannot allocate the flat buffer of 128 bytes for the plugin-owned "
                        "gradients on host (the first is 'first')") != std::string::npos, msg);
    BOOST_TEST(msg.find("refused 128 bytes (test)") != std::string::npos, msg);
  }
  BOOST_TEST(m.host.sizes.size() == 1u);
  BOOST_TEST(m.host.live() == 0);
  BOOST_TEST(mem.size() == 0u);
}

BOOST_AUTO_TEST_CASE(a_refused_parameter_buffer_is_named) {
  std::vector<Gradient> grads = {owned(10, "first")};
  withParameters(grads);
  const auto p = plan(grads, 1 << 20);
  Memories m;
  m.host.failAt = 1;
  BucketMemory mem(m.memoryFor());
  try {
    mem.build(grads, p, {0}, 2, SF_SHARD_FLAT);
    BOOST_ERROR("no error");
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_OUT_OF_MEMORY);
    BOOST_TEST(std::string(e.what()).find("cannot allocate the flat parameter buffer of 128 bytes on host") !=
                   std::string::npos,
               e.what());
  }
  BOOST_TEST(m.host.live() == 0);
}

BOOST_AUTO_TEST_CASE(a_refused_staging_buffer_releases_the_flat_buffer) {
  std::vector<float> host0(10);
  std::vector<Gradient> grads = {hostOwned(host0, "h0"), owned(10, "g1")};
  const auto p = plan(grads, 40);
  Memories m;
  m.host.failAt = 2;  // the flat buffer, then the staging of [#0]
  BucketMemory mem(m.memoryFor());
  try {
    mem.build(grads, p, {0, 0}, 1, SF_SHARD_NONE);
    BOOST_ERROR("no error");
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_OUT_OF_MEMORY);
    BOOST_TEST(std::string(e.what()) == "refused 40 bytes (test)");
  }
  BOOST_TEST(m.host.sizes.size() == 1u);
  BOOST_TEST(m.host.live() == 0);
}

BOOST_AUTO_TEST_CASE(sizes_past_2_to_the_63_are_refused_before_any_allocation) {
  // Two buckets of 2^62 bytes: the second would end at 2^63.
  const int64_t n = int64_t(1) << 60;
  std::vector<Gradient> grads = {owned(n, "g0"), owned(n, "g1")};
  const auto p = plan(grads, 1 << 20);
  BOOST_REQUIRE_EQUAL(p.size(), 2u);
  Memories m;
  BucketMemory mem(m.memoryFor());
  try {
    mem.build(grads, p, {0, 0}, 1, SF_SHARD_NONE);
    BOOST_ERROR("no error");
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_OUT_OF_MEMORY);
    BOOST_TEST(std::string(e.what()).find("bucket 1 (gradient 0, 'g0') would end past 2^63 bytes") !=
                   std::string::npos,
               e.what());
  }
  BOOST_TEST(m.host.sizes.empty());
}

BOOST_AUTO_TEST_SUITE_END()
