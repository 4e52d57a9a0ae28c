#pragma once
// The suites that call plugin code without the C ABI: `f` must throw an
// sfsync::Error of `status` whose message names every fragment. Returns the
// message ("" when nothing, or something else, was thrown: a failed check).

#include <boost/test/unit_test.hpp>

#include <string>
#include <vector>

#include "plugin/core/error.h"

namespace sftest {

template <typename F>
std::string expectError(F&& f, sf_status status, const std::vector<std::string>& fragments) {
  try {
    f();
  } catch (const sfsync::Error& e) {
    BOOST_TEST(e.status() == status, e.what());
    const std::string m = e.what();
    for (const auto& s : fragments) BOOST_TEST(m.find(s) != std::string::npos, "'" << s << "' in: " << m);
    return m;
  }
  BOOST_ERROR("no sfsync::Error of status " << status << " (expected one naming '"
                                            << (fragments.empty() ? "" : fragments.front()) << "')");
  return "";
}

}  // namespace sftest
