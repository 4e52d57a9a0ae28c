#pragma once
// Connects a Gloo full mesh through a rendezvous store within one deadline.
//
// Gloo 0.5's own Context::connectFullMesh waits up to 5 x timeout for a pair
// whose peer never connects: tcp::Pair::waitUntil (pair.h) uses
// `timeout_ * 5` for the initial connect, and on the listening (passive)
// side nothing else ends the wait; on the connecting side a peer that never
// answers the SYN waits as long. Here the same exchange (each rank writes
// the key "<rank>" with its pairs' addresses, reads the others' and
// connects pair by pair) runs under a watchdog that closes every pair at
// the deadline, which wakes Gloo's wait; the failure is SF_ERR_TIMEOUT
// naming the rank and address waited for. The pairs keep `timeout` for
// everything after the connect. Not responsible for the collectives.

#include <chrono>
#include <memory>

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}
namespace transport {
class Device;
}
}  // namespace gloo

namespace sfsync {

// Throws sfsync::Error: SF_ERR_TIMEOUT (a key or a peer did not come within
// `timeout`), SF_ERR_BACKEND (a peer refused or reset the connection),
// SF_ERR_MISMATCH (the store reports two claimants).
std::shared_ptr<gloo::Context> connectGlooMesh(gloo::rendezvous::Store& store,
                                               const std::shared_ptr<gloo::transport::Device>& device,
                                               int rank, int size, std::chrono::milliseconds timeout);

}  // namespace sfsync
