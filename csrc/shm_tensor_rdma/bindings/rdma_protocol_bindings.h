// Test-only Python view of the RDMA backend's device-independent logic (wire format, chunks, credits, queue-pair
// states, port choice): submodule megatron_app._shm_tensor_rdma._rdma_protocol, used by tests/test_rdma_protocol.py.
#pragma once

#include <pybind11/pybind11.h>

namespace mapp {

void bind_rdma_protocol(pybind11::module_& m);

}  // namespace mapp
