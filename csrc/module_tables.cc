// Python bindings of an embedding table's kernels (table_kernels.h): every array's dtype,
// shape, contiguity and writability checked (ValueError naming the argument), then GIL-free
// work. Used by byteps_like/embedding.py (TableShard, sum_rows, initial_rows); documented in
// byteps_like/_core.pyi.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dataplane_table_pulls.h"
#include "table_kernels.h"

namespace py = pybind11;

namespace bps {
namespace {

std::string shape_text(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// obj as a C-contiguous numpy array of T (writable if asked) of `shape` (-1: any length);
// ValueError naming `what` otherwise.
template <typename T>
py::array checked(py::handle obj, const char* what, std::vector<py::ssize_t> shape,
                  bool writable, const char* tname) {
  const std::string name = std::string("table kernels: ") + what;
  if (!py::isinstance<py::array_t<T>>(obj)) {
    throw py::value_error(name + " must be a numpy array of " + tname + ", not " +
                          (py::isinstance<py::array>(obj)
                               ? "one of " + std::string(py::str(obj.attr("dtype")))
                               : std::string(Py_TYPE(obj.ptr())->tp_name)));
  }
  auto a = py::reinterpret_borrow<py::array>(obj);
  bool ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
  for (std::size_t i = 0; ok && i < shape.size(); ++i)
    ok = shape[i] < 0 || a.shape(static_cast<py::ssize_t>(i)) == shape[i];
  if (!ok) {
    std::string want = "(";
    for (std::size_t i = 0; i < shape.size(); ++i)
      want += (i ? ", " : "") + (shape[i] < 0 ? std::string("n") : std::to_string(shape[i]));
    throw py::value_error(name + " has shape " + shape_text(a) + ", expected " + want +
                          (shape.size() == 1 ? ",)" : ")"));
  }
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(name + " must be C-contiguous (np.ascontiguousarray)");
  if (writable && !a.writeable()) throw py::value_error(name + " must be writable");
  return a;
}

py::array ids_array(py::handle obj, const char* what) {
  return checked<std::int64_t>(obj, what, {-1}, false, "int64");
}

table::Init init_kind(const std::string& s) {
  if (s == "zeros") return table::Init::kZeros;
  if (s == "uniform") return table::Init::kUniform;
  if (s == "normal") return table::Init::kNormal;
  throw py::value_error("table kernels: unknown initializer '" + s +
                        "' (zeros, uniform, normal)");
}

table::Opt opt_kind(const std::string& s) {
  if (s == "sgd") return table::Opt::kSgd;
  if (s == "adagrad") return table::Opt::kAdagrad;
  if (s == "adam") return table::Opt::kAdam;
  throw py::value_error("table kernels: unknown optimizer '" + s + "' (sgd, adagrad, adam)");
}

table::InitSpec init_spec(const std::string& init, double a, double b, std::uint64_t seed,
                          std::int64_t dim) {
  if (dim < 1) throw py::value_error("table kernels: dim must be >= 1, not " +
                                     std::to_string(dim));
  table::InitSpec s;
  s.kind = init_kind(init);
  s.a = a;
  s.b = b;
  s.seed = seed;
  s.dim = dim;
  return s;
}

// The kernels of one TableShard, bound to its arrays (kept alive here; never reallocated by
// the shard: it writes into them in place). The arrays are a ServedShard's, whose lock every
// call holds: a server's I/O threads may answer pulls from them (dataplane_table_pulls.h).
class TableKernels {
 public:
  TableKernels(py::object weights, py::object made, py::object changed, py::object acc,
               py::object m, py::object v, py::object t, std::int64_t shard,
               std::int64_t shards, py::dict init, py::dict opt, int threads);
  ~TableKernels() { sv_->retire(); }
  TableKernels(const TableKernels&) = delete;
  TableKernels& operator=(const TableKernels&) = delete;

  py::array gather(py::handle ids) {
    py::array a = ids_array(ids, "ids");
    const std::int64_t n = a.shape(0);
    py::array_t<float> out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(s_.dim)});
    float* o = out.mutable_data();
    const auto* p = static_cast<const std::int64_t*>(a.data());
    const std::int64_t bad =
        with_local(p, n, [&](const std::int64_t* local) { table::gather(s_, local, n, o); });
    if (bad != n) refuse_id(p[bad]);
    return out;
  }

