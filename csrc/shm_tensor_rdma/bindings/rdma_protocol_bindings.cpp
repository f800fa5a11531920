#include "rdma_protocol_bindings.h"

#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "rdma_chunk.h"
#include "rdma_flow.h"
#include "rdma_qp_state.h"
#include "rdma_settings.h"
#include "rdma_wire.h"

namespace py = pybind11;

namespace mapp {
namespace {

std::vector<uint8_t> bytes_of(const py::bytes& data) {
  const std::string text = data;
  return std::vector<uint8_t>(text.begin(), text.end());
}

py::bytes to_bytes(const uint8_t* data, size_t size) { return py::bytes(reinterpret_cast<const char*>(data), size); }

std::array<uint8_t, 16> gid_of(const py::bytes& data) {
  const std::string text = data;
  if (text.size() != 16) throw std::invalid_argument("a GID has 16 bytes, got " + std::to_string(text.size()));
  std::array<uint8_t, 16> gid{};
  std::memcpy(gid.data(), text.data(), 16);
  return gid;
}

RdmaEndpointInfo info_from_dict(const py::dict& fields) {
  RdmaEndpointInfo info;
  const std::string role = fields["role"].cast<std::string>();
  if (role != "sender" && role != "receiver") throw std::invalid_argument("role must be 'sender' or 'receiver'");
  info.role = role == "sender" ? RdmaRole::kSender : RdmaRole::kReceiver;
  info.rank = fields["rank"].cast<int32_t>();
  info.job_id = fields["job_id"].cast<std::string>();
  info.qp_num = fields["qp_num"].cast<uint32_t>();
  info.psn = fields["psn"].cast<uint32_t>();
  info.lid = fields["lid"].cast<uint16_t>();
  info.mtu = fields["mtu"].cast<uint8_t>();
  info.link_layer = fields["link_layer"].cast<uint8_t>();
  info.gid = gid_of(fields["gid"].cast<py::bytes>());
  info.ring_address = fields["ring_address"].cast<uint64_t>();
  info.ring_rkey = fields["ring_rkey"].cast<uint32_t>();
  info.slot_count = fields["slot_count"].cast<uint32_t>();
  info.slot_bytes = fields["slot_bytes"].cast<uint64_t>();
  return info;
}

py::dict info_to_dict(const RdmaEndpointInfo& info) {
  py::dict fields;
  fields["role"] = info.role == RdmaRole::kSender ? "sender" : "receiver";
  fields["rank"] = info.rank;
  fields["job_id"] = info.job_id;
  fields["qp_num"] = info.qp_num;
  fields["psn"] = info.psn;
  fields["lid"] = info.lid;
  fields["mtu"] = info.mtu;
  fields["link_layer"] = info.link_layer;
  fields["gid"] = to_bytes(info.gid.data(), info.gid.size());
  fields["ring_address"] = info.ring_address;
  fields["ring_rkey"] = info.ring_rkey;
  fields["slot_count"] = info.slot_count;
  fields["slot_bytes"] = info.slot_bytes;
  return fields;
}

QpState state_named(const std::string& name) {
  for (QpState state : {QpState::kReset, QpState::kInit, QpState::kReadyToReceive, QpState::kReadyToSend,
                        QpState::kError, QpState::kClosed}) {
    if (name == qp_state_name(state)) return state;
  }
  throw std::invalid_argument("unknown queue pair state '" + name + "'");
}

RdmaPortSummary port_from_dict(const py::dict& fields) {
  RdmaPortSummary port;
  port.device = fields["device"].cast<std::string>();
  port.port = fields["port"].cast<int>();
  port.active = fields["active"].cast<bool>();
  port.link_layer = fields["link_layer"].cast<uint8_t>();
  for (const py::handle& entry : fields["gids"].cast<py::list>()) {
    const py::tuple gid = entry.cast<py::tuple>();  // (index, type, 16 bytes)
    port.gids.push_back(RdmaGidEntry{gid[0].cast<uint32_t>(), static_cast<GidType>(gid[1].cast<uint32_t>()),
                                     gid_of(gid[2].cast<py::bytes>())});
  }
  return port;
}

// A message assembler with its own buffer pool, returning finished messages as Python values.
class PyAssembler {
 public:
  PyAssembler(uint64_t slot_bytes, uint64_t max_message_bytes)
      : assembler_(BufferPool::create(0), slot_bytes, max_message_bytes) {}
  py::object accept(const py::bytes& slot, uint64_t sequence) {
    const std::string text = slot;
    std::optional<Message> done =
        assembler_.accept(reinterpret_cast<const uint8_t*>(text.data()), text.size(), sequence);
    if (!done) return py::none();
    return py::make_tuple(done->header.tag, done->header.dtype_code, shape_of(done->header),
                          to_bytes(done->payload.data(), done->header.nbytes));
  }
  bool mid_message() const { return assembler_.mid_message(); }

