#include "errors.h"

#include <cstdio>
#include <cstring>

namespace mapp {

std::string system_error_text(const std::string& what, int errnum) {
  return what + ": " + std::strerror(errnum);
}

}  // namespace mapp

namespace mapp {

std::string printable_text(const std::string& untrusted) {
  std::string text;
  for (const char c : untrusted) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7F && byte != '\\') {
      text += c;
    } else {
      char escaped[5];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", byte);
      text += escaped;
    }
  }
  return text;
}

std::string format_seconds(double seconds) {
  char text[48];
  std::snprintf(text, sizeof(text), "%g s", seconds);
  return text;
}

}  // namespace mapp
