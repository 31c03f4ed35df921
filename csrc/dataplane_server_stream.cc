// A stream of the native data plane's server (ServerConn, dataplane_server_impl.h): its hello
// (with the proof of the job's secret when the job has one), then each message's header
// checks, meta frame and payload, summed chunk by chunk into the key's store (a compressed one
// received whole), or discarded after an error reply.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dataplane_auth.h"
#include "dataplane_server_impl.h"
#include "crypto.h"
#include "decl.h"
#include "payload_pool.h"

namespace bps {
namespace dp {

ServerConn::ServerConn(std::unique_ptr<Link> link, ServerImpl* srv)
    : FramedConn(std::move(link), &srv->c_), srv_(srv) {
  read_header();
}

void ServerConn::on_closed() {
  if (store_ && state_ == kPayload && !whole_ && !in_place_) {
    // a span read ahead and cut off: its whole chunks are summed (a TCP stream's were, as
    // they came), as they would be had they been read one at a time
    const std::size_t whole = static_cast<std::size_t>(rptr_ - scratch_.data()) / kChunk;
    sum_span(whole * kChunk);
  }
  if (store_) srv_->abort_push(store_);  // cut off in the middle of a push's payload
  store_.reset();
  unstage();
  give_meta();
  prove();
  srv_->closed_since_trim_++;  // before live_conns_: no stream is ever counted in neither
  srv_->live_conns_--;
}

// A stream's share of kReplyBudget: the budget over the streams open now, and only kMinShare
// while the server's streams together hold more than the budget. The share alone depended on
// the order: a stream read while few were open kept its large share when more came (+111 MB
// with 150 streams opened one by one, issue 41); the global cap holds whatever the order.
std::size_t ServerConn::queue_share() const {
  if (srv_->c_.queued_bytes.load() > kReplyBudget) return kMinShare;
  return std::max(kMinShare, kReplyBudget / std::max(1, srv_->live_conns_.load()));
}

bool ServerConn::advance() {
  switch (state_) {
    case kHdr: return on_header();
    case kMetaLen: return on_meta_len();
    case kMeta:
      give_meta();
      return after_meta();
    case kPayload: {
      if (table_) return table_payload();
      if (whole_) {  // a compressed payload or a seed, received whole: finish_push takes it
        off_ = h_.nbytes;
        return next_chunk();
      }
      if (in_place_) {  // the rest of the payload, received into the round's buffer
        in_place_ = false;
        srv_->landed(*store_, h_.round, off_, h_.nbytes - off_, gen_);
        off_ = h_.nbytes;
        return next_chunk();
      }
      const std::size_t len = static_cast<std::size_t>(rptr_ - scratch_.data());
      sum_span(len);  // the chunks of the span not summed yet (a UCX stream's: all of them)
      off_ += len;
      summed_ = 0;
      return next_chunk();
    }
    case kDiscard: return next_discard();
    case kNonceIn: return on_nonce();
    case kMacIn: return on_mac();
  }
  return false;
}

// Sums the scratch span's chunks from summed_ up to `upto` (a chunk boundary, or the span's
// end), each into the store at its place.
void ServerConn::sum_span(std::size_t upto) {
  for (; summed_ < upto; summed_ += std::min(kChunk, upto - summed_))
    srv_->sum_chunk(*store_, h_.round, off_ + summed_, scratch_.data() + summed_,
                    std::min(kChunk, upto - summed_), gen_);
}

// A TCP stream's span: each chunk summed as soon as all of it is in, while the bytes the kernel
// just copied are still in cache (a UCX stream's span is read whole and summed in advance()).
void ServerConn::on_read() {
  if (state_ != kPayload || !store_ || whole_ || in_place_ || link_->progressed()) return;
  const std::size_t have = static_cast<std::size_t>(rptr_ - scratch_.data());
  sum_span(have - have % kChunk);
}

bool ServerConn::on_nonce() {
  Out o;
  if (srv_->key_.empty()) {  // the worker has a secret, this job none: say so plainly
    hello_ = true;
    prove();
    o.hdr = make_header(kHello, kRoleServer, srv_->rank_.load(), 0, srv_->job_, stream_, 0);
    send(std::move(o));
    return read_header();
  }
  auto reply = std::make_shared<std::array<std::uint8_t, 64>>();
  random_bytes(my_nonce_, kNonce);
  std::memcpy(reply->data(), my_nonce_, kNonce);
  hello_mac(srv_->key_, "bpsl-srv", srv_->job_, rank_, stream_, peer_nonce_, my_nonce_,
            reply->data() + kNonce);
  o.hdr = make_header(kHello, kRoleServer, srv_->rank_.load(), kFlagAuth, srv_->job_, stream_,
                      0, 0, 0, 64);
  o.payload = reinterpret_cast<const char*>(reply->data());
  o.plen = 64;
  o.keep = reply;
  send(std::move(o));
  awaiting_mac_ = true;
  return read_header();
}

bool ServerConn::on_mac() {
  std::uint8_t want[32];
  hello_mac(srv_->key_, "bpsl-cli", srv_->job_, rank_, stream_, my_nonce_, peer_nonce_, want);
  if (!equal_ct(want, peer_mac_, 32)) {
    srv_->reject("authentication failed");
    why_ = "the worker's proof does not match this job's secret";
    return false;
  }
  awaiting_mac_ = false;
  hello_ = true;
  prove();
  return read_header();
}

bool ServerConn::on_header() {
  counters_->msgs_in++;
  if (std::memcmp(h_.magic, kMagic, 4) != 0) {
    srv_->reject("malformed");
    why_ = "bad magic: not a byteps_like peer";
    return false;
  }
  if (h_.version != kVersion) {
    srv_->reject("malformed");
    why_ = "protocol version mismatch";
    return false;
  }
  if (!hello_) {
    if (awaiting_mac_) {  // the worker's proof
      if (h_.type != kHello || !(h_.flags & kFlagAuth) || h_.nbytes != 32 ||
          h_.job != srv_->job_ || h_.rank != rank_) {
        srv_->reject("authentication failed");
        why_ = "no valid proof of the job's secret";
        return false;
      }
      state_ = kMacIn;
      expect(reinterpret_cast<char*>(peer_mac_), 32);
      return true;
    }
    const bool auth = h_.flags & kFlagAuth;
    table_ = h_.flags & kFlagTable;  // a worker process's table stream: its process rank
    const int ranks = srv_->num_workers_ * (table_ ? kMaxTableLocalSize : 1);
    if (h_.type != kHello || h_.job != srv_->job_ || h_.role != kRoleWorker || h_.rank < 0 ||
        h_.rank >= ranks || (h_.flags & kFlagMeta) ||
        h_.nbytes != (auth ? kNonce : 0)) {
      srv_->reject("bad hello");
      why_ = "the first message was not a valid hello of this job";
      return false;  // no reply: an unregistered peer learns nothing
    }
    if (!srv_->key_.empty() && !auth) {
      srv_->reject("authentication failed");
      why_ = "a hello without authentication, and this job has a secret";
      return false;
    }
    rank_ = h_.rank;
    stream_ = h_.key;
    if (auth) {  // the worker's nonce first
      state_ = kNonceIn;
      expect(reinterpret_cast<char*>(peer_nonce_), kNonce);
      return true;
    }
    hello_ = true;
    prove();
    Out o;
    o.hdr = make_header(kHello, kRoleServer, srv_->rank_.load(), 0, srv_->job_, h_.key, 0);
    send(std::move(o));
    return read_header();
  }
  if (h_.job != srv_->job_ || h_.rank != rank_ || h_.role != kRoleWorker) {
    srv_->reject("wrong job or rank for this stream");
    why_ = "a message with another job tag or rank than the stream's hello";
    return false;
  }
  if (table_) return table_header();
  if (h_.type == kPush) {
    const std::size_t isz = wire_itemsize(h_.dtype);
    if (!count_matches(h_, isz) || h_.nbytes > srv_->max_msg_) {
      srv_->reject("malformed");
      why_ = "PUSH with an inconsistent or oversized length";
      return false;
    }
  } else if (h_.type != kPull) {
    srv_->reject("unexpected type or rank");
    why_ = std::string("unexpected ") + type_name(h_.type) + " on a data stream";
    return false;
  }
  meta_.clear();
  if (h_.flags & kFlagMeta) return read_meta_len();
  return after_meta();
}

// A meta frame's length: at most the largest declaration (decl.h), and a large one within
// what the server's streams may hold of meta frames being read (kMetaBudget), else the stream
// is closed.
bool ServerConn::on_meta_len() {
  if (meta_len_ > kDeclMaxBytes) {
    srv_->reject("oversized meta");
    why_ = "a meta frame of " + std::to_string(meta_len_) + " bytes, over the largest "
           "declaration's " + std::to_string(kDeclMaxBytes);
    return false;
  }
  if (meta_len_ > kFreeMeta) {
    if (srv_->meta_bytes_.fetch_add(meta_len_) + meta_len_ > kMetaBudget) {
      srv_->meta_bytes_ -= meta_len_;
      srv_->reject("meta frames over the server's budget");
      why_ = "the server holds too many large meta frames being read";
      return false;
    }
    meta_charged_ = meta_len_;
  }
  return read_meta("meta frame over 1 MiB");
}

void ServerConn::give_meta() {
  srv_->meta_bytes_ -= meta_charged_;
  meta_charged_ = 0;
}

bool ServerConn::after_meta() {
  auto self = shared_from_this();
  if (table_) {  // a table request's payload, read whole (its length was checked)
    tpay_ = pooled(static_cast<std::size_t>(h_.nbytes));
    if (h_.nbytes == 0) return table_payload();
    state_ = kPayload;
    expect(&tpay_[0], tpay_.size());
    return true;
  }
  if (h_.type == kPull) {
    srv_->handle_pull(self, h_);
    return read_header();
  }
  store_ = srv_->begin_push(self, h_, meta_, &gen_, &staged_);
  off_ = 0;
  whole_ = store_ && (store_->codec || (h_.flags & kFlagSeed));
  if (!store_) {
    discard_left_ = h_.nbytes;
    return next_discard();
  }
  return next_chunk();
}

bool ServerConn::next_chunk() {
  if (off_ >= h_.nbytes) {
    srv_->finish_push(shared_from_this(), store_, h_, gen_, whole_ ? cbuf_.data() : nullptr);
    store_.reset();
    unstage();
    return read_header();
  }
  if (whole_) {  // staged (charged to the budget by begin_push) and read whole
    cbuf_.resize(h_.nbytes);
    state_ = kPayload;
    expect(reinterpret_cast<char*>(cbuf_.data()), h_.nbytes);
    return true;
  }
  if (char* at = off_ == 0 ? srv_->land_in_place(*store_, h_.round) : nullptr) {
    in_place_ = true;
    state_ = kPayload;
    expect(at, h_.nbytes);
    return true;
  }
  // a TCP stream's chunks that are first of their round and all waiting in the socket go
  // straight into the store (dataplane_server_sum.cc), up to a read budget's worth at a time
  std::size_t avail = SIZE_MAX;
  while (took_ < kReadBudget) {
    const std::size_t len = std::min<std::size_t>(kChunk, h_.nbytes - off_);
    const ssize_t n =
        srv_->land_chunk(*store_, h_.round, off_, len, gen_, *link_, &avail, &why_);
    if (n < 0) return false;
    if (n == 0) break;
    took_ += static_cast<std::size_t>(n);
    off_ += static_cast<std::size_t>(n);
    if (off_ >= h_.nbytes) return next_chunk();
  }
  // a UCX stream reads a piece (kUcxPiece, the size its payloads travel in) at a time, so a
  // piece lands whole in place; its chunks are summed when it has
  const std::size_t span = link_->progressed() ? kUcxAhead : kTcpAhead;
  const std::size_t len = std::min<std::size_t>(span, h_.nbytes - off_);
  if (scratch_.size() < len) scratch_.resize(span);
  summed_ = 0;
  state_ = kPayload;
  expect(scratch_.data(), len);
  return true;
}

// A compressed payload's staging: given back after each push (payloads of a partition's
// size must not stay with every stream), with its charge to the memory budget.
void ServerConn::unstage() {
  if (staged_) srv_->reserve(-static_cast<std::int64_t>(staged_));
  staged_ = 0;
  if (cbuf_.capacity() > kChunk) std::vector<std::uint8_t>().swap(cbuf_);
}

// A table stream's request header: a SPARSE_* request of at most BYTEPS_MAX_MESSAGE_BYTES
// (the tables' thread checks the rest: dtype, ids, rounds), then its meta and payload.
bool ServerConn::table_header() {
  if (!table_request_type(h_.type) || h_.nbytes > srv_->max_msg_) {
    srv_->reject("malformed");
    why_ = std::string("unexpected ") + type_name(h_.type) + " of " + std::to_string(h_.nbytes) +
           " bytes on a table stream";
    return false;
  }
  meta_.clear();
  if (h_.flags & kFlagMeta) return read_meta_len();
  return after_meta();
}

// A table request complete: to the tables' thread, charged to this stream until taken.
bool ServerConn::table_payload() {
  auto self = shared_from_this();
  if (!table_id_) table_id_ = srv_->tables_.add_stream(self);
  srv_->tables_.put(self, table_id_, h_, std::move(meta_), std::move(tpay_));
  meta_.clear();
  tpay_.clear();
  return read_header();
}

}  // namespace dp
}  // namespace bps
