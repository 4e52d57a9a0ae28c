// The env:// store's wire protocol as a pure unit: framing, limits and
// request decoding, also on random bytes (a small deterministic fuzz; the
// parser must reject or wait, never crash or buffer past its limit).

#include <boost/test/unit_test.hpp>

#include <random>

#include "plugin/rendezvous/store_protocol.h"

using namespace sfsync::store_protocol;

BOOST_AUTO_TEST_SUITE(store_protocol_tests)

BOOST_AUTO_TEST_CASE(frames_round_trip_byte_by_byte) {
  const std::string wire = encode('S', {"sfsync/1", std::string("a\0b", 3)}) + encode('G', {"k"});
  FrameParser p(1024);
  std::vector<Message> got;
  for (char c : wire) {
    p.feed(&c, 1);
    Message m;
    while (p.next(m) == FrameParser::Result::kMessage) got.push_back(m);
  }
  BOOST_TEST_REQUIRE(got.size() == 2u);
  BOOST_TEST(got[0].type == 'S');
  BOOST_TEST(got[0].fields[1] == std::string("a\0b", 3));
  Request r;
  std::string error;
  BOOST_TEST(decodeRequest(got[0], 64, r, &error));
  BOOST_TEST(r.key == "sfsync/1");
  BOOST_TEST(p.buffered() == 0u);
}

BOOST_AUTO_TEST_CASE(oversize_length_is_rejected_from_the_header_alone) {
  FrameParser p(1000);
  const char header[4] = {char(0x00), char(0x00), char(0x00), char(0x01)};  // 16 MiB
  p.feed(header, 4);
  Message m;
  BOOST_TEST(int(p.next(m)) == int(FrameParser::Result::kError));
  BOOST_TEST(p.error().find("16777216") != std::string::npos, p.error());
  BOOST_TEST(p.buffered() == 4u);  // nothing of the body was waited for
}

BOOST_AUTO_TEST_CASE(malformed_frames_and_requests_say_why) {
  Message m;
  {
    FrameParser p(100);
    p.feed("\0\0\0\0", 4);
    BOOST_TEST(int(p.next(m)) == int(FrameParser::Result::kError));
    BOOST_TEST(p.error() == "empty frame");
  }
  {
    FrameParser p(100);
    const std::string f = std::string("\x06\0\0\0G\xff\xff\0\0\0", 10);  // field overruns
    p.feed(f.data(), f.size());
    BOOST_TEST(int(p.next(m)) == int(FrameParser::Result::kError));
  }
  std::string error;
  Request r;
  BOOST_TEST(!decodeRequest({'Z', {}}, 64, r, &error));
  BOOST_TEST(!decodeRequest({'G', {std::string(65, 'k')}}, 64, r, &error));
  BOOST_TEST(error.find("65 bytes") != std::string::npos, error);
  BOOST_TEST(!decodeRequest({'C', {"-1"}}, 64, r, &error));
  BOOST_TEST(!decodeRequest({'A', {"short", ""}}, 64, r, &error));
  BOOST_TEST(decodeRequest({'C', {"17"}}, 64, r, &error));
  BOOST_TEST(r.rank == 17);
}

BOOST_AUTO_TEST_CASE(random_bytes_never_crash_nor_overbuffer) {
  std::mt19937 rng(1234);
  for (int round = 0; round < 20000; ++round) {
    FrameParser p(256);
    std::string bytes(rng() % 64, '\0');
    for (auto& c : bytes) c = char(rng());
    if (round % 3 == 0 && bytes.size() >= 4) bytes[1] = bytes[2] = bytes[3] = 0;  // plausible lengths
    p.feed(bytes.data(), bytes.size());
    Message m;
    FrameParser::Result res;
    while ((res = p.next(m)) == FrameParser::Result::kMessage) {
      Request r;
      std::string error;
      decodeRequest(m, 64, r, &error);
    }
    BOOST_TEST_REQUIRE(p.buffered() <= bytes.size());
  }
}

BOOST_AUTO_TEST_SUITE_END()
