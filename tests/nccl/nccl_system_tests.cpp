// What a process sees of the NCCL backend without the stand-ins: on this
// machine's real CUDA libraries (no GPU: cudaGetDeviceCount fails), with the
// module missing, and with no CUDA library on the loader's path at all; the
// module's choice of CUDA runtime and NCCL (the host's loaded copies, the
// SF_CUDART_LIBRARY / SF_NCCL_LIBRARY overrides). And that Gloo alone never
// loads CUDA. CTest runs each case in its own process:
// what is loaded is the point.

#include <dlfcn.h>

#include <boost/test/unit_test.hpp>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "sfsync.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

std::string loadedLibraries() {
  std::ifstream maps("/proc/self/maps");
  std::stringstream s;
  s << maps.rdbuf();
  return s.str();
}

bool loaded(const std::string& name) { return loadedLibraries().find(name) != std::string::npos; }

// The mapped files whose path contains `name`, one each.
std::string mappedFiles(const std::string& name) {
  std::istringstream maps(loadedLibraries());
  std::string line, files;
  while (std::getline(maps, line)) {
    const size_t slash = line.find('/');
    if (slash == std::string::npos || line.find(name) == std::string::npos) continue;
    const std::string file = line.substr(slash);
    if (files.find(file + "\n") == std::string::npos) files += file + "\n";
  }
  return files;
}

// Every mapped libcudart / libnccl is the stand-ins' (none from the system).
bool onlyStandins() {
  std::istringstream files(mappedFiles("libcudart") + mappedFiles("libnccl"));
  std::string file;
  bool any = false;
  while (std::getline(files, file)) {
    if (file.rfind(SF_STANDIN_LIB_DIR "/", 0) != 0) return false;
    any = true;
  }
  return any;
}

// Two thread ranks reduce host gradients with Gloo (backend auto).
std::string glooSync() {
  const std::string rdv = "memory://" + uniqueName("gloo-only");
  auto errors = runThreadRanks<std::string>(2, [&](int r) -> std::string {
    ContextHandle h;
    sf_options o = rankOptions(r, 2, rdv, 20000);
    if (sf_create(&o, &h.ctx) != SF_OK) return sf_last_error();
    int64_t id;
    if (sf_add_gradient(h.ctx, 1000, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "w", &id) != SF_OK) return sf_last_error();
    void* p;
    sf_gradient_data(h.ctx, id, &p);
    for (int i = 0; i < 1000; ++i) static_cast<float*>(p)[i] = float(r * 2 + i);
    for (int w = 0; w < 2; ++w) {
      if (sf_begin_accumulation(h.ctx) != SF_OK || sf_end_accumulation(h.ctx) != SF_OK ||
          sf_synchronize(h.ctx) != SF_OK) {
        return sf_last_error();
      }
    }
    for (int i = 0; i < 1000; ++i) {
      if (static_cast<float*>(p)[i] != float(1 + i)) return "wrong value at " + std::to_string(i);
    }
    if (statsOf(h.ctx).collectives_issued != 2) return "wrong collective count";
    return "";
  });
  return errors[0] + errors[1];
}

const char* const kCudaLibraries[] = {"libcudart", "libnccl", "libsfsync_nccl"};

}  // namespace

BOOST_AUTO_TEST_SUITE(nccl_system_tests)

BOOST_AUTO_TEST_CASE(gloo_alone_loads_no_cuda) {
  BOOST_TEST(glooSync() == "");
  for (const char* lib : kCudaLibraries) BOOST_TEST(!loaded(lib), lib << " was loaded by a Gloo-only process");
}

