// The one file that defines the Boost.Test module of each test executable.
#define BOOST_TEST_MODULE sfsync
#include <boost/test/unit_test.hpp>
