#include "buffer_pool.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <stdexcept>
#include <new>
#include <utility>
#include <vector>

namespace mapp {
namespace {

constexpr size_t kPageBytes = 4096;
// Above this, buffers come straight from mmap with MAP_POPULATE: one kernel call maps every page instead of
// one page fault per 4 KiB on first touch.
constexpr size_t kMmapThreshold = 256 * 1024;

size_t capacity_for(size_t size) { return (size + kPageBytes - 1) / kPageBytes * kPageBytes; }

uint8_t* allocate(size_t capacity) {
  if (capacity >= kMmapThreshold) {
    void* address = ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                           -1, 0);
    if (address == MAP_FAILED) throw std::bad_alloc();
    return static_cast<uint8_t*>(address);
  }
  void* address = std::aligned_alloc(kPageBytes, capacity);
  if (address == nullptr) throw std::bad_alloc();
  return static_cast<uint8_t*>(address);
}

void release(uint8_t* data, size_t capacity) {
  if (capacity >= kMmapThreshold) {
    ::munmap(data, capacity);
  } else {
    std::free(data);
  }
}

}  // namespace

PooledBuffer::PooledBuffer(std::shared_ptr<BufferPool> pool, uint8_t* data, size_t size, size_t capacity)
    : pool_(std::move(pool)), data_(data), size_(size), capacity_(capacity) {}

PooledBuffer::~PooledBuffer() { reset(); }

PooledBuffer::PooledBuffer(PooledBuffer&& other) noexcept
    : pool_(std::move(other.pool_)), data_(other.data_), size_(other.size_), capacity_(other.capacity_) {
  other.data_ = nullptr;
  other.size_ = other.capacity_ = 0;
}

PooledBuffer& PooledBuffer::operator=(PooledBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::move(other.pool_);
    data_ = other.data_;
    size_ = other.size_;
    capacity_ = other.capacity_;
    other.data_ = nullptr;
    other.size_ = other.capacity_ = 0;
  }
  return *this;
}

void PooledBuffer::reset() {
  if (data_ != nullptr && pool_) pool_->give_back(data_, capacity_);
  pool_.reset();
  data_ = nullptr;
  size_ = capacity_ = 0;
}

std::shared_ptr<BufferPool> BufferPool::create(size_t max_cached_bytes) {
  return std::shared_ptr<BufferPool>(new BufferPool(max_cached_bytes));
}

BufferPool::~BufferPool() {
  for (const auto& [key, data] : by_capacity_) release(data, key.first);
}

uint8_t* BufferPool::forget(SizeAndAge key) {
  auto entry = by_capacity_.find(key);
  uint8_t* data = entry->second;
  by_capacity_.erase(entry);
  by_age_.erase(key.second);
  cached_bytes_ -= key.first;
  return data;
}

void BufferPool::set_arena(uint8_t* base, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (arena_base_ != nullptr) throw std::logic_error("the receive arena is set once");
  if (base == nullptr || bytes < kPageBytes || reinterpret_cast<uintptr_t>(base) % kPageBytes != 0) {
    throw std::invalid_argument("an arena must be page-aligned and at least a page");
  }
  arena_base_ = base;
  arena_end_ = base + bytes / kPageBytes * kPageBytes;
  arena_free_.emplace(0, static_cast<size_t>(arena_end_ - arena_base_));
}

uint8_t* BufferPool::take_from_arena(size_t capacity) {
  for (auto range = arena_free_.begin(); range != arena_free_.end(); ++range) {  // first fit
    if (range->second < capacity) continue;
    const size_t offset = range->first;
    const size_t left = range->second - capacity;
    arena_free_.erase(range);
    if (left > 0) arena_free_.emplace(offset + capacity, left);
    return arena_base_ + offset;
  }
  return nullptr;
}

PooledBuffer BufferPool::acquire(size_t size) {
  if (size == 0) return PooledBuffer();
  const size_t capacity = capacity_for(size);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (arena_base_ != nullptr) {
      if (uint8_t* data = take_from_arena(capacity)) return PooledBuffer(shared_from_this(), data, size, capacity);
    }
    // Reuse a cached buffer at most 25% larger than needed.
    auto found = by_capacity_.lower_bound(SizeAndAge(capacity, 0));
    if (found != by_capacity_.end() && found->first.first <= capacity + capacity / 4) {
      const size_t found_capacity = found->first.first;
      return PooledBuffer(shared_from_this(), forget(found->first), size, found_capacity);
    }
  }
  return PooledBuffer(shared_from_this(), allocate(capacity), size, capacity);
}

void BufferPool::give_back(uint8_t* data, size_t capacity) {
  std::unique_lock<std::mutex> arena_lock(mutex_);
  if (in_arena(data)) {
    size_t offset = static_cast<size_t>(data - arena_base_);
    size_t length = capacity;
    auto next = arena_free_.lower_bound(offset);
    if (next != arena_free_.end() && next->first == offset + length) {  // merge with the free range after
      length += next->second;
      next = arena_free_.erase(next);
    }
    if (next != arena_free_.begin()) {  // and with the one before
      auto previous = std::prev(next);
      if (previous->first + previous->second == offset) {
        offset = previous->first;
        length += previous->second;
        arena_free_.erase(previous);
      }
    }
    arena_free_.emplace(offset, length);
    return;
  }
  arena_lock.unlock();
  if (capacity > max_cached_bytes_) {
    release(data, capacity);
    return;
  }
  std::vector<std::pair<uint8_t*, size_t>> evicted;  // (memory, capacity)
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (cached_bytes_ + capacity > max_cached_bytes_) {
      const SizeAndAge oldest(by_age_.begin()->second, by_age_.begin()->first);
      evicted.emplace_back(forget(oldest), oldest.first);
    }
    const uint64_t age = next_age_++;
    by_capacity_.emplace(SizeAndAge(capacity, age), data);
    by_age_.emplace(age, capacity);
    cached_bytes_ += capacity;
  }
  for (const auto& [memory, bytes] : evicted) release(memory, bytes);  // unlocked: munmap is slow
}

}  // namespace mapp
