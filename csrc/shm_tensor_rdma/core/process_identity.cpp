#include "process_identity.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace mapp {
namespace {

struct ProcStat {
  char state = 0;
  uint64_t start_time = 0;
};

// Reads state (field 3) and starttime (field 22) of /proc/<pid>/stat; false if the process is gone.
bool read_proc_stat(int32_t pid, ProcStat* out) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* file = std::fopen(path.c_str(), "re");
  if (file == nullptr) return false;
  char buffer[1024];
  const size_t length = std::fread(buffer, 1, sizeof(buffer) - 1, file);
  std::fclose(file);
  buffer[length] = '\0';
  // The command name (field 2) may contain spaces and ')' so fields are counted after the last ')'.
  const char* cursor = std::strrchr(buffer, ')');
  if (cursor == nullptr) return false;
  cursor += 1;
  for (int field = 3; field <= 22; ++field) {
    while (*cursor == ' ') ++cursor;
    if (*cursor == '\0') return false;
    if (field == 3) out->state = *cursor;
    if (field == 22) out->start_time = std::strtoull(cursor, nullptr, 10);
    while (*cursor != ' ' && *cursor != '\0') ++cursor;
  }
  return true;
}

}  // namespace

ProcessIdentity ProcessIdentity::self() {
  ProcessIdentity identity;
  identity.pid = static_cast<int32_t>(::getpid());
  ProcStat stat;
  if (read_proc_stat(identity.pid, &stat)) identity.start_time = stat.start_time;
  return identity;
}

bool ProcessIdentity::alive() const {
  if (pid <= 0) return false;
  ProcStat stat;
  if (!read_proc_stat(pid, &stat)) return false;
  if (stat.state == 'Z' || stat.state == 'X' || stat.state == 'x') return false;
  return start_time == 0 || stat.start_time == start_time;
}

}  // namespace mapp