  void make(py::handle ids) {
    py::array a = ids_array(ids, "ids");
    const std::int64_t n = a.shape(0);
    const auto* p = static_cast<const std::int64_t*>(a.data());
    const std::int64_t bad =
        with_local(p, n, [&](const std::int64_t* local) { table::make_rows(s_, local, n); });
    if (bad != n) refuse_id(p[bad]);
  }

  // applied >= 0: the round this step completes, published to the shard's pulls in the same
  // hold of its lock (the parked pulls of it are answered).
  void apply(py::handle ids, py::handle grad, std::int64_t applied) {
    py::array a = ids_array(ids, "ids");
    const std::int64_t n = a.shape(0);
    py::array g = checked<float>(grad, "grad", {n, s_.dim}, false, "float32");
    const auto* p = static_cast<const std::int64_t*>(a.data());
    const auto* gp = static_cast<const float*>(g.data());
    bool repeats = false;
    const std::int64_t bad = with_local(p, n, [&](const std::int64_t* local) {
      repeats = table::has_repeats(p, n);
      if (repeats) return;
      table::apply(s_, local, n, gp);
      if (applied >= 0) sv_->applied_locked(applied);
    });
    if (bad != n) refuse_id(p[bad]);
    if (repeats)
      throw py::value_error("table kernels: apply's ids repeat a row; sum the pushes per row "
                            "first (sum_rows)");
  }

  // The tables' thread's rules for the shard's pulls; returns the parked pulls that may no
  // longer wait, as (stream, header, meta, payload) requests for it to take.
  py::list serve(const dp::ServeRules& rules) {
    std::vector<dp::ReturnedPull> back;
    {
      py::gil_scoped_release nogil;
      back = sv_->serve(rules);
    }
    py::list out;
    for (auto& r : back)
      out.append(py::make_tuple(r.stream, py::bytes(reinterpret_cast<const char*>(&r.h),
                                                    sizeof r.h),
                                py::bytes(), py::bytes(r.ids)));
    return out;
  }
  // Python's own reads and writes of the arrays (restore, forget, snapshots) hold the lock.
  void lock() {
    py::gil_scoped_release nogil;
    sv_->lock().lock();
  }
  void unlock() { sv_->lock().unlock(); }
  std::shared_ptr<dp::ServedShard> served() const { return sv_; }
  py::dict pulls() const {
    py::dict d;
    d["answered"] = sv_->answered();
    d["parked"] = sv_->parked_total();
    return d;
  }

  std::int64_t nrows() const { return s_.nrows; }
  std::int64_t dim() const { return s_.dim; }

 private:
  [[noreturn]] void refuse_id(std::int64_t id) const {
    throw py::value_error("table kernels: id " + std::to_string(id) + " is not a row of shard " +
                          std::to_string(s_.shard) + " of " + std::to_string(s_.shards) +
                          " (" + std::to_string(s_.nrows) + " rows: ids r with r % " +
                          std::to_string(s_.shards) + " == " + std::to_string(s_.shard) + ")");
  }
  void bind_state(py::object acc, py::object m, py::object v, py::object t);
  // Without the GIL and holding the shard's lock: the local rows of global ids p[0..n) and,
  // when the shard holds every one, f(local); returns n, or the index of the first it does not.
  template <class F>
  std::int64_t with_local(const std::int64_t* p, std::int64_t n, F&& f) {
    py::gil_scoped_release nogil;
    std::vector<std::int64_t> local(static_cast<std::size_t>(n));
    std::lock_guard<std::mutex> g(sv_->lock());
    const std::int64_t bad = table::to_local(s_, p, n, local.data());
    if (bad == n) f(local.data());
    return bad;
  }

