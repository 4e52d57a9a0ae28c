// The sharded default bucket cap (issue 44, item 1; since 0.5 the plugin's,
// before only the Python binding's): a sharded context whose bucket cap was
// never chosen builds about kShardedBuckets buckets (the registered
// gradients' bytes / 8, within 1..25 MiB); a cap chosen by
// sf_set_bucket_cap_mb, by SF_BUCKET_CAP_MB or by sf_options keeps its
// buckets; unsharded contexts are unchanged. One rank (the plan is the same
// at any world size), through libsfsync.so.

#include <boost/test/unit_test.hpp>

#include <cstdlib>
#include <string>

#include "plugin/core/options.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

constexpr int64_t kMiB = 1048576;

// 32 layers of a 512 x 512 float32 weight (1 MiB) and a 512 bias (2 KiB),
// in module order, as the Python binding's test model: 32 x (1 MiB + 2 KiB)
// of gradients, so the sharded default is 4.0078125 MiB.
void registerLayers(sf_context* ctx, bool sharded) {
  for (int layer = 0; layer < 32; ++layer) {
    for (int64_t numel : {int64_t(512 * 512), int64_t(512)}) {
      int64_t id = -1;
      BOOST_REQUIRE(sf_add_gradient(ctx, numel, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id) ==
                    SF_OK);
      if (sharded) {
        BOOST_REQUIRE(sf_register_parameter(ctx, id, nullptr, numel, SF_DTYPE_FLOAT32,
                                            SF_DEVICE_HOST) == SF_OK);
      }
    }
  }
}

double capOf(const sf_context* ctx) {
  sf_options o;
  o.struct_size = sizeof o;
  BOOST_REQUIRE(sf_get_options(ctx, &o) == SF_OK);
  return o.bucket_cap_mb;
}

// Buckets of the model in a fresh world-size-1 context, `layout` set through
// sf_set_shard_layout and `cap` (> 0) through sf_set_bucket_cap_mb.
int64_t bucketsOf(sf_shard_layout layout, double cap = 0, double* effectiveCap = nullptr,
                  double optionsCap = 0) {
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  if (optionsCap > 0) o.bucket_cap_mb = optionsCap;
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  BOOST_REQUIRE(sf_set_shard_layout(h.ctx, layout) == SF_OK);
  if (cap > 0) BOOST_REQUIRE(sf_set_bucket_cap_mb(h.ctx, cap) == SF_OK);
  registerLayers(h.ctx, layout != SF_SHARD_NONE);
  BOOST_REQUIRE(sf_build_buckets(h.ctx) == SF_OK);
  if (effectiveCap) *effectiveCap = capOf(h.ctx);
  return statsOf(h.ctx).bucket_count;
}

// SF_BUCKET_CAP_MB unset for a case's life (the test environment may set it).
struct NoCapVariable {
  std::string saved;
  bool had;
  NoCapVariable() : had(std::getenv("SF_BUCKET_CAP_MB") != nullptr) {
    if (had) saved = std::getenv("SF_BUCKET_CAP_MB");
    ::unsetenv("SF_BUCKET_CAP_MB");
  }
  ~NoCapVariable() {
    if (had) ::setenv("SF_BUCKET_CAP_MB", saved.c_str(), 1);
  }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(sharded_bucket_cap_tests)

BOOST_AUTO_TEST_CASE(the_rule_is_an_eighth_of_the_gradients_within_1_and_25_mib) {
  BOOST_TEST(sfsync::kShardedBuckets == 8);
  BOOST_TEST(sfsync::shardedDefaultCapMb(32 * (kMiB + 2048)) == 32 * (kMiB + 2048) / 8.0 / kMiB);
  BOOST_TEST(sfsync::shardedDefaultCapMb(0) == 1.0);
  BOOST_TEST(sfsync::shardedDefaultCapMb(7 * kMiB) == 1.0);
  BOOST_TEST(sfsync::shardedDefaultCapMb(300 * kMiB) == 25.0);
}

BOOST_AUTO_TEST_CASE(a_sharded_context_without_a_cap_builds_about_eight_buckets) {
  NoCapVariable unset;
  for (sf_shard_layout layout : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
    ContextHandle h;
    sf_options o = rankOptions(0, 1, "");
    BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_REQUIRE(sf_set_shard_layout(h.ctx, layout) == SF_OK);
    registerLayers(h.ctx, true);
    BOOST_TEST(capOf(h.ctx) == 25.0);  // before the build: the cap as set
    BOOST_REQUIRE(sf_build_buckets(h.ctx) == SF_OK);
    // The first bucket closes at 1 MiB (the first cap), the others hold
    // 4 MiB of 1 MiB weights: 1 + ceil(31 / 4) = 9 buckets.
    BOOST_TEST(statsOf(h.ctx).bucket_count == 9, "layout " << layout);
    BOOST_TEST(capOf(h.ctx) == 32 * (kMiB + 2048) / 8.0 / kMiB);  // the effective cap
  }
}

BOOST_AUTO_TEST_CASE(a_chosen_cap_keeps_its_buckets) {
  NoCapVariable unset;
  const int64_t unsharded = bucketsOf(SF_SHARD_NONE);
  BOOST_TEST(unsharded == 3);  // 1 MiB, 25 MiB, the rest: unchanged unsharded
  double cap = 0;
  // sf_set_bucket_cap_mb, also at the default's value.
  BOOST_TEST(bucketsOf(SF_SHARD_FLAT, 25, &cap) == unsharded);
  BOOST_TEST(cap == 25.0);
  BOOST_TEST(bucketsOf(SF_SHARD_PARAMETER, 10, &cap) == bucketsOf(SF_SHARD_NONE, 10));
  BOOST_TEST(cap == 10.0);
  // sf_options.bucket_cap_mb other than the default.
  BOOST_TEST(bucketsOf(SF_SHARD_FLAT, 0, &cap, 10) == bucketsOf(SF_SHARD_NONE, 10));
  BOOST_TEST(cap == 10.0);
  // SF_BUCKET_CAP_MB, also at the default's value (sf_create reads it; a
  // struct filled before it was set counts too).
  ::setenv("SF_BUCKET_CAP_MB", "25", 1);
  BOOST_TEST(bucketsOf(SF_SHARD_FLAT, 0, &cap) == unsharded);
  BOOST_TEST(cap == 25.0);
  ::unsetenv("SF_BUCKET_CAP_MB");
  // Unsharded contexts never take the sharded default.
  BOOST_TEST(bucketsOf(SF_SHARD_NONE, 0, &cap) == 3);
  BOOST_TEST(cap == 25.0);
}

BOOST_AUTO_TEST_SUITE_END()
