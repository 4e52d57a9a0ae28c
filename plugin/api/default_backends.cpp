#include "plugin/api/default_backends.h"

#include "plugin/backend/gloo_backend.h"
#include "plugin/backend/local_backend.h"
#include "plugin/backend/nccl/nccl_backend.h"

namespace sfsync {

BackendMaker defaultBackends() {
  return [](sf_device device, const sf_options& opts,
            const std::shared_ptr<Rendezvous>& rendezvous) -> std::unique_ptr<Backend> {
    if (device == SF_DEVICE_CUDA) return std::make_unique<NcclBackend>(opts, rendezvous);
    if (opts.world_size == 1) return std::make_unique<LocalBackend>();
    return std::make_unique<GlooBackend>(opts, rendezvous);
  };
}

}  // namespace sfsync
