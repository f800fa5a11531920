#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <stdexcept>

#include "errors.h"

namespace mapp {

const char* const kShmDirectory = "/dev/shm";

namespace {

std::string shm_path(const std::string& name) { return std::string(kShmDirectory) + "/" + name; }

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

ShmSegment::ShmSegment(std::string name, std::string temporary_name, void* address, size_t size, dev_t device,
                       ino_t inode)
    : name_(std::move(name)),
      temporary_name_(std::move(temporary_name)),
      address_(address),
      size_(size),
      device_(device),
      inode_(inode) {}

std::unique_ptr<ShmSegment> ShmSegment::create_unpublished(const std::string& name, size_t bytes) {
  const std::string temporary_name = name + ".init" + std::to_string(::getpid());
  const std::string shm_name = "/" + temporary_name;
  ::shm_unlink(shm_name.c_str());  // a leftover of this very pid can only be ours
  FileDescriptor fd(::shm_open(shm_name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
  if (fd.get() < 0) throw std::runtime_error(system_error_text("shm_open " + shm_path(temporary_name), errno));
  // Reserve the pages now: touching an unbacked tmpfs page later would kill the process with SIGBUS.
  const int reserve_error = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes));
  if (reserve_error != 0) {
    ::shm_unlink(shm_name.c_str());
    throw std::runtime_error(system_error_text("cannot reserve " + std::to_string(bytes) + " bytes in " +
                                                   shm_path(temporary_name) + " (is " + kShmDirectory + " full?)",
                                               reserve_error));
  }
  struct stat info;
  if (::fstat(fd.get(), &info) != 0) {
    const int error = errno;
    ::shm_unlink(shm_name.c_str());
    throw std::runtime_error(system_error_text("fstat " + shm_path(temporary_name), error));
  }
  void* address = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (address == MAP_FAILED) {
    const int error = errno;
    ::shm_unlink(shm_name.c_str());
    throw std::runtime_error(system_error_text("mmap " + shm_path(temporary_name), error));
  }
  return std::unique_ptr<ShmSegment>(
      new ShmSegment(name, temporary_name, address, bytes, info.st_dev, info.st_ino));
}

std::unique_ptr<ShmSegment> ShmSegment::open_existing(const std::string& name) {
  FileDescriptor fd(::shm_open(("/" + name).c_str(), O_RDWR | O_CLOEXEC, 0));
  if (fd.get() < 0) {
    if (errno == ENOENT) return nullptr;
    throw std::runtime_error(system_error_text("shm_open " + shm_path(name), errno));
  }
  struct stat info;
  if (::fstat(fd.get(), &info) != 0) throw std::runtime_error(system_error_text("fstat " + shm_path(name), errno));
  if (info.st_size <= 0) return nullptr;
  const size_t size = static_cast<size_t>(info.st_size);
  void* address = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (address == MAP_FAILED) throw std::runtime_error(system_error_text("mmap " + shm_path(name), errno));
  return std::unique_ptr<ShmSegment>(new ShmSegment(name, "", address, size, info.st_dev, info.st_ino));
}

ShmSegment::~ShmSegment() {
  if (!temporary_name_.empty()) ::shm_unlink(("/" + temporary_name_).c_str());
  ::munmap(address_, size_);
}

void ShmSegment::publish() {
  if (temporary_name_.empty()) return;
  if (::rename(shm_path(temporary_name_).c_str(), shm_path(name_).c_str()) != 0) {
    throw std::runtime_error(
        system_error_text("rename " + shm_path(temporary_name_) + " to " + shm_path(name_), errno));
  }
  temporary_name_.clear();
}

bool ShmSegment::unlink_name() {
  struct stat info;
  if (::stat(shm_path(name_).c_str(), &info) != 0) return false;
  if (info.st_dev != device_ || info.st_ino != inode_) return false;  // the name now belongs to someone else
  return ::shm_unlink(("/" + name_).c_str()) == 0;
}

bool unlink_shm_name(const std::string& name) { return ::shm_unlink(("/" + name).c_str()) == 0; }

}  // namespace mapp
