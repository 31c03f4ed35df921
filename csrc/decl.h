// A key's declaration: what a worker's first push of a key tells its server in the message's
// meta frame (FLAG_DECLARE), in one fixed binary layout defined here. The server keeps the
// bytes (every worker must send the same ones: it compares them), reads the dtype, element
// count and codec parameters to make a compressed key's codec, and shows the rest in errors.
//
// The layout's one definition is here: byteps_like/wire.py builds its struct, limits and
// packing from _core.decl_spec() (module_spec.cc), and tests/unit/test_decl.py packs and parses
// declarations both ways. A change here is a change of the wire: bump kDeclVersion.
//
// Layout, little-endian, packed: DeclHead, then ndim int64 dims (the tensor's shape), ncodec
// uint64 codec parameters (compression.native_params: a built-in codec's; none otherwise),
// name_len bytes of the tensor's name (UTF-8), spec_len bytes of a compressor's spec (JSON: the
// one part a registered compressor's Python server codec reads, server/codecs.py; C++ never
// parses it). Nothing else: a declaration of any other size is refused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "wire.h"

namespace bps {
namespace dp {

constexpr char kDeclMagic[4] = {'B', 'P', 'S', 'D'};
constexpr std::uint8_t kDeclVersion = 1;
constexpr std::uint8_t kDeclMaxDims = 64;        // numpy's own limit
constexpr std::uint8_t kDeclMaxCodec = 16;       // compression.native_params' longest is 5
constexpr std::uint16_t kDeclMaxName = 4096;     // bytes of a tensor's name
constexpr std::uint32_t kDeclMaxSpec = 1u << 16;  // bytes of a compressor's JSON spec

#pragma pack(push, 1)
struct DeclHead {
  char magic[4];
  std::uint8_t version;
  std::uint8_t dtype;   // wire dtype code (wire.h) of the tensor as it travels
  std::uint8_t ndim;    // dims that follow, <= kDeclMaxDims
  std::uint8_t ncodec;  // codec parameters that follow, <= kDeclMaxCodec
  std::uint32_t part, nparts;  // this partition of the tensor's nparts (part < nparts)
  std::uint64_t count;  // elements of the partition, in dtype
  std::uint16_t name_len;  // <= kDeclMaxName
  std::uint16_t backup;    // backup workers b of an averaged key (BYTEPS_BACKUP_WORKERS); 0: none
  std::uint32_t spec_len;  // <= kDeclMaxSpec
};
#pragma pack(pop)
static_assert(sizeof(DeclHead) == 32, "a declaration's head is 32 bytes");
// The largest declaration: a server refuses a longer meta frame on a data stream unread.
constexpr std::size_t kDeclMaxBytes =
    sizeof(DeclHead) + 8 * (std::size_t{kDeclMaxDims} + kDeclMaxCodec) + kDeclMaxName +
    kDeclMaxSpec;
static_assert(kDeclMaxBytes <= kMaxMeta, "a declaration fits a meta frame");
#define BPS_DECL_FIELDS(X)                                                                     \
  X(magic) X(version) X(dtype) X(ndim) X(ncodec) X(part) X(nparts) X(count) X(name_len)       \
  X(backup) X(spec_len)

// A declaration read: every length checked against the bytes that came.
struct Decl {
  int dtype = 0;
  std::uint32_t part = 0, nparts = 0;
  std::uint64_t count = 0;
  std::uint16_t backup = 0;
  std::vector<std::int64_t> shape;
  std::vector<std::uint64_t> codec;
  std::string name, spec;
};

// The declaration in raw (a peer's bytes); throws std::invalid_argument saying what is wrong:
// short, of another magic or version, a length over its limit, a size that is not what its
// lengths add up to, an unknown dtype, a part out of range. Allocates at most raw's size.
inline Decl parse_decl(const std::string& raw) {
  DeclHead h;
  if (raw.size() < sizeof h)
    throw std::invalid_argument("a declaration of " + std::to_string(raw.size()) +
                                " bytes, shorter than its " + std::to_string(sizeof h) +
                                "-byte head");
  std::memcpy(&h, raw.data(), sizeof h);
  if (std::memcmp(h.magic, kDeclMagic, sizeof h.magic) != 0 || h.version != kDeclVersion)
    throw std::invalid_argument("not a declaration of this version (magic BPSD, version " +
                                std::to_string(kDeclVersion) + "): workers and servers must "
                                "run the same byteps_like");
  if (h.ndim > kDeclMaxDims || h.ncodec > kDeclMaxCodec || h.name_len > kDeclMaxName ||
      h.spec_len > kDeclMaxSpec)
    throw std::invalid_argument(
        "a declaration with " + std::to_string(h.ndim) + " dims, " + std::to_string(h.ncodec) +
        " codec parameters, a name of " + std::to_string(h.name_len) + " bytes and a spec of " +
        std::to_string(h.spec_len) + " (at most " + std::to_string(kDeclMaxDims) + ", " +
        std::to_string(kDeclMaxCodec) + ", " + std::to_string(kDeclMaxName) + " and " +
        std::to_string(kDeclMaxSpec) + ")");
  const std::size_t want = sizeof h + 8 * (std::size_t{h.ndim} + h.ncodec) + h.name_len +
                           std::size_t{h.spec_len};
  if (raw.size() != want)
    throw std::invalid_argument("a declaration of " + std::to_string(raw.size()) +
                                " bytes, whose lengths add up to " + std::to_string(want));
  if (h.dtype >= kNumWireDTypes || h.dtype == 0)
    throw std::invalid_argument("a declaration of unknown dtype code " +
                                std::to_string(h.dtype));
  if (h.part >= h.nparts)
    throw std::invalid_argument("a declaration of part " + std::to_string(h.part) + " of " +
                                std::to_string(h.nparts));
  Decl d;
  d.dtype = h.dtype;
  d.part = h.part;
  d.nparts = h.nparts;
  d.count = h.count;
  d.backup = h.backup;
  const char* p = raw.data() + sizeof h;
  d.shape.resize(h.ndim);
  std::memcpy(d.shape.data(), p, 8 * std::size_t{h.ndim});
  p += 8 * std::size_t{h.ndim};
  d.codec.resize(h.ncodec);
  std::memcpy(d.codec.data(), p, 8 * std::size_t{h.ncodec});
  p += 8 * std::size_t{h.ncodec};
  d.name.assign(p, h.name_len);
  d.spec.assign(p + h.name_len, h.spec_len);
  return d;
}

// The bytes of a declaration (what _core.decl_pack writes for the tests; workers pack the same
// in Python, wire.pack_decl); throws std::invalid_argument past a limit.
inline std::string pack_decl(const Decl& d) {
  if (d.shape.size() > kDeclMaxDims || d.codec.size() > kDeclMaxCodec ||
      d.name.size() > kDeclMaxName || d.spec.size() > kDeclMaxSpec)
    throw std::invalid_argument("a declaration past its limits (dims, codec, name, spec)");
  DeclHead h;
  std::memcpy(h.magic, kDeclMagic, sizeof h.magic);
  h.version = kDeclVersion;
  h.dtype = static_cast<std::uint8_t>(d.dtype);
  h.ndim = static_cast<std::uint8_t>(d.shape.size());
  h.ncodec = static_cast<std::uint8_t>(d.codec.size());
  h.part = d.part;
  h.nparts = d.nparts;
  h.count = d.count;
  h.name_len = static_cast<std::uint16_t>(d.name.size());
  h.backup = d.backup;
  h.spec_len = static_cast<std::uint32_t>(d.spec.size());
  std::string out(reinterpret_cast<const char*>(&h), sizeof h);
  out.append(reinterpret_cast<const char*>(d.shape.data()), 8 * d.shape.size());
  out.append(reinterpret_cast<const char*>(d.codec.data()), 8 * d.codec.size());
  return out + d.name + d.spec;
}

}  // namespace dp
}  // namespace bps
