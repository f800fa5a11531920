#include "stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace mapp {
namespace {

// Below this, ordinary stores win: the data is small enough to stay in cache anyway.
constexpr size_t kStreamingThreshold = 256 * 1024;

}  // namespace

void copy_bypassing_cache(void* destination, const void* source, size_t bytes) {
#if defined(__SSE2__)
  const auto dst_address = reinterpret_cast<uintptr_t>(destination);
  const auto src_address = reinterpret_cast<uintptr_t>(source);
  if (bytes >= kStreamingThreshold && dst_address % 16 == 0 && src_address % 16 == 0) {
    auto* dst = static_cast<__m128i*>(destination);
    const auto* src = static_cast<const __m128i*>(source);
    const size_t blocks = bytes / 64;  // 4 x 16 bytes per iteration
    for (size_t i = 0; i < blocks; ++i, dst += 4, src += 4) {
      const __m128i a = _mm_load_si128(src);
      const __m128i b = _mm_load_si128(src + 1);
      const __m128i c = _mm_load_si128(src + 2);
      const __m128i d = _mm_load_si128(src + 3);
      _mm_stream_si128(dst, a);
      _mm_stream_si128(dst + 1, b);
      _mm_stream_si128(dst + 2, c);
      _mm_stream_si128(dst + 3, d);
    }
    _mm_sfence();  // order the streaming stores before the message is published
    std::memcpy(dst, src, bytes % 64);
    return;
  }
#endif
  std::memcpy(destination, source, bytes);
}

}  // namespace mapp
