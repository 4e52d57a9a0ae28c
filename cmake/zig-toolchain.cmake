# The portable wheel's toolchain (scripts/build-wheel.sh): Zig's clang,
# libc++ and glibc stubs (`zig cc` / `zig c++` from PyPI's ziglang), targeting
# an old glibc, so that every binary binds only glibc symbol versions up to
# SF_ZIG_GLIBC and needs no libstdc++ (libc++ is linked in, hidden).
#
#   cmake -DCMAKE_TOOLCHAIN_FILE=cmake/zig-toolchain.cmake -DSF_ZIG=/path/to/zig
#         [-DSF_ZIG_GLIBC=2.28] -DSF_VENDORED_DEPS=ON ...
set(SF_ZIG "${SF_ZIG}" CACHE FILEPATH "the zig executable (ziglang's zig)")
set(SF_ZIG_GLIBC "2.28" CACHE STRING "the glibc version to target")
if(NOT SF_ZIG OR NOT EXISTS "${SF_ZIG}")
  message(FATAL_ERROR "zig-toolchain.cmake: SF_ZIG='${SF_ZIG}' is not the zig executable "
                      "(pip install ziglang; then SF_ZIG=<site-packages>/ziglang/zig)")
endif()
if(NOT SF_ZIG_GLIBC MATCHES "^2\\.[0-9]+$")
  message(FATAL_ERROR "zig-toolchain.cmake: SF_ZIG_GLIBC='${SF_ZIG_GLIBC}' is not 2.N")
endif()
# CMake wants one executable per tool: small wrappers in the build tree.
set(sf_wrap "${CMAKE_BINARY_DIR}/zig-wrappers")
file(MAKE_DIRECTORY "${sf_wrap}")
foreach(pair "cc;cc -target x86_64-linux-gnu.${SF_ZIG_GLIBC}"
             "c++;c++ -target x86_64-linux-gnu.${SF_ZIG_GLIBC}" "ar;ar" "ranlib;ranlib")
  list(GET pair 0 name)
  list(GET pair 1 args)
  # Zig builds libc++, libc++abi, libunwind and compiler_rt into its cache
  # once per optimize mode and strip setting, for the first link that needs
  # them. CMake's compiler identification links CMakeC(XX)CompilerId.c(pp)
  # with no flags: Zig made a Debug set for it (with UBSan's runtime) beside
  # the Release set the libraries link (measured: ~65 of the cold wheel
  # build's CPU-s). It gets the Release link's flags instead, and so do
  # CMake's other checks (CMAKE_EXE_LINKER_FLAGS_INIT below).
  set(id "")
  if(name STREQUAL "cc" OR name STREQUAL "c++")
    set(id "case \"$*\" in *CMakeCCompilerId.c*|*CMakeCXXCompilerId.cpp*) set -- -O3 -s \"$@\" ;; esac\n")
  endif()
  file(WRITE "${sf_wrap}/${name}" "#!/bin/sh\n${id}exec \"${SF_ZIG}\" ${args} \"$@\"\n")
  file(CHMOD "${sf_wrap}/${name}" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE
       GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
endforeach()
set(CMAKE_C_COMPILER "${sf_wrap}/cc")
set(CMAKE_CXX_COMPILER "${sf_wrap}/c++")
set(CMAKE_AR "${sf_wrap}/ar" CACHE FILEPATH "" FORCE)
set(CMAKE_RANLIB "${sf_wrap}/ranlib" CACHE FILEPATH "" FORCE)
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES SF_ZIG SF_ZIG_GLIBC)
# CMake's WHOLE_ARCHIVE wraps the archives in --push-state/--pop-state, which
# Zig's linker rejects: the plain pair instead (per language: the platform
# files set only the generic variable).
foreach(lang C CXX)
  set(CMAKE_${lang}_LINK_LIBRARY_USING_WHOLE_ARCHIVE
      "LINKER:--whole-archive" "<LINK_ITEM>" "LINKER:--no-whole-archive")
  set(CMAKE_${lang}_LINK_LIBRARY_USING_WHOLE_ARCHIVE_SUPPORTED TRUE)
endforeach()
# Zig emits DWARF even without -g: the wheel's libraries carry none (19.5 MB
# of libsfsync.so.1 was debug info), as a manylinux wheel's usually do not.
# Zig's clang emits DWARF unless told not to: -g0 (a configuration's own -g
# comes later and wins) compiles ~20 % faster, and the libraries are
# stripped at link (-s) either way.
set(CMAKE_C_FLAGS_INIT "-g0")
set(CMAKE_CXX_FLAGS_INIT "-g0")
set(CMAKE_SHARED_LINKER_FLAGS_INIT "-s")
set(CMAKE_MODULE_LINKER_FLAGS_INIT "-s")
set(CMAKE_EXE_LINKER_FLAGS_INIT "-s")  # CMake's checks: the libraries' Zig runtime set (above)