 private:
  RdmaMessageAssembler assembler_;
};

}  // namespace

void bind_rdma_protocol(py::module_& parent) {
  py::module_ m = parent.def_submodule("_rdma_protocol", "Test-only view of the RDMA backend's protocol logic.");

  m.attr("LINK_LAYER_INFINIBAND") = kLinkLayerInfiniband;
  m.attr("LINK_LAYER_ETHERNET") = kLinkLayerEthernet;
  m.attr("CHUNK_HEADER_BYTES") = sizeof(RdmaChunkHeader);
  m.attr("CONTROL_BYTES") = kRdmaControlBytes;
  m.attr("BYE") = static_cast<uint32_t>(RdmaControlKind::kBye);

  m.def("crc32", [](const py::bytes& data) {
    const std::vector<uint8_t> bytes = bytes_of(data);
    return crc32_of(bytes.data(), bytes.size());
  });
  m.def("endpoint_info_bytes", &rdma_endpoint_info_bytes);
  m.def("encode_endpoint_info", [](const py::dict& fields) {
    const std::vector<uint8_t> bytes = encode_endpoint_info(info_from_dict(fields));
    return to_bytes(bytes.data(), bytes.size());
  });
  m.def("decode_endpoint_info", [](const py::bytes& data) { return info_to_dict(decode_endpoint_info(bytes_of(data))); });
  m.def("check_endpoint_peer", [](const py::dict& fields, const std::string& expected_role, const std::string& job_id,
                                  const std::vector<int>& ranks) {
    RdmaEndpointInfo info = info_from_dict(fields);
    return check_endpoint_peer(info, expected_role == "sender" ? RdmaRole::kSender : RdmaRole::kReceiver, job_id, ranks);
  });
  m.def("encode_control", [](uint32_t kind) {
    const auto bytes = encode_control(static_cast<RdmaControlKind>(kind));
    return to_bytes(bytes.data(), bytes.size());
  });
  m.def("decode_control", [](const py::bytes& data) {
    const std::vector<uint8_t> bytes = bytes_of(data);
    return static_cast<uint32_t>(decode_control(bytes.data(), bytes.size()));
  });

  m.def("slot_payload_bytes", &rdma_slot_payload_bytes, py::arg("slot_bytes"));
  m.def("chunk_count", &rdma_chunk_count, py::arg("nbytes"), py::arg("payload_per_slot"));
  m.def(
      "write_chunks",
      [](const py::bytes& payload, uint64_t tag, uint32_t dtype_code, const std::vector<int64_t>& shape,
         uint64_t slot_bytes, uint64_t first_sequence, uint64_t message_index) {
        const std::string data = payload;
        const MessageHeader header = make_message_header(tag, dtype_code, shape, data.size());
        const RdmaChunker chunker(header, reinterpret_cast<const uint8_t*>(data.data()), slot_bytes, message_index);
        std::vector<uint8_t> slot(slot_bytes);
        py::list slots;
        for (uint64_t i = 0; i < chunker.count(); ++i) {
          const size_t written = chunker.write(i, first_sequence + i, slot.data());
          slots.append(to_bytes(slot.data(), written));
        }
        return slots;
      },
      py::arg("payload"), py::arg("tag"), py::arg("dtype_code"), py::arg("shape"), py::arg("slot_bytes"),
      py::arg("first_sequence"), py::arg("message_index"));
  m.def(
      "read_chunk",
      [](const py::bytes& slot, uint64_t sequence, uint64_t slot_bytes, uint64_t max_message_bytes) {
        const std::vector<uint8_t> bytes = bytes_of(slot);
        const RdmaChunkHeader header = read_rdma_chunk(bytes.data(), bytes.size(), sequence, slot_bytes, max_message_bytes);
        py::dict fields;
        fields["sequence"] = header.sequence;
        fields["message_index"] = header.message_index;
        fields["offset"] = header.offset;
        fields["length"] = header.length;
        fields["tag"] = header.message.tag;
        fields["nbytes"] = header.message.nbytes;
        fields["shape"] = shape_of(header.message);
        return fields;
      },
      py::arg("slot"), py::arg("sequence"), py::arg("slot_bytes"), py::arg("max_message_bytes"));
  py::class_<PyAssembler>(m, "MessageAssembler")
      .def(py::init<uint64_t, uint64_t>(), py::arg("slot_bytes"), py::arg("max_message_bytes"))
      .def("accept", &PyAssembler::accept, py::arg("slot"), py::arg("sequence"))
      .def_property_readonly("mid_message", &PyAssembler::mid_message);

  m.def("widen_sequence", &widen_sequence, py::arg("floor"), py::arg("low_bits"));
  py::class_<RdmaSendWindow>(m, "SendWindow")
      .def(py::init<uint32_t>(), py::arg("slot_count"))
      .def("can_claim", &RdmaSendWindow::can_claim)
      .def("claim", &RdmaSendWindow::claim)
      .def("slot_of", &RdmaSendWindow::slot_of)
      .def("on_write_completed", &RdmaSendWindow::on_write_completed)
      .def("on_credit", &RdmaSendWindow::on_credit, py::arg("released_low_bits"))
      .def_property_readonly("writes_done", &RdmaSendWindow::writes_done)
      .def_property_readonly("claimed", &RdmaSendWindow::claimed)
      .def_property_readonly("completed", &RdmaSendWindow::completed)
      .def_property_readonly("credited", &RdmaSendWindow::credited);
  py::class_<RdmaSlotReleases>(m, "SlotReleases")
      .def(py::init<uint32_t>(), py::arg("slot_count"))
      .def("on_arrival", &RdmaSlotReleases::on_arrival, py::arg("sequence_low_bits"))
      .def("release", &RdmaSlotReleases::release, py::arg("sequence"))
      .def("slot_of", &RdmaSlotReleases::slot_of)
      .def_property_readonly("released_prefix", &RdmaSlotReleases::released_prefix)
      .def_property_readonly("arrived", &RdmaSlotReleases::arrived);
  py::class_<RdmaCreditReturn>(m, "CreditReturn")
      .def(py::init<uint32_t, uint32_t>(), py::arg("batch"), py::arg("max_in_flight"))
      .def("due", &RdmaCreditReturn::due, py::arg("released_prefix"), py::arg("idle"))
      .def("on_send_completed", &RdmaCreditReturn::on_send_completed)
      .def_property_readonly("returned", &RdmaCreditReturn::returned)
      .def_property_readonly("in_flight", &RdmaCreditReturn::in_flight);

  py::class_<QpStateMachine>(m, "QpStateMachine")
      .def(py::init<>())
      .def_property_readonly("state", [](const QpStateMachine& machine) { return qp_state_name(machine.state()); })
      .def_property_readonly("ready", &QpStateMachine::ready)
      .def("advance", [](QpStateMachine& machine, const std::string& to) { machine.advance(state_named(to)); })
      .def_static("allowed", [](const std::string& from, const std::string& to) {
        return QpStateMachine::allowed(state_named(from), state_named(to));
      });

  m.def("parse_settings", [](const std::map<std::string, std::string>& environment) {
    const RdmaSettings settings = parse_rdma_settings([&](const char* name) -> const char* {
      auto found = environment.find(name);
      return found == environment.end() ? nullptr : found->second.c_str();
    });
    py::dict fields;
    fields["device"] = settings.device;
    fields["port"] = settings.port;
    fields["gid_index"] = settings.gid_index;
    fields["slot_bytes"] = settings.slot_bytes;
    fields["slot_count"] = settings.slot_count;
    return fields;
  });
  m.def("choose_gid_index", [](const py::dict& port, int requested) {
    return choose_gid_index(port_from_dict(port), requested);
  });
  m.def("choose_port", [](const py::list& ports, const std::string& device, int port, int gid_index) {
    std::vector<RdmaPortSummary> summaries;
    for (const py::handle& entry : ports) summaries.push_back(port_from_dict(entry.cast<py::dict>()));
    RdmaSettings settings;
    settings.device = device;
    settings.port = port;
    settings.gid_index = gid_index;
    const RdmaPortSummary& chosen = choose_rdma_port(summaries, settings);
    return py::make_tuple(chosen.device, chosen.port);
  });
}

}  // namespace mapp
