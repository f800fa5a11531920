#include "shm_names.h"

#include <dirent.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "process_identity.h"
#include "shm_layout.h"
#include "shm_segment.h"

namespace mapp {
namespace {

constexpr size_t kMaxJobIdLength = 64;

struct JobEntry {
  std::string name;
  int rank;
  std::optional<int32_t> builder_pid;  // set for ".init<pid>" names
};

bool parse_digits(const std::string& text, long* value) {
  if (text.empty() || text.size() > 9) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  *value = std::strtol(text.c_str(), nullptr, 10);
  return true;
}

// Parses "<prefix><rank>" or "<prefix><rank>.init<pid>" where prefix is "mapp_<job>_r".
std::optional<JobEntry> parse_entry(const std::string& name, const std::string& prefix) {
  if (name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  const std::string rest = name.substr(prefix.size());
  const size_t dot = rest.find(".init");
  long rank = 0;
  if (!parse_digits(rest.substr(0, dot), &rank)) return std::nullopt;
  JobEntry entry{name, static_cast<int>(rank), std::nullopt};
  if (dot != std::string::npos) {
    long pid = 0;
    if (!parse_digits(rest.substr(dot + 5), &pid)) return std::nullopt;
    entry.builder_pid = static_cast<int32_t>(pid);
  }
  return entry;
}

std::vector<JobEntry> list_job_entries(const std::string& job_id) {
  const std::string prefix = "mapp_" + job_id + "_r";
  std::vector<JobEntry> entries;
  DIR* directory = ::opendir(kShmDirectory);
  if (directory == nullptr) return entries;
  while (const struct dirent* item = ::readdir(directory)) {
    if (auto entry = parse_entry(item->d_name, prefix)) entries.push_back(*entry);
  }
  ::closedir(directory);
  return entries;
}

// The live owner of a published segment, or nullopt if it is gone (or the segment is not a valid one).
// With open_only, an owner that already closed its transport does not count.
std::optional<ProcessIdentity> live_owner(const std::string& name, bool open_only = false) {
  std::unique_ptr<ShmSegment> segment = ShmSegment::open_existing(name);
  if (!segment) return std::nullopt;
  std::optional<SegmentView> view = SegmentView::validate(segment->data(), segment->size());
  if (!view) return std::nullopt;
  const ProcessIdentity owner = view->owner();
  if (!owner.alive()) return std::nullopt;
  if (open_only && view->header().closed.load() != 0) return std::nullopt;
  return owner;
}

bool builder_alive(int32_t pid) {
  ProcessIdentity builder;
  builder.pid = pid;
  return builder.alive();
}

}  // namespace

void validate_job_id(const std::string& job_id) {
  bool valid = !job_id.empty() && job_id.size() <= kMaxJobIdLength;
  for (char c : job_id) {
    valid = valid && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                      c == '-');
  }
  if (!valid) {
    throw std::invalid_argument("invalid job_id '" + job_id + "': use 1-" + std::to_string(kMaxJobIdLength) +
                                " characters from [A-Za-z0-9_-]");
  }
}

std::string segment_name(const std::string& job_id, int rank) {
  return "mapp_" + job_id + "_r" + std::to_string(rank);
}

std::vector<std::string> remove_dead_job_segments(const std::string& job_id) {
  validate_job_id(job_id);
  std::vector<std::string> removed;
  for (const JobEntry& entry : list_job_entries(job_id)) {
    const bool owner_alive = entry.builder_pid ? builder_alive(*entry.builder_pid) : live_owner(entry.name).has_value();
    if (!owner_alive && unlink_shm_name(entry.name)) removed.push_back(entry.name);
  }
  return removed;
}

void reclaim_segment_name(const std::string& job_id, int rank) {
  const std::string name = segment_name(job_id, rank);
  if (std::optional<ProcessIdentity> owner = live_owner(name, /*open_only=*/true)) {
    throw std::runtime_error("rank " + std::to_string(rank) + " of job '" + job_id + "' is already running as pid " +
                             std::to_string(owner->pid));
  }
  unlink_shm_name(name);
  for (const JobEntry& entry : list_job_entries(job_id)) {
    if (entry.rank == rank && entry.builder_pid && !builder_alive(*entry.builder_pid)) unlink_shm_name(entry.name);
  }
}

}  // namespace mapp
