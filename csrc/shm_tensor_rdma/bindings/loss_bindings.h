// Python bindings of the loss layer (models, channels, the transport's injector); called by bindings.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace mapp {

// Must run after the Transport class is bound (attach_loss_injector takes one).
void bind_loss(pybind11::module_& m);

}  // namespace mapp
