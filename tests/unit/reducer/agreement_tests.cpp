// agreeAcrossRanks on its own (plugin/reducer/agreement.h), without the C
// ABI: what every rank learns of a few int64 values in one control
// collective. The other ranks are simulated in one thread, without knowing
// the wire format: each rank's wire array is what agreeAcrossRanks itself
// hands a capturing backend for that rank's values (one collective, so no
// rank's array depends on a result), and the simulated collective is the
// elementwise max of this rank's array with the others'. Checked: the
// smallest and largest value of every slot, the same on every rank, the
// verdict (agreed), one collective whatever the count, none for no values,
// extreme values, and a failing backend.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/error.h"
#include "plugin/reducer/agreement.h"

using namespace sfsync;

namespace {

// The control collective of `peers` (their wire arrays) and this rank.
class MaxOverPeers : public Backend {
 public:
  explicit MaxOverPeers(std::vector<std::vector<int64_t>> peers = {}) : peers_(std::move(peers)) {}
  std::vector<std::vector<int64_t>> sent;  // every array this rank handed in
  bool failing = false;

  const char* name() const override { return "max-over-peers"; }
  void connect() override {}
  std::unique_ptr<Work> startAllreduce(void*, int64_t, sf_dtype, ReduceSpec) override {
    fail(SF_ERR_INTERNAL, "agreement started a bucket collective");
  }
  void allreduceMaxInt64(int64_t* data, int64_t n) override {
    sent.emplace_back(data, data + n);
    if (failing) fail(SF_ERR_TIMEOUT, "control collective timed out (test)");
    for (const auto& p : peers_) {
      BOOST_REQUIRE_EQUAL(int64_t(p.size()), n);
      for (int64_t i = 0; i < n; ++i) data[i] = std::max(data[i], p[size_t(i)]);
    }
  }
  void barrierQuietly() noexcept override {}
  void broadcast(void*, size_t, int) override {}

 private:
  std::vector<std::vector<int64_t>> peers_;
};

// What a rank holding `values` puts on the wire.
std::vector<int64_t> wireOf(const std::vector<int64_t>& values) {
  MaxOverPeers capture;
  agreeAcrossRanks(capture, values);
  BOOST_REQUIRE_EQUAL(capture.sent.size(), 1u);
  return capture.sent[0];
}

// Every rank's ranges, rank r holding values[r]; `collectives[r]` the
// control collectives rank r issued.
std::vector<std::vector<RankRange>> agreeAll(const std::vector<std::vector<int64_t>>& values,
                                             std::vector<size_t>* collectives = nullptr) {
  std::vector<std::vector<RankRange>> out;
  for (size_t r = 0; r < values.size(); ++r) {
    std::vector<std::vector<int64_t>> peers;
    for (size_t k = 0; k < values.size(); ++k) {
      if (k != r) peers.push_back(wireOf(values[k]));
    }
    MaxOverPeers backend(peers);
    out.push_back(agreeAcrossRanks(backend, values[r]));
    if (collectives) collectives->push_back(backend.sent.size());
  }
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(agreement_tests)

BOOST_AUTO_TEST_CASE(no_values_issue_no_collective) {
  MaxOverPeers backend;
  const std::vector<RankRange> r = agreeAcrossRanks(backend, {});
  BOOST_TEST(r.empty());
  BOOST_TEST(backend.sent.empty());
}

BOOST_AUTO_TEST_CASE(each_value_travels_with_its_negation_in_one_collective) {
  MaxOverPeers backend;
  const std::vector<RankRange> r = agreeAcrossRanks(backend, {3, -8, 0});
  BOOST_REQUIRE_EQUAL(backend.sent.size(), 1u);
  BOOST_TEST(backend.sent[0] == (std::vector<int64_t>{3, -3, -8, 8, 0, 0}), boost::test_tools::per_element());
  // Alone: every slot agreed, lo = hi = the value.
  BOOST_REQUIRE_EQUAL(r.size(), 3u);
  const int64_t want[] = {3, -8, 0};
  for (size_t i = 0; i < 3; ++i) {
    BOOST_TEST(r[i].lo == want[i]);
    BOOST_TEST(r[i].hi == want[i]);
    BOOST_TEST(r[i].agreed());
  }
}

BOOST_AUTO_TEST_CASE(three_simulated_ranks_learn_the_same_lo_and_hi_of_every_slot) {
  const std::vector<std::vector<int64_t>> values = {{4, 10, -2, 7}, {4, 12, -9, 7}, {4, 11, 5, 6}};
  std::vector<size_t> collectives;
  const auto ranges = agreeAll(values, &collectives);
  const int64_t lo[] = {4, 10, -9, 6}, hi[] = {4, 12, 5, 7};
  for (size_t r = 0; r < 3; ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(collectives[r] == 1u);
      BOOST_REQUIRE_EQUAL(ranges[r].size(), 4u);
      for (size_t i = 0; i < 4; ++i) {
        BOOST_TEST(ranges[r][i].lo == lo[i], "slot " << i);
        BOOST_TEST(ranges[r][i].hi == hi[i], "slot " << i);
      }
      // The verdict: only slot 0 agreed, on every rank alike.
      BOOST_TEST(ranges[r][0].agreed());
      BOOST_TEST(!ranges[r][1].agreed());
      BOOST_TEST(!ranges[r][2].agreed());
      BOOST_TEST(!ranges[r][3].agreed());
    }
  }
}

BOOST_AUTO_TEST_CASE(one_rank_differing_is_seen_by_all_8_simulated_ranks) {
  std::vector<std::vector<int64_t>> values(8, std::vector<int64_t>{100, 200});
  values[5][1] = 199;  // one rank one below in one slot
  const auto ranges = agreeAll(values);
  for (size_t r = 0; r < 8; ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(ranges[r][0].agreed());
      BOOST_TEST(ranges[r][1].lo == 199);
      BOOST_TEST(ranges[r][1].hi == 200);
      BOOST_TEST(!ranges[r][1].agreed());
    }
  }
}

