# sf_test_pch(exe main_source): with SF_TEST_PCH=ON, the Boost.Test suites of
# exe compile against one precompiled header (Boost.Test and the standard
# headers most suites include): measured in the clang ASan tree, those headers
# are most of a suite's compile time. main_source (the file that defines
# BOOST_TEST_MODULE before it includes Boost.Test) is compiled without it.
# For trees nobody edits in (scripts/test.sh's sanitizer trees): a suite that
# forgets an include of its own still compiles there, so the normal tree,
# without it, is the one that checks each file's includes.

include_guard(GLOBAL)

option(SF_TEST_PCH "Compile the Boost.Test suites against one precompiled header of Boost.Test and standard headers (most of a suite's compile time in a clang Debug tree), for trees nobody edits in (scripts/test.sh's sanitizer trees); the normal tree, without it, checks each file's includes" OFF)

function(sf_test_pch exe main_source)
  if(NOT SF_TEST_PCH)
    return()
  endif()
  target_precompile_headers(${exe} PRIVATE
    <boost/test/unit_test.hpp> <algorithm> <atomic> <chrono> <cmath> <cstdint> <cstdlib>
    <cstring> <functional> <map> <memory> <string> <thread> <vector>)
  set_source_files_properties(${main_source} TARGET_DIRECTORY ${exe}
    PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
endfunction()
