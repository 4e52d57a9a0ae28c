#pragma once
// A TCP socket that listens and never answers: connections queue in its
// backlog (or, once that is full, get no answer at all). The stand-in for a
// wedged or SIGSTOPped peer in sfsync-faults and the store tests.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

namespace sfsync {

struct SilentListener {
  int fd = -1;
  int port = 0;  // the bound port (an ephemeral one)
  explicit SilentListener(const char* ip = "127.0.0.1", int backlog = 128) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    ::inet_pton(AF_INET, ip, &a.sin_addr);
    socklen_t len = sizeof a;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(fd, backlog);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
  }
  // Fills the accept queue with `n` connections that nobody accepts, so
  // that a further connect gets no answer at all (a wedged peer). They are
  // closed with the listener.
  void fillBacklog(int n) {
    for (int i = 0; i < n; ++i) {
      int c = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(uint16_t(port));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      ::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a);
      fillers_.push_back(c);
    }
  }
  ~SilentListener() {
    for (int c : fillers_) ::close(c);
    ::close(fd);
  }
  SilentListener(const SilentListener&) = delete;
  SilentListener& operator=(const SilentListener&) = delete;

 private:
  std::vector<int> fillers_;
};

}  // namespace sfsync
