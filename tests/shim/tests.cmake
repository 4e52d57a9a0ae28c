# The shim's tests, included from shim/CMakeLists.txt (CMAKE_CURRENT_LIST_DIR
# is this directory). Labels: "unit" (decision logic), "shim" (the
# interposer under real hosts).

find_package(Boost 1.74 REQUIRED COMPONENTS unit_test_framework)
include(${PROJECT_SOURCE_DIR}/tests/support/checked_test.cmake)
set(SF_SHIM_TESTS ${CMAKE_CURRENT_LIST_DIR})

# Decision logic (shim/policy/), driven directly: no interposition. The
# window state comes from real contexts of libsfsync.so, through its private
# interface (sf_internal_window_state_v1).
add_executable(sfsync_shim_tests
  ${SF_SHIM_TESTS}/shim_tests_main.cpp
  ${SF_SHIM_TESTS}/reduce_probe_tests.cpp
  ${SF_SHIM_TESTS}/pass_tracker_tests.cpp
  ${SF_SHIM_TESTS}/shim_policy_tests.cpp)
include(${PROJECT_SOURCE_DIR}/tests/support/test_pch.cmake)
sf_test_pch(sfsync_shim_tests ${SF_SHIM_TESTS}/shim_tests_main.cpp)
target_compile_definitions(sfsync_shim_tests PRIVATE BOOST_TEST_DYN_LINK)
target_compile_options(sfsync_shim_tests PRIVATE -Wall -Wextra ${SF_TEST_CODE_OPTIONS})
target_link_libraries(sfsync_shim_tests PRIVATE sfsync_shim_policy sfsync gloo Boost::unit_test_framework)
foreach(suite reduce_probe_tests pass_tracker_tests shim_policy_tests)
  add_test(NAME ${suite} COMMAND sfsync_shim_tests --run_test=${suite})
  set_tests_properties(${suite} PROPERTIES LABELS "unit;shim" TIMEOUT 60)
endforeach()

# The shim exports what it interposes and its report, nothing else.
add_test(NAME shim_exported_symbols
  COMMAND ${PROJECT_SOURCE_DIR}/tests/check_exports.sh $<TARGET_FILE:sfsync_shim>
          -=${SF_SHIM_TESTS}/shim_exported_symbols.txt)
set_tests_properties(shim_exported_symbols PROPERTIES LABELS "unit;shim")
include(${PROJECT_SOURCE_DIR}/tests/support/unit_targets.cmake)
sf_unit_targets(sfsync_shim_tests sfsync_shim)

