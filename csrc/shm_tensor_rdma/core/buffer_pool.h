// Private, page-aligned receive buffers. A buffer handed to Python returns to its pool when the last tensor
// viewing it dies, so steady-state traffic (same sizes every iteration) reuses already-faulted-in pages.
// When the cache is full the buffers returned longest ago make room: a phase of one size must not leave the
// cache full of buffers no later message fits, or every later message pays for fresh pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace mapp {

class BufferPool;

// Move-only owner of one buffer; gives the memory back to its pool on destruction.
class PooledBuffer {
 public:
  PooledBuffer() = default;
  PooledBuffer(std::shared_ptr<BufferPool> pool, uint8_t* data, size_t size, size_t capacity);
  ~PooledBuffer();
  PooledBuffer(PooledBuffer&& other) noexcept;
  PooledBuffer& operator=(PooledBuffer&& other) noexcept;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void reset();

  std::shared_ptr<BufferPool> pool_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // Keeps at most `max_cached_bytes` of returned buffers for reuse.
  static std::shared_ptr<BufferPool> create(size_t max_cached_bytes);
  ~BufferPool();

  // A buffer of exactly `size` bytes (size 0 allocates nothing): from the arena while it has room, else from the
  // cache or fresh memory. Throws std::bad_alloc.
  PooledBuffer acquire(size_t size);
  // Memory the caller owns (page-locked for a device, say) that later buffers come from while it has room; their
  // space returns to it when they are given back. The caller keeps it alive as long as any buffer may use it (the
  // pool only hands out and takes back ranges of it; it never reads, writes or frees it). Once per pool.
  void set_arena(uint8_t* base, size_t bytes);

 private:
  friend class PooledBuffer;
  using SizeAndAge = std::pair<size_t, uint64_t>;  // (capacity, when it was given back)

  explicit BufferPool(size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}
  void give_back(uint8_t* data, size_t capacity);
  // Removes a cached buffer from both indexes and returns its memory; caller holds mutex_.
  uint8_t* forget(SizeAndAge key);  // by value: the key may live in the node it erases

  // Whether `data` lies in the arena; caller holds mutex_.
  bool in_arena(const uint8_t* data) const { return arena_base_ != nullptr && data >= arena_base_ && data < arena_end_; }
  // A page-aligned range of the arena of at least `capacity` bytes, or nullptr; caller holds mutex_.
  uint8_t* take_from_arena(size_t capacity);

  const size_t max_cached_bytes_;
  uint8_t* arena_base_ = nullptr;  // set once, before buffers come from it
  uint8_t* arena_end_ = nullptr;
  std::map<size_t, size_t> arena_free_;  // offset -> length of each free range, coalesced
  std::mutex mutex_;
  std::map<SizeAndAge, uint8_t*> by_capacity_;
  std::map<uint64_t, size_t> by_age_;  // age -> capacity, oldest first
  uint64_t next_age_ = 0;
  size_t cached_bytes_ = 0;
};

}  // namespace mapp
