# The Python interpreters the Python suites run under, one per supported
# torch line (tests/python, samples/python; tests/python/sfsync/torch/integrations):
#
#   key     interpreter        test names     labels added
#   torch1  SF_PYTHON          as written     (none)        Debian's torch 1.13 (/usr/bin/python3)
#   torch2  SF_PYTHON_TORCH2   name_torch2    torch2        pip's newest torch 2.x, the venv
#                                                           scripts/torch2-venv.sh makes and prints
#
# SF_PYTHON_TORCH2 empty means "not configured": the suites' torch2 halves are
# then one missing-prerequisite test each (a failure with CI=true, a skip
# elsewhere; sf_missing_prerequisite), never left out silently.
#
# sf_python_probe(KEY CODE OUT)
#   OUT is empty if KEY's interpreter runs `CODE` (Python: the imports and
#   asserts the suites need) with exit 0 (and, for torch2, imports a
#   torch >= 2), else the reason it cannot be used (no ';' in it).
#   The torch version found is left in sf_python_torch_<KEY>.
# sf_python_use(KEY)   (a macro)
#   sets sf_py (the interpreter), sf_py_suffix ("" / "_torch2") and
#   sf_py_labels ("" / "torch2") for the registrations that follow.

# No include_guard: SF_PYTHON_KEYS is a variable of the including directory.

set(SF_PYTHON "/usr/bin/python3" CACHE FILEPATH "Python interpreter for the sfsync package and its tests")
set(SF_PYTHON_TORCH2 "" CACHE FILEPATH
    "Python with pip's torch 2.x for the torch2 half of the Python suites (scripts/torch2-venv.sh prints it; empty: not configured)")
set(SF_PYTHON_KEYS torch1 torch2)

macro(sf_python_use key)
  if("${key}" STREQUAL "torch1")
    set(sf_py "${SF_PYTHON}")
    set(sf_py_suffix "")
    set(sf_py_labels "")
  elseif("${key}" STREQUAL "torch2")
    set(sf_py "${SF_PYTHON_TORCH2}")
    set(sf_py_suffix "_torch2")
    set(sf_py_labels "torch2")
  else()
    message(FATAL_ERROR "sf_python_use: unknown interpreter key '${key}' (torch1, torch2)")
  endif()
endmacro()

function(sf_python_probe key code out)
  sf_python_use(${key})
  if(key STREQUAL "torch2" AND NOT sf_py)
    set(${out} "SF_PYTHON_TORCH2 is not set (configure with -DSF_PYTHON_TORCH2=$(bash scripts/torch2-venv.sh | tail -1) as scripts/test.sh does)" PARENT_SCOPE)
    return()
  endif()
  execute_process(
    COMMAND ${sf_py} -c "${code}\nimport torch; print(torch.__version__)"
    RESULT_VARIABLE rc OUTPUT_VARIABLE version ERROR_VARIABLE err
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    string(REGEX REPLACE ".*\n([^\n]+)\n?$" "\\1" err "${err}")
    string(REPLACE ";" "," err "${err}")  # (a reason travels as one list element)
    set(${out} "${sf_py} cannot import torch (with Gloo) and numpy (${rc}: ${err})" PARENT_SCOPE)
    return()
  endif()
  string(REGEX REPLACE ".*\n" "" version "${version}")
  set(sf_python_torch_${key} "${version}" PARENT_SCOPE)
  if(key STREQUAL "torch2" AND NOT version MATCHES "^([2-9]|[1-9][0-9])\\.")
    set(${out} "SF_PYTHON_TORCH2=${sf_py} has torch ${version}, not 2.x" PARENT_SCOPE)
    return()
  endif()
  set(${out} "" PARENT_SCOPE)
endfunction()