BOOST_AUTO_TEST_CASE(real_cuda_without_gpu_is_unsupported) {
  // The module loads the real CUDA runtime and NCCL (ld.so.cache); here no
  // GPU is usable (cudaGetDeviceCount returns 35, insufficient driver).
  const sf_status st = sf_backend_available(SF_BACKEND_NCCL);
  if (st == SF_OK) {
    BOOST_TEST_MESSAGE("a GPU is usable here: the no-GPU path is not what this machine shows");
    return;
  }
  const std::string m = sf_last_error();
  BOOST_TEST(st == SF_ERR_UNSUPPORTED, m);
  BOOST_TEST(m.find("sf_backend_available: nccl: ") == 0, m);
  BOOST_TEST((m.find("cudaGetDeviceCount failed with cuda") != std::string::npos ||
              m.find("no GPU is visible") != std::string::npos),
             m);
  BOOST_TEST_MESSAGE("the message: " << m);
  BOOST_TEST(loaded("libsfsync_nccl.so"));
  BOOST_TEST(loaded("libcudart.so.13"));

  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t id;
  BOOST_TEST(sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &id) == SF_ERR_UNSUPPORTED);
  BOOST_TEST(std::string(sf_last_error()).find("cudaGetDeviceCount") != std::string::npos, sf_last_error());
  BOOST_TEST(sf_register_gradient(h.ctx, &id, 1, SF_DTYPE_FLOAT64, SF_DEVICE_CUDA, "w", &id) == SF_ERR_UNSUPPORTED);
  // Nothing was registered; host gradients in the same context work.
  BOOST_TEST(sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "h", &id) == SF_OK);
  BOOST_TEST(id == 0);
  BOOST_TEST(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
  BOOST_TEST(glooSync() == "");
}

BOOST_AUTO_TEST_CASE(missing_module_is_unsupported) {
  ::setenv("SF_NCCL_MODULE", "/nonexistent/libsfsync_nccl.so", 1);
  BOOST_TEST(sf_backend_available(SF_BACKEND_NCCL) == SF_ERR_UNSUPPORTED);
  std::string m = sf_last_error();
  BOOST_TEST(m.find("/nonexistent/libsfsync_nccl.so") != std::string::npos, m);
  BOOST_TEST(m.find("SF_NCCL_MODULE") != std::string::npos, m);
  BOOST_TEST(m.find("libcudart.so.13") != std::string::npos, m);  // says what it needs
  BOOST_TEST(!loaded("libcudart"));
  // The override names the module to load.
  ::setenv("SF_NCCL_MODULE", SF_NCCL_MODULE_FILE, 1);
  const sf_status st = sf_backend_available(SF_BACKEND_NCCL);
  m = sf_last_error();
  BOOST_TEST((st == SF_OK || m.find("cudaGetDeviceCount") != std::string::npos ||
              m.find("no GPU") != std::string::npos),
             m);
  BOOST_TEST(loaded("libsfsync_nccl.so"));
  ::unsetenv("SF_NCCL_MODULE");
}