# ---- PyTorch DDP over Gloo, 2 CPU processes (Debian's python3-torch) -------
# The reference run uses no_sync(); the others run the same script under the
# shim without it, and compare their final weights with the reference's.
set(SF_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with Debian's torch, for the shim's DDP tests")
execute_process(COMMAND ${SF_PYTHON} -c "import torch.distributed as d; assert d.is_gloo_available()"
                RESULT_VARIABLE SF_NO_TORCH OUTPUT_QUIET ERROR_QUIET)
if(SF_NO_TORCH)
  sf_missing_prerequisite(NAME shim_ddp_tests LABELS "shim;torch"
    REASON "${SF_PYTHON} has no torch with Gloo: the shim's DDP tests cannot run")
else()
  set(ddp ${SF_PYTHON} ${SF_SHIM_TESTS}/ddp_accumulation.py --steps 4)
  set(ref ${CMAKE_CURRENT_BINARY_DIR}/shim_ddp_reference.pt)
  set(reports ${CMAKE_CURRENT_BINARY_DIR}/reports)
  set(preload LD_PRELOAD=$<TARGET_FILE:sfsync_shim>)
  # PASS: a regex the output must match, besides exit status EXIT (0 unless
  # given: SF_STRICT=1 runs end in the host's RuntimeError, exit status 1).
  function(sf_shim_ddp_test name)
    cmake_parse_arguments(T "" "EXIT" "ARGS;ENV;PASS" ${ARGN})
    if(NOT DEFINED T_EXIT)
      set(T_EXIT 0)
    endif()
    set(expect)
    if(T_PASS)
      set(expect EXPECT "${T_PASS}")
    endif()
    sf_add_checked_test(NAME ${name} ${expect} EXIT_CODE ${T_EXIT} COMMAND ${ddp} ${T_ARGS})
    # SF_FOLLOW_HOST=0: the shim's own windows (a Python host's go to the
    # in-process layer by default since 0.5: tests/python, follow_host_*).
    set_tests_properties(${name} PROPERTIES LABELS "shim;torch" TIMEOUT 120
      FIXTURES_REQUIRED shim_ddp_reference ENVIRONMENT "SF_FOLLOW_HOST=0;${T_ENV}")
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
  # (a') the same two ctypes calls with the default since 0.5 (SF_FOLLOW_HOST
  # unset: the shim hands a Python host to the in-process layer, which reads
  # the default context's windows): local from window 1, the reference's weights.
  sf_shim_ddp_test(shim_ddp_explicit_windows_in_process
    ARGS --mode calls --reference ${ref} --check-grads --local-from 1
    ENV "${preload};SF_FOLLOW_HOST=1")
  # (b) the script untouched, SF_ACCUMULATION_STEPS=4: passes counted by the shim.
  sf_shim_ddp_test(shim_ddp_automatic_windows
    ARGS --mode plain --reference ${ref} --check-grads --local-from 6
         --report ${reports}/automatic-%r.json --expect auto
    ENV "${preload};SF_ACCUMULATION_STEPS=4;SF_SHIM_REPORT=${reports}/automatic-%r.json;SF_DEBUG=INFO"
    # The automatic mode says at INFO that it cannot see weights.
    PASS "INFO shim SF_ACCUMULATION_STEPS=4: automatic windows of 4 backward passes.*verify_every=K.*\nOK\n")
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
  # A host that already synchronizes once per optimizer step (a correct
  # no_sync()) run with SF_ACCUMULATION_STEPS=4: every pass the shim counts is
  # a real synchronization, pass 6 (the host's window 6) is deferred. The
  # foreign all-reduce before window 7 loses the track: said at that call,
  # naming the window (it had said "correct, not faster"); SF_STRICT=1 fails it.
  set(nosync_said "WARN shim SF_ACCUMULATION_STEPS=4: cannot tell where backward passes start \\(pass 7: an all-reduce of 160000 bytes[^\n]*window 2 \\(backward passes 5-8 as the shim counts them\\) had 2 gradient all-reduces [^\n]*not averaged across the ranks")
  sf_shim_ddp_test(shim_ddp_nosync_host_automatic_said
    ARGS --mode nosync --windows 7 --foreign-at 7
    ENV "${preload};SF_ACCUMULATION_STEPS=4"
    PASS "${nosync_said}")
  sf_shim_ddp_test(shim_ddp_nosync_host_automatic_strict
    ARGS --mode nosync --windows 7 --foreign-at 7
    ENV "${preload};SF_ACCUMULATION_STEPS=4;SF_STRICT=1" EXIT 1
    PASS "RuntimeError: sfsync shim: SF_ACCUMULATION_STEPS=4: cannot tell where backward passes start[^\n]*window 2 \\(backward passes 5-8")
  # Issue 9: a window around each non-final micro-batch, the last one
  # synchronized, is legal: no message (today: "window K ended with ... the
  # optimizer stepped on local gradients" for 2 of every 3 windows).
  sf_shim_ddp_test(shim_ddp_per_microbatch_windows
    ARGS --mode permicro --reference ${ref} --check-grads --local-from 1
         --report ${reports}/permicro-%r.json --expect permicro
    ENV "${preload};SF_SHIM_REPORT=${reports}/permicro-%r.json")
  set_tests_properties(shim_ddp_per_microbatch_windows PROPERTIES
    FAIL_REGULAR_EXPRESSION "WARN|ended with|stepped on local")
  # Windows 1-2 synchronized, then the last micro-batch stays inside the
  # window: said at that pass (between the host's markers in SF_DEBUG_FILE),
  # and the window still open at exit.
  sf_shim_ddp_test(shim_ddp_unsynchronized_window
    ARGS --mode unsynced --unsynced-from 3 --windows 4 --report ${reports}/unsynced-%r.json
         --expect unsynced --unsynchronized 3 --mark --log-dir ${reports}/unsynced-log
         --order "host backward window 3 micro-batch 3<WARN shim window 3 has deferred 7 gradient all-reduces<host backward done window 3 micro-batch 3"
    ENV "${preload};SF_SHIM_REPORT=${reports}/unsynced-%r.json;SF_DEBUG=INFO;SF_DEBUG_FILE=${reports}/unsynced-log/%p.log"
    PASS "for host backward window 3 micro-batch 3<.*\nOK\n")
  # A forgotten sf_end_accumulation (window 2): the window grows past window
  # 1 at its last pass, and the next sf_begin_accumulation is refused and
  # said at that call, before the next pass.
  sf_shim_ddp_test(shim_ddp_forgotten_end
    ARGS --mode forgot --forgot-at 2 --windows 3 --mark --log-dir ${reports}/forgot-log
         --order "host backward window 2 micro-batch 3<WARN shim window 2 has deferred<host backward done window 2 micro-batch 3"
         --order "host begin window 3<WARN window sf_begin_accumulation inside window 2 refused<host backward window 3 micro-batch 0"
    ENV "${preload};SF_DEBUG=INFO;SF_DEBUG_FILE=${reports}/forgot-log/%p.log"
    PASS "for host begin window 3<.*\nOK\n")
  # PyTorch's own reduce functions, every dtype x op: only float sums deferred.
  # (A Python host without DistributedDataParallel: the in-process layer follows
# nothing, so the shim's own windows apply, as before 0.5, with no opt-out.)
add_test(NAME shim_gloo_ops_classified COMMAND ${SF_PYTHON} ${SF_SHIM_TESTS}/gloo_ops.py)
  set_tests_properties(shim_gloo_ops_classified PROPERTIES LABELS "shim;torch" TIMEOUT 120
    ENVIRONMENT "${preload};SF_SHIM_REPORT=${reports}/gloo-ops-%r.json")
  # SF_STRICT=1: each misuse fails the interposed call where it is seen; the
  # host's backward raises. A window grown too long (window 2's last pass) ...
  sf_shim_ddp_test(shim_ddp_strict
    ARGS --mode unsynced --unsynced-from 2 --windows 3
    ENV "${preload};SF_STRICT=1" EXIT 1
    PASS "RuntimeError: sfsync shim: window 2 has deferred 7 gradient all-reduces \\([0-9]+ bytes\\) without a synchronization, more than the longest window that did synchronize \\(4792440 bytes\\)")
  # ... and a refused sf_begin_accumulation (window 2's first pass).
  sf_shim_ddp_test(shim_ddp_strict_forgotten_end
    ARGS --mode forgot --forgot-at 1 --windows 3
    ENV "${preload};SF_STRICT=1" EXIT 1
    PASS "WARN window sf_begin_accumulation inside window 1 refused.*RuntimeError: sfsync shim: sf_begin_accumulation was refused inside window 1")
  # DDP and the two ctypes calls without the shim: libsfsync says at the first
  # sf_end_accumulation that these windows affect nothing.
  sf_shim_ddp_test(shim_ddp_without_shim_windows_affect_nothing
    ARGS --mode calls --windows 2
    ENV "LD_LIBRARY_PATH=$<TARGET_FILE_DIR:sfsync>"
    PASS "WARN window window 1 ended, but these windows affect nothing.*\nOK\n")
endif()

# ---- Pip's torch 2.x (Gloo built into libtorch_cpu.so), 2 CPU processes ------
# The shim never reads another Gloo's structures: at the first all-reduce it
# says that this host's Gloo is not the system libgloo.so.0 (WARN, the facts
# at INFO) and passes every one through untouched, so the run is plain DDP
# (every pass synchronized, the no_sync() reference's weights); SF_STRICT=1
# makes it an error. SF_PYTHON_TORCH2: that Python (scripts/torch2-venv.sh).
if(NOT DEFINED SF_PYTHON_TORCH2)
  set(SF_PYTHON_TORCH2 "" CACHE FILEPATH "Python with pip's torch 2.x (its own Gloo), for the torch 2 tests")
endif()
if(NOT SF_PYTHON_TORCH2)
  sf_missing_prerequisite(NAME shim_torch2_ddp_tests LABELS "shim;torch"
    REASON "SF_PYTHON_TORCH2 is not set: the shim's tests under pip's torch 2.x cannot run")
else()
  set(ddp2 ${SF_PYTHON_TORCH2} ${SF_SHIM_TESTS}/ddp_accumulation.py --steps 4)
  set(ref2 ${CMAKE_CURRENT_BINARY_DIR}/shim_torch2_ddp_reference.pt)
  set(reports2 ${CMAKE_CURRENT_BINARY_DIR}/reports-torch2)
  set(preload2 LD_PRELOAD=$<TARGET_FILE:sfsync_shim>)
  # The exact lines (each rank says them once, at its first all-reduce).
  set(torch2_cpu "/[^ ]*/torch/lib/libtorch_cpu\\.so")
  set(torch2_said "this host's Gloo is not the system libgloo\\.so\\.0 the shim was built against: gloo::allreduce called from ${torch2_cpu} is its own \\(a Gloo built into it, as pip's torch builds one into libtorch_cpu\\.so\\)\\. The shim never reads another Gloo's structures: nothing is deferred and windows \\(WINDOWS\\) have no effect on this host's all-reduces\\. Use the in-process integration instead: sfsync\\.torch\\.attach\\(ddp_model\\) or sfsync\\.torch\\.GradientSync\\(model\\) ")
  string(REPLACE "WINDOWS" "SF_ACCUMULATION_STEPS=4 and sf_begin_accumulation" torch2_said_auto "${torch2_said}")
  string(REPLACE "WINDOWS" "SF_ACCUMULATION_STEPS and sf_begin_accumulation" torch2_said_calls "${torch2_said}")
  set(torch2_passes "\\(they pass through untouched; SF_STRICT=1 makes this an error\\)$")
  set(torch2_warn "^sfsync [^ ]+ WARN shim ")
  set(torch2_facts "^sfsync [^ ]+ INFO shim host Gloo: gloo::allreduce statically inside ${torch2_cpu}, not the system libgloo\\.so\\.0 \\(built against Gloo [0-9]+\\.[0-9]+\\.[0-9]+, /[^ ]*libgloo[^ ]*; the system libgloo\\.so\\.0 loaded here is /[^ ]*libgloo\\.so[^ ]*\\)$")
  function(sf_shim_torch2_test name)
    cmake_parse_arguments(T "" "EXIT" "ARGS;ENV;LINES;REJECT" ${ARGN})
    if(NOT DEFINED T_EXIT)
      set(T_EXIT 0)
    endif()
    sf_add_checked_test(NAME ${name} LINES ${T_LINES} REJECT ${T_REJECT} EXIT_CODE ${T_EXIT}
      COMMAND ${ddp2} ${T_ARGS})
    set_tests_properties(${name} PROPERTIES LABELS "shim;torch;torch2" TIMEOUT 180
      FIXTURES_REQUIRED shim_torch2_ddp_reference ENVIRONMENT "SF_FOLLOW_HOST=0;${T_ENV}")
  endfunction()

  add_test(NAME shim_torch2_ddp_reference_no_sync
           COMMAND ${ddp2} --mode nosync --check-grads --save ${ref2})
  set_tests_properties(shim_torch2_ddp_reference_no_sync PROPERTIES
    LABELS "shim;torch;torch2" TIMEOUT 180 FIXTURES_SETUP shim_torch2_ddp_reference)
  # SF_ACCUMULATION_STEPS=4 on the script untouched: plain DDP (every pass
  # synchronized, the reference's weights), the shim's report holds plain
  # DDP's 47 all-reduces (1 bucket, then 2, over 24 passes), all passed, none
  # read; the automatic mode is not announced.
  sf_shim_torch2_test(shim_torch2_foreign_gloo_passthrough
    ARGS --mode plain --reference ${ref2} --check-grads
         --report ${reports2}/passthrough-%p.json --expect foreign
    ENV "${preload2};SF_ACCUMULATION_STEPS=4;SF_DEBUG=INFO;SF_SHIM_REPORT=${reports2}/passthrough-%p.json"
    LINES "${torch2_warn}${torch2_said_auto}${torch2_passes}" "${torch2_facts}" "^OK$"
    REJECT "automatic windows|INFO shim host Gloo: [^\n]*interposed")
  # Said at once: inside the first backward pass (between the host's markers
  # in SF_DEBUG_FILE), not at exit.
  sf_shim_torch2_test(shim_torch2_foreign_gloo_said_at_once
    ARGS --mode plain --windows 2 --mark --log-dir ${reports2}/at-once-log
         --order "host backward window 1 micro-batch 0<WARN shim this host's Gloo is not the system libgloo.so.0<host backward done window 1 micro-batch 0"
    ENV "${preload2};SF_ACCUMULATION_STEPS=4;SF_DEBUG=INFO;SF_DEBUG_FILE=${reports2}/at-once-log/%p.log"
    LINES "^OK$")
  # Explicit windows (the two ctypes calls) change nothing either: every pass
  # synchronized, the reference's weights, said.
  sf_shim_torch2_test(shim_torch2_foreign_gloo_explicit_windows
    ARGS --mode calls --reference ${ref2} --check-grads
    ENV "${preload2}"
    LINES "${torch2_warn}${torch2_said_calls}${torch2_passes}" "^OK$")
  # ... and with the default since 0.5 (SF_FOLLOW_HOST unset: the in-process
  # layer reads the default context's windows), they take effect on pip's
  # torch: local from window 1, the reference's weights.
  sf_shim_torch2_test(shim_torch2_explicit_windows_in_process
    ARGS --mode calls --reference ${ref2} --check-grads --local-from 1
    ENV "${preload2};SF_FOLLOW_HOST=1"
    LINES "^OK$")
  # SF_STRICT=1: the first all-reduce fails with the message; the host's
  # backward raises it, the process exits 1.
  sf_shim_torch2_test(shim_torch2_foreign_gloo_strict
    ARGS --mode plain --windows 2
    ENV "${preload2};SF_ACCUMULATION_STEPS=4;SF_STRICT=1" EXIT 1
    LINES "RuntimeError: sfsync shim: ${torch2_said_auto}\\(SF_STRICT=1: this all-reduce fails\\)$"
          "${torch2_warn}${torch2_said_auto}\\(SF_STRICT=1: this all-reduce fails\\)$")
endif()

# libsfsync's own warnings about windows (no torch: ctypes processes).
add_test(NAME shim_window_warnings
  COMMAND ${SF_PYTHON} ${SF_SHIM_TESTS}/window_warnings.py $<TARGET_FILE:sfsync>
          $<TARGET_FILE:sfsync_shim>)
set_tests_properties(shim_window_warnings PROPERTIES LABELS "shim" TIMEOUT 120)

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
sf_add_checked_test(NAME shim_bench_smoke COMMAND sfsync-shim-bench --iterations 2000 --repeats 1
  EXPECT "interposed, deferred: float sum in a window.*interposed, deferred: float sum in a window")
set_tests_properties(shim_bench_smoke PROPERTIES LABELS "shim;bench" TIMEOUT 60)
sf_add_checked_test(NAME shim_bench_smoke_automatic
  COMMAND sfsync-shim-bench --automatic --iterations 2000 --repeats 1
  EXPECT "\"state\": \"tracking\", \"pass_bytes\": 128, \"calls_per_pass\": 2")
set_tests_properties(shim_bench_smoke_automatic PROPERTIES LABELS "shim;bench" TIMEOUT 60)