BOOST_AUTO_TEST_CASE(extreme_values_keep_their_range) {
  // Far from INT64_MIN (whose negation overflows; no caller passes it).
  const int64_t big = INT64_MAX, small = -INT64_MAX;
  const auto ranges = agreeAll({{big, 0, int64_t(1) << 62}, {small, -1, -(int64_t(1) << 62)}});
  for (size_t r = 0; r < 2; ++r) {
    BOOST_TEST(ranges[r][0].lo == small);
    BOOST_TEST(ranges[r][0].hi == big);
    BOOST_TEST(ranges[r][1].lo == -1);
    BOOST_TEST(ranges[r][1].hi == 0);
    BOOST_TEST(ranges[r][2].lo == -(int64_t(1) << 62));
    BOOST_TEST(ranges[r][2].hi == int64_t(1) << 62);
  }
}

BOOST_AUTO_TEST_CASE(one_collective_whatever_the_count) {
  std::vector<int64_t> many(500);
  for (size_t i = 0; i < many.size(); ++i) many[i] = int64_t(i) * 3 - 700;
  std::vector<int64_t> other = many;
  other[499] += 5;
  MaxOverPeers backend({wireOf(other)});
  const auto r = agreeAcrossRanks(backend, many);
  BOOST_TEST(backend.sent.size() == 1u);
  BOOST_TEST(backend.sent[0].size() == 1000u);
  BOOST_REQUIRE_EQUAL(r.size(), 500u);
  for (size_t i = 0; i < 499; ++i) BOOST_REQUIRE(r[i].agreed());
  BOOST_TEST(r[499].lo == many[499]);
  BOOST_TEST(r[499].hi == many[499] + 5);
}

BOOST_AUTO_TEST_CASE(a_failing_backend_is_rethrown_as_it_is) {
  MaxOverPeers backend;
  backend.failing = true;
  try {
    agreeAcrossRanks(backend, {1, 2});
    BOOST_ERROR("no error");
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_TIMEOUT);
    BOOST_TEST(std::string(e.what()) == "control collective timed out (test)");
  }
}

BOOST_AUTO_TEST_CASE(a_default_range_is_agreed) {
  const RankRange r;
  BOOST_TEST(r.lo == 0);
  BOOST_TEST(r.hi == 0);
  BOOST_TEST(r.agreed());
  BOOST_TEST(!(RankRange{1, 2}.agreed()));
}

BOOST_AUTO_TEST_SUITE_END()
