#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdlib>
#include <string>

#include "plugin/core/error.h"
#include "plugin/launch/launch_options.h"

using namespace sfsync;

namespace {
// Sets environment variables for one test case and restores them after.
struct EnvGuard {
  std::vector<std::pair<std::string, std::string>> saved;
  std::vector<std::string> unset;
  void set(const char* k, const char* v) {
    const char* old = std::getenv(k);
    if (old) saved.emplace_back(k, old);
    else unset.push_back(k);
    ::setenv(k, v, 1);
  }
  ~EnvGuard() {
    for (auto& kv : saved) ::setenv(kv.first.c_str(), kv.second.c_str(), 1);
    for (auto& k : unset) ::unsetenv(k.c_str());
  }
};

std::string errorOf(const sf_options& o) {
  try {
    validateOptions(o);
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_INVALID_ARGUMENT);
    return e.what();
  }
  return "";
}

sf_options clean() {
  EnvGuard env;
  for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "SF_RENDEZVOUS",
                        "SF_BUCKET_CAP_MB", "SF_FIRST_BUCKET_CAP_MB", "SF_BACKEND", "SF_REDUCE"}) {
    env.set(k, "");
  }
  sf_options o;
  optionsFromEnvironment(o);
  return o;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(options_tests)

BOOST_AUTO_TEST_CASE(defaults_match_ddp) {
  sf_options o = clean();
  BOOST_TEST(o.bucket_cap_mb == 25.0);
  BOOST_TEST(o.first_bucket_cap_mb == 1.0);
  BOOST_TEST(o.world_size == 1);
  BOOST_TEST(o.rank == 0);
  BOOST_TEST(o.reduce_op == SF_REDUCE_AVERAGE);
  BOOST_TEST(o.backend == SF_BACKEND_AUTO);
  BOOST_TEST(std::string(o.rendezvous).empty());
  BOOST_TEST(errorOf(o).empty());
}

BOOST_AUTO_TEST_CASE(torchrun_and_sf_variables_are_read) {
  EnvGuard env;
  env.set("RANK", "3");
  env.set("WORLD_SIZE", "4");
  env.set("LOCAL_RANK", "1");
  env.set("MASTER_ADDR", "127.0.0.1");
  env.set("SF_RENDEZVOUS", "");
  env.set("SF_BUCKET_CAP_MB", "0.5");
  env.set("SF_FIRST_BUCKET_CAP_MB", "0.25");
  env.set("SF_REDUCE", "sum");
  env.set("SF_TIMEOUT_MS", "1234");
  sf_options o;
  optionsFromEnvironment(o);
  BOOST_TEST(o.rank == 3);
  BOOST_TEST(o.world_size == 4);
  BOOST_TEST(o.local_rank == 1);
  BOOST_TEST(std::string(o.rendezvous) == "env://");
  BOOST_TEST(o.bucket_cap_mb == 0.5);
  BOOST_TEST(o.first_bucket_cap_mb == 0.25);
  BOOST_TEST(o.reduce_op == SF_REDUCE_SUM);
  BOOST_TEST(o.timeout_ms == 1234);
}

BOOST_AUTO_TEST_CASE(a_bad_variable_is_named_and_the_rest_still_applies) {
  EnvGuard env;
  env.set("SF_BUCKET_CAP_MB", "abc");
  env.set("SF_FIRST_BUCKET_CAP_MB", "2");
  sf_options o;
  std::string message;
  try {
    optionsFromEnvironment(o);
  } catch (const Error& e) {
    message = e.what();
  }
  BOOST_TEST(message.find("SF_BUCKET_CAP_MB='abc'") != std::string::npos, message);
  BOOST_TEST(o.first_bucket_cap_mb == 2.0);
  BOOST_TEST(o.bucket_cap_mb == 25.0);
}

BOOST_AUTO_TEST_CASE(caps_must_be_positive_and_finite) {
  for (const char* v : {"0", "-1", "nan", "inf"}) {
    EnvGuard env;
    env.set("SF_BUCKET_CAP_MB", v);
    sf_options o;
    BOOST_CHECK_THROW(optionsFromEnvironment(o), Error);
  }
  for (double bad : {0.0, -3.0, double(NAN), double(INFINITY)}) {
    sf_options o = clean();
    o.first_bucket_cap_mb = bad;
    const std::string m = errorOf(o);
    BOOST_TEST(m.find("first_bucket_cap_mb") != std::string::npos, m);
  }
}

BOOST_AUTO_TEST_CASE(invalid_fields_are_named_with_their_value) {
  sf_options o = clean();
  o.rank = 5;
  o.world_size = 2;
  std::strcpy(o.rendezvous, "memory://x");
  BOOST_TEST(errorOf(o).find("rank = 5") != std::string::npos);
  o = clean();
  o.world_size = 2;
  BOOST_TEST(errorOf(o).find("rendezvous is empty") != std::string::npos);
  o = clean();
  std::strcpy(o.rendezvous, "tcp://1.2.3.4");
  BOOST_TEST(errorOf(o).find("'tcp://1.2.3.4'") != std::string::npos);
  for (const char* bad : {"tcp://:29500", "tcp://h:0", "tcp://h:65536", "tcp://h:x", "mpi://x"}) {
    std::strcpy(o.rendezvous, bad);
    BOOST_TEST(errorOf(o).find(std::string("'") + bad + "'") != std::string::npos, bad);
  }
  o.world_size = 2;
  for (const char* good : {"tcp://node07:22423", "tcp://[::1]:1", "mpi://"}) {  // since 0.3
    std::strcpy(o.rendezvous, good);
    BOOST_TEST(errorOf(o).empty(), good);
  }
  o = clean();
  o.backend = 9;
  BOOST_TEST(errorOf(o).find("backend = 9") != std::string::npos);
  o = clean();
  o.timeout_ms = 0;
  BOOST_TEST(errorOf(o).find("timeout_ms = 0") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(caller_struct_smaller_than_version_one_is_rejected) {
  sf_options o = clean();
  o.struct_size = 16;
  BOOST_CHECK_THROW(optionsFromCaller(&o), Error);
  o.struct_size = sizeof o;
  o.bucket_cap_mb = 3;
  BOOST_TEST(optionsFromCaller(&o).bucket_cap_mb == 3.0);
}

BOOST_AUTO_TEST_SUITE_END()
