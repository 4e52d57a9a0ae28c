# Sourced by scripts/demo.sh and scripts/test.sh: the compiler launcher both
# builds use. ccache (installed by install-deps.sh) makes rebuilds of an
# unchanged tree fast; paths are hashed relative to the checkout, so clones
# share hits. Sets `launcher` (cmake arguments).
launcher=()
if command -v ccache > /dev/null; then
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
# The normal tree's configuration: the demo builds in it what it runs, and
# the test command's build of the same tree then compiles only the rest.
# RelWithDebInfo with line tables only (SF_LINE_TABLES: -g1, a backtrace
# still names file:line), which GCC compiles ~30 % faster than -g.
normal_tree=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DSF_LINE_TABLES=ON)