// The module links neither library: it takes the copies the host already
// loaded (as PyTorch does from its nvidia-* wheels), here the stand-ins,
// loaded by path from a directory not on the loader's path, although the
// real ones (ld.so.cache) would be found by soname. The stand-ins have GPUs.
BOOST_AUTO_TEST_CASE(prefers_loaded_libraries) {
  void* cudart = ::dlopen(SF_STANDIN_LIB_DIR "/libcudart.so.13", RTLD_NOW | RTLD_LOCAL);
  BOOST_TEST_REQUIRE(cudart != nullptr, ::dlerror());
  void* nccl = ::dlopen(SF_STANDIN_LIB_DIR "/libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  BOOST_TEST_REQUIRE(nccl != nullptr, ::dlerror());
  BOOST_TEST(sf_backend_available(SF_BACKEND_NCCL) == SF_OK, sf_last_error());
  BOOST_TEST(loaded("libsfsync_nccl.so"));
  BOOST_TEST(onlyStandins(), mappedFiles("libcudart") + mappedFiles("libnccl"));
}

// SF_CUDART_LIBRARY / SF_NCCL_LIBRARY name the files to load.
BOOST_AUTO_TEST_CASE(library_overrides) {
  ::setenv("SF_CUDART_LIBRARY", SF_STANDIN_LIB_DIR "/libcudart.so.13", 1);
  ::setenv("SF_NCCL_LIBRARY", SF_STANDIN_LIB_DIR "/libnccl.so.2", 1);
  BOOST_TEST(sf_backend_available(SF_BACKEND_NCCL) == SF_OK, sf_last_error());
  BOOST_TEST(onlyStandins(), mappedFiles("libcudart") + mappedFiles("libnccl"));
  ::unsetenv("SF_CUDART_LIBRARY");
  ::unsetenv("SF_NCCL_LIBRARY");
}

// A library that cannot be loaded, or lacks a function, is the backend's
// "unavailable" with the reason; the next try (fixed environment) works.
BOOST_AUTO_TEST_CASE(unloadable_or_incomplete_library_is_unsupported) {
  ::setenv("SF_CUDART_LIBRARY", "/nonexistent/libcudart.so.13", 1);
  BOOST_TEST(sf_backend_available(SF_BACKEND_NCCL) == SF_ERR_UNSUPPORTED);
  std::string m = sf_last_error();
  BOOST_TEST(m.find("/nonexistent/libcudart.so.13") != std::string::npos, m);
  BOOST_TEST(m.find("SF_CUDART_LIBRARY") != std::string::npos, m);
  BOOST_TEST(m.find("cannot load its module") != std::string::npos, m);  // what the doctor reads

  // The CUDA runtime stand-in posing as NCCL: the first NCCL function of
  // the list is missing; the message names it and the file.
  ::setenv("SF_CUDART_LIBRARY", SF_STANDIN_LIB_DIR "/libcudart.so.13", 1);
  ::setenv("SF_NCCL_LIBRARY", SF_STANDIN_LIB_DIR "/libcudart.so.13", 1);
  BOOST_TEST(sf_backend_available(SF_BACKEND_NCCL) == SF_ERR_UNSUPPORTED);
  m = sf_last_error();
  BOOST_TEST(m.find("symbol ncclAllGather not found in " SF_STANDIN_LIB_DIR "/libcudart.so.13") !=
                 std::string::npos,
             m);
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t id;
  BOOST_TEST(sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &id) == SF_ERR_UNSUPPORTED);
  BOOST_TEST(std::string(sf_last_error()).find("ncclAllGather") != std::string::npos, sf_last_error());

  ::setenv("SF_NCCL_LIBRARY", SF_STANDIN_LIB_DIR "/libnccl.so.2", 1);
  BOOST_TEST(sf_backend_available(SF_BACKEND_NCCL) == SF_OK, sf_last_error());
  ::unsetenv("SF_CUDART_LIBRARY");
  ::unsetenv("SF_NCCL_LIBRARY");
}

BOOST_AUTO_TEST_CASE(without_cuda_libraries) {
  // Run by without_cuda.sh: the CUDA libraries are not on the loader's path.
  void* probe = ::dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD);
  BOOST_TEST_REQUIRE(!probe, "libcudart.so.13 is already loaded");
  probe = ::dlopen("libnccl.so.2", RTLD_NOW);
  if (probe) {
    ::dlclose(probe);
    BOOST_FAIL("libnccl.so.2 can be loaded: run this case through without_cuda.sh");
  }
  BOOST_TEST(glooSync() == "");
  for (const char* lib : kCudaLibraries) BOOST_TEST(!loaded(lib), lib);

  BOOST_TEST(sf_backend_available(SF_BACKEND_NCCL) == SF_ERR_UNSUPPORTED);
  const std::string m = sf_last_error();
  BOOST_TEST_MESSAGE("the message: " << m);
  BOOST_TEST((m.find("libcudart.so.13: cannot open shared object file") != std::string::npos ||
              m.find("libnccl.so.2: cannot open shared object file") != std::string::npos),
             m);
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t id;
  BOOST_TEST(sf_add_gradient(h.ctx, 16, SF_DTYPE_BFLOAT16, SF_DEVICE_CUDA, "w", &id) == SF_ERR_UNSUPPORTED);
  BOOST_TEST(std::string(sf_last_error()).find("cannot open shared object file") != std::string::npos,
             sf_last_error());
  // Still fine afterwards.
  BOOST_TEST(glooSync() == "");
}

BOOST_AUTO_TEST_SUITE_END()
