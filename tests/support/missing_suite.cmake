# sf_missing_suite(NAME name LABELS labels REASON text NOTE text)
#   for a CMakeLists.txt read with or without SF_BUILD_TESTS whose suite lacks
#   a prerequisite: with SF_BUILD_TESTS, sf_missing_prerequisite (NAME, LABELS,
#   REASON; checked_test.cmake); without, NOTE as a STATUS message. The caller
#   then return()s. checked_test.cmake (it needs python3) is read only in a
#   build with tests.

include_guard(GLOBAL)

function(sf_missing_suite)
  cmake_parse_arguments(T "" "NAME;REASON;NOTE" "LABELS" ${ARGN})
  if(SF_BUILD_TESTS)
    include(${CMAKE_CURRENT_FUNCTION_LIST_DIR}/checked_test.cmake)
    sf_missing_prerequisite(NAME ${T_NAME} LABELS "${T_LABELS}" REASON "${T_REASON}")
  else()
    message(STATUS "${T_NOTE}")
  endif()
endfunction()
