#pragma once
// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read
// it back, close): for MASTER_PORT in the launcher and in tests. -1 on error.
// freeLoopbackPortPair() returns a port p whose successor p + 1 was free on
// every address too (a second store beside MASTER_PORT, as the Python
// samples put torch.distributed on MASTER_PORT + 1): the kernel's pick of p
// says nothing about p + 1, which an outgoing connection may hold.

#include <cstdint>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace sfsync {

// Binds a TCP socket to `port` (0: any) on `addr`; returns the bound port,
// or -1. The socket is closed before returning.
inline int bindAndRelease(uint32_t addr, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(addr);
  a.sin_port = htons(uint16_t(port));
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  return ok ? ntohs(a.sin_port) : -1;
}

inline int freeLoopbackPort() { return bindAndRelease(INADDR_LOOPBACK, 0); }

inline int freeLoopbackPortPair() {
  for (int attempt = 0; attempt < 64; ++attempt) {
    const int p = freeLoopbackPort();
    if (p < 0) return -1;
    if (p < 65535 && bindAndRelease(INADDR_ANY, p + 1) == p + 1) return p;
  }
  return -1;
}

}  // namespace sfsync
