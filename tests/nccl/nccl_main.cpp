// The one file that defines the Boost.Test module of each NCCL test executable.
#define BOOST_TEST_MODULE sfsync_nccl
#include <boost/test/unit_test.hpp>
