#pragma once
// Turns a rendezvous URL (sf_options::rendezvous) into a Gloo store, and
// decides which local address peers should use to reach this rank.

#include <chrono>
#include <memory>
#include <string>

#include <gloo/rendezvous/store.h>

#include "sfsync.h"

namespace sfsync {

// Every key is prefixed with "sfsync/". While a returned store is held, the
// same rendezvous and rank (and MASTER_ADDR:MASTER_PORT for env://) get the
// same store again in this process. Throws SF_ERR_INVALID_ARGUMENT for
// an unknown scheme, SF_ERR_BACKEND / SF_ERR_TIMEOUT when the store is not
// reachable.
std::shared_ptr<gloo::rendezvous::Store> openStore(const sf_options& opts);

// `inner` with every key under "<prefix>/" (kept alive by the result); a
// wait without a timeout uses `timeout` (Gloo's PrefixStore waits a fixed
// 30 s); StoreHealth is passed through.
std::shared_ptr<gloo::rendezvous::Store> prefixedStore(
    const std::string& prefix, std::shared_ptr<gloo::rendezvous::Store> inner,
    std::chrono::milliseconds timeout);

// SF_GLOO_HOSTNAME if set; 127.0.0.1 for memory:// and a loopback
// MASTER_ADDR; else this machine's host name.
std::string localHostname(const sf_options& opts);

}  // namespace sfsync
