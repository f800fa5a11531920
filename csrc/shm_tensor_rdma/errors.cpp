#include "errors.h"

#include <cstdio>
#include <cstring>

namespace mapp {

std::string system_error_text(const std::string& what, int errnum) {
  return what + ": " + std::strerror(errnum);
}

}  // namespace mapp

namespace mapp {

std::string format_seconds(double seconds) {
  char text[48];
  std::snprintf(text, sizeof(text), "%g s", seconds);
  return text;
}

}  // namespace mapp
