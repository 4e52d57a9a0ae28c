# The shim's NCCL host program (nccl_host.cpp), included from
# shim/CMakeLists.txt whether or not the tests are built: tests/gpu/run.sh
# builds it (with tests/shim/gpu_check.sh) in a build without Boost tests.
# Linked against the real CUDA runtime and NCCL, as any host; the stand-ins
# replace them through LD_LIBRARY_PATH in the CTest runs.

find_package(CUDAToolkit QUIET)
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
find_library(NCCL_LIBRARY NAMES nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
if(NOT CUDAToolkit_FOUND OR NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
  include(${PROJECT_SOURCE_DIR}/tests/support/missing_suite.cmake)
  sf_missing_suite(NAME shim_nccl_standin LABELS "shim;nccl"
    REASON "no CUDA toolkit with NCCL headers: no NCCL host program for the shim's NCCL tests"
    NOTE "shim: no CUDA toolkit with NCCL: no NCCL host program")
  return()
endif()
add_executable(sfsync_shim_nccl_host ${CMAKE_CURRENT_LIST_DIR}/nccl_host.cpp)
target_include_directories(sfsync_shim_nccl_host SYSTEM PRIVATE ${NCCL_INCLUDE_DIR})
target_compile_options(sfsync_shim_nccl_host PRIVATE -Wall -Wextra)
target_link_libraries(sfsync_shim_nccl_host PRIVATE sfsync CUDA::cudart ${NCCL_LIBRARY} ${CMAKE_DL_LIBS})
if(NOT SF_BUILD_TESTS)
  set_target_properties(sfsync_shim_nccl_host PROPERTIES EXCLUDE_FROM_ALL ON)
endif()
