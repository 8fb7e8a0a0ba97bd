// The only PYBIND11_MODULE of hsync._C. Calls that may block on other ranks release the GIL.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>

#include "bucket.h"
#include "checks.h"
#include "comm/process_group_comm.h"
#include "engine.h"
#include "kernels/pack.h"
#ifdef HSYNC_WITH_CUDA
#include "comm/nccl_comm.h"
#endif

namespace py = pybind11;
using hsync::Communicator;
using hsync::Engine;

namespace {

std::vector<std::vector<int64_t>> bucket_assignment(const std::vector<int64_t>& bytes,
                                                    const std::vector<int64_t>& groups,
                                                    const std::vector<int64_t>& order,
                                                    int64_t bytes_cap, int64_t first_bytes_cap) {
  HSYNC_CHECK(bytes.size() == groups.size(), "got ", bytes.size(), " sizes and ", groups.size(), " groups");
  std::vector<hsync::ParamInfo> params;
  for (size_t i = 0; i < bytes.size(); ++i) params.push_back({bytes[i], groups[i]});
  return hsync::compute_bucket_assignment(params, order, bytes_cap, first_bytes_cap);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hsync's compiled core: bucketed, weighted gradient all-reduce";
  using release_gil = py::call_guard<py::gil_scoped_release>;

#ifdef HSYNC_WITH_CUDA
  m.attr("cuda_enabled") = true;
#else
  m.attr("cuda_enabled") = false;
#endif
  m.attr("default_bucket_bytes_cap") = hsync::kDefaultBucketBytesCap;
  m.attr("default_first_bucket_bytes_cap") = hsync::kDefaultFirstBucketBytesCap;
  m.attr("backend_grace_s") = std::chrono::duration<double>(hsync::kBackendGrace).count();

  m.def("compute_bucket_assignment", &bucket_assignment, py::arg("bytes"), py::arg("groups"),
        py::arg("order"), py::arg("bytes_cap"), py::arg("first_bytes_cap"),
        "Bucket assignment by size: lists of parameter indices in launch order (see bucket.h).");
  m.def("scale_and_pack", &hsync::scale_and_pack, py::arg("grad"), py::arg("out"), py::arg("scale"),
        py::arg("nonfinite_flag"), py::arg("used_flag"),
        "out = grad * scale; raises the flags as the engine's pack does (see kernels/pack.h).");

  py::class_<hsync::FaultOptions>(m, "FaultOptions",
                                  "How a communicator detects and reports failures (comm/communicator.h).")
      .def(py::init([](c10::intrusive_ptr<c10d::Store> store, std::string key, double timeout_s, bool debug) {
             return hsync::FaultOptions{std::move(store), std::move(key),
                                        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)), debug};
           }),
           py::arg("store"), py::arg("key"), py::arg("timeout_s"), py::arg("debug") = false);

  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::world_size)
      .def_property_readonly("backend", &Communicator::backend)
      .def_property_readonly("timeout_s", [](const Communicator& c) { return c.timeout().count() / 1000.0; })
      .def("all_reduce_sum",
           [](Communicator& c, const at::Tensor& tensor, std::string label) {
             c.all_reduce_sum(tensor, hsync::Purpose::kHost, -1, std::move(label));
           },
           py::arg("tensor"), py::arg("label"), release_gil(),
           "Enqueues an in-place SUM all-reduce; `label` names it in errors (hsync/collectives.py).")
      .def("synchronize", &Communicator::synchronize, release_gil(),
           "Orders the caller after every collective issued: the host waits on CPU, the current stream on GPU.")
      .def("check", &Communicator::check, "Throws if a collective failed here or on a peer.");

  py::class_<hsync::ProcessGroupComm, Communicator, std::shared_ptr<hsync::ProcessGroupComm>>(
      m, "ProcessGroupComm")
      .def(py::init<const c10::intrusive_ptr<c10d::ProcessGroup>&, const hsync::FaultOptions&>(),
           py::arg("process_group"), py::arg("faults"));

#ifdef HSYNC_WITH_CUDA
  m.def("nccl_unique_id", []() { return py::bytes(hsync::nccl_unique_id()); });
  m.def("nccl_version", &hsync::nccl_version);
  py::class_<hsync::NcclComm, Communicator, std::shared_ptr<hsync::NcclComm>>(m, "NcclComm")
      .def(py::init<const std::string&, int, int, int, const hsync::FaultOptions&>(), py::arg("unique_id"),
           py::arg("rank"), py::arg("world_size"), py::arg("device_index"), py::arg("faults"), release_gil());
#endif

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init<std::vector<at::Tensor>, std::vector<std::string>, std::shared_ptr<Communicator>,
                    int64_t, int64_t, bool, std::optional<at::ScalarType>>(),
           py::arg("params"), py::arg("names"), py::arg("comm"), py::arg("bucket_bytes_cap"),
           py::arg("first_bucket_bytes_cap"), py::arg("grads_as_views"), py::arg("comm_dtype"))
      .def("begin_weighted_step", &Engine::begin_weighted_step, py::arg("scalars"),
           py::arg("ref_weight"), release_gil())
      .def("step_scalars", &Engine::step_scalars, release_gil())
      .def("finalize_if_pending", &Engine::finalize_if_pending, release_gil())
      .def("mark_step_failed", &Engine::mark_step_failed, release_gil())
      .def("abandon_step", &Engine::abandon_step, py::arg("why"), release_gil())
      .def("expect_gradients", &Engine::expect_gradients, py::arg("expected"))
      .def("begin_backward", &Engine::begin_backward, release_gil())
      .def("set_comm_hook",
           [](Engine& e, py::object state, py::object hook) {
             e.set_comm_hook(std::make_shared<c10d::PythonCommHook>(std::move(state), std::move(hook)));
           },
           py::arg("state"), py::arg("hook"))
      .def("set_owners", &Engine::set_owners, py::arg("owners"), py::arg("witness") = -1, release_gil())
      .def("set_join_plain_step", &Engine::set_join_plain_step, py::arg("scalars"),
           py::arg("divide_by_world_size"))
      .def("broadcast_coalesced", &Engine::broadcast_coalesced, py::arg("tensors"), py::arg("root"),
           py::arg("label") = "", release_gil())
      .def("last_grad_nonfinite", &Engine::last_grad_nonfinite)
      .def("steps_completed", &Engine::steps_completed)
      .def("check", &Engine::check)
      .def_property_readonly("comm", &Engine::comm)
      .def("bucket_params", &Engine::bucket_params)
      .def("allocated_bucket_bytes", &Engine::allocated_bucket_bytes)
      .def("start_busy_interval", [](Engine& e) { e.clock().start(); })
      .def("end_busy_interval", [](Engine& e) { return e.clock().stop(); })
      .def("busy_seconds_so_far", [](Engine& e) { return e.clock().seconds_so_far(); },
           py::call_guard<py::gil_scoped_release>())
      .def("begin_peer_wait", [](Engine& e) { e.clock().begin_wait(); })
      .def("end_peer_wait", [](Engine& e) { e.clock().end_wait(); });

  py::class_<hsync::BusyInterval>(m, "BusyInterval", "A rank's own work in a step (Note [Busy time]).")
      .def("seconds", &hsync::BusyInterval::seconds, release_gil(),
           "Its seconds less its waits for peers; on a GPU this waits for the device to reach its end.");
}
