# The shim's tests, included from shim/CMakeLists.txt (CMAKE_CURRENT_LIST_DIR
# is this directory). Labels: "unit" (decision logic), "shim" (the
# interposer under real hosts).

find_package(Boost 1.74 REQUIRED COMPONENTS unit_test_framework)
set(SF_SHIM_TESTS ${CMAKE_CURRENT_LIST_DIR})

# Decision logic, driven directly: no interposition.
add_executable(sfsync_shim_tests
  ${SF_SHIM_TESTS}/shim_tests_main.cpp
  ${SF_SHIM_TESTS}/reduce_probe_tests.cpp
  ${SF_SHIM_TESTS}/pass_tracker_tests.cpp
  ${SF_SHIM_TESTS}/shim_policy_tests.cpp)
target_compile_definitions(sfsync_shim_tests PRIVATE BOOST_TEST_DYN_LINK)
target_compile_options(sfsync_shim_tests PRIVATE -Wall -Wextra)
target_link_libraries(sfsync_shim_tests PRIVATE sfsync_internal Boost::unit_test_framework)
foreach(suite reduce_probe_tests pass_tracker_tests shim_policy_tests)
  add_test(NAME ${suite} COMMAND sfsync_shim_tests --run_test=${suite})
  set_tests_properties(${suite} PROPERTIES LABELS "unit;shim" TIMEOUT 60)
endforeach()

