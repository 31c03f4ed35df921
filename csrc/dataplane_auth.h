// The native data plane's authenticated hello (a job secret turns it on), both sides' proofs
// and the worker's end of the handshake; the server's end is ServerConn's
// (dataplane_server_stream.cc).
// worker: HELLO + nonce Nc (32) -> server: HELLO + Ns (32) + HMAC(K, "bpsl-srv"|ctx|Nc|Ns)
// -> worker: HELLO + HMAC(K, "bpsl-cli"|ctx|Ns|Nc); ctx = job, rank, stream. Each side proves
// it holds the key derived from the secret; the nonces make every proof fresh.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace bps {
namespace dp {

constexpr std::size_t kNonce = 32;

void random_bytes(std::uint8_t* out, std::size_t n);  // throws when the system has none
void hello_mac(const std::string& key, const char* who, std::uint32_t job, std::int32_t rank,
               std::uint64_t stream, const std::uint8_t* first, const std::uint8_t* second,
               std::uint8_t out[32]);

// Moves exactly n bytes out of (out) or into p before the deadline, blocking; false and *err
// when it cannot. The hello below runs over one: a socket's or a UCX endpoint's.
using IoFull = std::function<bool(char* p, std::size_t n, bool out, double deadline,
                                  std::string* err)>;
// The worker's end of the hello on a fresh stream (with the proof when `key` is not empty):
// false and *err when the peer is not a server of this job or the proof fails. table: the
// stream carries server-held tables' requests (FLAG_TABLE), not partitions.
bool say_hello(const IoFull& io, int rank, std::uint32_t job, int stream, double deadline,
               const std::string& key, std::string* err, bool table = false);

// One stream of a worker to a server: connect (retrying until the deadline), say hello (with
// the proof when `key` is not empty), check the answer. The descriptor, non-blocking; -1 and
// *err when it cannot.
int open_stream(const std::string& host, int port, int rank, std::uint32_t job, int stream,
                double deadline, const std::string& key, std::string* err, bool table = false);

}  // namespace dp
}  // namespace bps
