// Python bindings of the formats defined once in C++: the wire header (wire.h), the codec
// frame (codec.h) and the declaration (decl.h), each exported as a spec that byteps_like/wire.py
// and compression.py build their structs from, with pack/parse hooks for the tests that hold
// both sides together; and the handshake's HMAC (crypto.h). Documented in byteps_like/_core.pyi.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "codec.h"
#include "crypto.h"
#include "dataplane.h"
#include "dataplane_io.h"
#include "decl.h"
#include "wire.h"

namespace py = pybind11;

namespace bps {
namespace {

// What every spec says: magic, version, the header's size and its fields.
py::dict layout(const char* magic, std::size_t magic_len, int version, std::size_t size,
                py::list fields) {
  py::dict d;
  d["magic"] = py::bytes(magic, magic_len);
  d["version"] = version;
  d["header_size"] = size;
  d["header"] = fields;
  return d;
}

// One field of a packed struct as a spec lists it: (name, offset, size, struct code).
#define BPS_SPEC_FIELD(S, f)                                                                   \
  fields.append(py::make_tuple(#f, offsetof(S, f), sizeof(S::f),                              \
                               dp::StructCode<decltype(S::f)>::value));
#define BPS_HEADER_FIELD(f) BPS_SPEC_FIELD(dp::Header, f)
#define BPS_FRAME_FIELD(f) BPS_SPEC_FIELD(compress::FrameHeader, f)
#define BPS_DECL_FIELD(f) BPS_SPEC_FIELD(dp::DeclHead, f)
// The layout of struct S, whose fields LIST names (X-macro) and FIELD appends.
#define BPS_LAYOUT(S, LIST, FIELD, magic, version)                                             \
  [] {                                                                                         \
    py::list fields;                                                                           \
    LIST(FIELD)                                                                                \
    return layout(magic, sizeof magic, version, sizeof(S), fields);                           \
  }()

// ---- the wire protocol's one definition (wire.h), for byteps_like/wire.py ----
py::dict wire_spec() {
  py::dict d = BPS_LAYOUT(dp::Header, BPS_WIRE_HEADER_FIELDS, BPS_HEADER_FIELD, dp::kMagic,
                          dp::kVersion);
  py::dict types, flags, roles;
#define BPS_ITEM(dict, cname, pyname, value) dict[#pyname] = static_cast<int>(dp::cname);
#define BPS_TYPE(cname, pyname, value) BPS_ITEM(types, cname, pyname, value)
#define BPS_FLAG(cname, pyname, bit) BPS_ITEM(flags, cname, pyname, bit)
#define BPS_ROLE(cname, pyname, value) BPS_ITEM(roles, cname, pyname, value)
  BPS_WIRE_MSG_TYPES(BPS_TYPE)
  BPS_WIRE_FLAGS(BPS_FLAG)
  BPS_WIRE_ROLES(BPS_ROLE)
#undef BPS_ITEM
#undef BPS_TYPE
#undef BPS_FLAG
#undef BPS_ROLE
  d["msg_types"] = types;
  d["flags"] = flags;
  d["roles"] = roles;
  d["contrib_shift"] = dp::kContribShift;
  d["max_meta"] = dp::kMaxMeta;
  py::list dtypes;  // (name, itemsize, summable) in code order
  for (const auto& t : dp::kWireDTypes)
    dtypes.append(py::make_tuple(t.name, t.itemsize, t.kernel >= 0));
  d["dtypes"] = dtypes;
  return d;
}

py::dict codec_frame_spec() {
  namespace c = compress;
  py::dict d = BPS_LAYOUT(c::FrameHeader, BPS_FRAME_FIELDS, BPS_FRAME_FIELD, c::kFrameMagic,
                          c::kFrameVersion);
  py::list codecs;  // (name, id, the struct code of the header's field)
#define BPS_CODEC(cname, pyname, id, field) \
  codecs.append(py::make_tuple(#pyname, static_cast<int>(c::cname), field));
  BPS_CODECS(BPS_CODEC)
#undef BPS_CODEC
  d["codecs"] = codecs;
  return d;
}

// ---- the declaration's one definition (decl.h), for byteps_like/wire.py ----
py::dict decl_spec() {
  py::dict d = BPS_LAYOUT(dp::DeclHead, BPS_DECL_FIELDS, BPS_DECL_FIELD, dp::kDeclMagic,
                          dp::kDeclVersion);
  d["max_dims"] = dp::kDeclMaxDims;
  d["max_codec"] = dp::kDeclMaxCodec;
  d["max_name"] = dp::kDeclMaxName;
  d["max_spec"] = dp::kDeclMaxSpec;
  d["max_bytes"] = dp::kDeclMaxBytes;
  return d;
}

#undef BPS_LAYOUT
#undef BPS_DECL_FIELD
#undef BPS_FRAME_FIELD
#undef BPS_HEADER_FIELD
#undef BPS_SPEC_FIELD

// A declaration as the native data plane writes one (for tests).
py::bytes decl_pack(int dtype, std::vector<std::int64_t> shape, std::uint32_t part,
                    std::uint32_t nparts, std::uint64_t count, std::vector<std::uint64_t> codec,
                    py::bytes name, py::bytes spec) {
  if (dtype < 0 || dtype > 255) throw py::value_error("decl_pack: a dtype code out of 0..255");
  dp::Decl d;
  d.dtype = dtype;
  d.shape = std::move(shape);
  d.part = part;
  d.nparts = nparts;
  d.count = count;
  d.codec = std::move(codec);
  d.name = name;
  d.spec = spec;
  try {
    return py::bytes(dp::pack_decl(d));
  } catch (const std::invalid_argument& exc) {
    throw py::value_error(std::string("decl_pack: ") + exc.what());
  }
}

// A declaration's fields as the native data plane's server reads them; ValueError saying
// why it would refuse one.
py::dict decl_parse(py::bytes raw) {
  dp::Decl d;
  try {
    d = dp::parse_decl(raw);
  } catch (const std::invalid_argument& exc) {
    throw py::value_error(exc.what());
  }
  using namespace pybind11::literals;
  return py::dict("dtype"_a = d.dtype, "shape"_a = d.shape, "part"_a = d.part,
                  "nparts"_a = d.nparts, "count"_a = d.count, "codec"_a = d.codec,
                  "name"_a = py::bytes(d.name), "spec"_a = py::bytes(d.spec),
                  "text"_a = dp::describe_decl(raw));
}

// A header as the native data plane writes it (magic and version its own).
py::bytes wire_pack_header(int type, int dtype, int role, std::int32_t rank, std::uint32_t flags,
                           std::uint32_t job, std::uint64_t key, std::int64_t round,
                           std::uint64_t count, std::uint64_t nbytes) {
  for (int v : {type, dtype, role})
    if (v < 0 || v > 255) throw py::value_error("wire_pack_header: a code out of 0..255");
  const dp::Header h = dp::make_header(static_cast<std::uint8_t>(type),
                                       static_cast<std::uint8_t>(role), rank, flags, job, key,
                                       round, static_cast<std::uint8_t>(dtype), count, nbytes);
  return py::bytes(reinterpret_cast<const char*>(&h), sizeof h);
}

// A header as the native data plane reads it: its fields by name, and whether the data plane
// would take it as a data message (PUSH or PULL_RESP of a known dtype whose count fits nbytes).
py::dict wire_parse_header(py::bytes raw) {
  const std::string s = raw;
  if (s.size() != sizeof(dp::Header))
    throw py::value_error("wire_parse_header: " + std::to_string(s.size()) + " bytes, not " +
                          std::to_string(sizeof(dp::Header)));
  dp::Header h;
  std::memcpy(&h, s.data(), sizeof h);
  py::dict d;
  d["magic"] = py::bytes(h.magic, sizeof h.magic);
  d["version"] = h.version;
  d["type"] = h.type;
  d["dtype"] = h.dtype;
  d["role"] = h.role;
  d["rank"] = h.rank;
  d["flags"] = h.flags;
  d["job"] = h.job;
  d["key"] = h.key;
  d["round"] = h.round;
  d["count"] = h.count;
  d["nbytes"] = h.nbytes;
  d["valid_data"] = (h.type == dp::kPush || h.type == dp::kPullResp) &&
                    dp::count_matches(h, dp::wire_itemsize(h.dtype));
  return d;
}

}  // namespace

void bind_wire(py::module_& m) {
  m.def("wire_spec", &wire_spec,
        "The wire protocol's definition (csrc/wire.h): magic, version, header size and fields "
        "(name, offset, size, struct code), message types, flags, roles, dtypes (name, "
        "itemsize, summable) in code order, contrib_shift, max_meta.");
  m.def("codec_frame_spec", &codec_frame_spec,
        "The codec frame's definition (csrc/codec.h): magic, version, header size and fields "
        "(name, offset, size, struct code), and the built-in codecs (name, id, the struct code "
        "of the header's 4-byte field).");
  m.def("wire_pack_header", &wire_pack_header, py::arg("type"), py::arg("dtype"),
        py::arg("role"), py::arg("rank"), py::arg("flags"), py::arg("job"), py::arg("key"),
        py::arg("round"), py::arg("count"), py::arg("nbytes"),
        "A header packed by the native data plane's struct (for tests).");
  m.def("wire_parse_header", &wire_parse_header, py::arg("raw"),
        "A header's fields as the native data plane reads them (for tests).");
  m.def("decl_spec", &decl_spec,
        "The declaration's definition (csrc/decl.h): magic, version, head size and fields "
        "(name, offset, size, struct code), max_dims, max_codec, max_name, max_spec, "
        "max_bytes (the largest).");
  m.def("decl_pack", &decl_pack, py::arg("dtype"), py::arg("shape"), py::arg("part"),
        py::arg("nparts"), py::arg("count"), py::arg("codec"), py::arg("name"),
        py::arg("spec"), "A declaration packed by the native data plane's struct (for tests).");
  m.def("decl_parse", &decl_parse, py::arg("raw"),
        "A declaration's fields as the native data plane's server reads them, and its text in "
        "errors; ValueError saying why the server would refuse it (for tests).");
  m.def(
      "hmac_sha256",
      [](py::bytes key, py::bytes msg) {
        const std::string k = key, s = msg;
        std::uint8_t out[32];
        hmac_sha256(k.data(), k.size(), s.data(), s.size(), out);
        return py::bytes(reinterpret_cast<const char*>(out), 32);
      },
      py::arg("key"), py::arg("msg"),
      "HMAC-SHA256 of the data plane's handshake, by libcrypto (for tests); RuntimeError "
      "naming the package to install when libcrypto cannot be loaded.");
  m.def(
      "crypto_available",
      []() {
        std::string err;
        const bool ok = crypto_available(&err);
        return py::make_tuple(ok, err);
      },
      "(whether OpenSSL's libcrypto is loaded, the error when it cannot be).");
  m.def("_crypto_set_names", &crypto_set_names, py::arg("names"),
        "Testing hook: forget libcrypto and load it from these ':'-separated names from now on "
        "(empty: the default list); returns the previous list.");
}

}  // namespace bps
