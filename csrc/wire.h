// The wire protocol's one definition: the header's layout, magic and version, every message
// type, flag, sender role and dtype code. The native data plane (dataplane.cc) reads it here;
// byteps_like/wire.py reads it through _core.wire_spec() (module_wire.cc) and builds its struct
// format, enums and tables from it, refusing to import when a name is missing on either side
// (tests/unit/test_wire.py holds the two together, and packs and parses headers both ways).
//
// A change to anything here is a change of the wire: bump kVersion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "dtype.h"

namespace bps {
namespace dp {

constexpr char kMagic[4] = {'B', 'P', 'S', 'L'};
constexpr std::uint8_t kVersion = 1;
constexpr std::uint32_t kMaxMeta = 1u << 20;  // a JSON meta frame's bytes (wire.MAX_META_BYTES)

// Message types: X(C++ name, Python name (wire.MsgType), code)
#define BPS_WIRE_MSG_TYPES(X)                                                                  \
  /* control plane (node <-> scheduler) */                                                     \
  X(kRegister, REGISTER, 1)                                                                    \
  X(kNodeTable, NODE_TABLE, 2)                                                                 \
  X(kBarrier, BARRIER, 3)                                                                      \
  X(kBarrierDone, BARRIER_DONE, 4)                                                             \
  X(kHeartbeat, HEARTBEAT, 5)                                                                  \
  X(kPeerLost, PEER_LOST, 6)                                                                   \
  X(kFinish, FINISH, 7)                                                                        \
  X(kShutdown, SHUTDOWN, 8)                                                                    \
  X(kAbort, ABORT, 9)                                                                          \
  X(kStall, STALL, 10)             /* server -> scheduler: rounds waiting on some workers */   \
  X(kJoin, JOIN, 11)               /* worker -> scheduler: this rank is out of data */         \
  X(kMembers, MEMBERS, 12)         /* scheduler -> servers: ranks joined / left */             \
  X(kJoinDone, JOIN_DONE, 13)      /* scheduler -> workers: every rank has joined */           \
  X(kEpoch, EPOCH, 14)             /* elastic: reset to a new membership epoch */              \
  X(kReady, READY, 15)             /* elastic: worker left the epoch, ready for the next */    \
  X(kEpochStart, EPOCH_START, 16)  /* elastic: the new epoch is formed (rank, size) */         \
  X(kExited, EXITED, 17)           /* launcher -> scheduler: a process it started exited */    \
  /* losing a server (docs/reliability.md, "Losing a server"): key = the failover's number */  \
  X(kFailover, FAILOVER, 18)       /* scheduler -> workers: a server is lost, its keys move */ \
  X(kSeeded, SEEDED, 19)           /* worker -> scheduler: its moved keys are re-seeded */     \
  X(kResume, RESUME, 33)           /* scheduler -> workers: every worker seeded; go on */      \
  X(kStreamLost, STREAM_LOST, 34)  /* worker -> scheduler: its streams to a server closed */   \
  X(kReport, REPORT, 35)           /* node -> scheduler: telemetry (progress, stragglers) */   \
  /* data plane (worker <-> server) */                                                         \
  X(kPush, PUSH, 20)                                                                           \
  X(kPushAck, PUSH_ACK, 21)                                                                    \
  X(kPull, PULL, 22)                                                                           \
  X(kPullResp, PULL_RESP, 23)                                                                  \
  X(kHello, HELLO, 24)             /* native data plane: a stream's first message */           \
  /* server-held embedding tables (issue 31; served by server/sparse.py): key = table id */   \
  X(kSparseCreate, SPARSE_CREATE, 25)  /* worker -> server: meta declares the table's shard */ \
  X(kSparsePull, SPARSE_PULL, 26)      /* worker -> server: int64 row ids, round = step */     \
  X(kSparseRows, SPARSE_ROWS, 27)      /* server -> worker: float32 rows of a SPARSE_PULL */   \
  X(kSparsePush, SPARSE_PUSH, 28)      /* worker -> server: uint8 [ids int64][grads float32] */\
  X(kSparseAck, SPARSE_ACK, 29)        /* server -> worker: a create or push was taken */      \
  X(kSparseSave, SPARSE_SAVE, 31)      /* worker -> server: meta names a checkpoint to write */ \
  X(kSparseLoad, SPARSE_LOAD, 32)      /* worker -> server: meta names a checkpoint to read */  \
  /* either */                                                                                 \
  X(kError, ERROR, 30)                                                                         \
  /* local reduction among the worker processes of one machine (byteps_like.local) */          \
  X(kLocalReady, LOCAL_READY, 40)                                                              \
  X(kLocalReduce, LOCAL_REDUCE, 41)                                                            \
  X(kLocalReduced, LOCAL_REDUCED, 42)                                                          \
  X(kLocalDone, LOCAL_DONE, 43)

// Flags: X(C++ name, Python name, bit)
#define BPS_WIRE_FLAGS(X)                                                                      \
  X(kFlagMeta, FLAG_META, 0)              /* a JSON meta frame follows the payload */          \
  X(kFlagDeclare, FLAG_DECLARE, 1)        /* first round of a key: meta declares it */         \
  X(kFlagAsync, FLAG_ASYNC, 2)            /* asynchronous mode push */                         \
  X(kFlagPull, FLAG_PULL, 3)              /* a push that also asks for the round's result */   \
  X(kFlagCompressed, FLAG_COMPRESSED, 4)  /* the payload is a compressor's encoding */         \
  X(kFlagAuth, FLAG_AUTH, 5)              /* a HELLO of the authenticated handshake */         \
  /* a PULL_RESP of a round fewer workers pushed (ranks had joined): the number of pushes */   \
  /* summed is in flags >> kContribShift; averages divide by it (join()) */                    \
  X(kFlagContrib, FLAG_CONTRIB, 6)                                                             \
  /* losing a server: a PUSH that carries the completed sum of its round, from a worker */     \
  /* that received it, to the key's new server; and a push re-sent to a key's new server */    \
  X(kFlagSeed, FLAG_SEED, 7)                                                                   \
  X(kFlagRetry, FLAG_RETRY, 8)                                                                 \
  /* a HELLO that opens a table stream: the worker process's server-held tables' requests */  \
  /* (SPARSE_*) and their answers, handed to the tables' thread (dataplane_tables.h) */        \
  X(kFlagTable, FLAG_TABLE, 9)
constexpr unsigned kContribShift = 16;

// Sender roles: X(C++ name, Python name (wire.Role), code)
#define BPS_WIRE_ROLES(X)                                                                      \
  X(kRoleScheduler, SCHEDULER, 0)                                                              \
  X(kRoleServer, SERVER, 1)                                                                    \
  X(kRoleWorker, WORKER, 2)

// Dtypes: X(name (wire.DTYPES), code, itemsize, the kernels' DType when summable, else -1)
#define BPS_WIRE_DTYPES(X)                                                                     \
  X(none, 0, 1, -1)                                                                            \
  X(float32, 1, 4, static_cast<int>(DType::kFloat32))                                          \
  X(float64, 2, 8, static_cast<int>(DType::kFloat64))                                          \
  X(float16, 3, 2, static_cast<int>(DType::kFloat16))                                          \
  X(bfloat16, 4, 2, static_cast<int>(DType::kBFloat16))                                        \
  X(int32, 5, 4, static_cast<int>(DType::kInt32))                                              \
  X(int64, 6, 8, static_cast<int>(DType::kInt64))                                              \
  X(uint8, 7, 1, -1)                                                                           \
  X(int8, 8, 1, -1)

#define BPS_WIRE_ENUM_ITEM(cname, pyname, value) cname = value,
#define BPS_WIRE_FLAG_ITEM(cname, pyname, bit) cname = 1u << (bit),
enum MsgType : std::uint8_t { BPS_WIRE_MSG_TYPES(BPS_WIRE_ENUM_ITEM) };
enum Flags : std::uint32_t { BPS_WIRE_FLAGS(BPS_WIRE_FLAG_ITEM) };
enum Role : std::uint8_t { BPS_WIRE_ROLES(BPS_WIRE_ENUM_ITEM) };
#undef BPS_WIRE_ENUM_ITEM
#undef BPS_WIRE_FLAG_ITEM

struct WireDType {
  const char* name;
  int code;
  std::size_t itemsize;
  int kernel;  // DType, or -1: not summable
};
#define BPS_WIRE_DTYPE_ITEM(name, code, size, kernel) {#name, code, size, kernel},
constexpr WireDType kWireDTypes[] = {BPS_WIRE_DTYPES(BPS_WIRE_DTYPE_ITEM)};
#undef BPS_WIRE_DTYPE_ITEM
constexpr int kNumWireDTypes = static_cast<int>(sizeof kWireDTypes / sizeof kWireDTypes[0]);
constexpr bool wire_dtypes_in_code_order() {
  for (int i = 0; i < kNumWireDTypes; ++i)
    if (kWireDTypes[i].code != i) return false;
  return true;
}
static_assert(wire_dtypes_in_code_order(), "wire dtype codes are 0, 1, 2, ... in table order");

// The header: little-endian, packed, in this order (BPS_WIRE_HEADER_FIELDS lists the fields
// for wire_spec(), module_wire.cc).
#pragma pack(push, 1)
struct Header {
  char magic[4];
  std::uint8_t version, type, dtype, role;
  std::int32_t rank;
  std::uint32_t flags, job;
  std::uint64_t key;
  std::int64_t round;
  std::uint64_t count, nbytes;
};
#pragma pack(pop)
static_assert(sizeof(Header) == 52, "the wire header is 52 bytes");
#define BPS_WIRE_HEADER_FIELDS(X)                                                              \
  X(magic) X(version) X(type) X(dtype) X(role) X(rank) X(flags) X(job) X(key) X(round)         \
  X(count) X(nbytes)

// A header of this version: the fields the caller names, magic and version filled in (the
// native data plane's messages, and _core.wire_pack_header for the tests).
inline Header make_header(std::uint8_t type, std::uint8_t role, std::int32_t rank,
                          std::uint32_t flags, std::uint32_t job, std::uint64_t key,
                          std::int64_t round, std::uint8_t dtype = 0, std::uint64_t count = 0,
                          std::uint64_t nbytes = 0) {
  Header h;
  std::memcpy(h.magic, kMagic, sizeof h.magic);
  h.version = kVersion;
  h.type = type;
  h.dtype = dtype;
  h.role = role;
  h.rank = rank;
  h.flags = flags;
  h.job = job;
  h.key = key;
  h.round = round;
  h.count = count;
  h.nbytes = nbytes;
  return h;
}

// Whether a data message's header holds count elements of itemsize isz in nbytes, checked
// without overflow (count * isz wraps for counts near 2^64: 2^61 + 1000 float64 would pass as
// 8000 bytes); false for an unknown dtype (isz 0).
constexpr bool count_matches(const Header& h, std::size_t isz) {
  return isz != 0 && h.nbytes % isz == 0 && h.count == h.nbytes / isz;
}

// The Python struct code of a header field's type (this header's, and the codec frame's:
// codec.h, _core.codec_frame_spec()).
template <class T> struct StructCode;
template <> struct StructCode<char[2]> { static constexpr const char* value = "2s"; };
template <> struct StructCode<char[4]> { static constexpr const char* value = "4s"; };
template <> struct StructCode<std::uint8_t> { static constexpr const char* value = "B"; };
template <> struct StructCode<std::uint16_t> { static constexpr const char* value = "H"; };
template <> struct StructCode<std::int32_t> { static constexpr const char* value = "i"; };
template <> struct StructCode<std::uint32_t> { static constexpr const char* value = "I"; };
template <> struct StructCode<std::int64_t> { static constexpr const char* value = "q"; };
template <> struct StructCode<std::uint64_t> { static constexpr const char* value = "Q"; };

}  // namespace dp
}  // namespace bps
