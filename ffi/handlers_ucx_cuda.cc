// XLA FFI handlers (CUDA platform) over UCX: handlers_cuda.h's on the UCX engine. Device
// buffers go to UCP as CUDA memory (UCS_MEMORY_TYPE_CUDA): UCX picks the protocol -- cuda_ipc
// between processes of one node, GPUDirect RDMA over verbs, or its own pipeline through host
// fragments (cuda_copy) -- and its protocol tables say which (h2jax.comm._paths classifies them).
#include <cstdint>
#include <string>
#include <string_view>

#include "handlers_cuda.h"
#include "ucx_engine.h"

namespace {

struct UcxDevice {  // `comm` is a handle from ucx_engine.h's Connect
  static bool DevicePointers() { return true; }
  static std::string Transfer(int64_t comm, const void* sbuf, size_t sbytes, int dest, int stag, void* rbuf,
                              size_t rbytes, int src, int rtag, double timeout_s, std::string_view op,
                              std::string_view desc, bool device) {
    return h2ucx::Transfer(comm, sbuf, sbytes, dest, stag, rbuf, rbytes, src, rtag, timeout_s, op, desc,
                           device ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST);
  }
};

}  // namespace

H2_DEFINE_CUDA_HANDLERS(UcxDevice, UcxCuda);
