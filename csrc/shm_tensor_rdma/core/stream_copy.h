// Copy for the receive side: the destination is a private buffer that will not be read again until Python uses
// the tensor, so large copies bypass the cache (non-temporal stores). That spares the read-for-ownership of every
// destination line and leaves the cache to the slots, which are reused at once.
#pragma once

#include <cstddef>

namespace mapp {

void copy_bypassing_cache(void* destination, const void* source, size_t bytes);

}  // namespace mapp
