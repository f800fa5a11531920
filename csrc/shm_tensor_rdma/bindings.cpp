// Python module megatron_app._shm_tensor_rdma: the torch-free core. megatron_app.transport wraps it with tensors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "backend_registry.h"
#include "errors.h"
#include "loss_bindings.h"
#include "rdma_backend.h"
#include "rdma_protocol_bindings.h"
#include "tag.h"
#include "transport.h"

namespace py = pybind11;

namespace mapp {
namespace {

// Lets Ctrl-C (and other Python signal handlers) end a blocking wait: runs about every kWaitTick while the GIL
// is released. Only the main thread sees signals; elsewhere PyErr_CheckSignals does nothing.
void raise_pending_python_signal() {
  py::gil_scoped_acquire acquire;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// A received payload exposed through the buffer protocol, so torch.frombuffer can wrap it without copying.
// The memory goes back to the pool when the last Python reference (e.g. the tensor) is dropped.
class ReceivedBuffer {
 public:
  explicit ReceivedBuffer(PooledBuffer buffer) : buffer_(std::move(buffer)) {}
  uint8_t* data() const { return buffer_.data(); }
  size_t size() const { return buffer_.size(); }

 private:
  PooledBuffer buffer_;
};

py::tuple header_tuple(const MessageHeader& header) {
  return py::make_tuple(header.dtype_code, py::tuple(py::cast(shape_of(header))), header.nbytes);
}

// (dtype_code, shape, nbytes, ReceivedBuffer)
py::tuple message_tuple(Message message) {
  const MessageHeader header = message.header;
  return py::make_tuple(header.dtype_code, py::tuple(py::cast(shape_of(header))), header.nbytes,
                        ReceivedBuffer(std::move(message.payload)));
}

}  // namespace
}  // namespace mapp

PYBIND11_MODULE(_shm_tensor_rdma, m) {
  using namespace mapp;
  m.doc() = "Shared-memory tensor transport core (no torch dependency).";

  py::register_exception<TimeoutError>(m, "TransportTimeout", PyExc_TimeoutError);
  py::register_exception<PeerDiedError>(m, "PeerDied", PyExc_RuntimeError);
  py::register_exception<ClosedError>(m, "TransportClosed", PyExc_RuntimeError);

  m.attr("DIRECTION_FORWARD") = static_cast<uint32_t>(Direction::kForward);
  m.attr("DIRECTION_BACKWARD") = static_cast<uint32_t>(Direction::kBackward);
  m.attr("DIRECTION_CONTROL") = static_cast<uint32_t>(Direction::kControl);
  m.attr("MAX_DIMS") = kMaxDims;
  py::list backend_names;
  py::list backend_kind_rows;
  for (const BackendKind& kind : backend_kinds()) {
    backend_names.append(kind.name);
    backend_kind_rows.append(py::dict(py::arg("name") = kind.name, py::arg("summary") = kind.summary,
                                      py::arg("remote") = kind.remote, py::arg("needs_device") = kind.needs_device,
                                      py::arg("auto_priority") = kind.auto_priority));
  }
  m.attr("BACKENDS") = py::tuple(backend_names);  // from backend_registry.cpp, in creation order
  m.attr("BACKEND_KINDS") = py::tuple(backend_kind_rows);  // the same, with what Python's registry needs

  m.def("make_tag", &make_tag, py::arg("direction"), py::arg("microbatch"), py::arg("iteration"));
  m.def(
      "split_tag",
      [](uint64_t tag) {
        const TagParts parts = split_tag(tag);
        return py::make_tuple(parts.direction, parts.microbatch, parts.iteration);
      },
      py::arg("tag"));
  m.def("describe_tag", &describe_tag, py::arg("tag"));
  m.def("rdma_status", [] {
    const RdmaStatus status = rdma_status();
    return py::make_tuple(status.built, status.usable, status.detail);
  });
  m.def("cleanup_job", &Transport::cleanup_job, py::arg("job_id"), py::call_guard<py::gil_scoped_release>());

  py::class_<ReceivedBuffer>(m, "ReceivedBuffer", py::buffer_protocol())
      .def_buffer([](ReceivedBuffer& buffer) {
        return py::buffer_info(buffer.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(buffer.size())}, {1}, /*readonly=*/false);
      })
      .def("__len__", &ReceivedBuffer::size);

