#include "plugin/launch/meeting_point.h"

#include <cstdlib>
#include <cstring>

#include "plugin/core/deadline.h"
#include "plugin/core/env.h"
#include "plugin/core/error.h"

namespace sfsync {

namespace {

int parsePort(const char* text, const std::string& what) {
  char* end = nullptr;
  const long port = std::strtol(text, &end, 10);
  if (end == text || *end || port <= 0 || port > 65535) {
    fail(SF_ERR_INVALID_ARGUMENT, what + " is not a port in [1, 65535]");
  }
  return int(port);
}

}  // namespace

bool isTcpRendezvous(const std::string& url) {
  return url == "env://" || url == "mpi://" || (url.compare(0, 6, "tcp://") == 0 && url.size() > 6);
}

MeetingAddress meetingAddress(const sf_options& o) {
  const std::string url = o.rendezvous;
  MeetingAddress a;
  if (url == "mpi://") return mpiBootstrap(o.rank, o.world_size, timeoutDuration(o.timeout_ms));
  if (url.compare(0, 6, "tcp://") == 0) {
    const std::string rest = url.substr(6);
    const size_t colon = rest.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      fail(SF_ERR_INVALID_ARGUMENT, "rendezvous = '" + url + "' is not tcp://host:port");
    }
    a.host = rest.substr(0, colon);
    if (a.host.size() > 2 && a.host.front() == '[' && a.host.back() == ']') {
      a.host = a.host.substr(1, a.host.size() - 2);  // tcp://[::1]:port
    }
    a.port = parsePort(rest.c_str() + colon + 1, "rendezvous = '" + url + "': the port");
    return a;
  }
  const char* addr = envValue("MASTER_ADDR");
  a.host = addr ? addr : "127.0.0.1";
  const char* port = envValue("MASTER_PORT");
  a.port = port ? parsePort(port, std::string("environment variable MASTER_PORT='") + port + "'")
                           : 29500;  // torchrun's default
  return a;
}

}  // namespace sfsync
