// XLA FFI handlers (CUDA platform) over MPI: handlers_cuda.h's on the MPI engine. With a
// CUDA-aware MPI (Open MPI's MPIX_Query_cuda_support() == 1) device pointers go straight to
// MPI; otherwise the bytes are staged through page-locked host memory (the always-correct path).
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "handlers_cuda.h"
#include "mpi_engine.h"
#include "xla/ffi/api/ffi.h"
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

namespace {

bool CudaAwareMpi() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  static const bool aware = MPIX_Query_cuda_support() == 1;
  return aware;
#else
  return false;
#endif
}

struct MpiDevice {  // `comm` is the Fortran handle of an mpi4py communicator
  static bool DevicePointers() { return CudaAwareMpi(); }
  static std::string Transfer(int64_t comm, const void* sbuf, size_t sbytes, int dest, int stag, void* rbuf,
                              size_t rbytes, int src, int rtag, double timeout_s, std::string_view op,
                              std::string_view desc, bool /*device*/) {
    return h2::Transfer(h2::CommFromF(comm), sbuf, sbytes, dest, stag, rbuf, rbytes, src, rtag, timeout_s, op, desc);
  }
};

}  // namespace

H2_DEFINE_CUDA_HANDLERS(MpiDevice, Cuda);

extern "C" int H2CudaAwareMpi() { return CudaAwareMpi() ? 1 : 0; }
