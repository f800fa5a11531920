#include "message.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace mapp {

MessageHeader make_message_header(uint64_t tag, uint32_t dtype_code, const std::vector<int64_t>& shape,
                                  uint64_t nbytes) {
  if (shape.size() > kMaxDims) {
    throw std::invalid_argument("tensor has " + std::to_string(shape.size()) + " dimensions; at most " +
                                std::to_string(kMaxDims) + " are supported");
  }
  MessageHeader header;
  std::memset(&header, 0, sizeof(header));
  header.tag = tag;
  header.nbytes = nbytes;
  header.dtype_code = dtype_code;
  header.ndim = static_cast<uint32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) throw std::invalid_argument("negative extent " + std::to_string(shape[i]) + " in shape");
    header.shape[i] = shape[i];
  }
  return header;
}

std::vector<int64_t> shape_of(const MessageHeader& header) {
  return std::vector<int64_t>(header.shape, header.shape + header.ndim);
}

std::string message_header_problem(const MessageHeader& header, uint64_t max_message_bytes) {
  if (header.ndim > kMaxDims) return "a tensor with " + std::to_string(header.ndim) + " dimensions";
  for (uint32_t i = 0; i < header.ndim; ++i) {
    if (header.shape[i] < 0) return "negative extent " + std::to_string(header.shape[i]) + " in its shape";
  }
  if (header.nbytes > max_message_bytes) {
    return "a message of " + std::to_string(header.nbytes) + " bytes, over max_message_bytes=" +
           std::to_string(max_message_bytes);
  }
  return "";
}

}  // namespace mapp
