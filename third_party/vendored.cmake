# SF_VENDORED_DEPS=ON (the portable wheel, scripts/build-wheel.sh): Gloo and
# hiredis from the pinned source archives beside this file, checked against
# their SHA-256, unpacked into the build tree and built as static,
# position-independent libraries with hidden symbols, so that libsfsync.so
# carries them inside and its version script (plugin/sfsync.map) keeps every
# one of their symbols out of the process's global scope: no Gloo a host
# carries (pip's torch has one inside libtorch_cpu.so) can take them, and none
# of theirs can take the host's. The job token's HMAC-SHA256 is sfsync's own
# (plugin/core/sha256.*): nothing of OpenSSL is needed.
#
# Defines the targets `gloo` (as Debian's GlooConfig.cmake does) and
# `sf_hiredis`, and SF_HIREDIS_LIBRARY = sf_hiredis.

set(SF_VENDORED_GLOO gloo-0.0-git20220518.5b14351
    7e843827d196533f0294c7a043b5bf835ca0f49907d94bfa9eca9eb351c1d0a9)
set(SF_VENDORED_HIREDIS hiredis-0.14.1
    2663b2aed9fd430507e30fc5e63274ee40cdd1a296026e22eafd7d99b01c8913)

# sf_unpack(NAME SHA256 ARCHIVE OUT_VAR): the archive's one top folder, unpacked
# once under the build tree (again when the archive's hash changes).
function(sf_unpack name sha archive out)
  file(SHA256 ${archive} got)
  if(NOT got STREQUAL sha)
    message(FATAL_ERROR "third_party: ${archive} has SHA-256 ${got}, not the pinned ${sha}")
  endif()
  set(dest ${CMAKE_BINARY_DIR}/third_party/src/${name})
  set(stamp ${dest}/.sfsync-sha256)
  set(have "")
  if(EXISTS ${stamp})
    file(READ ${stamp} have)
  endif()
  if(NOT have STREQUAL sha)
    file(REMOVE_RECURSE ${dest})
    file(ARCHIVE_EXTRACT INPUT ${archive} DESTINATION ${dest}.tmp)
    file(GLOB top LIST_DIRECTORIES true ${dest}.tmp/*)
    list(LENGTH top n)
    if(NOT n EQUAL 1)
      message(FATAL_ERROR "third_party: ${archive} does not hold exactly one top folder")
    endif()
    file(RENAME ${top} ${dest})
    file(REMOVE_RECURSE ${dest}.tmp)
    file(WRITE ${stamp} ${sha})
  endif()
  set(${out} ${dest} PARENT_SCOPE)
endfunction()

set(sf_here ${CMAKE_CURRENT_LIST_DIR})

# ---- Gloo: its own CMake, TCP transport only (no Redis, ibverbs, libuv, CUDA).
list(GET SF_VENDORED_GLOO 0 gloo_name)
list(GET SF_VENDORED_GLOO 1 gloo_sha)
sf_unpack(${gloo_name} ${gloo_sha} ${sf_here}/gloo/${gloo_name}.tar.xz gloo_src)
foreach(off USE_REDIS USE_IBVERBS USE_NCCL USE_RCCL USE_LIBUV USE_TCP_OPENSSL_LINK
            USE_TCP_OPENSSL_LOAD USE_CUDA BUILD_TEST BUILD_BENCHMARK)
  set(${off} OFF CACHE BOOL "sfsync: vendored Gloo" FORCE)
endforeach()
set(sf_shared_was ${BUILD_SHARED_LIBS})
set(BUILD_SHARED_LIBS OFF)
set(CMAKE_CXX_VISIBILITY_PRESET hidden)
set(CMAKE_VISIBILITY_INLINES_HIDDEN ON)
add_subdirectory(${gloo_src} ${CMAKE_BINARY_DIR}/third_party/gloo EXCLUDE_FROM_ALL SYSTEM)
set(BUILD_SHARED_LIBS ${sf_shared_was})
unset(CMAKE_CXX_VISIBILITY_PRESET)
unset(CMAKE_VISIBILITY_INLINES_HIDDEN)
set_target_properties(gloo PROPERTIES POSITION_INDEPENDENT_CODE ON)
if(SF_UNITY)  # as sfsync's own libraries (SF_UNITY): the wheel's Gloo in batches of 8
  set_target_properties(gloo PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
  # its own ReductionFunction beside gloo::ReductionFunction: ambiguous in a batch
  set_source_files_properties(${gloo_src}/gloo/allreduce_local.cc TARGET_DIRECTORY gloo
                              PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
endif()
# Its sources and the generated gloo/config.h, for sfsync's includes.
target_include_directories(gloo SYSTEM INTERFACE $<BUILD_INTERFACE:${gloo_src}>
                           $<BUILD_INTERFACE:${CMAKE_BINARY_DIR}/third_party/gloo>)
target_link_libraries(gloo INTERFACE Threads::Threads)

# ---- hiredis: the synchronous client (redis:// store), as <hiredis/hiredis.h>.
list(GET SF_VENDORED_HIREDIS 0 hiredis_name)
list(GET SF_VENDORED_HIREDIS 1 hiredis_sha)
sf_unpack(${hiredis_name} ${hiredis_sha} ${sf_here}/hiredis/${hiredis_name}.tar.gz hiredis_src)
file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/third_party/include)
file(CREATE_LINK ${hiredis_src} ${CMAKE_BINARY_DIR}/third_party/include/hiredis SYMBOLIC)
add_library(sf_hiredis STATIC ${hiredis_src}/hiredis.c ${hiredis_src}/net.c
            ${hiredis_src}/read.c ${hiredis_src}/sds.c ${hiredis_src}/alloc.c)
set_target_properties(sf_hiredis PROPERTIES POSITION_INDEPENDENT_CODE ON C_VISIBILITY_PRESET hidden
                      EXCLUDE_FROM_ALL ON)
target_compile_options(sf_hiredis PRIVATE -w)
target_include_directories(sf_hiredis SYSTEM INTERFACE ${CMAKE_BINARY_DIR}/third_party/include)
set(SF_HIREDIS_LIBRARY sf_hiredis)