  std::vector<py::array> keep_;
  std::shared_ptr<dp::ServedShard> sv_ = std::make_shared<dp::ServedShard>();
  table::Shard& s_ = sv_->s;
};

TableKernels::TableKernels(py::object weights, py::object made, py::object changed,
                           py::object acc, py::object m, py::object v, py::object t,
                           std::int64_t shard, std::int64_t shards, py::dict init, py::dict opt,
                           int threads) {
  if (threads < 1)
    throw py::value_error("table kernels: threads must be >= 1, not " + std::to_string(threads));
  s_.threads = threads;
  if (shards < 1 || shard < 0 || shard >= shards)
    throw py::value_error("table kernels: shard " + std::to_string(shard) + " of " +
                          std::to_string(shards) + " is not a shard (0 <= shard < shards)");
  if (!py::isinstance<py::array>(weights) || py::reinterpret_borrow<py::array>(weights).ndim() != 2)
    throw py::value_error("table kernels: weights must be a 2-d numpy array of float32");
  auto w0 = py::reinterpret_borrow<py::array>(weights);
  s_.nrows = w0.shape(0);
  s_.dim = w0.shape(1);
  py::array w = checked<float>(weights, "weights", {s_.nrows, s_.dim}, true, "float32");
  py::array mk = checked<bool>(made, "made", {s_.nrows}, true, "bool");
  py::array ch = checked<bool>(changed, "changed", {s_.nrows}, true, "bool");
  s_.w = static_cast<float*>(w.mutable_data());
  s_.made = static_cast<std::uint8_t*>(mk.mutable_data());
  s_.changed = static_cast<std::uint8_t*>(ch.mutable_data());
  keep_ = {w, mk, ch};
  s_.shard = shard;
  s_.shards = shards;
  s_.init = init_spec(init["init"].cast<std::string>(), init["a"].cast<double>(),
                      init["b"].cast<double>(), init["seed"].cast<std::uint64_t>(), s_.dim);
  s_.opt.kind = opt_kind(opt["optimizer"].cast<std::string>());
  s_.opt.lr = opt["lr"].cast<float>();
  s_.opt.eps = opt["eps"].cast<float>();
  s_.opt.beta1 = opt["beta1"].cast<double>();
  s_.opt.beta2 = opt["beta2"].cast<double>();
  s_.opt.b1 = static_cast<float>(s_.opt.beta1);
  s_.opt.b2 = static_cast<float>(s_.opt.beta2);
  s_.opt.c1 = static_cast<float>(1.0 - s_.opt.beta1);  // in float64 first, as the reference
  s_.opt.c2 = static_cast<float>(1.0 - s_.opt.beta2);
  s_.opt.acc0 = static_cast<float>(opt["acc0"].cast<double>());
  bind_state(acc, m, v, t);
}

void TableKernels::bind_state(py::object acc, py::object m, py::object v, py::object t) {
  const bool ada = s_.opt.kind == table::Opt::kAdagrad, adam = s_.opt.kind == table::Opt::kAdam;
  const char* opt = ada ? "adagrad" : adam ? "adam" : "sgd";
  auto none = [&](const py::object& o, bool want, const char* what) {
    if (o.is_none() == want)
      throw py::value_error(std::string("table kernels: ") + opt +
                            (want ? std::string(" needs ") + what : std::string(" keeps no ") +
                             what + " (pass None)"));
    return !o.is_none();
  };
  if (none(acc, ada, "acc")) {
    keep_.push_back(checked<float>(acc, "acc", {s_.nrows, s_.dim}, true, "float32"));
    s_.acc = static_cast<float*>(keep_.back().mutable_data());
  }
  if (none(m, adam, "m")) {
    keep_.push_back(checked<float>(m, "m", {s_.nrows, s_.dim}, true, "float32"));
    s_.m = static_cast<float*>(keep_.back().mutable_data());
  }
  if (none(v, adam, "v")) {
    keep_.push_back(checked<float>(v, "v", {s_.nrows, s_.dim}, true, "float32"));
    s_.v = static_cast<float*>(keep_.back().mutable_data());
  }
  if (none(t, adam, "t")) {
    keep_.push_back(checked<std::int32_t>(t, "t", {s_.nrows}, true, "int32"));
    s_.t = static_cast<std::int32_t*>(keep_.back().mutable_data());
  }
}

// One round's pushes summed per row: (unique ids ascending, float32 sums), the pushes added in
// list order.
py::tuple sum_rows(py::list ids, py::list grads, std::int64_t dim) {
  if (dim < 1) throw py::value_error("table kernels: dim must be >= 1, not " +
                                     std::to_string(dim));
  if (ids.size() != grads.size())
    throw py::value_error("table kernels: " + std::to_string(ids.size()) + " id arrays but " +
                          std::to_string(grads.size()) + " gradient arrays");
  std::vector<py::array> keep;
  std::vector<const std::int64_t*> ip;
  std::vector<const float*> gp;
  std::vector<std::int64_t> len;
  for (std::size_t p = 0; p < ids.size(); ++p) {
    const std::string what = "push " + std::to_string(p) + "'s ";
    py::array a = ids_array(ids[p], (what + "ids").c_str());
    py::array g = checked<float>(grads[p], (what + "gradients").c_str(), {a.shape(0), dim},
                                 false, "float32");
    ip.push_back(static_cast<const std::int64_t*>(a.data()));
    gp.push_back(static_cast<const float*>(g.data()));
    len.push_back(a.shape(0));
    keep.push_back(a);
    keep.push_back(g);
  }
  table::RoundIndex index;
  {
    py::gil_scoped_release nogil;
    index.build(ip, len);
  }
  const auto nu = static_cast<py::ssize_t>(index.unique());
  py::array_t<std::int64_t> uniq(nu);
  py::array_t<float> sums({nu, static_cast<py::ssize_t>(dim)});
  std::int64_t* up = uniq.mutable_data();
  float* sp = sums.mutable_data();
  {
    py::gil_scoped_release nogil;
    index.sum(gp, dim, up, sp);
  }
  return py::make_tuple(uniq, sums);
}

// ids as an int64 array none of which is negative (ValueError naming the first that is).
py::array nonnegative_ids(py::handle ids) {
  py::array arr = ids_array(ids, "ids");
  const auto* p = static_cast<const std::int64_t*>(arr.data());
  for (py::ssize_t i = 0; i < arr.shape(0); ++i)
    if (p[i] < 0) throw py::value_error("table kernels: row id " + std::to_string(p[i]) +
                                        " is negative");
  return arr;
}

py::array initial_rows(py::handle ids, std::int64_t dim, const std::string& init, double a,
                       double b, std::uint64_t seed) {
  const table::InitSpec spec = init_spec(init, a, b, seed, dim);
  py::array arr = nonnegative_ids(ids);
  const std::int64_t n = arr.shape(0);
  const auto* p = static_cast<const std::int64_t*>(arr.data());
  py::array_t<float> out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(dim)});
  float* o = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    table::initial_rows(spec, p, n, o);
  }
  return out;
}

