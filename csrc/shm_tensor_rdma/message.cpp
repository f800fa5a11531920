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

}  // namespace mapp
