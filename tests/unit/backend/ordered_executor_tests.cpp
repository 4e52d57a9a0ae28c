#include <boost/test/unit_test.hpp>

#include <stdexcept>
#include <vector>

#include "plugin/backend/ordered_executor.h"
#include "plugin/core/error.h"

using sfsync::OrderedExecutor;

BOOST_AUTO_TEST_SUITE(ordered_executor_tests)

BOOST_AUTO_TEST_CASE(tasks_run_in_submission_order) {
  std::vector<int> order;
  std::vector<std::future<sfsync::TaskResult>> done;
  {
    OrderedExecutor ex;
    for (int i = 0; i < 100; ++i) done.push_back(ex.submit([&order, i] { order.push_back(i); }));
    for (auto& f : done) f.get();
  }
  BOOST_REQUIRE_EQUAL(order.size(), 100u);
  for (int i = 0; i < 100; ++i) BOOST_TEST(order[size_t(i)] == i);
}

BOOST_AUTO_TEST_CASE(failures_reach_the_future_as_statuses_and_later_tasks_still_run) {
  OrderedExecutor ex;
  auto bad = ex.submit([] { throw sfsync::Error(SF_ERR_TIMEOUT, "late peer"); });
  auto odd = ex.submit([] { throw std::runtime_error("boom"); });
  int ran = 0;
  auto good = ex.submit([&] { ran = 1; });
  const sfsync::TaskResult b = bad.get();
  BOOST_TEST(b.status == SF_ERR_TIMEOUT);
  BOOST_TEST(b.message == "late peer");
  BOOST_CHECK_THROW(b.throwIfFailed(), sfsync::Error);
  BOOST_TEST(odd.get().status == SF_ERR_INTERNAL);
  BOOST_TEST(good.get().status == SF_OK);
  BOOST_TEST(ran == 1);
}

BOOST_AUTO_TEST_CASE(destructor_drains_the_queue) {
  int count = 0;
  {
    OrderedExecutor ex;
    for (int i = 0; i < 10; ++i) ex.submit([&] { ++count; });
  }
  BOOST_TEST(count == 10);
}

BOOST_AUTO_TEST_SUITE_END()
