// Python bindings of byteps_like._core: argument and buffer checks, then GIL-free work in
// ops.cc. Documented in byteps_like/_core.pyi.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

#include "codec.h"
#include "compress.h"
#include "dataplane.h"
#include "dataplane_coder.h"
#include "dataplane_failover.h"
#include "crypto.h"
#include "cpu.h"
#include "dtype.h"
#include "ops.h"
#include "parallel.h"

namespace py = pybind11;

namespace bps {
namespace {

// A C-contiguous buffer export of a Python object, viewed as raw bytes.
class Buffer {
 public:
  Buffer(py::handle obj, bool writable, const char* func, const char* arg) {
    if (!PyObject_CheckBuffer(obj.ptr())) {
      throw py::type_error(std::string(func) + ": " + arg +
                           " must support the buffer protocol (numpy array, bytes, bytearray, "
                           "memoryview, ...), got " + Py_TYPE(obj.ptr())->tp_name);
    }
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
      const std::string why = py::error_already_set().what();  // fetches and clears
      if (writable && PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) == 0) {
        PyBuffer_Release(&view_);
        throw py::value_error(std::string(func) + ": " + arg + " is read-only (" +
                              Py_TYPE(obj.ptr())->tp_name + "); it must be a writable buffer");
      }
      PyErr_Clear();
      throw py::value_error(std::string(func) + ": " + arg +
                            " must be a C-contiguous buffer (" + why + ")");
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { PyBuffer_Release(&view_); }

