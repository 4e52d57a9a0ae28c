# sf_cuda_program(TARGET SOURCE): a CUDA program linked with sfsync, built
# wherever the CUDA toolkit is (kernels for sm_90, Hopper; no GPU needed to
# build), on the shared CUDA runtime as libsfsync_nccl.so uses (one runtime
# per process), after the NCCL module when there is one. A macro, because
# enable_language must run in the caller's directory scope. Callers skip
# sanitizer builds first (nvcc takes no -fsanitize).
macro(sf_cuda_program target source)
  if(NOT CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_COMPILER ${CUDAToolkit_NVCC_EXECUTABLE})
  endif()
  enable_language(CUDA)
  add_executable(${target} ${source})
  set_target_properties(${target} PROPERTIES
    CUDA_ARCHITECTURES 90
    CUDA_STANDARD 17
    CUDA_RUNTIME_LIBRARY Shared)
  target_link_libraries(${target} PRIVATE sfsync)
  if(TARGET sfsync_nccl)
    add_dependencies(${target} sfsync_nccl)
  endif()
endmacro()