# ---- PyTorch DDP over Gloo, 2 CPU processes (Debian's python3-torch) -------
# The reference run uses no_sync(); the others run the same script under the
# shim without it, and compare their final weights with the reference's.
set(SF_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with Debian's torch, for the shim's DDP tests")
execute_process(COMMAND ${SF_PYTHON} -c "import torch.distributed as d; assert d.is_gloo_available()"
                RESULT_VARIABLE SF_NO_TORCH OUTPUT_QUIET ERROR_QUIET)
if(SF_NO_TORCH)
  message(STATUS "shim: ${SF_PYTHON} has no torch with Gloo: no DDP tests")
else()
  set(ddp ${SF_PYTHON} ${SF_SHIM_TESTS}/ddp_accumulation.py --steps 4)
  set(ref ${CMAKE_CURRENT_BINARY_DIR}/shim_ddp_reference.pt)
  set(reports ${CMAKE_CURRENT_BINARY_DIR}/reports)
  set(preload LD_PRELOAD=$<TARGET_FILE:sfsync_shim>)
  function(sf_shim_ddp_test name)
    cmake_parse_arguments(T "" "" "ARGS;ENV;PASS" ${ARGN})
    add_test(NAME ${name} COMMAND ${ddp} ${T_ARGS})
    set_tests_properties(${name} PROPERTIES LABELS "shim;torch" TIMEOUT 120
      FIXTURES_REQUIRED shim_ddp_reference ENVIRONMENT "${T_ENV}")
    if(T_PASS)
      set_tests_properties(${name} PROPERTIES PASS_REGULAR_EXPRESSION "${T_PASS}")
    endif()
  endfunction()

  add_test(NAME shim_ddp_reference_no_sync
           COMMAND ${ddp} --mode nosync --check-grads --save ${ref})
  set_tests_properties(shim_ddp_reference_no_sync PROPERTIES
    LABELS "shim;torch" TIMEOUT 120 FIXTURES_SETUP shim_ddp_reference)

  # (a) the two ctypes calls: 1x the gradient bytes per window, from window 1.
  sf_shim_ddp_test(shim_ddp_explicit_windows
    ARGS --mode calls --reference ${ref} --check-grads --local-from 1
         --report ${reports}/explicit-%r.json --expect calls
    ENV "${preload};SF_SHIM_REPORT=${reports}/explicit-%r.json")
  # (b) the script untouched, SF_ACCUMULATION_STEPS=4: passes counted by the shim.
  sf_shim_ddp_test(shim_ddp_automatic_windows
    ARGS --mode plain --reference ${ref} --check-grads --local-from 6
         --report ${reports}/automatic-%r.json --expect auto
    ENV "${preload};SF_ACCUMULATION_STEPS=4;SF_SHIM_REPORT=${reports}/automatic-%r.json")
  # Without windows the shim only counts: N x the bytes (the baseline).
  sf_shim_ddp_test(shim_ddp_passthrough
    ARGS --mode plain --reference ${ref} --check-grads
         --report ${reports}/passthrough-%r.json --expect pass
    ENV "${preload};SF_SHIM_REPORT=${reports}/passthrough-%r.json")
  # A foreign float all-reduce: automatic mode gives up, says so, stays exact.
  sf_shim_ddp_test(shim_ddp_automatic_gives_up
    ARGS --mode plain --foreign-at 4 --reference ${ref} --check-grads --local-from 6
         --report ${reports}/foreign-%r.json --expect lost
    ENV "${preload};SF_ACCUMULATION_STEPS=4;SF_SHIM_REPORT=${reports}/foreign-%r.json"
    PASS "cannot tell where backward passes start \\(pass 13: an all-reduce of 160000 bytes.*\nOK\n")
  # A window the host never synchronizes: reported, naming it.
  sf_shim_ddp_test(shim_ddp_unsynchronized_window
    ARGS --mode unsynced --windows 3 --report ${reports}/unsynced-%r.json --expect unsynced
         --unsynchronized 1,2,3
    ENV "${preload};SF_SHIM_REPORT=${reports}/unsynced-%r.json"
    PASS "window 1 ended with 7 deferred gradient all-reduces \\(6389920 bytes\\) and no real synchronization before window 2 began.*\nOK\n")
  # PyTorch's own reduce functions, every dtype x op: only float sums deferred.
  add_test(NAME shim_gloo_ops_classified COMMAND ${SF_PYTHON} ${SF_SHIM_TESTS}/gloo_ops.py)
  set_tests_properties(shim_gloo_ops_classified PROPERTIES LABELS "shim;torch" TIMEOUT 120
    ENVIRONMENT "${preload};SF_SHIM_REPORT=${reports}/gloo-ops-%r.json")
  # ... and fatal with SF_STRICT=1: the host's backward raises.
  sf_shim_ddp_test(shim_ddp_strict
    ARGS --mode unsynced --windows 3
    ENV "${preload};SF_STRICT=1"
    PASS "RuntimeError: sfsync shim: sf_shim_decide: a window before window 2 was never synchronized and SF_STRICT=1")
endif()

# ---- A C++ host calling NCCL itself, on the NCCL stand-in --------------------
# (the program is defined by nccl_host.cmake)
if(TARGET sfsync_shim_nccl_host)
  if(NOT TARGET sfsync_standin_nccl)
    add_subdirectory(${PROJECT_SOURCE_DIR}/tests/standin ${PROJECT_BINARY_DIR}/tests/standin)
  endif()
  # The stand-ins replace the real CUDA runtime and NCCL through LD_LIBRARY_PATH.
  set(standin "LD_LIBRARY_PATH=${SF_STANDIN_LIB_DIR}")
  foreach(case calls auto none)
    add_test(NAME shim_nccl_standin_${case}
             COMMAND sfsync_shim_nccl_host --mode ${case} --ranks 2 --steps 4 --windows 6)
    set_tests_properties(shim_nccl_standin_${case} PROPERTIES LABELS "shim;nccl" TIMEOUT 120)
  endforeach()
  set_tests_properties(shim_nccl_standin_calls PROPERTIES
    ENVIRONMENT "${standin};LD_PRELOAD=$<TARGET_FILE:sfsync_shim>")
  set_tests_properties(shim_nccl_standin_auto PROPERTIES
    ENVIRONMENT "${standin};LD_PRELOAD=$<TARGET_FILE:sfsync_shim>;SF_ACCUMULATION_STEPS=4")
  # No shim: the same host synchronizes every pass (the baseline and parity).
  set_tests_properties(shim_nccl_standin_none PROPERTIES ENVIRONMENT "${standin}")
endif()

# The benchmark runs (a short smoke run; the numbers are in shim/README.md).
add_test(NAME shim_bench_smoke COMMAND sfsync-shim-bench --iterations 2000 --repeats 1)
set_tests_properties(shim_bench_smoke PROPERTIES LABELS "shim;bench" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "interposed, deferred: float sum in a window.*interposed, deferred: float sum in a window")
add_test(NAME shim_bench_smoke_automatic COMMAND sfsync-shim-bench --automatic --iterations 2000 --repeats 1)
set_tests_properties(shim_bench_smoke_automatic PROPERTIES LABELS "shim;bench" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "\"state\": \"tracking\", \"pass_bytes\": 128, \"calls_per_pass\": 2")
