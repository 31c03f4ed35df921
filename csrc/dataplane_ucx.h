// UCX as a second stream implementation of the native data plane (docs/architecture.md, "UCX
// in the data plane"): a UcxLink moves a stream's bytes over a UCP endpoint (the stream API)
// where a TcpLink uses a socket; the framing, budgets, rules and hello above it are the same.
// libucp is not linked: ucx_load() opens the library the libucx wheel ships (its path comes
// from Python) at run time, and the extension is built against the wheel's headers when they
// are present at build time (BPS_WITH_UCX); without them ucx_load() says so. Internal to the
// extension.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "dataplane_io.h"

namespace bps {
namespace dp {

// ucx_load(), ucx_unavailable() and ucx_built() are in dataplane.h (the module binds them).

// One UCP worker, run by one IoLoop (its event fd in the loop's epoll set).
class UcxWorker {
 public:
  virtual ~UcxWorker() = default;
  virtual int efd() const = 0;
  // Progresses the worker until it is idle (the loop thread, before it serves its streams).
  virtual void progress() = 0;
  // Arms the event fd; false when events are pending (the loop must not sleep).
  virtual bool arm() = 0;
};
// A worker whose wake-ups write to `wake_fd` (the loop's eventfd); throws std::runtime_error
// when UCX is not usable.
std::unique_ptr<UcxWorker> make_ucx_worker(int wake_fd);

// A worker's stream to host:port, hello and all (open_stream's UCX twin): nullptr and *err
// when it cannot within the deadline.
std::unique_ptr<Link> ucx_open_stream(UcxWorker* w, const std::string& host, int port, int rank,
                                      std::uint32_t job, int stream, double deadline,
                                      const std::string& key, std::string* err,
                                      bool table = false);

// A UCX listener on a worker: each connection request is offered to `take` (called on the
// worker's loop thread) with a function that makes its Link on a worker (that of the loop the
// stream will join); `take` returns false to refuse it.
class UcxListener {
 public:
  virtual ~UcxListener() = default;
  virtual int port() const = 0;
};
using UcxAccept =
    std::function<bool(const std::function<std::unique_ptr<Link>(UcxWorker*)>& make)>;
std::unique_ptr<UcxListener> ucx_listen(UcxWorker* w, const std::string& host, int port,
                                        UcxAccept take);

}  // namespace dp
}  // namespace bps
