# CTest helpers that keep a test honest (issue 19).
#
# sf_add_checked_test(NAME name COMMAND cmd args...
#                     [LINES re...] [EXPECT re...] [REJECT re...] [EXIT_CODE n]
#                     [SKIP_RETURN_CODE 77])
#   passes only if the command exits 0 (or EXIT_CODE: a test of a failure
#   names the failure's status) AND every LINES regex matches one
#   line of its output (e.g. one "RESULT rank=R .* OK" per rank), every
#   EXPECT regex matches the whole output (as PASS_REGULAR_EXPRESSION) and no
#   REJECT regex matches (as FAIL_REGULAR_EXPRESSION). Never set
#   PASS_REGULAR_EXPRESSION yourself: CTest then ignores the exit status.
#   Regexes are Python's (tests/support/expect_output.py). A first COMMAND
#   word that is a target becomes its file, as add_test does.
#
# sf_missing_prerequisite(NAME name REASON text)
#   registers `name` for a suite whose prerequisite is missing, instead of
#   leaving it out: it fails where CI=true is set in the environment (CI must
#   run every suite the README promises) and is skipped elsewhere (exit 77,
#   SKIP_RETURN_CODE), printing the reason either way.

include_guard(GLOBAL)

find_program(SF_CHECK_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT SF_CHECK_PYTHON)
  find_program(SF_CHECK_PYTHON NAMES python3 REQUIRED)
endif()

function(sf_add_checked_test)
  cmake_parse_arguments(T "" "NAME;SKIP_RETURN_CODE;EXIT_CODE" "COMMAND;LINES;EXPECT;REJECT" ${ARGN})
  if(NOT T_NAME OR NOT T_COMMAND)
    message(FATAL_ERROR "sf_add_checked_test: NAME and COMMAND are required")
  endif()
  set(args)
  foreach(re IN LISTS T_LINES)
    list(APPEND args --line "${re}")
  endforeach()
  foreach(re IN LISTS T_EXPECT)
    list(APPEND args --expect "${re}")
  endforeach()
  foreach(re IN LISTS T_REJECT)
    list(APPEND args --reject "${re}")
  endforeach()
  if(DEFINED T_EXIT_CODE)
    list(APPEND args --exit ${T_EXIT_CODE})
  endif()
  if(T_SKIP_RETURN_CODE)
    list(APPEND args --skip-code ${T_SKIP_RETURN_CODE})
  endif()
  list(GET T_COMMAND 0 first)
  if(TARGET ${first})
    list(REMOVE_AT T_COMMAND 0)
    list(INSERT T_COMMAND 0 "$<TARGET_FILE:${first}>")
  endif()
  add_test(NAME ${T_NAME} COMMAND ${SF_CHECK_PYTHON}
           ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/expect_output.py ${args} -- ${T_COMMAND})
  if(T_SKIP_RETURN_CODE)
    set_tests_properties(${T_NAME} PROPERTIES SKIP_RETURN_CODE ${T_SKIP_RETURN_CODE})
  endif()
endfunction()

function(sf_missing_prerequisite)
  cmake_parse_arguments(T "" "NAME;REASON" "LABELS" ${ARGN})
  message(STATUS "${T_NAME}: ${T_REASON} (a skip here, a failure with CI=true)")
  add_test(NAME ${T_NAME} COMMAND ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/missing_prerequisite.sh "${T_REASON}")
  set_tests_properties(${T_NAME} PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 10)
  if(T_LABELS)
    set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}")
  endif()
endfunction()
