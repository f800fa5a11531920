// Owned file descriptors: UniqueFd closes its fd exactly once; EventFd is an owned eventfd one thread signals to
// wake another from poll(). Used by every backend thread that sleeps in poll() (tcp, rdma, the shm connector).
#pragma once

namespace mapp {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Closes the fd now (if any).
  void reset(int fd = -1);
  int release();

 private:
  int fd_ = -1;
};

class EventFd {
 public:
  EventFd();  // non-blocking, close-on-exec; throws std::runtime_error
  int fd() const { return fd_.get(); }
  // Makes fd() readable until clear(). Safe from any thread.
  void signal();
  void clear();

 private:
  UniqueFd fd_;
};

}  // namespace mapp
