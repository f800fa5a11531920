// What every backend's send() gets, whatever carries it (shm, tcp, rdma): the message, and the limits a blocking
// send honours to give up with a clear error.
#pragma once

#include <atomic>
#include <cstdint>

#include "message.h"

namespace mapp {

struct OutgoingMessage {
  MessageHeader header;
  const uint8_t* data;  // header.nbytes bytes; the caller keeps them valid until the send completes
};

// A slot lent to the caller (Backend::reserve_slot): `length` payload bytes of the message go to `data`.
struct SlotLease {
  uint8_t* data;
  uint64_t length;
};

// A range of memory a backend lends slots from (registered once with a device so copies into it run at full speed).
struct SlotRegion {
  uint8_t* data;
  uint64_t bytes;
};

// A chunk of a claimed message still in its slot (Backend::next_claimed_chunk): `length` bytes at `data` are the
// message's bytes from `offset` on; the slot is the receiver's until released.
struct ReceivedChunk {
  MessageHeader header;
  uint64_t offset;
  uint64_t length;
  const uint8_t* data;
};

struct SendLimits {
  int my_rank;
  double timeout_s;                  // without progress, give up after this long
  const std::atomic<bool>* stopping; // the transport is closing
};

}  // namespace mapp
