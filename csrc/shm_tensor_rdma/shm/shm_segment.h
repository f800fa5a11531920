// One POSIX shared-memory segment mapped into this process (RAII: unmapped on destruction).
// A new segment is built under a private temporary name and renamed into place by publish(), so a process that
// opens the public name never sees a half-initialised segment.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace mapp {

// Where POSIX shared memory lives on Linux; names below are relative to it.
extern const char* const kShmDirectory;

class ShmSegment {
 public:
  // Creates and maps `bytes` of zeroed memory under `name` + ".init<pid>". Throws std::runtime_error.
  static std::unique_ptr<ShmSegment> create_unpublished(const std::string& name, size_t bytes);
  // Maps an existing segment; nullptr if no segment has that name.
  static std::unique_ptr<ShmSegment> open_existing(const std::string& name);

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Atomically gives the segment its public name (replacing any stale segment of that name).
  void publish();
  // Removes the public name if it still refers to this segment (processes that mapped it keep their mapping).
  bool unlink_name();

  uint8_t* data() const { return static_cast<uint8_t*>(address_); }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  ShmSegment(std::string name, std::string temporary_name, void* address, size_t size, dev_t device, ino_t inode);

  std::string name_;
  std::string temporary_name_;  // empty once published (or for opened segments)
  void* address_;
  size_t size_;
  dev_t device_;
  ino_t inode_;
};

// Removes /dev/shm/<name>; true if it existed.
bool unlink_shm_name(const std::string& name);

}  // namespace mapp
