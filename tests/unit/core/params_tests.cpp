// plugin/core/params.cpp (the SF_* parameter table) and plugin/core/env.cpp
// (the one reader): the table against docs/launchers.md's Environment section and
// against the sources, and the readers' rules.
#include <boost/test/unit_test.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "plugin/core/env.h"
#include "plugin/core/params.h"

using namespace sfsync;

namespace {

std::set<std::string> tableNames() {
  size_t n = 0;
  const Param* p = params(&n);
  std::set<std::string> out;
  for (size_t i = 0; i < n; ++i) out.insert(p[i].name);
  return out;
}

std::string readFile(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  BOOST_REQUIRE_MESSAGE(f, "cannot read " << path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The SF_* names in the first column of the Environment table of
// docs/launchers.md (the README's until 0.4).
std::set<std::string> readmeNames() {
  const std::string text = readFile(std::filesystem::path(SF_SOURCE_DIR) / "docs" / "launchers.md");
  const size_t begin = text.find("\n## Environment\n");
  BOOST_REQUIRE(begin != std::string::npos);
  const size_t end = text.find("\n## ", begin + 1);
  std::istringstream section(text.substr(begin, end - begin));
  std::set<std::string> out;
  const std::regex name("SF_[A-Z0-9_]+");
  for (std::string line; std::getline(section, line);) {
    if (line.rfind("| ", 0) != 0) continue;
    const std::string first = line.substr(2, line.find(" | ", 2) - 2);
    for (std::sregex_iterator m(first.begin(), first.end(), name), e; m != e; ++m) {
      out.insert(m->str());
    }
  }
  return out;
}

std::string joined(const std::set<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(params_tests)

BOOST_AUTO_TEST_CASE(rows_are_complete_and_declared_once) {
  size_t n = 0;
  const Param* p = params(&n);
  BOOST_TEST(n == 28u);  // a new variable: a row, a row in docs/launchers.md, and this count
  std::set<std::string> seen;
  for (size_t i = 0; i < n; ++i) {
    BOOST_TEST_CONTEXT(p[i].name) {
      BOOST_TEST(std::string(p[i].name).rfind("SF_", 0) == 0u);
      BOOST_TEST(seen.insert(p[i].name).second);
      BOOST_TEST(*p[i].type);
      BOOST_TEST(*p[i].defaultValue);
      BOOST_TEST(*p[i].doc);
      BOOST_TEST(std::filesystem::exists(std::filesystem::path(SF_SOURCE_DIR) /
                                         (std::string(p[i].readBy).rfind("shim/", 0) == 0
                                              ? std::string(p[i].readBy)
                                              : "plugin/" + std::string(p[i].readBy))));
      BOOST_TEST(findParam(p[i].name) == &p[i]);
    }
  }
  BOOST_TEST(findParam("SF_NOT_A_VARIABLE") == nullptr);
}

BOOST_AUTO_TEST_CASE(readme_environment_lists_exactly_the_table) {
  const std::set<std::string> table = tableNames();
  const std::set<std::string> readme = readmeNames();
  std::set<std::string> missing, extra;
  for (const std::string& n : table) {
    if (!readme.count(n)) missing.insert(n);
  }
  for (const std::string& n : readme) {
    if (!table.count(n)) extra.insert(n);
  }
  BOOST_TEST(missing.empty(), "in plugin/core/params.cpp, not in docs/launchers.md's Environment: " << joined(missing));
  BOOST_TEST(extra.empty(), "in docs/launchers.md's Environment, not in plugin/core/params.cpp: " << joined(extra));
  BOOST_TEST(readme.size() == table.size());
}

BOOST_AUTO_TEST_CASE(every_sf_name_in_the_sources_is_declared) {
  const std::set<std::string> table = tableNames();
  const std::regex literal("\"(SF_[A-Z0-9_]+)\"");
  std::set<std::string> undeclared, used;
  size_t files = 0;
  for (const char* dir : {"plugin", "shim"}) {
    for (const auto& entry :
         std::filesystem::recursive_directory_iterator(std::filesystem::path(SF_SOURCE_DIR) / dir)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() || (ext != ".cpp" && ext != ".h")) continue;
      ++files;
      const std::string text = readFile(entry.path());
      for (std::sregex_iterator m(text.begin(), text.end(), literal), e; m != e; ++m) {
        const std::string name = (*m)[1].str();
        used.insert(name);
        if (!table.count(name)) undeclared.insert(name + " (" + entry.path().filename().string() + ")");
      }
    }
  }
  BOOST_TEST(files > 100u);
  BOOST_TEST(undeclared.empty(), "read but not in plugin/core/params.cpp: " << joined(undeclared));
  // And the other way: every declared variable is read somewhere.
  std::set<std::string> unread;
  for (const std::string& n : table) {
    if (!used.count(n)) unread.insert(n);
  }
  BOOST_TEST(unread.empty(), "declared but read nowhere: " << joined(unread));
}

BOOST_AUTO_TEST_CASE(reader_treats_empty_as_unset_and_keeps_the_first_error) {
  const char* const envp[] = {"SF_MAX_INFLIGHT=", "SF_TIMEOUT_MS=abc", "SF_BACKEND=tpu",
                              "SF_BUCKET_CAP_MB=2.5", "SF_BUCKET_CAP_MB=9", nullptr};
  EnvReader r(envpEnvironment(envp));
  int32_t inflight = 4;
  r.readInt("SF_MAX_INFLIGHT", inflight, 1, 16);
  BOOST_TEST(inflight == 4);
  BOOST_TEST(r.firstError().empty());
  double cap = 25;
  r.readDouble("SF_BUCKET_CAP_MB", cap, true);
  BOOST_TEST(cap == 2.5);  // the first entry wins, as getenv's
  int64_t timeout = 7;
  r.readTimeoutMs("SF_TIMEOUT_MS", timeout);
  BOOST_TEST(timeout == 7);
  static const char* const kBackends[] = {"auto", "gloo", "nccl"};
  int32_t backend = 0;
  r.readChoice("SF_BACKEND", backend, kBackends, 3);
  BOOST_TEST(backend == 0);
  BOOST_TEST(r.firstError() == "environment variable SF_TIMEOUT_MS='abc' is not a positive integer");
  BOOST_TEST(envValue(envpEnvironment(envp), "SF_MAX_INFLIGHT") == nullptr);
  BOOST_TEST(envValue(envpEnvironment(envp), "SF_RANK") == nullptr);
}

BOOST_AUTO_TEST_SUITE_END()
