// sf_digest is XXH64: known answers (checked once against xxhsum 0.8.1 for
// seed 0, and against an independent Python implementation for the seeds),
// chaining through the seed, alignment independence, argument checks.

#include <boost/test/unit_test.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "sfsync.h"

namespace {

// The byte pattern of the known answers: byte i = (i * 31 + 7) mod 256.
std::vector<unsigned char> pat(size_t n) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (unsigned char)((i * 31 + 7) & 255);
  return v;
}

uint64_t digest(const void* p, size_t n, uint64_t seed) {
  uint64_t out = 0;
  BOOST_REQUIRE(sf_digest(p, n, seed, &out) == SF_OK);
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(digest_tests)

BOOST_AUTO_TEST_CASE(known_answers_seed_0_match_xxh64) {
  BOOST_TEST(digest(nullptr, 0, 0) == 0xef46db3751d8e999ULL);
  BOOST_TEST(digest("a", 1, 0) == 0xd24ec4f1a98c6e5bULL);
  BOOST_TEST(digest("abc", 3, 0) == 0x44bc2cf5ad770999ULL);
  // Every tail path (4, 8, 32-byte stripes and the byte loop) and block count.
  const struct {
    size_t n;
    uint64_t h;
  } cases[] = {
      {3, 0x56e6957632a487f9ULL},   {4, 0xc60d15b1e3ff8f04ULL},   {7, 0xafbefc3d6c6f9a8eULL},
      {8, 0x3da5c7aa269683e0ULL},   {12, 0x8fe8ab1c1fd0666eULL},  {31, 0x4a74f3a1a39ad4a1ULL},
      {32, 0x8d57d6a4671cc43dULL},  {33, 0x62c9fd21ed857664ULL},  {63, 0x5c320a0d2707057fULL},
      {64, 0x7bbabbc45729d17eULL},  {100, 0xefa0ad2d3e70c151ULL}, {1000, 0x99594f4828043d35ULL},
      {4099, 0x98531e44aa4f969dULL},
  };
  for (const auto& c : cases) {
    const auto v = pat(c.n);
    BOOST_TEST(digest(v.data(), c.n, 0) == c.h, "n = " << c.n);
  }
}

BOOST_AUTO_TEST_CASE(known_answers_with_seeds) {
  const auto p31 = pat(31), p33 = pat(33), p1000 = pat(1000);
  BOOST_TEST(digest(nullptr, 0, 1) == 0xd5afba1336a3be4bULL);
  BOOST_TEST(digest("abc", 3, 1) == 0xbea9ca8199328908ULL);
  BOOST_TEST(digest(p31.data(), 31, 1) == 0xd7ac4f4bea4e460aULL);
  BOOST_TEST(digest(p33.data(), 33, 1) == 0xb1575979b72c805aULL);
  BOOST_TEST(digest(p1000.data(), 1000, 1) == 0x31db8080bc8eb541ULL);
  BOOST_TEST(digest(nullptr, 0, 0x9e3779b97f4a7c15ULL) == 0xc4349fc93c010000ULL);
  BOOST_TEST(digest(p33.data(), 33, 0x9e3779b97f4a7c15ULL) == 0x52fac3c981f3cc2eULL);
  BOOST_TEST(digest(p1000.data(), 1000, 0x9e3779b97f4a7c15ULL) == 0xda717f741f399f3fULL);
  BOOST_TEST(digest("abc", 3, ~0ULL) == 0x28306e589cc02176ULL);
  BOOST_TEST(digest(p1000.data(), 1000, ~0ULL) == 0x44b2e23187d61c00ULL);
}

BOOST_AUTO_TEST_CASE(chaining_passes_the_previous_digest_as_seed) {
  const auto p33 = pat(33), p1000 = pat(1000);
  uint64_t h = 0;
  h = digest("abc", 3, h);
  h = digest(p33.data(), 33, h);
  h = digest(p1000.data(), 1000, h);
  BOOST_TEST(h == 0x8f65581ccd16e850ULL);  // the same chain in the Python reference
  // A chain is not the digest of the concatenation, and order matters.
  std::vector<unsigned char> all = {'a', 'b', 'c'};
  all.insert(all.end(), p33.begin(), p33.end());
  all.insert(all.end(), p1000.begin(), p1000.end());
  BOOST_TEST(digest(all.data(), all.size(), 0) != h);
  uint64_t swapped = digest(p33.data(), 33, digest("abc", 3, 0));
  BOOST_TEST(swapped != digest("abc", 3, digest(p33.data(), 33, 0)));
}

BOOST_AUTO_TEST_CASE(alignment_does_not_change_the_digest_and_every_bit_matters) {
  const auto v = pat(4099);
  std::vector<unsigned char> shifted(4099 + 7);
  for (size_t off = 0; off < 8; ++off) {
    std::memcpy(shifted.data() + off, v.data(), v.size());
    BOOST_TEST(digest(shifted.data() + off, v.size(), 0) == 0x98531e44aa4f969dULL, "offset " << off);
  }
  const uint64_t base = digest(v.data(), v.size(), 0);
  auto w = v;
  for (size_t byte : {size_t(0), size_t(31), size_t(32), size_t(4095), size_t(4098)}) {
    for (int bit = 0; bit < 8; bit += 7) {
      w[byte] ^= (unsigned char)(1u << bit);
      BOOST_TEST(digest(w.data(), w.size(), 0) != base, "byte " << byte << " bit " << bit);
      w[byte] ^= (unsigned char)(1u << bit);
    }
  }
}

BOOST_AUTO_TEST_CASE(arguments_are_checked) {
  uint64_t out = 42;
  BOOST_TEST(sf_digest(nullptr, 1, 0, &out) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()) == "sf_digest: data is NULL with bytes = 1");
  BOOST_TEST(out == 42u);
  BOOST_TEST(sf_digest("x", 1, 0, nullptr) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()) == "sf_digest: out is NULL");
  BOOST_TEST(sf_digest(nullptr, 0, 7, &out) == SF_OK);
}

BOOST_AUTO_TEST_SUITE_END()