  void* data() const { return view_.buf; }
  std::size_t size() const { return static_cast<std::size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

DType to_dtype(const std::string& name, const char* func, const char* arg = "dtype") {
  DType dt;
  if (!parse_dtype(name, &dt)) {
    throw py::value_error(std::string(func) + ": unknown " + arg + " '" + name +
                          "'; expected one of: " + valid_dtype_names());
  }
  return dt;
}

// Checks a buffer pair holds the same whole number of elements of dt.
std::size_t element_count(const Buffer& dst, const Buffer& src, DType dt, const char* func) {
  const std::size_t size = itemsize(dt);
  if (dst.size() != src.size() || dst.size() % size != 0) {
    throw py::value_error(std::string(func) + ": dst has " + std::to_string(dst.size()) +
                          " bytes and src has " + std::to_string(src.size()) +
                          " bytes; they must be equal and a multiple of the " + dtype_name(dt) +
                          " itemsize (" + std::to_string(size) + ")");
  }
  return dst.size() / size;
}

void py_add_into(py::handle dst, py::handle src, const std::string& dtype, int nthreads) {
  const DType dt = to_dtype(dtype, "add_into");
  const Buffer d(dst, true, "add_into", "dst");
  const Buffer s(src, false, "add_into", "src");
  const std::size_t n = element_count(d, s, dt, "add_into");
  py::gil_scoped_release nogil;
  add_into(dt, d.data(), s.data(), n, nthreads);
}

void py_copy_into(py::handle dst, py::handle src, int nthreads) {
  const Buffer d(dst, true, "copy_into", "dst");
  const Buffer s(src, false, "copy_into", "src");
  if (d.size() != s.size()) {
    throw py::value_error("copy_into: dst has " + std::to_string(d.size()) + " bytes and src has " +
                          std::to_string(s.size()) + " bytes; they must be equal");
  }
  py::gil_scoped_release nogil;
  copy_into(d.data(), s.data(), d.size(), nthreads);
}

void py_scale_into(py::handle buf, const std::string& dtype, std::int64_t divisor, int nthreads) {
  const DType dt = to_dtype(dtype, "scale_into");
  if (divisor < 1) {
    throw py::value_error("scale_into: divisor must be >= 1, got " + std::to_string(divisor));
  }
  const Buffer b(buf, true, "scale_into", "buf");
  if (b.size() % itemsize(dt) != 0) {
    throw py::value_error("scale_into: buf has " + std::to_string(b.size()) +
                          " bytes, not a multiple of the " + dtype_name(dt) + " itemsize (" +
                          std::to_string(itemsize(dt)) + ")");
  }
  py::gil_scoped_release nogil;
  scale_into(dt, b.data(), b.size() / itemsize(dt), divisor, nthreads);
}

void py_convert(py::handle dst, const std::string& dst_dtype, py::handle src,
                const std::string& src_dtype, int nthreads) {
  const DType ddt = to_dtype(dst_dtype, "convert", "dst_dtype");
  const DType sdt = to_dtype(src_dtype, "convert", "src_dtype");
  if (!can_convert(ddt, sdt)) {
    throw py::value_error(std::string("convert: ") + dtype_name(sdt) + " -> " + dtype_name(ddt) +
                          " is not supported; supported: float32 -> float16, float16 -> float32, "
                          "float32 -> bfloat16, bfloat16 -> float32");
  }
  const Buffer d(dst, true, "convert", "dst");
  const Buffer s(src, false, "convert", "src");
  const std::size_t dsize = itemsize(ddt), ssize = itemsize(sdt);
  if (d.size() % dsize != 0 || s.size() % ssize != 0 || d.size() / dsize != s.size() / ssize) {
    throw py::value_error("convert: dst has " + std::to_string(d.size()) + " bytes (" +
                          dtype_name(ddt) + ", itemsize " + std::to_string(dsize) +
                          ") and src has " + std::to_string(s.size()) + " bytes (" +
                          dtype_name(sdt) + ", itemsize " + std::to_string(ssize) +
                          "); both must hold the same whole number of elements");
  }
  py::gil_scoped_release nogil;
  convert(ddt, d.data(), sdt, s.data(), d.size() / dsize, nthreads);
}

py::dict py_cpu_features() {
  const CpuFeatures& f = cpu_features();
  const Isa isa = active_isa();
  py::dict out;
  out["x86_64"] = f.x86_64;
  out["sse2"] = f.sse2;
  out["avx"] = f.avx;
  out["avx2"] = f.avx2;
  out["fma"] = f.fma;
  out["f16c"] = f.f16c;
  out["avx512f"] = f.avx512f;
  out["avx512bw"] = f.avx512bw;
  out["avx512vl"] = f.avx512vl;
  out["detected_isa"] = isa_name(detected_isa());
  out["isa"] = isa_name(isa);
  out["kernel_fp16"] = isa == Isa::kAvx512 ? "f16c-avx512" : isa == Isa::kAvx2 ? "f16c-avx2" : "scalar";
  out["kernel_bf16"] = isa_name(isa);
  out["kernel_float32"] = isa_name(isa);
  out["max_threads"] = kMaxThreads;
  out["min_bytes_per_thread"] = kMinBytesPerThread;
  return out;
}

std::string py_set_isa(const std::string& name) {
  const std::string previous = isa_name(active_isa());
  if (name == "auto") {
    reset_isa_limit();
    return previous;
  }
  Isa isa;
  if (!parse_isa(name.c_str(), &isa)) {
    throw py::value_error("_set_isa: unknown level '" + name +
                          "'; expected one of: auto, scalar, avx2, avx512");
  }
  if (!set_isa_limit(isa)) {
    throw py::value_error("_set_isa: this CPU does not support '" + name + "' (detected: " +
                          isa_name(detected_isa()) + ")");
  }
  return previous;
}

// ---- compression kernels (compress.h): buffers are checked here, bodies there ----
std::size_t f32_count(const Buffer& b, const char* func, const char* arg) {
  if (b.size() % 4 != 0) {
    throw py::value_error(std::string(func) + ": " + arg + " has " + std::to_string(b.size()) +
                          " bytes, not a whole number of float32");
  }
  return b.size() / 4;
}
void need_bytes(const Buffer& b, std::size_t want, const char* func, const char* arg) {
  if (b.size() != want) {
    throw py::value_error(std::string(func) + ": " + arg + " has " + std::to_string(b.size()) +
                          " bytes, expected " + std::to_string(want));
  }
}

float py_onebit_encode(py::handle x, py::handle bits, bool scaling) {
  const Buffer xs(x, false, "onebit_encode", "x"), bs(bits, true, "onebit_encode", "bits");
  const std::size_t n = f32_count(xs, "onebit_encode", "x");
  need_bytes(bs, (n + 7) / 8, "onebit_encode", "bits");
  py::gil_scoped_release nogil;
  return compress::onebit_encode(static_cast<const float*>(xs.data()), n,
                                 static_cast<std::uint8_t*>(bs.data()), scaling);
}

void py_onebit_decode(py::handle bits, float scale, py::handle out, bool add) {
  const Buffer bs(bits, false, "onebit_decode", "bits"), os(out, true, "onebit_decode", "out");
  const std::size_t n = f32_count(os, "onebit_decode", "out");
  need_bytes(bs, (n + 7) / 8, "onebit_decode", "bits");
  py::gil_scoped_release nogil;
  compress::onebit_decode(static_cast<const std::uint8_t*>(bs.data()), n, scale,
                          static_cast<float*>(os.data()), add);
}

float py_onebit_ef_encode(py::handle x, py::handle r, py::handle bits, bool scaling,
                          std::optional<float> settle) {
  const Buffer xs(x, false, "onebit_ef_encode", "x"), rs(r, true, "onebit_ef_encode", "r"),
      bs(bits, true, "onebit_ef_encode", "bits");
  const std::size_t n = f32_count(xs, "onebit_ef_encode", "x");
  need_bytes(rs, 4 * n, "onebit_ef_encode", "r");
  need_bytes(bs, (n + 7) / 8, "onebit_ef_encode", "bits");
  py::gil_scoped_release nogil;
  return compress::onebit_ef_encode(static_cast<const float*>(xs.data()),
                                    static_cast<float*>(rs.data()), n,
                                    static_cast<std::uint8_t*>(bs.data()), scaling,
                                    settle ? &*settle : nullptr);
}

void py_onebit_residual(py::handle y, float scale) {
  const Buffer ys(y, true, "onebit_residual", "y");
  const std::size_t n = f32_count(ys, "onebit_residual", "y");
  py::gil_scoped_release nogil;
  compress::onebit_residual(static_cast<float*>(ys.data()), n, scale);
}

// The arguments of a sparse kernel, checked: a dense float32 array of n elements (x, or out),
// k float32 values (val) and their k uint32 indices (idx).
struct SparseArgs {
  SparseArgs(const char* func, py::handle d, const char* dname, bool dense_out, py::handle i,
             bool idx_out, py::handle v, bool val_out)
      : dense(d, dense_out, func, dname),
        idx(i, idx_out, func, "idx"),
        val(v, val_out, func, "val"),
        n(f32_count(dense, func, dname)),
        k(f32_count(val, func, "val")) {
    need_bytes(idx, 4 * k, func, "idx");
  }
  float* dense_f32() const { return static_cast<float*>(dense.data()); }
  const Buffer dense, idx, val;
  const std::size_t n, k;
};

void py_topk_select(py::handle x, py::handle idx, py::handle val) {
  const SparseArgs a("topk_select", x, "x", false, idx, true, val, true);
  py::gil_scoped_release nogil;
  compress::topk_select(a.dense_f32(), a.n, a.k, a.idx.data(), a.val.data());
}

void py_topk_ef_encode(py::handle x, py::handle r, py::handle idx, py::handle val) {
  const SparseArgs a("topk_ef_encode", x, "x", false, idx, true, val, true);
  const Buffer rs(r, true, "topk_ef_encode", "r");
  need_bytes(rs, 4 * a.n, "topk_ef_encode", "r");
  py::gil_scoped_release nogil;
  compress::topk_ef_encode(a.dense_f32(), static_cast<float*>(rs.data()), a.n, a.k,
                           a.idx.data(), a.val.data());
}

void py_gather(py::handle x, py::handle idx, py::handle val) {
  const SparseArgs a("gather", x, "x", false, idx, false, val, true);
  py::gil_scoped_release nogil;
  compress::gather(a.dense_f32(), a.n, a.idx.data(), a.k, a.val.data());
}

void py_scatter(py::handle idx, py::handle val, py::handle out, bool add) {
  const SparseArgs a("scatter", out, "out", true, idx, false, val, false);
  py::gil_scoped_release nogil;
  compress::scatter(a.idx.data(), a.val.data(), a.k, a.dense_f32(), a.n, add);
}

void py_randomk_indices(std::uint64_t n, std::uint64_t seed, std::uint64_t key, std::uint64_t step,
                        py::handle idx) {
  const Buffer is(idx, true, "randomk_indices", "idx");
  const std::size_t k = f32_count(is, "randomk_indices", "idx");
  py::gil_scoped_release nogil;
  compress::randomk_indices(n, k, seed, key, step, is.data());
}

float py_dither_encode(py::handle x, py::handle out, int levels, bool natural, bool l2,
                       std::uint64_t seed, std::uint64_t key, std::uint64_t step) {
  const Buffer xs(x, false, "dither_encode", "x"), os(out, true, "dither_encode", "out");
  const std::size_t n = f32_count(xs, "dither_encode", "x");
  if (levels < 1 || levels > 65535) throw py::value_error("dither_encode: levels out of range");
  need_bytes(os, compress::dither_bytes(n, levels), "dither_encode", "out");
  py::gil_scoped_release nogil;
  return compress::dither_encode(static_cast<const float*>(xs.data()), n, levels, natural, l2,
                                 seed, key, step, static_cast<std::uint8_t*>(os.data()));
}

void py_dither_decode(py::handle body, float norm, py::handle out, int levels, bool natural,
                      bool add) {
  const Buffer bs(body, false, "dither_decode", "body"), os(out, true, "dither_decode", "out");
  const std::size_t n = f32_count(os, "dither_decode", "out");
  py::gil_scoped_release nogil;
  compress::dither_decode(static_cast<const std::uint8_t*>(bs.data()), bs.size(), n, levels,
                          natural, norm, static_cast<float*>(os.data()), add);
}

void bind_compress(py::module_& m) {
  m.def("onebit_encode", &py_onebit_encode, py::arg("x"), py::arg("bits"),
        py::arg("scaling") = true, "Sign bits of float32 x into bits; returns mean |x| or 1.");
  m.def("onebit_decode", &py_onebit_decode, py::arg("bits"), py::arg("scale"), py::arg("out"),
        py::arg("add") = false, "out (+)= +-scale by the sign bits.");
  m.def("onebit_ef_encode", &py_onebit_ef_encode, py::arg("x"), py::arg("r"), py::arg("bits"),
        py::arg("scaling"), py::arg("settle") = py::none(),
        "r = x + r and onebit_encode(r, bits, scaling) in one pass; returns the scale. With "
        "settle: onebit_residual(r, settle) first, in the same pass.");
  m.def("onebit_residual", &py_onebit_residual, py::arg("y"), py::arg("scale"),
        "y -= what onebit_decode gives for onebit_encode's bits of y (error feedback, one pass).");
  m.def("topk_select", &py_topk_select, py::arg("x"), py::arg("idx"), py::arg("val"),
        "The len(val) entries of largest |x|: increasing u32 indices and their values.");
  m.def("topk_ef_encode", &py_topk_ef_encode, py::arg("x"), py::arg("r"), py::arg("idx"),
        py::arg("val"),
        "r = x + r; topk_select(r, idx, val); r[idx] -= val (error feedback, two passes).");
  m.def("gather", &py_gather, py::arg("x"), py::arg("idx"), py::arg("val"), "val = x[idx].");
  m.def("scatter", &py_scatter, py::arg("idx"), py::arg("val"), py::arg("out"),
        py::arg("add") = false, "out[idx] (+)= val; out is zeroed first unless add.");
  m.def("randomk_indices", &py_randomk_indices, py::arg("n"), py::arg("seed"), py::arg("key"),
        py::arg("step"), py::arg("idx"), "len(idx) distinct increasing indices of range(n).");
  m.def("dither_bytes", &compress::dither_bytes, py::arg("n"), py::arg("levels"),
        "Body bytes of n dithered elements.");
  m.def("dither_encode", &py_dither_encode, py::arg("x"), py::arg("out"), py::arg("levels"),
        py::arg("natural"), py::arg("l2"), py::arg("seed"), py::arg("key"), py::arg("step"),
        "Stochastic quantisation of x into out; returns the norm.");
  m.def("dither_decode", &py_dither_decode, py::arg("body"), py::arg("norm"), py::arg("out"),
        py::arg("levels"), py::arg("natural"), py::arg("add") = false,
        "out (+)= the dithered values of body.");
}


// ---- the framed codecs (codec.h): the native server's, for tests against compression.py ----
void bind_codec(py::module_& m) {
  py::class_<dp::CastCoder, std::shared_ptr<dp::CastCoder>>(m, "NativeCast")
      .def(py::init([](std::size_t n, const std::string& wire) {
             try {
               return std::make_shared<dp::CastCoder>(n, to_dtype(wire, "NativeCast", "wire"));
             } catch (const std::invalid_argument& exc) {
               throw py::value_error(std::string("NativeCast: ") + exc.what());
             }
           }),
           py::arg("n"), py::arg("wire"),
           "A float32 partition of n elements cast to `wire` (float16, bfloat16) for the "
           "native data plane's coded operations (DataClient.submit(codecs=...)).")
      .def_property_readonly("n", &dp::CastCoder::count)
      .def_property_readonly("wire_bytes", &dp::CastCoder::wire_bytes);
  py::class_<compress::FramedCodec, std::shared_ptr<compress::FramedCodec>>(m, "NativeCodec")
      .def(py::init([](const std::vector<std::uint64_t>& params, std::uint64_t key,
                       std::size_t n) {
             try {
               return new compress::FramedCodec(compress::params_from_list(params), key, n);
             } catch (const std::invalid_argument& exc) {
               throw py::value_error(std::string("NativeCodec: ") + exc.what());
             }
           }),
           py::arg("params"), py::arg("key"), py::arg("n"))
      .def_property_readonly("n", &compress::FramedCodec::n)
      .def_property_readonly("max_bytes", &compress::FramedCodec::max_bytes)
      .def_property_readonly("held_bytes", &compress::FramedCodec::held_bytes)
      .def(
          "encode",
          [](compress::FramedCodec& c, py::handle x, std::uint64_t step, py::handle out) {
            const Buffer xs(x, false, "NativeCodec.encode", "x"),
                os(out, true, "NativeCodec.encode", "out");
            need_bytes(xs, 4 * c.n(), "NativeCodec.encode", "x");
            need_bytes(os, c.max_bytes(), "NativeCodec.encode", "out");
            py::gil_scoped_release nogil;
            c.encode(static_cast<const float*>(xs.data()), step,
                     static_cast<std::uint8_t*>(os.data()));
          },
          py::arg("x"), py::arg("step"), py::arg("out"))
      .def(
          "decode",
          [](compress::FramedCodec& c, py::handle payload, py::handle out, bool add) {
            const Buffer ps(payload, false, "NativeCodec.decode", "payload"),
                os(out, true, "NativeCodec.decode", "out");
            need_bytes(os, 4 * c.n(), "NativeCodec.decode", "out");
            try {
              py::gil_scoped_release nogil;
              return c.decode(static_cast<const std::uint8_t*>(ps.data()), ps.size(),
                              static_cast<float*>(os.data()), add);
            } catch (const std::invalid_argument& exc) {
              throw py::value_error(exc.what());
            }
          },
          py::arg("payload"), py::arg("out"), py::arg("add") = false);
}

// ---- a registered compressor's server codec on the native plane: its math is Python ----
// Whether Python can run code now (not before its start, not while it shuts down).
bool python_gone() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// A Python exception as one line: "TypeName: text" (the text alone for `plain`), at most 500
// characters of it (the codec is the user's; its text goes into our replies and log). GIL held.
std::string py_error_text(py::error_already_set& e, bool plain) {
  std::string text, name = "error";
  try {
    text = py::str(e.value()).cast<std::string>();
    name = py::str(e.type().attr("__name__")).cast<std::string>();
  } catch (const std::exception&) {
    text = "(an exception that cannot be shown)";
  }
  if (text.size() > 500) text = text.substr(0, 500) + "...";
  return plain ? text : name + ": " + text;
}

// Python objects held from C++ threads: let go with the GIL taken, or leaked once Python
// shuts down (a reference count is not touched without the GIL).
void drop_py(py::object& o) {
  if (!o) return;
  if (python_gone()) {
    o.release();
    return;
  }
  py::gil_scoped_acquire gil;
  o = py::object();
}

// The server's codec of one compressed key whose compressor is a registered one (codec.h,
// ServerCodec): the object compression.make_codec(n, role="server", key=key) made, its
// decode/decode_add/encode called with the GIL taken for the call alone. Its accumulator is a
// numpy array of its own (Python code may keep a reference to what it was given); payloads
// go to it as bytes (copies: the stream's buffer is reused). The codec's CompressionError (the
// `malformed` type) is a malformed payload (std::invalid_argument); anything else the codec
// raises or answers wrongly is a CodecFault. Not thread-safe, as any ServerCodec: the key's
// store serialises calls. Made with the GIL held.
class PyServerCodec : public compress::ServerCodec {
 public:
  PyServerCodec(py::object codec, std::size_t n, std::size_t held, py::object malformed)
      : codec_(std::move(codec)), malformed_(std::move(malformed)), n_(n), held_(held) {
    const py::object mb = codec_.attr("max_bytes");
    if (!py::isinstance<py::int_>(mb) || py::isinstance<py::bool_>(mb) || mb.cast<py::int_>() < py::int_(1))
      throw std::invalid_argument("its server codec's max_bytes is not a positive integer");
    max_bytes_ = mb.cast<std::size_t>();
    acc_ = py::module_::import("numpy").attr("zeros")(n, "float32");
    Py_buffer view;
    if (PyObject_GetBuffer(acc_.ptr(), &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0)
      throw py::error_already_set();
    accp_ = static_cast<float*>(view.buf);
    PyBuffer_Release(&view);
  }
  ~PyServerCodec() override {
    drop_py(codec_);
    drop_py(malformed_);
    drop_py(acc_);
  }
  std::size_t n() const override { return n_; }
  std::size_t max_bytes() const override { return max_bytes_; }
  bool exact() const override { return false; }
  std::size_t held_bytes() const override { return held_; }
  float* accumulator() override { return accp_; }

  std::uint64_t decode(const std::uint8_t* p, std::size_t len, float* out, bool add) override {
    if (out != accp_) throw compress::CodecFault("decode into another buffer than its own");
    std::string fault, bad;
    std::uint64_t step = 0;
    call([&] {
      py::object r = codec_.attr(add ? "decode_add" : "decode")(
          py::bytes(reinterpret_cast<const char*>(p), len), acc_);
      if (!py::isinstance<py::int_>(r) || py::isinstance<py::bool_>(r))
        fault = std::string(add ? "decode_add" : "decode") + " returned " +
                py::repr(r).cast<std::string>().substr(0, 100) + ", not the payload's step";
      else
        step = r.cast<std::uint64_t>();
    }, &fault, &bad);
    if (!bad.empty()) throw std::invalid_argument(bad);
    if (!fault.empty()) throw compress::CodecFault(fault);
    return step;
  }

  std::size_t encode(const float* x, std::uint64_t step, std::uint8_t* out) override {
    if (x != accp_) throw compress::CodecFault("encode of another buffer than its own");
    std::string fault, bad;
    std::size_t len = 0;
    call([&] {
      py::object r = codec_.attr("encode")(acc_, step);
      Py_buffer view;
      if (PyObject_GetBuffer(r.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
      len = static_cast<std::size_t>(view.len);
      if (len < 1 || len > max_bytes_)
        fault = "encode returned " + std::to_string(len) + " bytes; its payloads take 1 to " +
                std::to_string(max_bytes_) + " (max_bytes)";
      else
        std::memcpy(out, view.buf, len);
      PyBuffer_Release(&view);
    }, &fault, &bad);
    if (!bad.empty()) fault = bad;  // a sum the server made is not a malformed payload
    if (!fault.empty()) throw compress::CodecFault(fault);
    return len;
  }

 private:
  // fn() with the GIL taken; what it raises goes to *bad (the codec's CompressionError) or
  // *fault (anything else), as text.
  template <typename Fn>
  void call(Fn fn, std::string* fault, std::string* bad) {
    if (python_gone()) {
      *fault = "the server process is shutting down";
      return;
    }
    py::gil_scoped_acquire gil;
    try {
      fn();
    } catch (py::error_already_set& e) {
      const bool malformed = e.matches(malformed_);
      (malformed ? *bad : *fault) = py_error_text(e, malformed);
    } catch (const std::exception& e) {
      *fault = e.what();
    }
  }

  py::object codec_, malformed_, acc_;
  std::size_t n_, held_, max_bytes_ = 0;
  float* accp_ = nullptr;
};

// DataServer.set_codec_factory: factory(key, n, decl: bytes) -> (codec, held bytes), raising
// `malformed` (CompressionError) with the reason it makes none.
void set_codec_factory(dp::DataServer& s, py::object factory, py::object malformed) {
  auto keep = [](py::object o) {  // held by the server's threads; let go with the GIL
    return std::shared_ptr<py::object>(new py::object(std::move(o)), [](py::object* p) {
      drop_py(*p);
      delete p;
    });
  };
  auto fn = keep(std::move(factory)), err = keep(std::move(malformed));
  s.set_codec_factory([fn, err](std::uint64_t key, std::size_t n, const std::string& decl)
                          -> std::unique_ptr<compress::ServerCodec> {
    std::string why = "the server process is shutting down";
    if (!python_gone()) {
      py::gil_scoped_acquire gil;
      try {
        py::tuple made = (*fn)(key, n, py::bytes(decl)).cast<py::tuple>();
        if (made.size() != 2) throw std::invalid_argument("the codec factory answered no pair");
        return std::unique_ptr<compress::ServerCodec>(
            new PyServerCodec(made[0], n, made[1].cast<std::size_t>(), *err));
      } catch (py::error_already_set& e) {
        why = py_error_text(e, e.matches(*err));
      } catch (const std::exception& e) {
        why = e.what();
      }
    }
    throw std::invalid_argument(why);
  });
}

// ---- the native data plane (dataplane.h): every blocking call releases the GIL ----
py::dict counters_dict(const std::map<std::string, std::uint64_t>& m) {
  py::dict d;
  for (const auto& kv : m) d[py::str(kv.first)] = kv.second;
  return d;
}

py::tuple completion_tuple(const dp::Completion& c) {
  py::list times;
  for (std::size_t i = 0; i + 2 < c.times.size(); i += 3)
    times.append(py::make_tuple(c.times[i], c.times[i + 1], c.times[i + 2]));
  return py::make_tuple(c.op, c.ok, c.kind, c.server, py::bytes(c.message), c.t_first_send,
                        c.t_last_done, c.bytes, times, c.contrib);
}

// The UCX loader and the bare UCX stream of the hostile-peer tests.
void bind_ucx(py::module_& m) {
  m.def(
      "ucx_load",
      [](const std::string& path, const std::map<std::string, std::string>& settings) {
        std::string err;
        py::gil_scoped_release nogil;
        dp::ucx_load(path, settings, &err);
        return err;
      },
      py::arg("path"), py::arg("settings") = std::map<std::string, std::string>(),
      "Open libucp at path for the data plane's UCX streams, with UCX settings (names without "
      "UCX_) over the UCX_* environment; '' when they are usable, else why not (the first "
      "call's answer holds for the process).");
  m.def("ucx_unavailable", &dp::ucx_unavailable,
        "'' when the data plane's UCX streams are usable (ucx_load succeeded), else why not.");
  py::class_<dp::UcxRawStream>(m, "UcxRawStream",
                                "A bare UCX stream for tests that play a hostile peer.")
      .def(py::init<const std::string&, int>(), py::arg("host"), py::arg("port"),
           py::call_guard<py::gil_scoped_release>())
      .def("send",
           [](dp::UcxRawStream& s, py::bytes b, double timeout, bool rndv) {
             std::string d = b;
             py::gil_scoped_release g;
             s.send(d, timeout, rndv);
           },
           py::arg("data"), py::arg("timeout"), py::arg("rndv") = false,
           "One message of the stream: eager, or with rendezvous (rndv).")
      .def("recv",
           [](dp::UcxRawStream& s, std::size_t n, double timeout, bool all) {
             std::string d;
             {
               py::gil_scoped_release g;
               d = s.recv(n, timeout, all);
             }
             return py::bytes(d);
           },
           py::arg("n"), py::arg("timeout"), py::arg("all") = false)
      .def("close", &dp::UcxRawStream::close, py::call_guard<py::gil_scoped_release>());
  m.def("ucx_built", &dp::ucx_built,
        "Whether this _core was built with UCX's headers (it can load UCX at run time).");
  m.def("failover_owner", &dp::hrw_owner, py::arg("key"), py::arg("alive"),
        "The server of a key whose first server is lost, among the servers `alive` "
        "(rendezvous hashing, as the native client routes it); -1 when none is alive.");
}

// fn() without the GIL; its answer.
template <typename Fn>
auto nogil(Fn fn) -> decltype(fn()) {
  py::gil_scoped_release release;
  return fn();
}

// A DataServer is deleted without the GIL: its close() joins I/O threads, one of which may
// wait for the GIL in a registered compressor's codec.
struct DeleteNoGil {
  void operator()(dp::DataServer* s) const {
    py::gil_scoped_release release;
    delete s;
  }
};

// py::init of a data server or client whose argument K is the job's key: with a key,
// libcrypto is loaded first (crypto.h), so where it is missing the error comes now, not at
// a stream's hello.
template <class T, std::size_t K, class... A>
auto init_keyed() {
  return py::init([](A... a) {
    if (!std::get<K>(std::tie(a...)).empty()) require_crypto();
    return new T(std::move(a)...);
  });
}

void bind_data_server(py::module_& m) {
  py::class_<dp::DataServer, std::unique_ptr<dp::DataServer, DeleteNoGil>>(m, "DataServer")
      .def(init_keyed<dp::DataServer, 7, int, int, std::uint32_t, int, std::uint64_t,
                      std::uint64_t, int, std::string, bool>(),
           py::arg("num_workers"), py::arg("server_rank"), py::arg("job"),
           py::arg("io_threads"), py::arg("max_message_bytes"), py::arg("max_store_bytes"),
           py::arg("max_connections"), py::arg("auth_key") = py::bytes(),
           py::arg("async_mode") = false)
      .def("listen", &dp::DataServer::listen, py::arg("host"), py::arg("port"),
           py::call_guard<py::gil_scoped_release>())
      .def("listen_ucx", &dp::DataServer::listen_ucx, py::arg("host"), py::arg("port"),
           py::call_guard<py::gil_scoped_release>())
      .def("start", &dp::DataServer::start, py::call_guard<py::gil_scoped_release>())
      .def("close", &dp::DataServer::close, py::call_guard<py::gil_scoped_release>())
      // no call below holds the GIL while it waits for a lock of the server: an I/O thread may
      // hold one while it waits for the GIL (a registered compressor's codec)
      .def("reserve", &dp::DataServer::reserve, py::arg("bytes"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_rank", &dp::DataServer::set_rank, py::arg("rank"))
      .def("set_codec_factory", &set_codec_factory, py::arg("factory"), py::arg("malformed"))
      .def("set_partition_bytes", &dp::DataServer::set_partition_bytes, py::arg("nbytes"))
      .def("set_staleness", &dp::DataServer::set_staleness, py::arg("rounds"))
      .def("set_backup_max_lag", &dp::DataServer::set_backup_max_lag, py::arg("rounds"))
      .def("set_members", &dp::DataServer::set_members, py::arg("joined"), py::arg("left"),
           py::call_guard<py::gil_scoped_release>())
      .def("reset_epoch", &dp::DataServer::reset_epoch, py::arg("round_base"),
           py::arg("required"), py::call_guard<py::gil_scoped_release>())
      .def("stats", [](dp::DataServer& s) { return counters_dict(nogil([&] { return s.stats(); })); })
      .def("async_values",
           [](dp::DataServer& s) {
             std::vector<dp::AsyncValue> v = nogil([&] { return s.async_values(); });
             py::list out;
             for (auto& a : v)
               out.append(py::make_tuple(a.key, a.wire_dtype, py::bytes(a.value)));
             return out;
           })
      .def("adopt_async",
           [](dp::DataServer& s, std::uint64_t key, py::bytes value) {
             std::string v = value;
             return nogil([&] { return s.adopt_async(key, std::move(v)); });
           },
           py::arg("key"), py::arg("value"))
      .def("rejected",
           [](dp::DataServer& s) { return counters_dict(nogil([&] { return s.rejected(); })); })
      .def(
          "stalls",
          [](dp::DataServer& s, double min_age) {
            const std::vector<dp::StallInfo> v = nogil([&] { return s.stalls(min_age); });
            py::list out;
            for (auto& si : v)
              out.append(py::make_tuple(si.key, si.round, si.age, si.pushed, py::bytes(si.decl)));
            return out;
          },
          py::arg("min_age"))
      .def("straggle", [](dp::DataServer& s) {
        std::vector<dp::StraggleRow> v = nogil([&] { return s.straggle(); });
        py::list out;
        for (auto& r : v) out.append(py::make_tuple(r.held_s, r.held_rounds, r.waited_s));
        return out;
      });
}

// DataClient.submit. Holds the GIL: it only checks, queues and returns (the I/O threads
// write).
void data_client_submit(dp::DataClient& c, std::uint64_t op, int priority, py::handle src,
                        py::handle dst, int wire_dtype, std::int64_t divisor,
                        std::int64_t round, py::list parts, bool compressed,
                        py::object codec_list) {
  std::vector<std::shared_ptr<dp::PartCoder>> codecs;
  if (!codec_list.is_none()) {
    // NativeCodec (a built-in codec: compressed=True, wire dtype float32, code 1) or NativeCast
    // (compressed=False, wire dtype its float16/bfloat16), one per part
    const int code = static_cast<int>(wire_dtype);
    for (py::handle c : codec_list.cast<py::list>()) {
      if (py::isinstance<compress::FramedCodec>(c) && compressed && code == 1) {
        codecs.push_back(std::make_shared<dp::FramedCoder>(
            c.cast<std::shared_ptr<compress::FramedCodec>>()));
      } else if (py::isinstance<dp::CastCoder>(c) && !compressed) {
        auto cc = c.cast<std::shared_ptr<dp::CastCoder>>();
        if (dp::wire_to_kernel_dtype(code) != static_cast<int>(cc->wire()))
          throw py::value_error("submit: a NativeCast's wire dtype differs from wire_dtype");
        codecs.push_back(cc);
      } else {
        throw py::value_error("submit: codecs make a coded operation: NativeCodec objects "
                              "with compressed=True and wire dtype float32 (code 1), or "
                              "NativeCast objects of the wire dtype, one per part");
      }
    }
    if (codecs.size() != parts.size())
      throw py::value_error("submit: codecs make a coded operation: one codec per part");
  }
  const std::size_t isz = dp::wire_itemsize(wire_dtype);
  if (compressed && codecs.empty() && (isz != 1 || divisor != 1))
    throw py::value_error("submit: a compressed payload is uint8 (wire dtype code "
                          "7) and is never divided");
  if (!compressed && dp::wire_to_kernel_dtype(wire_dtype) < 0)
    throw py::value_error("submit: wire dtype code " + std::to_string(wire_dtype) +
                          " cannot be summed");
  if (divisor < 1) throw py::value_error("submit: divisor must be >= 1");
  const Buffer s(src, false, "submit", "src");
  const Buffer d(dst, true, "submit", "dst");
  std::vector<dp::PartSpec> specs;
  specs.reserve(parts.size());
  for (py::handle item : parts) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 6) throw py::value_error("submit: a part is (key, server, conn, "
                                             "offset, nbytes, decl)");
    dp::PartSpec p;
    p.key = t[0].cast<std::uint64_t>();
    p.round = round;
    p.server = t[1].cast<int>();
    p.conn = t[2].cast<int>();
    p.offset = t[3].cast<std::uint64_t>();
    p.nbytes = t[4].cast<std::uint64_t>();
    if (!t[5].is_none()) p.decl = t[5].cast<std::string>();
    if (p.nbytes == 0 || p.nbytes % isz != 0 || p.offset % isz != 0 ||
        p.offset > s.size() || p.nbytes > s.size() - p.offset ||
        p.offset > d.size() || p.nbytes > d.size() - p.offset)
      throw py::value_error("submit: part of key " + std::to_string(p.key) +
                            " at offset " + std::to_string(p.offset) + " with " +
                            std::to_string(p.nbytes) + " bytes does not fit the " +
                            std::to_string(s.size()) + "-byte buffers");
    if (p.decl.size() > dp::kMaxMeta)
      throw py::value_error("submit: declaration over 1 MiB");
    specs.push_back(std::move(p));
  }
  c.submit(op, priority, static_cast<const char*>(s.data()),
           static_cast<char*>(d.data()), wire_dtype, divisor, std::move(specs),
           compressed, compressed && codecs.empty() ? d.size() : 0, std::move(codecs));
}

void bind_data_client(py::module_& m) {
  py::class_<dp::DataClient>(m, "DataClient")
      .def(init_keyed<dp::DataClient, 5, int, std::uint32_t, int, std::uint64_t, std::uint64_t,
                      std::string, int>(),
           py::arg("rank"), py::arg("job"), py::arg("io_threads"), py::arg("credit_bytes"),
           py::arg("max_message_bytes"), py::arg("auth_key") = py::bytes(),
           py::arg("codec_threads") = 1)
      .def("connect", &dp::DataClient::connect, py::arg("server"), py::arg("host"),
           py::arg("port"), py::arg("streams"), py::arg("timeout"), py::arg("ucx") = false,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "submit",
          &data_client_submit,
          py::arg("op"), py::arg("priority"), py::arg("src"), py::arg("dst"),
          py::arg("wire_dtype"), py::arg("divisor"), py::arg("round"), py::arg("parts"),
          py::arg("compressed") = false, py::arg("codecs") = py::none())
      .def("wait", &dp::DataClient::wait, py::arg("op"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "take",
          [](dp::DataClient& c, std::uint64_t op) -> py::object {
            dp::Completion comp;
            if (!c.take(op, &comp)) return py::none();
            return completion_tuple(comp);
          },
          py::arg("op"))
      .def(
          "completions",
          [](dp::DataClient& c, double timeout) {
            const std::vector<dp::Completion> v = nogil([&] { return c.completions(timeout); });
            py::list out;
            for (auto& comp : v) out.append(completion_tuple(comp));
            return out;
          },
          py::arg("timeout"))
      .def("close", &dp::DataClient::close, py::call_guard<py::gil_scoped_release>())
      .def("set_paused", &dp::DataClient::set_paused, py::arg("paused"))
      .def("hold_landed", &dp::DataClient::hold_landed, py::arg("on"),
           py::call_guard<py::gil_scoped_release>())
      .def("take_dispatch_log", &dp::DataClient::take_dispatch_log)
      .def("set_failover", &dp::DataClient::set_failover, py::arg("on"))
      .def("failover", &dp::DataClient::failover, py::arg("lost"), py::arg("hold"),
           py::call_guard<py::gil_scoped_release>())
      .def("wait_seeds", &dp::DataClient::wait_seeds, py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("resume", &dp::DataClient::resume, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](dp::DataClient& c) { return counters_dict(c.stats()); });
}

// The data plane's clock, for tests.
void bind_dataplane_tools(py::module_& m) {
  m.def("monotonic", &dp::monotonic_now, "CLOCK_MONOTONIC seconds (time.monotonic()).");
}

void bind_dataplane(py::module_& m) {
  bind_ucx(m);
  bind_data_server(m);
  bind_data_client(m);
  bind_dataplane_tools(m);
}

}  // namespace

void bind_wire(py::module_& m);  // module_wire.cc
void bind_tables(py::module_& m);  // module_tables.cc
void bind_table_streams(py::module_& m);  // module_table_streams.cc

}  // namespace bps

PYBIND11_MODULE(_core, m) {
  using namespace bps;
  m.doc() = "Native summation, scaling, conversion and compression kernels of byteps_like (see _core.pyi).";
  m.def("add_into", &py_add_into, py::arg("dst"), py::arg("src"), py::arg("dtype"),
        py::arg("nthreads") = 1, "dst += src elementwise; buffers are raw bytes of `dtype`.");
  m.def("copy_into", &py_copy_into, py::arg("dst"), py::arg("src"), py::arg("nthreads") = 1,
        "Copy src's bytes into dst (equal lengths).");
  m.def("scale_into", &py_scale_into, py::arg("buf"), py::arg("dtype"), py::arg("divisor"),
        py::kw_only(), py::arg("nthreads") = 1,
        "buf /= divisor in place (floor division for ints); divisor >= 1.");
  m.def("convert", &py_convert, py::arg("dst"), py::arg("dst_dtype"), py::arg("src"),
        py::arg("src_dtype"), py::kw_only(), py::arg("nthreads") = 1,
        "dst = src converted between float32 and float16/bfloat16, round to nearest even.");
  m.def("cpu_features", &py_cpu_features, "CPU features detected and kernels in use.");
  m.def(
      "itemsize",
      [](const std::string& dtype) { return itemsize(to_dtype(dtype, "itemsize")); },
      py::arg("dtype"), "Bytes per element of `dtype`.");
  m.def("_set_isa", &py_set_isa, py::arg("name"),
        "Testing hook: cap the kernel level ('scalar', 'avx2', 'avx512' or 'auto'); returns the "
        "previous level.");
  py::list names;
  for (int i = 0; i < kNumDTypes; ++i) names.append(dtype_name(static_cast<DType>(i)));
  m.attr("DTYPES") = py::tuple(names);
  bind_compress(m);
  bind_codec(m);
  bind_dataplane(m);
  bind_wire(m);
  bind_tables(m);
  bind_table_streams(m);  // after bind_dataplane: adds to DataServer
}