// A worker's ids split by shard: (order, counts), see table::split_by_shard.
py::tuple split_ids(py::handle ids, std::int64_t shards) {
  if (shards < 1) throw py::value_error("table kernels: shards must be >= 1, not " +
                                        std::to_string(shards));
  py::array a = nonnegative_ids(ids);
  const std::int64_t n = a.shape(0);
  const auto* p = static_cast<const std::int64_t*>(a.data());
  py::array_t<std::int64_t> order(n), counts(shards);
  std::int64_t* o = order.mutable_data();
  std::int64_t* c = counts.mutable_data();
  {
    py::gil_scoped_release nogil;
    table::split_by_shard(p, n, shards, o, c);
  }
  return py::make_tuple(order, counts);
}

// A push's records per shard (a list of uint8 arrays: the shard's ids, then their rows), from
// the split's order and counts.
py::list push_records(py::handle ids, py::handle grads, py::handle order, py::handle counts) {
  py::array a = ids_array(ids, "ids");
  const std::int64_t n = a.shape(0);
  py::array g = checked<float>(grads, "grads", {n, -1}, false, "float32");
  py::array o = checked<std::int64_t>(order, "order", {n}, false, "int64");
  py::array c = ids_array(counts, "counts");
  const std::int64_t dim = g.shape(1), shards = c.shape(0);
  const auto* op = static_cast<const std::int64_t*>(o.data());
  const auto* cp = static_cast<const std::int64_t*>(c.data());
  std::int64_t total = 0;
  for (std::int64_t s = 0; s < shards; ++s) {
    if (cp[s] < 0) throw py::value_error("table kernels: a negative count");
    total += cp[s];
  }
  if (total != n) throw py::value_error("table kernels: counts add up to " +
                                        std::to_string(total) + ", not the " +
                                        std::to_string(n) + " ids");
  for (std::int64_t i = 0; i < n; ++i)
    if (op[i] < 0 || op[i] >= n) throw py::value_error("table kernels: order is not of the ids");
  py::list out;
  std::int64_t at = 0;
  for (std::int64_t s = 0; s < shards; ++s) {
    py::array_t<std::uint8_t> rec(static_cast<py::ssize_t>(cp[s] * (8 + dim * 4)));
    std::uint8_t* r = rec.mutable_data();
    {
      py::gil_scoped_release nogil;
      table::push_records(static_cast<const std::int64_t*>(a.data()),
                          static_cast<const float*>(g.data()), dim, op + at, cp[s], r);
    }
    at += cp[s];
    out.append(rec);
  }
  return out;
}

}  // namespace

