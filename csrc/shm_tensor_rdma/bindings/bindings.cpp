// Python module megatron_app.transport._shm_tensor_rdma: the torch-free core. megatron_app.transport wraps it with tensors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "backend_registry.h"
#include "errors.h"
#include "loss_bindings.h"
#include "rdma_backend.h"
#include "rdma_protocol_bindings.h"
#include "shm_layout.h"
#include "tag.h"
#include "tcp_frame.h"
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

// Test-only: the parsers every backend runs on bytes from another process, fed from Python (tests/test_wire_fuzz.py).
void bind_wire_parsers(py::module_& parent) {
  py::module_ m = parent.def_submodule("_wire", "Test-only entry points to the transport's wire parsers.");
  m.attr("TCP_HELLO_BYTES") = sizeof(TcpHello);
  m.attr("TCP_FRAME_BYTES") = sizeof(TcpFrameHeader);
  const auto fixed_size = [](const py::bytes& data, size_t size, const char* what) {
    std::string text = data;
    if (text.size() != size) {
      throw std::invalid_argument(std::string(what) + " of " + std::to_string(text.size()) + " bytes, expected " +
                                  std::to_string(size));
    }
    return text;
  };
  m.def("tcp_hello_problem", [fixed_size](const py::bytes& data, const std::string& job_id,
                                          const std::vector<int>& peers) {
    const std::string text = fixed_size(data, sizeof(TcpHello), "hello");
    TcpHello hello;
    std::memcpy(&hello, text.data(), sizeof(hello));
    return check_tcp_hello(hello, job_id, peers);
  });
  m.def("tcp_frame_problem", [fixed_size](const py::bytes& data, uint64_t max_message_bytes) {
    const std::string text = fixed_size(data, sizeof(TcpFrameHeader), "frame header");
    TcpFrameHeader frame;
    std::memcpy(&frame, text.data(), sizeof(frame));
    return check_tcp_frame(frame, max_message_bytes);
  });
  // The geometry SegmentView::validate accepts for a segment of `size` bytes whose header is `data`, or None.
  m.def("validate_segment_header", [](const py::bytes& data, uint64_t size) -> py::object {
    std::string text = data;
    std::vector<uint64_t> aligned((std::max<size_t>(text.size(), sizeof(SegmentHeader)) + 7) / 8 + 8, 0);
    std::memcpy(aligned.data(), text.data(), text.size());
    // validate() reads only the header, so the header stands for a segment of `size` bytes.
    auto view = SegmentView::validate(reinterpret_cast<uint8_t*>(aligned.data()), size);
    if (!view) return py::none();
    return py::make_tuple(view->num_rings(), view->slots_per_ring(), view->slot_bytes());
  });
  py::dict layout;
  layout["header_bytes"] = sizeof(SegmentHeader);
  layout["magic"] = offsetof(SegmentHeader, magic);
  layout["num_rings"] = offsetof(SegmentHeader, num_rings);
  layout["slots_per_ring"] = offsetof(SegmentHeader, slots_per_ring);
  layout["slot_bytes"] = offsetof(SegmentHeader, slot_bytes);
  layout["rings_offset"] = offsetof(SegmentHeader, rings_offset);
  layout["chunks_offset"] = offsetof(SegmentHeader, chunks_offset);
  layout["data_offset"] = offsetof(SegmentHeader, data_offset);
  layout["total_bytes"] = offsetof(SegmentHeader, total_bytes);
  layout["ring_bytes"] = sizeof(RingControl);
  layout["ring_producer_rank"] = offsetof(RingControl, producer_rank);
  layout["ring_head"] = offsetof(RingControl, head);
  layout["ring_tail"] = offsetof(RingControl, tail);
  layout["ring_space"] = offsetof(RingControl, space);
  layout["chunk_bytes"] = sizeof(ChunkHeader);
  layout["chunk_offset"] = offsetof(ChunkHeader, offset);
  layout["chunk_length"] = offsetof(ChunkHeader, length);
  layout["message_tag"] = offsetof(MessageHeader, tag);
  layout["message_nbytes"] = offsetof(MessageHeader, nbytes);
  layout["message_dtype"] = offsetof(MessageHeader, dtype_code);
  layout["message_ndim"] = offsetof(MessageHeader, ndim);
  layout["message_shape"] = offsetof(MessageHeader, shape);
  m.attr("SHM_LAYOUT") = layout;
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
      .def(
          "reserve_slot",
          [](Transport& transport, int peer, uint64_t tag, uint32_t dtype_code, const std::vector<int64_t>& shape,
             uint64_t nbytes, uint64_t offset) {
            py::gil_scoped_release release;
            const SlotLease lease = transport.reserve_slot(peer, tag, dtype_code, shape, nbytes, offset);
            return std::make_pair(reinterpret_cast<uintptr_t>(lease.data), lease.length);
          },
          py::arg("peer"), py::arg("tag"), py::arg("dtype_code"), py::arg("shape"), py::arg("nbytes"),
          py::arg("offset"))
      .def("commit_slot", &Transport::commit_slot, py::arg("peer"), py::call_guard<py::gil_scoped_release>())
      .def(
          "slot_region",
          [](Transport& transport, int peer) {
            py::gil_scoped_release release;
            const SlotRegion region = transport.slot_region(peer);
            return std::make_pair(reinterpret_cast<uintptr_t>(region.data), region.bytes);
          },
          py::arg("peer"))
      .def("claim_receive", &Transport::claim_receive, py::arg("peer"), py::arg("tag"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "next_claimed_chunk",
          [](Transport& transport, int peer, std::optional<double> timeout_s) {
            ReceivedChunk chunk;
            {
              py::gil_scoped_release release;
              chunk = transport.next_claimed_chunk(peer, timeout_s);
            }
            // (dtype_code, shape, nbytes, offset, length, address of the chunk's bytes in its slot)
            return py::make_tuple(chunk.header.dtype_code, py::tuple(py::cast(shape_of(chunk.header))),
                                  chunk.header.nbytes, chunk.offset, chunk.length,
                                  reinterpret_cast<uintptr_t>(chunk.data));
          },
          py::arg("peer"), py::arg("timeout") = py::none())
      .def("release_claimed_chunk", &Transport::release_claimed_chunk, py::arg("peer"),
           py::call_guard<py::gil_scoped_release>())
      .def("cancel_claim", &Transport::cancel_claim, py::arg("peer"), py::call_guard<py::gil_scoped_release>())
      .def(
          "receive_region",
          [](Transport& transport, int peer) {
            py::gil_scoped_release release;
            const SlotRegion region = transport.receive_region(peer);
            return std::make_pair(reinterpret_cast<uintptr_t>(region.data), region.bytes);
          },
          py::arg("peer"))
      .def(
          "set_receive_arena",
          [](Transport& transport, uintptr_t address, uint64_t nbytes) {
            transport.set_receive_arena(reinterpret_cast<uint8_t*>(address), nbytes);
          },
          py::arg("address"), py::arg("nbytes"))
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
      .def(
          "peer_failure",
          [](Transport& transport, int peer) -> py::object {
            std::optional<PeerFailure> failure;
            {
              py::gil_scoped_release release;
              failure = transport.peer_failure(peer);
            }
            if (!failure) return py::none();
            return py::make_tuple(failure->died, failure->text);
          },
          py::arg("peer"))
      .def(
          "set_wait_spin_us",
          [](Transport& transport, int64_t microseconds) {
            if (microseconds < 0 || microseconds > 10000) {
              throw std::invalid_argument("wait spin must be 0..10000 us, got " + std::to_string(microseconds));
            }
            transport.set_wait_spin(std::chrono::microseconds(microseconds));
          },
          py::arg("microseconds"))
      .def_property_readonly("wait_spin_us", [](const Transport& transport) { return transport.wait_spin().count(); })
      .def("wait_any", &Transport::wait_any, py::arg("keys"), py::arg("timeout") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("close", &Transport::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Transport::closed)
      .def_property_readonly("peers", &Transport::peers)
      .def_property_readonly("rank", &Transport::rank);

  bind_loss(m);
  bind_rdma_protocol(m);
  bind_wire_parsers(m);
}
