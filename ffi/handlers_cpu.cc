// XLA FFI handlers (CPU platform) over MPI: the host handlers of handlers_host.h on the MPI
// engine (mpi_engine.h). FFI targets h2jax_send, h2jax_recv, h2jax_recv_into, h2jax_sendrecv, and
// h2jax_bsend (the buffered send).
#include <cstdint>
#include <string>
#include <string_view>

#include "handlers_host.h"
#include "mpi_engine.h"

namespace {

struct MpiHost {  // `comm` is the Fortran handle of an mpi4py communicator
  static std::string Transfer(int64_t comm, const void* sbuf, size_t sbytes, int dest, int stag, void* rbuf,
                              size_t rbytes, int src, int rtag, double timeout_s, std::string_view op,
                              std::string_view desc) {
    return h2::Transfer(h2::CommFromF(comm), sbuf, sbytes, dest, stag, rbuf, rbytes, src, rtag, timeout_s, op, desc);
  }
};

struct MpiHostBuffered {  // the send returns once its bytes are copied (mpi_engine.h, BufferedSend)
  static std::string Transfer(int64_t comm, const void* sbuf, size_t sbytes, int dest, int stag, void*, size_t, int,
                              int, double timeout_s, std::string_view, std::string_view desc) {
    return h2::BufferedSend(h2::CommFromF(comm), sbuf, sbytes, dest, stag, timeout_s, desc);
  }
};

}  // namespace

H2_DEFINE_HOST_HANDLERS(MpiHost, Cpu);
H2_DEFINE_HOST_SEND(MpiHostBuffered, H2BSendCpu);