// The ServedShard of a TableKernels (module_table_streams.cc registers it with a server).
std::shared_ptr<dp::ServedShard> served_shard(py::handle kernels) {
  return kernels.cast<TableKernels&>().served();
}

void bind_tables(py::module_& m) {
  py::class_<TableKernels>(m, "TableKernels")
      .def(py::init<py::object, py::object, py::object, py::object, py::object, py::object,
                    py::object, std::int64_t, std::int64_t, py::dict, py::dict, int>(),
           py::arg("weights"), py::arg("made"), py::arg("changed"), py::arg("acc"), py::arg("m"),
           py::arg("v"), py::arg("t"), py::kw_only(), py::arg("shard"), py::arg("shards"),
           py::arg("init"), py::arg("opt"), py::arg("threads") = 1)
      .def("gather", &TableKernels::gather, py::arg("ids"))
      .def("make", &TableKernels::make, py::arg("ids"))
      .def("apply", &TableKernels::apply, py::arg("ids"), py::arg("grad"),
           py::arg("applied") = -1)
      .def(
          "serve",
          [](TableKernels& k, bool open, std::int64_t applied, std::uint32_t generation,
             std::int64_t rows, std::int64_t rank_limit, std::int64_t park_limit,
             std::int64_t max_ids, std::uint64_t max_message) {
            dp::ServeRules r;
            r.open = open;
            r.applied = applied;
            r.generation = generation;
            r.rows = rows;
            r.rank_limit = rank_limit;
            r.park_limit = park_limit;
            r.max_ids = max_ids;
            r.max_message = max_message;
            return k.serve(r);
          },
          py::kw_only(), py::arg("open"), py::arg("applied"), py::arg("generation"),
          py::arg("rows"), py::arg("rank_limit"), py::arg("park_limit"), py::arg("max_ids"),
          py::arg("max_message"))
      .def("lock", &TableKernels::lock)
      .def("unlock", &TableKernels::unlock)
      .def_property_readonly("pulls", &TableKernels::pulls)
      .def_property_readonly("nrows", &TableKernels::nrows)
      .def_property_readonly("dim", &TableKernels::dim);
  m.def("table_sum_rows", &sum_rows, py::arg("ids"), py::arg("grads"), py::arg("dim"),
        "One round's pushes summed per row: (unique ids, float32 sums), in list order.");
  m.def("table_split", &split_ids, py::arg("ids"), py::arg("shards"),
        "A worker's ids by shard (id % shards): (order, counts), a stable counting sort.");
  m.def("table_push_records", &push_records, py::arg("ids"), py::arg("grads"), py::arg("order"),
        py::arg("counts"),
        "A push's records per shard: [the shard's ids (int64) then their rows (float32)].");
  m.def("table_initial_rows", &initial_rows, py::arg("ids"), py::arg("dim"), py::arg("init"),
        py::arg("a"), py::arg("b"), py::arg("seed"),
        "The initial values of global rows `ids` (float32, len(ids) x dim).");
}

}  // namespace bps
