// The native data plane's server (dataplane_server_impl.h): its life (listen, start, close) and
// the admission of its streams: accepted sockets and UCX connection requests take a connection
// slot (streams without hello at most a quarter of them, the oldest evicted for a new one), and
// the loops' tick closes streams that never say hello or leave their replies unread and gives
// closed streams' memory back.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#ifdef __GLIBC__
#include <malloc.h>  // malloc_trim
#endif

#include "dataplane_server_impl.h"
#include "payload_pool.h"

namespace bps {
namespace dp {

ServerImpl::ServerImpl(int num_workers, int server_rank, std::uint32_t job, int io_threads,
                       std::uint64_t max_msg, std::uint64_t max_store, int max_conns,
                       std::string key, bool async_mode)
    : num_workers_(num_workers), rank_(server_rank), job_(job), max_msg_(max_msg),
      max_store_(max_store), max_conns_(max_conns), key_(std::move(key)), async_(async_mode),
      joined_(static_cast<std::size_t>(std::max(0, num_workers)), 0),
      required_(num_workers) {
  for (int i = 0; i < std::max(1, io_threads); ++i) loops_.emplace_back(new IoLoop());
  tables_.identify(&rank_, job_);
}

ServerImpl::~ServerImpl() { close(); }

int ServerImpl::listen(const std::string& host, int port) { return listen_tcp(host, port, &lfd_); }

// Streams over UCX instead (dataplane_ucx.h): a UCP listener on the first loop's worker,
// whose connection requests pass the same admission as accepted sockets.
int ServerImpl::listen_ucx(const std::string& host, int port) {
  UcxWorker* w = loops_[0]->ucx();
  ucx_listener_ = ucx_listen(w, host, port, [this](const auto& make) {
    // the streams spread over the loops, each endpoint on its loop's worker
    const std::size_t loop = next_ucx_++ % loops_.size();
    return !closing_.load() && admit([&] { return make(loops_[loop]->ucx()); }, loop);
  });
  return ucx_listener_->port();
}

void ServerImpl::start() {
  for (auto& l : loops_) l->start([this](const auto& conns) { tick(conns); });
  if (lfd_ >= 0) acceptor_ = std::thread([this] { accept_loop(); });
}

void ServerImpl::close() {
  if (closing_.exchange(true)) return;
  if (acceptor_.joinable()) acceptor_.join();
  if (lfd_ >= 0) ::close(lfd_);
  lfd_ = -1;
  ucx_listener_.reset();
  for (auto& l : loops_) l->stop();
  tables_.close();
}

template <typename Make>
bool ServerImpl::admit(Make make, std::size_t loop) {
  // Slots for streams that have said hello (and proved the secret, in a job with one):
  // streams that have not are at most a quarter of the slots, and the oldest of them
  // makes room for a new connection, so peers without the secret cannot hold the slots
  // a reconnecting or joining worker needs.
  const bool full = live_conns_.load() >= max_conns_;
  if ((full || unproven_.load() >= std::max(1, max_conns_ / 4)) && !evict_unproven()) {
    reject("too many connections");
    return false;
  }
  std::unique_ptr<Link> link = make();
  if (!link) return false;
  live_conns_++;
  unproven_++;
  c_.connections++;
  auto conn = make_conn(std::move(link));
  {
    std::lock_guard<std::mutex> g(slot_mu_);
    prune_unproven_locked();
    unproven_q_.push_back(conn);
  }
  loops_[loop % loops_.size()]->add(conn);
  return true;
}

void ServerImpl::accept_loop() {
  std::size_t next = 0;
  while (!closing_.load()) {
    pollfd pfd{lfd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, 200);
    if (r <= 0) continue;
    const int fd = ::accept4(lfd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        reject("file descriptor limit");
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      continue;
    }
    const auto tcp = [fd] {
      set_nodelay(fd);
      return std::unique_ptr<Link>(new TcpLink(fd));
    };
    if (!admit(tcp, next++)) ::close(fd);
  }
}

void ServerImpl::prune_unproven_locked() {
  while (!unproven_q_.empty()) {
    std::shared_ptr<Conn> c = unproven_q_.front().lock();
    if (c && static_cast<ServerConn*>(c.get())->unproven()) return;
    unproven_q_.pop_front();
  }
}

bool ServerImpl::evict_unproven() {
  std::lock_guard<std::mutex> g(slot_mu_);
  while (!unproven_q_.empty()) {
    std::shared_ptr<Conn> c = unproven_q_.front().lock();
    unproven_q_.pop_front();
    auto* sc = static_cast<ServerConn*>(c.get());
    if (sc && sc->prove()) {  // counted out now; its loop closes it
      reject("stream without hello evicted for a new one");
      sc->shut();
      return true;
    }
  }
  return false;
}

std::shared_ptr<Conn> ServerImpl::make_conn(std::unique_ptr<Link> link) {
  return std::make_shared<ServerConn>(std::move(link), this);
}

void ServerImpl::tick(const std::unordered_map<int, std::shared_ptr<Conn>>& conns) {
  // streams that never said hello are closed: a connection flood holds no descriptor for long;
  // streams whose peer leaves its replies unread are closed too
  const double now = monotonic_now();
  for (auto& kv : conns) {
    auto* sc = static_cast<ServerConn*>(kv.second.get());
    if (!sc->hello_done() && now - sc->created > kHelloTimeout) {
      reject("no hello in time");
      sc->shut();
    } else if (sc->drop_if_unread(now)) {
      reject("replies left unread");
    }
  }
  // the memory of closed streams (their queues, a large meta) goes back to the system, at
  // most once a second
  if (closed_since_trim_.load() > 0 && now - trimmed_at_ > 1.0 && trim_mu_.try_lock()) {
    std::lock_guard<std::mutex> g(trim_mu_, std::adopt_lock);
    const int closed = closed_since_trim_.load();
    if (now - trimmed_at_ > 1.0 && closed > 0) {
      trimmed_at_ = now;
      drain_pool();  // the table messages' buffers kept for reuse go back too
#ifdef __GLIBC__
      malloc_trim(0);
#endif
      closed_since_trim_ -= closed;  // given back now (stats: closed_since_trim)
    }
  }
}

}  // namespace dp
}  // namespace bps
