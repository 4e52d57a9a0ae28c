#pragma once
// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read
// it back, close): for MASTER_PORT in the launcher and in tests. -1 on error.

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace sfsync {

inline int freeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  return ok ? ntohs(a.sin_port) : -1;
}

}  // namespace sfsync
