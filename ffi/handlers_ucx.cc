// XLA FFI handlers (CPU platform) over UCX: the host handlers of handlers_host.h on the UCX
// engine (ucx_engine.h). FFI targets h2jax_ucx_send, h2jax_ucx_recv, h2jax_ucx_recv_into,
// h2jax_ucx_sendrecv, and h2jax_ucx_bsend (the buffered send); `comm` is a handle from
// ucx_engine.h's Connect.
#include <cstdint>
#include <string>
#include <string_view>

#include "handlers_host.h"
#include "ucx_engine.h"

namespace {

struct UcxHost {
  static std::string Transfer(int64_t comm, const void* sbuf, size_t sbytes, int dest, int stag, void* rbuf,
                              size_t rbytes, int src, int rtag, double timeout_s, std::string_view op,
                              std::string_view desc) {
    return h2ucx::Transfer(comm, sbuf, sbytes, dest, stag, rbuf, rbytes, src, rtag, timeout_s, op, desc);
  }
};

struct UcxHostBuffered {  // the send returns once its bytes are copied (ucx_engine.h, BufferedSend)
  static std::string Transfer(int64_t comm, const void* sbuf, size_t sbytes, int dest, int stag, void*, size_t, int,
                              int, double timeout_s, std::string_view, std::string_view desc) {
    return h2ucx::BufferedSend(comm, sbuf, sbytes, dest, stag, timeout_s, desc);
  }
};

}  // namespace

H2_DEFINE_HOST_HANDLERS(UcxHost, Ucx);
H2_DEFINE_HOST_SEND(UcxHostBuffered, H2BSendUcx);
