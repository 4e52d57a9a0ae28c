// plugin/core/sha256.cpp: SHA-256 against the FIPS 180-2 vectors, HMAC-SHA256
// against RFC 4231 and, byte for byte, against OpenSSL (the oracle the
// library used to link) over a fixed sweep of key and message lengths; the
// constant-time comparison and the kernel's random bytes.
#include <boost/test/unit_test.hpp>

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <cstdint>
#include <string>
#include <vector>

#include "plugin/core/sha256.h"

using namespace sfsync;

namespace {

std::string hex(const uint8_t* p, size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

std::string hex(const Sha256Digest& d) { return hex(d.data(), d.size()); }

// splitmix64 (Steele, Lea, Flood 2014) from a fixed seed: the same bytes on
// every run and every host.
struct FixedBytes {
  uint64_t state;
  uint8_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return uint8_t((z ^ (z >> 31)) >> 56);
  }
  std::vector<uint8_t> take(size_t n) {
    std::vector<uint8_t> out(n);
    for (auto& b : out) b = next();
    return out;
  }
};

// OpenSSL is given a valid pointer also for 0 bytes (its one-shot HMAC treats
// a NULL key as "no key given").
const uint8_t* nonNull(const std::vector<uint8_t>& v) {
  static const uint8_t empty = 0;
  return v.empty() ? &empty : v.data();
}

std::string opensslSha256(const std::vector<uint8_t>& data) {
  uint8_t md[SHA256_DIGEST_LENGTH];
  BOOST_REQUIRE(SHA256(nonNull(data), data.size(), md) != nullptr);
  return hex(md, sizeof md);
}

std::string opensslHmacSha256(const std::vector<uint8_t>& key, const std::vector<uint8_t>& msg) {
  uint8_t md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  BOOST_REQUIRE(HMAC(EVP_sha256(), nonNull(key), int(key.size()), nonNull(msg), msg.size(), md,
                     &len) != nullptr);
  BOOST_REQUIRE_EQUAL(len, 32u);
  return hex(md, len);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(sha256_tests)

// FIPS 180-2, appendix B.1 and B.2 (one and two blocks), and the empty message.
BOOST_AUTO_TEST_CASE(fips_180_2_short_vectors) {
  const std::string abc = "abc";
  BOOST_TEST(hex(sha256(abc.data(), abc.size())) ==
             "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 448 bits
  BOOST_TEST(two.size() * 8 == 448u);
  BOOST_TEST(hex(sha256(two.data(), two.size())) ==
             "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  BOOST_TEST(hex(sha256(nullptr, 0)) ==
             "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

// FIPS 180-2, appendix B.3: one million 'a'.
BOOST_AUTO_TEST_CASE(fips_180_2_one_million_a) {
  const std::string a(1000000, 'a');
  BOOST_TEST(hex(sha256(a.data(), a.size())) ==
             "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// RFC 4231, section 4: test cases 1-7 (case 5's MAC truncated to 128 bits as
// there; 6 and 7 with a 131-byte key, hashed first).
BOOST_AUTO_TEST_CASE(rfc_4231_cases_1_to_7) {
  std::string key4;
  for (int i = 1; i <= 25; ++i) key4 += char(i);
  struct Case {
    int number;
    std::string key, data, mac;
  };
  const Case cases[] = {
      {1, std::string(20, '\x0b'), "Hi There",
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {2, "Jefe", "what do ya want for nothing?",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {3, std::string(20, '\xaa'), std::string(50, '\xdd'),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {4, key4, std::string(50, '\xcd'),
       "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {5, std::string(20, '\x0c'), "Test With Truncation", "a3b6167473100ee06e0c796c2955552b"},
      {6, std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {7, std::string(131, '\xaa'),
       "This is a test using a larger than block-size key and a larger than block-size data. "
       "The key needs to be hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT("RFC 4231 test case " << c.number) {
      const std::string mac =
          hex(hmacSha256(c.key.data(), c.key.size(), c.data.data(), c.data.size()));
      BOOST_TEST(mac.substr(0, c.mac.size()) == c.mac);
    }
  }
}

// Every length 0..300 (each padding case: 55/56/63/64 bytes and their
// multi-block counterparts) and a few longer ones, against OpenSSL's SHA256.
BOOST_AUTO_TEST_CASE(sha256_matches_openssl_lengths_0_to_300) {
  FixedBytes gen{0x5348413235360001ULL};
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (size_t n : {1000u, 4095u, 4096u, 4097u, 65599u}) lengths.push_back(n);
  int mismatches = 0;
  for (size_t n : lengths) {
    const std::vector<uint8_t> data = gen.take(n);
    const std::string ours = hex(sha256(data.data(), data.size()));
    const std::string theirs = opensslSha256(data);
    if (ours != theirs && ++mismatches <= 5) {
      BOOST_ERROR("length " << n << ": ours " << ours << ", OpenSSL " << theirs);
    }
  }
  BOOST_TEST(mismatches == 0);
}

// Every key length 0..200 (below, at and above the 64-byte block: hashed
// first) with every message length 0..300, fixed-seed bytes, against
// OpenSSL's HMAC(EVP_sha256()).
BOOST_AUTO_TEST_CASE(hmac_matches_openssl_keys_0_to_200_messages_0_to_300) {
  FixedBytes gen{0x484D414332353601ULL};
  int compared = 0, mismatches = 0;
  for (size_t k = 0; k <= 200; ++k) {
    for (size_t m = 0; m <= 300; ++m) {
      const std::vector<uint8_t> key = gen.take(k);
      const std::vector<uint8_t> msg = gen.take(m);
      const std::string ours = hex(hmacSha256(key.data(), key.size(), msg.data(), msg.size()));
      const std::string theirs = opensslHmacSha256(key, msg);
      ++compared;
      if (ours != theirs && ++mismatches <= 5) {
        BOOST_ERROR("key " << k << " bytes, message " << m << " bytes: ours " << ours
                           << ", OpenSSL " << theirs);
      }
    }
  }
  BOOST_TEST(compared == 201 * 301);
  BOOST_TEST(mismatches == 0);
}

BOOST_AUTO_TEST_CASE(equal_constant_time_compares_every_byte) {
  const std::string a(32, 'x');
  BOOST_TEST(equalConstantTime(a.data(), std::string(a).data(), a.size()));
  BOOST_TEST(equalConstantTime(nullptr, nullptr, 0));
  for (size_t i : {size_t(0), size_t(17), size_t(31)}) {
    std::string b = a;
    b[i] = char(b[i] ^ 0x01);
    BOOST_TEST_CONTEXT("differs at byte " << i) {
      BOOST_TEST(!equalConstantTime(a.data(), b.data(), a.size()));
      BOOST_TEST(equalConstantTime(a.data(), b.data(), i));  // the prefix before it
    }
  }
}

BOOST_AUTO_TEST_CASE(secure_random_two_draws_differ) {
  uint8_t first[32] = {}, second[32] = {};
  secureRandomBytes(first, sizeof first);
  secureRandomBytes(second, sizeof second);
  BOOST_TEST_MESSAGE("draws " << hex(first, 32) << " " << hex(second, 32));
  BOOST_TEST(hex(first, 32) != hex(second, 32));
  BOOST_TEST(hex(first, 32) != std::string(64, '0'));
  BOOST_TEST(hex(second, 32) != std::string(64, '0'));
}

// 0 bytes (NULL allowed) and 1 MiB: every 4 KiB of it written (a short read
// that was not continued would leave a zero tail) and every byte value about
// as frequent as the others (4096 expected each; the bounds are 9 standard
// deviations out).
BOOST_AUTO_TEST_CASE(secure_random_zero_bytes_and_one_mebibyte) {
  BOOST_CHECK_NO_THROW(secureRandomBytes(nullptr, 0));
  std::vector<uint8_t> big(size_t(1) << 20, 0);
  secureRandomBytes(big.data(), big.size());
  int zeroPages = 0;
  for (size_t at = 0; at < big.size(); at += 4096) {
    bool allZero = true;
    for (size_t i = at; i < at + 4096; ++i) allZero = allZero && big[i] == 0;
    zeroPages += allZero;
  }
  BOOST_TEST(zeroPages == 0);
  std::vector<int> counts(256, 0);
  for (uint8_t b : big) ++counts[b];
  for (int v = 0; v < 256; ++v) {
    BOOST_TEST_CONTEXT("byte value " << v) {
      BOOST_TEST(counts[v] > 3500);
      BOOST_TEST(counts[v] < 4700);
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