  py::class_<SendRequest, std::shared_ptr<SendRequest>>(m, "SendRequest")
      .def("done", &SendRequest::done)
      .def(
          "wait",
          [](SendRequest& request, std::optional<double> timeout_s) {
            if (timeout_s && *timeout_s < 0) throw std::invalid_argument("timeout must be >= 0");
            py::gil_scoped_release release;
            request.wait_or_throw(timeout_s, "send", raise_pending_python_signal);
          },
          py::arg("timeout") = py::none());

  py::class_<Transport>(m, "Transport")
      .def(py::init([](int rank, int world_size, const std::string& job_id, uint64_t slot_bytes, uint32_t num_slots,
                       uint64_t max_message_bytes, int send_workers, std::optional<std::vector<int>> peers,
                       double timeout_s, std::map<int, std::string> backends, const std::string& listen_host,
                       int listen_port, const py::bytes& admission_secret) {
             TransportOptions options;
             options.rank = rank;
             options.world_size = world_size;
             options.job_id = job_id;
             options.slot_bytes = slot_bytes;
             options.num_slots = num_slots;
             options.max_message_bytes = max_message_bytes;
             options.send_workers = send_workers;
             options.peers = std::move(peers);
             options.timeout_s = timeout_s;
             options.peer_backends = std::move(backends);
             options.listen_host = listen_host;
             options.listen_port = listen_port;
             options.admission_secret = admission_secret;
             py::gil_scoped_release release;
             auto transport = std::make_unique<Transport>(std::move(options));
             transport->set_interrupt_check(raise_pending_python_signal);
             return transport;
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("job_id"), py::arg("slot_bytes"), py::arg("num_slots"),
           py::arg("max_message_bytes"), py::arg("send_workers"), py::arg("peers"), py::arg("timeout_s"),
           py::arg("backends") = std::map<int, std::string>(), py::arg("listen_host") = "127.0.0.1",
           py::arg("listen_port") = 0, py::arg("admission_secret") = py::bytes())
      .def("backend_of", &Transport::backend_of, py::arg("peer"))
      .def_property_readonly("strangers_dropped", &Transport::strangers_dropped)
      .def("local_address", &Transport::local_address, py::arg("backend"))
      .def("set_peer_address", &Transport::set_peer_address, py::arg("peer"), py::arg("address"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "send",
          [](Transport& transport, int peer, uint64_t tag, uint32_t dtype_code, const std::vector<int64_t>& shape,
             uintptr_t data_ptr, uint64_t nbytes) {
            py::gil_scoped_release release;
            return transport.send(peer, tag, dtype_code, shape, reinterpret_cast<const void*>(data_ptr), nbytes);
          },
          py::arg("peer"), py::arg("tag"), py::arg("dtype_code"), py::arg("shape"), py::arg("data_ptr"),
          py::arg("nbytes"))
      .def("wait_sends", &Transport::wait_sends, py::arg("timeout") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("poll", &Transport::poll, py::call_guard<py::gil_scoped_release>())
      .def(
          "peek",
          [](Transport& transport, int peer, uint64_t tag) -> py::object {
            std::optional<MessageHeader> header;
            {
              py::gil_scoped_release release;
              header = transport.peek(peer, tag);
            }
            if (!header) return py::none();
            return header_tuple(*header);
          },
          py::arg("peer"), py::arg("tag"))
      .def(
          "try_take",
          [](Transport& transport, int peer, uint64_t tag) -> py::object {
            std::optional<Message> message;
            {
              py::gil_scoped_release release;
              message = transport.try_take(peer, tag);
            }
            if (!message) return py::none();
            return message_tuple(std::move(*message));
          },
          py::arg("peer"), py::arg("tag"))
      .def(
          "recv",
          [](Transport& transport, int peer, uint64_t tag, std::optional<double> timeout_s) {
            std::optional<Message> message;
            {
              py::gil_scoped_release release;
              message = transport.recv(peer, tag, timeout_s);
            }
            return message_tuple(std::move(*message));
          },
          py::arg("peer"), py::arg("tag"), py::arg("timeout") = py::none())
      .def("wait_any", &Transport::wait_any, py::arg("keys"), py::arg("timeout") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("close", &Transport::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Transport::closed)
      .def_property_readonly("peers", &Transport::peers)
      .def_property_readonly("rank", &Transport::rank);

  bind_loss(m);
  bind_rdma_protocol(m);
}
