#include "loss_bindings.h"

#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "loss_channel.h"
#include "loss_injector.h"
#include "transport.h"

namespace py = pybind11;

namespace mapp {
namespace {

py::dict stats_dict(const LossStatsSnapshot& stats) {
  py::dict result;
  result["packets"] = stats.packets;
  result["lost"] = stats.lost;
  result["bursts"] = stats.bursts;
  result["open_burst"] = stats.open_burst;
  return result;
}

ElementType element_type(uint32_t size, uint32_t kind) {
  if (size == 0) throw std::invalid_argument("element size must be at least 1 byte");
  if (kind > static_cast<uint32_t>(ElementKind::kFloat64)) {
    throw std::invalid_argument("unknown element kind " + std::to_string(kind));
  }
  return ElementType{size, static_cast<ElementKind>(kind)};
}

LossChannelConfig channel_config(const LossModelSpec& model, const std::string& fill, uint64_t packet_bytes,
                                 std::optional<double> rescale_rate) {
  LossChannelConfig config;
  config.model = model;
  config.fill = parse_fill_mode(fill);
  config.packet_bytes = packet_bytes;
  config.rescale_rate = rescale_rate;
  config.validate();
  return config;
}

}  // namespace

void bind_loss(py::module_& m) {
  py::enum_<LossModelKind>(m, "LossModelKind")
      .value("NONE", LossModelKind::kNone)
      .value("BERNOULLI", LossModelKind::kBernoulli)
      .value("GILBERT_ELLIOTT", LossModelKind::kGilbertElliott)
      .value("REPLAY", LossModelKind::kReplay);
  py::enum_<ElementKind>(m, "ElementKind")
      .value("OPAQUE", ElementKind::kOpaque)
      .value("FLOAT16", ElementKind::kFloat16)
      .value("BFLOAT16", ElementKind::kBFloat16)
      .value("FLOAT32", ElementKind::kFloat32)
      .value("FLOAT64", ElementKind::kFloat64);

  py::class_<LossModelSpec>(m, "LossModelSpec")
      .def(py::init<>())
      .def_readwrite("kind", &LossModelSpec::kind)
      .def_readwrite("loss_rate", &LossModelSpec::loss_rate)
      .def_readwrite("p", &LossModelSpec::p)
      .def_readwrite("r", &LossModelSpec::r)
      .def_readwrite("bad_loss", &LossModelSpec::bad_loss)
      .def_readwrite("good_loss", &LossModelSpec::good_loss)
      .def_readwrite("pattern", &LossModelSpec::pattern)
      .def("validate", &LossModelSpec::validate)
      .def("stationary_loss_rate", &LossModelSpec::stationary_loss_rate);

  py::class_<LossChannel>(m, "LossChannel")
      .def(py::init([](const LossModelSpec& model, const std::string& fill, uint64_t packet_bytes, uint64_t seed,
                       const std::vector<uint64_t>& stream, std::optional<double> rescale_rate) {
             uint64_t stream_seed = mix_stream_seed(seed, {});
             for (uint64_t part : stream) stream_seed = mix_stream_seed(stream_seed, {part});
             return std::make_unique<LossChannel>(channel_config(model, fill, packet_bytes, rescale_rate),
                                                  stream_seed);
           }),
           py::arg("model"), py::arg("fill") = "zeros", py::arg("packet_bytes") = 4096, py::arg("seed") = 0,
           py::arg("stream") = std::vector<uint64_t>{}, py::arg("rescale_rate") = py::none())
      .def(
          "apply",
          [](LossChannel& channel, uintptr_t data_ptr, uint64_t nbytes, uint32_t element_size, uint32_t element_kind,
             uint64_t family) {
            const ElementType type = element_type(element_size, element_kind);
            py::gil_scoped_release release;
            channel.apply(reinterpret_cast<uint8_t*>(data_ptr), nbytes, type, family);
          },
          py::arg("data_ptr"), py::arg("nbytes"), py::arg("element_size"), py::arg("element_kind"),
          py::arg("family") = 0)
      .def(
          "apply_mask",
          [](LossChannel& channel, uintptr_t data_ptr, uint64_t nbytes, uint32_t element_size, uint32_t element_kind,
             uint64_t family, uintptr_t keep_ptr, uint64_t parts) {
            const ElementType type = element_type(element_size, element_kind);
            py::gil_scoped_release release;
            channel.apply_mask(reinterpret_cast<uint8_t*>(data_ptr), nbytes, type, family,
                               reinterpret_cast<const uint8_t*>(keep_ptr), parts);
          },
          py::arg("data_ptr"), py::arg("nbytes"), py::arg("element_size"), py::arg("element_kind"), py::arg("family"),
          py::arg("keep_ptr"), py::arg("parts"))
      .def(
          "record_mask",
          [](LossChannel& channel, uintptr_t keep_ptr, uint64_t parts) {
            channel.record_mask(reinterpret_cast<const uint8_t*>(keep_ptr), parts);
          },
          py::arg("keep_ptr"), py::arg("parts"))
      .def("stats", [](const LossChannel& channel) { return stats_dict(channel.stats()); })
      .def_property_readonly("rescale_rate",
                             [](const LossChannel& channel) { return channel.config().effective_rescale_rate(); });

  py::class_<LossInjector, std::shared_ptr<LossInjector>>(m, "LossInjector")
      .def(py::init([](const LossModelSpec& model, const std::string& fill, uint64_t packet_bytes, uint64_t seed,
                       int local_rank, bool forward, bool backward,
                       const std::unordered_map<uint32_t, std::tuple<uint32_t, uint32_t>>& element_types) {
             LossInjectorConfig config;
             config.channel = channel_config(model, fill, packet_bytes, std::nullopt);
             config.seed = seed;
             config.local_rank = local_rank;
             config.forward = forward;
             config.backward = backward;
             for (const auto& [code, type] : element_types) {
               config.element_types[code] = element_type(std::get<0>(type), std::get<1>(type));
             }
             return std::make_shared<LossInjector>(std::move(config));
           }),
           py::arg("model"), py::arg("fill"), py::arg("packet_bytes"), py::arg("seed"), py::arg("local_rank"),
           py::arg("forward"), py::arg("backward"), py::arg("element_types"))
      .def("stats", [](const LossInjector& injector) {
        py::list result;
        for (const LinkLossStats& link : injector.stats()) {
          py::dict entry = stats_dict(link.stats);
          entry["source"] = link.source;
          entry["destination"] = link.destination;
          entry["direction"] = link.direction;
          result.append(entry);
        }
        return result;
      });

  m.def("stale_family_of", &stale_family_of, py::arg("tag"),
        "The tag family whose last payload stale fill reuses: the tag without its iteration field.");
  m.def(
      "attach_loss_injector",
      [](Transport& transport, std::shared_ptr<LossInjector> injector) { transport.set_arrival_filter(injector); },
      py::arg("transport"), py::arg("injector").none(true),
      "Applies `injector` to every message this transport receives from now on (None removes it).");
}

}  // namespace mapp
