// Python bindings of the table streams (dataplane_tables.h): the DataServer's table inbox
// (table_requests, table_send, table_wake, added to the class bind_data_server made) and the
// worker's TableClient. Messages cross as (header bytes, meta bytes, payload bytes); every
// header is checked for its size here and for its contents by the stream's end in C++.
// Documented in byteps_like/_core.pyi; used by byteps_like/transport/native.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "crypto.h"
#include "dataplane.h"
#include "dataplane_tables.h"
#include "payload_pool.h"

namespace py = pybind11;

namespace bps {

std::shared_ptr<dp::ServedShard> served_shard(py::handle kernels);  // module_tables.cc

namespace {

dp::Header header_of(const py::bytes& raw) {
  std::string s = raw;
  if (s.size() != sizeof(dp::Header))
    throw py::value_error("table message: a header of " + std::to_string(s.size()) +
                          " bytes, not " + std::to_string(sizeof(dp::Header)));
  dp::Header h;
  std::memcpy(&h, s.data(), sizeof h);
  return h;
}

// A C-contiguous buffer's bytes (None: none).
std::string bytes_of(const py::handle& obj) {
  if (obj.is_none()) return std::string();
  Py_buffer view;
  if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
  std::string out = dp::pooled(static_cast<std::size_t>(view.len));  // (payload_pool.h)
  if (view.len) std::memcpy(&out[0], view.buf, static_cast<std::size_t>(view.len));
  PyBuffer_Release(&view);
  return out;
}

py::bytes header_bytes(const dp::Header& h) {
  return py::bytes(reinterpret_cast<const char*>(&h), sizeof h);
}

// The messages take() returns (waited for without the GIL), as tuples: a server's requests
// (stream, header, meta, payload), or a worker's answers (server, header, meta, payload, lost).
template <class Take>
py::list messages(Take take, bool answers) {
  std::vector<dp::TableMessage> v;
  {
    py::gil_scoped_release g;
    v = take();
  }
  py::list out;
  for (auto& m : v) {
    py::bytes h = header_bytes(m.h), meta(m.meta), payload(m.payload);
    dp::recycle(std::move(m.payload));
    if (answers)
      out.append(py::make_tuple(m.server, h, meta, payload, m.lost));
    else
      out.append(py::make_tuple(m.conn, h, meta, payload));
  }
  return out;
}

py::list server_requests(dp::DataServer& s, double timeout) {
  return messages([&] { return s.table_requests(timeout); }, false);
}

bool server_send(dp::DataServer& s, std::uint64_t conn, const py::bytes& header,
                 const py::handle& meta, const py::handle& payload) {
  dp::Header h = header_of(header);  // with the GIL: queueing is quick (the loop writes it)
  return s.table_send(conn, h, bytes_of(meta), bytes_of(payload));
}

py::list client_answers(dp::TableClient& c, double timeout) {
  return messages([&] { return c.answers(timeout); }, true);
}

}  // namespace

void bind_table_streams(py::module_& m) {
  py::object ds = m.attr("DataServer");
  ds.attr("table_requests") = py::cpp_function(
      &server_requests, py::is_method(ds), py::name("table_requests"), py::arg("timeout"),
      "The table streams' requests waiting: [(stream, header, meta, payload)], once one is, "
      "after timeout seconds, or at once after table_wake() or close().");
  ds.attr("table_send") = py::cpp_function(
      &server_send, py::is_method(ds), py::name("table_send"), py::arg("stream"),
      py::arg("header"), py::arg("meta"), py::arg("payload"),
      "Answer on a table stream; False when it is closed.");
  ds.attr("table_serve") = py::cpp_function(
      [](dp::DataServer& s, std::uint64_t key, py::handle kernels) {
        s.table_serve(key, served_shard(kernels));
      },
      py::is_method(ds), py::name("table_serve"), py::arg("key"), py::arg("kernels"),
      "Let the I/O threads answer pulls of table key `key` from a TableKernels' shard, by the "
      "rules its serve() sets.");
  ds.attr("table_wake") = py::cpp_function(
      [](dp::DataServer& s) { s.table_wake(); }, py::is_method(ds), py::name("table_wake"),
      py::call_guard<py::gil_scoped_release>(), "Wake the thread waiting in table_requests.");

  py::class_<dp::TableClient>(m, "TableClient")
      .def(py::init([](int rank, std::uint32_t job, std::uint64_t max_message_bytes,
                       std::string auth_key, std::uint64_t answer_budget) {
             if (!auth_key.empty()) require_crypto();
             return new dp::TableClient(rank, job, max_message_bytes, std::move(auth_key),
                                        answer_budget);
           }),
           py::arg("rank"), py::arg("job"), py::arg("max_message_bytes"),
           py::arg("auth_key") = py::bytes(), py::arg("answer_budget") = dp::kAnswerBudget)
      .def("connect", &dp::TableClient::connect, py::arg("server"), py::arg("host"),
           py::arg("port"), py::arg("timeout"), py::arg("ucx") = false,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "send",
          [](dp::TableClient& c, int server, const py::bytes& header, const py::handle& meta,
             const py::handle& payload) {
            // with the GIL: queueing is quick (the stream's loop writes it), and letting the
            // GIL go would make the caller wait for it back behind the answers' thread
            dp::Header h = header_of(header);
            return c.send(server, h, bytes_of(meta), bytes_of(payload));
          },
          py::arg("server"), py::arg("header"), py::arg("meta"), py::arg("payload"))
      .def("answers", &client_answers, py::arg("timeout"))
      .def("close", &dp::TableClient::close, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](dp::TableClient& c) {
        py::dict d;
        for (auto& kv : c.stats()) d[py::str(kv.first)] = kv.second;
        return d;
      });
}

}  // namespace bps
