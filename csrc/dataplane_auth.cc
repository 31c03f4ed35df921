// The authenticated hello of the native data plane (dataplane_auth.h).
#include "dataplane_auth.h"

#include <netdb.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "dataplane_io.h"
#include "crypto.h"

namespace bps {
namespace dp {

void random_bytes(std::uint8_t* out, std::size_t n) {
  while (n > 0) {
    const ssize_t k = getrandom(out, n, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("data plane: getrandom failed: ") +
                               std::strerror(errno));
    }
    out += k;
    n -= static_cast<std::size_t>(k);
  }
}

void hello_mac(const std::string& key, const char* who, std::uint32_t job, std::int32_t rank,
               std::uint64_t stream, const std::uint8_t* first, const std::uint8_t* second,
               std::uint8_t out[32]) {
  std::string msg(who);
  msg.append(reinterpret_cast<const char*>(&job), sizeof job);
  msg.append(reinterpret_cast<const char*>(&rank), sizeof rank);
  msg.append(reinterpret_cast<const char*>(&stream), sizeof stream);
  msg.append(reinterpret_cast<const char*>(first), kNonce);
  msg.append(reinterpret_cast<const char*>(second), kNonce);
  hmac_sha256(key.data(), key.size(), msg.data(), msg.size(), out);
}

namespace {

bool io_full(int fd, char* p, std::size_t n, bool out, double deadline, std::string* err) {
  while (n > 0) {
    const double left = deadline - monotonic_now();
    if (left <= 0) {
      *err = "timed out";
      return false;
    }
    pollfd pfd{fd, static_cast<short>(out ? POLLOUT : POLLIN), 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(left * 1000) + 1);
    if (r < 0 && errno != EINTR) {
      *err = std::strerror(errno);
      return false;
    }
    if (r <= 0) continue;
    const ssize_t k = out ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
    } else if (k == 0) {
      *err = "the server closed the connection";
      return false;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      *err = std::strerror(errno);
      return false;
    }
  }
  return true;
}

// The rest of an authenticated hello, after the server's HELLO header `r`: its nonce and
// proof checked, the worker's proof sent. False and *err when it fails.
bool prove_to_server(const IoFull& io, const Header& r, int rank, std::uint32_t job, std::uint64_t sid,
                     const std::uint8_t* nonce, double deadline, const std::string& key,
                     std::string* err) {
  if (!(r.flags & kFlagAuth) || r.nbytes != 64) {
    *err = "the server does not authenticate its streams: give every node the same "
           "BYTEPS_AUTH_SECRET";
    return false;
  }
  std::uint8_t got[64], want[32], proof[32];
  if (!io(reinterpret_cast<char*>(got), 64, false, deadline, err)) return false;
  hello_mac(key, "bpsl-srv", job, rank, sid, nonce, got, want);
  if (!equal_ct(want, got + kNonce, 32)) {
    *err = "authentication failed: the server's proof does not match this job's secret "
           "(BYTEPS_AUTH_SECRET differs between nodes)";
    return false;
  }
  hello_mac(key, "bpsl-cli", job, rank, sid, got, nonce, proof);
  Header a = make_header(kHello, kRoleWorker, rank, kFlagAuth, job, sid, 0, 0, 0, 32);
  return io(reinterpret_cast<char*>(&a), sizeof a, true, deadline, err) &&
         io(reinterpret_cast<char*>(proof), 32, true, deadline, err);
}

}  // namespace

bool say_hello(const IoFull& io, int rank, std::uint32_t job, int stream, double deadline,
               const std::string& key, std::string* err, bool table) {
  const bool auth = !key.empty();
  const std::uint64_t sid = static_cast<std::uint64_t>(stream);
  const std::uint32_t flags = (auth ? kFlagAuth : 0u) | (table ? kFlagTable : 0u);
  Header h = make_header(kHello, kRoleWorker, rank, flags, job, sid, 0, 0, 0, auth ? kNonce : 0);
  std::uint8_t nonce[kNonce];
  if (auth) random_bytes(nonce, kNonce);
  Header r{};
  if (!io(reinterpret_cast<char*>(&h), sizeof h, true, deadline, err) ||
      (auth && !io(reinterpret_cast<char*>(nonce), kNonce, true, deadline, err)) ||
      !io(reinterpret_cast<char*>(&r), sizeof r, false, deadline, err)) {
    *err = "no hello from the server (" + *err + "): is it a byteps_like server of this job" +
           (auth ? std::string(" (and does it have the job's secret)?")
                 : std::string("? A server with a secret closes streams that do not "
                               "authenticate: give every node the same BYTEPS_AUTH_SECRET"));
    return false;
  }
  if (std::memcmp(r.magic, kMagic, 4) != 0 || r.version != kVersion || r.type != kHello ||
      r.job != job || r.role != kRoleServer) {
    *err = "the peer's hello is not that of a byteps_like server of this job";
    return false;
  }
  if (auth && !prove_to_server(io, r, rank, job, sid, nonce, deadline, key, err)) {
    return false;
  }
  return true;
}

int open_stream(const std::string& host, int port, int rank, std::uint32_t job, int stream,
                double deadline, const std::string& key, std::string* err, bool table) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string ps = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), ps.c_str(), &hints, &res);
  if (rc != 0) {
    *err = std::string("cannot resolve ") + host + ": " + gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  while (fd < 0 && monotonic_now() < deadline) {
    for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
      const int s = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
      if (s < 0) continue;
      if (::connect(s, a->ai_addr, a->ai_addrlen) == 0) {
        fd = s;
      } else {
        *err = std::strerror(errno);
        ::close(s);
      }
    }
    if (fd < 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  freeaddrinfo(res);
  if (fd < 0) return -1;
  set_nodelay(fd);
  set_nonblocking(fd);
  const IoFull io = [fd](char* p, std::size_t n, bool out, double dl, std::string* e) {
    return io_full(fd, p, n, out, dl, e);
  };
  if (!say_hello(io, rank, job, stream, deadline, key, err, table)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace dp
}  // namespace bps
