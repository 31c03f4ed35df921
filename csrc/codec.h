// The framed codecs of byteps_like/compression.py in C++, for the native data plane's server
// (dataplane_server.cc): a payload is the 20-byte little-endian header (FrameHeader) -- magic
// "BC", version (1), compressor id (BPS_CODECS), element count n (u32), step (u64), one 4-byte
// field (onebit: the scale f32; top-k, random-k: k u32; dithering: the norm f32) -- then the
// body the kernels of compress.h write. A decoded payload is a peer's: its scale / norm must be
// finite and >= 0, its values finite, its top-k indices distinct.
//
// The frame's one definition is here: compression.py builds its header structs, magic, version
// and codec ids from _core.codec_frame_spec() (module_wire.cc), which exports FrameHeader and
// BPS_CODECS, and refuses to import when a codec is missing on either side; so worker-side
// Python codecs and server-side C++ codecs write and read the same bytes
// (tests/unit/test_codec_frame.py packs and parses frames both ways, tests/unit/
// test_native_codec.py compares whole payloads). A change here is a change of the frame: bump
// kFrameVersion.
//
// No JSON here: Python turns a compressor spec into CodecParams (compression.native_params);
// the server reads them from the declaration's codec parameters (decl.h) and checks them with
// validate() before any memory is taken.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace bps {
namespace compress {

// The built-in codecs: X(C++ id, name (compression.py's), id on the wire, the Python struct
// code of the header's 4-byte field)
#define BPS_CODECS(X)                                                                          \
  X(kOneBit, onebit, 1, "f")       /* field: the scale, f32 */                                 \
  X(kTopK, topk, 2, "I")           /* field: k, u32 */                                         \
  X(kRandomK, randomk, 3, "I")     /* field: k, u32 */                                         \
  X(kDithering, dithering, 4, "f") /* field: the norm, f32 */

#define BPS_CODEC_ID_ITEM(cname, pyname, id, field) cname = id,
enum CodecId : int { BPS_CODECS(BPS_CODEC_ID_ITEM) };
#undef BPS_CODEC_ID_ITEM

constexpr char kFrameMagic[2] = {'B', 'C'};
constexpr std::uint8_t kFrameVersion = 1;
// The header: little-endian (the build is little-endian only: x86-64, aarch64), packed, in
// this order (BPS_FRAME_FIELDS lists the fields for codec_frame_spec()).
#pragma pack(push, 1)
struct FrameHeader {
  char magic[2];
  std::uint8_t version, id;
  std::uint32_t n;
  std::uint64_t step;
  std::uint32_t field;  // the 4 bytes of the codec's field (a float's bits: onebit, dithering)
};
#pragma pack(pop)
#define BPS_FRAME_FIELDS(X) X(magic) X(version) X(id) X(n) X(step) X(field)
constexpr std::size_t kFrameHeader = sizeof(FrameHeader);
static_assert(kFrameHeader == 20, "the codec frame's header is 20 bytes");

struct CodecParams {
  int id = 0;             // CodecId
  bool ef = false;        // error feedback around the codec (both roles)
  bool scaling = true;    // onebit
  std::uint64_t k = 0;    // top-k, random-k: the count (1..n), already resolved for n
  std::uint64_t seed = 0; // random-k, dithering
  int levels = 0;         // dithering
  bool natural = false, l2 = false;  // dithering
};

// The params from their flat list form [id, ef, scaling, k, seed, levels, natural, l2]
// (compression.native_params, the declaration's "native_codec"); throws std::invalid_argument
// naming the field when the list is not of that shape (flags 0/1, levels < 2^16).
CodecParams params_from_list(const std::vector<std::uint64_t>& v);
// "onebit(scaling) with error feedback" and the like, for error messages.
std::string describe(const CodecParams& p);
// Throws std::invalid_argument naming the field when p is not a codec of n elements.
void validate(const CodecParams& p, std::size_t n);
// The exact payload size of a codec of n elements (validate() first).
std::size_t payload_bytes(const CodecParams& p, std::size_t n);

// A codec that failed (not a payload it judged malformed): a registered compressor's Python
// codec that raised something else than CompressionError, or answered what it must not. The
// native server fails the key with it (every worker waiting gets the error).
class CodecFault : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The server's codec of one compressed key (dataplane_server.cc): FramedCodec for the built-in
// codecs, or a registered compressor's Python codec (module.cc, PyServerCodec). Not
// thread-safe: its owner (the key's store, under its mutex) serialises calls.
class ServerCodec {
 public:
  virtual ~ServerCodec() = default;
  virtual std::size_t n() const = 0;
  // The largest payload, pushed or answered; exact(): every payload has exactly this size.
  virtual std::size_t max_bytes() const = 0;
  virtual bool exact() const { return true; }
  // The memory this codec holds, for a memory budget.
  virtual std::size_t held_bytes() const = 0;
  // The float32 accumulator of n elements when the codec provides one (a Python codec's, which
  // Python code may keep a reference to); null: its owner allocates it.
  virtual float* accumulator() { return nullptr; }
  // Decodes (add: adds) a payload of len <= max_bytes() bytes into out[n]; returns its step.
  // Throws std::invalid_argument on a malformed payload, CodecFault when the codec failed.
  virtual std::uint64_t decode(const std::uint8_t* p, std::size_t len, float* out, bool add) = 0;
  // Encodes x[n] (not modified) of round `step` into out[max_bytes()]; returns the payload's
  // bytes. Throws CodecFault when the codec failed.
  virtual std::size_t encode(const float* x, std::uint64_t step, std::uint8_t* out) = 0;
};

// One partition's built-in codec for one role (the server's: no momentum, which is a worker
// concern). Not thread-safe: its owner serialises calls.
class FramedCodec : public ServerCodec {
 public:
  FramedCodec(const CodecParams& p, std::uint64_t key, std::size_t n);  // validates
  std::size_t n() const override { return n_; }
  std::size_t max_bytes() const override { return max_bytes_; }
  // The memory this codec holds (its residual; the scratch of encode is per thread), for a
  // memory budget.
  std::size_t held_bytes() const override;
  // Decodes (add: adds) a payload into out[n]; returns its step. Every field and the exact
  // length are checked first, and what the numbers may be: a finite scale / norm >= 0, finite
  // values, distinct top-k indices (a peer's NaN or inf would land in every worker's result);
  // throws std::invalid_argument (what() names the field) and leaves out untouched on a
  // malformed payload.
  std::uint64_t decode(const std::uint8_t* p, std::size_t len, float* out, bool add) override {
    return decode_impl(p, len, out, add, 1, false, true);
  }
  // decode() without add, each value divided by divisor (>= 1) as it lands, bit for bit
  // decode-then-divide (an average, with no pass of its own over out), into an out that is
  // not read back soon (a worker's result: written with non-temporal stores where a kernel
  // can).
  std::uint64_t decode_divided(const std::uint8_t* p, std::size_t len, float* out,
                               std::int64_t divisor) {
    return decode_impl(p, len, out, false, divisor, true, true);
  }
  // Two buffers of max_bytes() (0 and 1), made at the first call and kept: the native
  // client's encoded push and received answer of this codec's partition.
  std::uint8_t* wire_buffer(int which) {
    std::vector<std::uint8_t>& b = wire_[which & 1];
    if (b.size() != max_bytes_) b.assign(max_bytes_, 0);
    return b.data();
  }
  // Encodes x[n] (not modified) of round `step` into out[max_bytes()] (returns max_bytes());
  // with error feedback y = x + r, encode y, r = y - decode(payload), as compression.py's
  // _ErrorFeedbackCodec.
  std::size_t encode(const float* x, std::uint64_t step, std::uint8_t* out) override;

 private:
  void encode_plain(const float* x, std::uint64_t step, std::uint8_t* out);
  std::uint64_t decode_impl(const std::uint8_t* p, std::size_t len, float* out, bool add,
                            std::int64_t divisor, bool stream, bool check);
  const std::uint32_t* indices(std::uint64_t step);  // random-k, cached per step
  CodecParams p_;
  std::uint64_t key_;
  std::size_t n_, max_bytes_;
  // onebit with error feedback keeps y with its residual not yet taken (settled by the next
  // encode's pass, with the scale it was encoded with): one pass over the residual per step
  std::vector<float> residual_;
  std::vector<std::uint8_t> wire_[2];  // wire_buffer()
  bool unsettled_ = false;
  float unsettled_scale_ = 0.0f;
  std::vector<std::uint32_t> idx_;
  std::uint64_t idx_step_ = 0;
  bool idx_valid_ = false;
};

}  // namespace compress
}  // namespace bps
