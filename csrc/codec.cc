// The framed codecs (codec.h) over the kernels of compress.h.
#include "codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "compress.h"

namespace bps {
namespace compress {
namespace {

const char* id_name(int id) {
  switch (id) {
#define BPS_CODEC_NAME(cname, pyname, id, field) \
  case cname: return #pyname;
    BPS_CODECS(BPS_CODEC_NAME)
#undef BPS_CODEC_NAME
    default: return "unknown";
  }
}

void bad(const std::string& what) { throw std::invalid_argument(what); }

void put_header(std::uint8_t* out, int id, std::size_t n, std::uint64_t step,
                std::uint32_t field) {
  FrameHeader h;  // codec.h: the frame's one definition
  std::memcpy(h.magic, kFrameMagic, sizeof h.magic);
  h.version = kFrameVersion;
  h.id = static_cast<std::uint8_t>(id);
  h.n = static_cast<std::uint32_t>(n);
  h.step = step;
  h.field = field;
  std::memcpy(out, &h, sizeof h);
}

std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- what a peer's payload may carry (decode_impl with `check`) -------------------------
// Every number in a payload is what an encoder wrote for a finite tensor: a scale or norm that
// is finite and >= 0, values that are finite, top-k indices that are distinct. A NaN or inf
// from one peer would otherwise land in every worker's result, and a duplicated index makes
// the sum depend on the order of the writes. O(k) or O(1) each: the payload's own bytes.

std::string show(float v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return std::to_string(v);
}

void check_scale(const std::string& name, const char* field, float v) {
  if (!std::isfinite(v) || v < 0.0f)
    bad(name + " payload: its " + field + " is " + show(v) + ", not a finite number >= 0 "
        "(the sender's tensor held NaN or inf?)");
}

// One branch-free pass over a sparse body's k values (and, with idx, its indices): bit 0 set
// when a value is not finite, bit 1 when the indices do not increase strictly. Each index pair
// is loaded afresh (no carried value) and compared signed with the top bit flipped (SSE2 and
// AVX2 compare only signed), so the compiler vectorises the loop; on x86-64 GCC also builds an
// AVX2 clone, picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
std::uint32_t scan_sparse(const std::uint8_t* idx, const std::uint8_t* val, std::size_t k) {
  std::uint32_t hit = 0, down = 0;
  for (std::size_t j = 0; j < k; ++j) {
    std::uint32_t u;
    std::memcpy(&u, val + 4 * j, 4);
    hit |= static_cast<std::uint32_t>((u & 0x7F800000u) == 0x7F800000u);
  }
  if (idx) {
    for (std::size_t j = 1; j < k; ++j) {
      std::uint32_t a, b;
      std::memcpy(&a, idx + 4 * (j - 1), 4);
      std::memcpy(&b, idx + 4 * j, 4);
      down |= static_cast<std::uint32_t>(static_cast<std::int32_t>(b ^ 0x80000000u) <=
                                         static_cast<std::int32_t>(a ^ 0x80000000u));
    }
  }
  return hit | (down << 1);
}

// A sparse body's values are finite and (idx: top-k) its indices distinct: increasing, as
// every encoder writes them, or else distinct once a copy is sorted (order is not part of the
// format; repetition is).
void check_sparse(const std::string& name, const std::uint8_t* idx, const std::uint8_t* val,
                  std::size_t k) {
  const std::uint32_t found = scan_sparse(idx, val, k);
  if (!found) return;
  for (std::size_t j = 0; (found & 1) && j < k; ++j) {
    float f;
    std::memcpy(&f, val + 4 * j, 4);
    if (!std::isfinite(f))
      bad(name + " payload: value " + std::to_string(j) + " is " + show(f) + ", not finite "
          "(the sender's tensor held NaN or inf?)");
  }
  thread_local std::vector<std::uint32_t> c;
  c.resize(k);
  std::memcpy(c.data(), idx, 4 * k);
  std::sort(c.begin(), c.end());
  const auto d = std::adjacent_find(c.begin(), c.end());
  if (d != c.end())
    bad(name + " payload: index " + std::to_string(*d) + " appears more than once (top-k "
        "indices are distinct)");
}

}  // namespace

CodecParams params_from_list(const std::vector<std::uint64_t>& v) {
  if (v.size() != 8)
    bad("native codec parameters: expected 8 integers [id, ef, scaling, k, seed, levels, "
        "natural, l2], got " + std::to_string(v.size()));
  const char* flags[] = {nullptr, "ef", "scaling", nullptr, nullptr, nullptr, "natural", "l2"};
  for (int i = 0; i < 8; ++i)
    if (flags[i] && v[i] > 1) bad(std::string(flags[i]) + ": must be 0 or 1");
  if (v[0] > 255) bad("compressor id " + std::to_string(v[0]) + " is not a built-in codec");
  if (v[5] > 65535) bad("levels: must be below 2^16, got " + std::to_string(v[5]));
  CodecParams p;
  p.id = static_cast<int>(v[0]);
  p.ef = v[1] != 0;
  p.scaling = v[2] != 0;
  p.k = v[3];
  p.seed = v[4];
  p.levels = static_cast<int>(v[5]);
  p.natural = v[6] != 0;
  p.l2 = v[7] != 0;
  return p;
}

std::string describe(const CodecParams& p) {
  std::string s = id_name(p.id);
  switch (p.id) {
    case kOneBit: s += p.scaling ? "(scaling)" : "(no scaling)"; break;
    case kTopK: s += "(k=" + std::to_string(p.k) + ")"; break;
    case kRandomK:
      s += "(k=" + std::to_string(p.k) + ", seed=" + std::to_string(p.seed) + ")";
      break;
    case kDithering:
      s += "(levels=" + std::to_string(p.levels) + (p.natural ? ", natural" : ", linear") +
           (p.l2 ? ", l2" : ", max") + ", seed=" + std::to_string(p.seed) + ")";
      break;
    default: break;
  }
  return p.ef ? s + " with error feedback" : s;
}

void validate(const CodecParams& p, std::size_t n) {
  if (p.id < kOneBit || p.id > kDithering)
    bad("compressor id " + std::to_string(p.id) + " is not a built-in codec (1..4)");
  if (n < 1 || n > 0xFFFFFFFFULL)
    bad("n: must be an element count in [1, 2^32), got " + std::to_string(n));
  if ((p.id == kTopK || p.id == kRandomK) && (p.k < 1 || p.k > n))
    bad("k: must be a count in [1, n = " + std::to_string(n) + "], got " + std::to_string(p.k));
  if (p.id == kDithering) {
    const int hi = p.natural ? 127 : 65535;
    if (p.levels < 1 || p.levels > hi)
      bad("levels: must be an integer in [1, " + std::to_string(hi) + "] for " +
          (p.natural ? "natural" : "linear") + " dithering, got " + std::to_string(p.levels));
  }
}

std::size_t payload_bytes(const CodecParams& p, std::size_t n) {
  switch (p.id) {
    case kOneBit: return kFrameHeader + (n + 7) / 8;
    case kTopK: return kFrameHeader + 8 * p.k;
    case kRandomK: return kFrameHeader + 4 * p.k;
    default: return kFrameHeader + dither_bytes(n, p.levels);
  }
}

FramedCodec::FramedCodec(const CodecParams& p, std::uint64_t key, std::size_t n)
    : p_(p), key_(key), n_(n) {
  validate(p, n);
  max_bytes_ = payload_bytes(p, n);
  if (p.ef) residual_.assign(n, 0.0f);
  if (p.id == kRandomK) idx_.resize(p.k);
}

std::size_t FramedCodec::held_bytes() const {
  return sizeof(float) * residual_.size() +
         sizeof(std::uint32_t) * idx_.size() + sizeof(*this);
}

const std::uint32_t* FramedCodec::indices(std::uint64_t step) {
  if (!idx_valid_ || idx_step_ != step) {
    randomk_indices(n_, p_.k, p_.seed, key_, step, idx_.data());
    idx_step_ = step;
    idx_valid_ = true;
  }
  return idx_.data();
}

std::uint64_t FramedCodec::decode_impl(const std::uint8_t* p, std::size_t len, float* out,
                                       bool add, std::int64_t divisor, bool stream, bool check) {
  if (add || divisor < 1) divisor = 1;
  const float div = static_cast<float>(divisor);
  const std::string name = id_name(p_.id);
  if (len != max_bytes_)
    bad(name + " payload has " + std::to_string(len) + " bytes; " + std::to_string(n_) +
        " elements need exactly " + std::to_string(max_bytes_));
  FrameHeader f;
  std::memcpy(&f, p, sizeof f);
  if (std::memcmp(f.magic, kFrameMagic, sizeof f.magic) != 0 || f.version != kFrameVersion)
    bad(name + " payload: bad magic/version; expected b'" + std::string(kFrameMagic, 2) + "'/" +
        std::to_string(kFrameVersion));
  if (f.id != p_.id)
    bad(name + " payload carries compressor id " + std::to_string(f.id) + " (" +
        id_name(f.id) + "), expected " + std::to_string(p_.id));
  if (f.n != n_)
    bad(name + " payload is of " + std::to_string(f.n) + " elements, expected " +
        std::to_string(n_));
  const std::uint8_t* body = p + kFrameHeader;
  const std::size_t blen = len - kFrameHeader;
  try {
    switch (p_.id) {
      case kOneBit:  // (+-s) / d is +-(s / d), bit for bit
        if (check) check_scale(name, "scale", bits_float(f.field));
        onebit_decode(body, n_, divisor > 1 ? bits_float(f.field) / div : bits_float(f.field),
                      out, add, stream);
        break;
      case kTopK:
      case kRandomK:
        if (f.field != p_.k)
          bad(name + " payload carries k = " + std::to_string(f.field) + ", expected " +
              std::to_string(p_.k));
        {
          const std::uint8_t* vals = p_.id == kTopK ? body + 4 * p_.k : body;
          if (check) check_sparse(name, p_.id == kTopK ? body : nullptr, vals, p_.k);
          if (divisor > 1) {  // the k values divided before they land: 0 / d is 0
            thread_local std::vector<float> dv;
            dv.resize(p_.k);
            std::memcpy(dv.data(), vals, 4 * p_.k);
            for (float& v : dv) v = v / div;
            vals = reinterpret_cast<const std::uint8_t*>(dv.data());
          }
          if (p_.id == kTopK)
            scatter(body, vals, p_.k, out, n_, add);
          else
            scatter(indices(f.step), vals, p_.k, out, n_, add);
        }
        break;
      default:
        if (check) check_scale(name, "norm", bits_float(f.field));
        dither_decode(body, blen, n_, p_.levels, p_.natural, bits_float(f.field), out, add);
        if (divisor > 1)
          for (std::size_t i = 0; i < n_; ++i) out[i] = out[i] / div;
    }
  } catch (const std::out_of_range& exc) {
    bad(name + " payload: " + exc.what());
  }
  return f.step;
}

void FramedCodec::encode_plain(const float* x, std::uint64_t step, std::uint8_t* out) {
  std::uint8_t* body = out + kFrameHeader;
  std::uint32_t field = 0;
  switch (p_.id) {
    case kOneBit:
      field = float_bits(onebit_encode(x, n_, body, p_.scaling));
      break;
    case kTopK:
      topk_select(x, n_, p_.k, body, body + 4 * p_.k);
      field = static_cast<std::uint32_t>(p_.k);
      break;
    case kRandomK:
      gather(x, n_, indices(step), p_.k, body);
      field = static_cast<std::uint32_t>(p_.k);
      break;
    default:
      field = float_bits(
          dither_encode(x, n_, p_.levels, p_.natural, p_.l2, p_.seed, key_, step, body));
  }
  put_header(out, p_.id, n_, step, field);
}

std::size_t FramedCodec::encode(const float* x, std::uint64_t step, std::uint8_t* out) {
  if (!p_.ef) {
    encode_plain(x, step, out);
    return max_bytes_;
  }
  // exactly numpy's np.add / np.subtract, element by element (no contraction: ISO C++17),
  // as compression.py's _ErrorFeedbackCodec: y = x + r formed in r's own memory (r is not
  // needed again), so the passes stream x and r once each; d is the thread's scratch, shared
  // by every codec it runs (scratch per codec put each partition's passes on memory of its
  // own, out of cache: memory bandwidth set the speed)
  float* y = residual_.data();
  if (p_.id == kOneBit) {  // y, its packing and scale in one pass, which takes the residual
    const float scale = onebit_ef_encode(x, y, n_, out + kFrameHeader, p_.scaling,  // of the
                                         unsettled_ ? &unsettled_scale_ : nullptr);  // last y
    put_header(out, kOneBit, n_, step, float_bits(scale));
    unsettled_ = true;  // r = y - decode(payload) is left to the next encode's pass
    unsettled_scale_ = scale;
    return max_bytes_;
  }
  if (p_.id == kTopK) {  // y, its selection and r = y - decoded in two passes
    std::uint8_t* body = out + kFrameHeader;
    topk_ef_encode(x, y, n_, p_.k, body, body + 4 * p_.k);
    put_header(out, kTopK, n_, step, static_cast<std::uint32_t>(p_.k));
    return max_bytes_;
  }
  for (std::size_t i = 0; i < n_; ++i) y[i] = x[i] + y[i];
  encode_plain(y, step, out);
  if (p_.id == kRandomK) {  // d is 0 but at the k indices (y - 0 is y: y is a sum, no
    const std::uint8_t* idx = reinterpret_cast<const std::uint8_t*>(indices(step));
    const std::uint8_t* val = out + kFrameHeader;  // signalling NaN)
    for (std::size_t j = 0; j < p_.k; ++j) {
      std::uint32_t i;
      float v;
      std::memcpy(&i, idx + 4 * j, 4);
      std::memcpy(&v, val + 4 * j, 4);
      y[i] = y[i] - v;
    }
    return max_bytes_;
  }
  thread_local std::vector<float> td;
  if (td.size() < n_) td.resize(n_);
  float* d = td.data();
  decode_impl(out, max_bytes_, d, false, 1, false, false);  // its own payload: NaN may stay
  for (std::size_t i = 0; i < n_; ++i) y[i] = y[i] - d[i];
  return max_bytes_;
}

}  // namespace compress
}  // namespace bps
