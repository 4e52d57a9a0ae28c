# The targets the `unit`-labelled tests need (their executables, the tools
# they start, the libraries they load or inspect), gathered into one target,
# sf_unit_tests, defined at the end of the top-level CMakeLists.txt. The
# sanitizer trees of scripts/test.sh build only that target
# (`cmake --build DIR --target sf_unit_tests`) and run only `ctest -L unit`;
# tests/support/check_unit_targets.py then checks that every file a unit test's
# command, arguments or environment names in the tree exists, so a unit test
# whose target is not listed here fails loudly instead of being skipped.
#
# sf_unit_targets(target...)   add targets (defined anywhere) to sf_unit_tests.

include_guard(GLOBAL)

function(sf_unit_targets)
  set_property(GLOBAL APPEND PROPERTY SF_UNIT_TARGETS ${ARGN})
endfunction()
