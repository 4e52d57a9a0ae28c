#include <boost/test/unit_test.hpp>

#include <stdexcept>
#include <vector>

#include "plugin/backend/ordered_executor.h"

using sfsync::OrderedExecutor;

BOOST_AUTO_TEST_SUITE(ordered_executor_tests)

BOOST_AUTO_TEST_CASE(tasks_run_in_submission_order) {
  std::vector<int> order;
  std::vector<std::future<void>> done;
  {
    OrderedExecutor ex;
    for (int i = 0; i < 100; ++i) done.push_back(ex.submit([&order, i] { order.push_back(i); }));
    for (auto& f : done) f.get();
  }
  BOOST_REQUIRE_EQUAL(order.size(), 100u);
  for (int i = 0; i < 100; ++i) BOOST_TEST(order[size_t(i)] == i);
}

BOOST_AUTO_TEST_CASE(exceptions_reach_the_future_and_later_tasks_still_run) {
  OrderedExecutor ex;
  auto bad = ex.submit([] { throw std::runtime_error("boom"); });
  int ran = 0;
  auto good = ex.submit([&] { ran = 1; });
  BOOST_CHECK_THROW(bad.get(), std::runtime_error);
  good.get();
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
