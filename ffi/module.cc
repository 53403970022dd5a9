// The Python extension: exports the handler capsules and nothing else (Python decides).
// Built twice: _mpi_ffi_cpu, and _mpi_ffi_cuda with H2JAX_CUDA defined.
#include <mpi.h>

#include <string>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "mpi_engine.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

#ifdef H2JAX_CUDA
#define H2_SUFFIX(name) name##Cuda
#define H2_MODULE _mpi_ffi_cuda
extern "C" int H2CudaAwareMpi();
#else
#define H2_SUFFIX(name) name##Cpu
#define H2_MODULE _mpi_ffi_cpu
#endif

extern "C" XLA_FFI_Error* H2_SUFFIX(H2Send)(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* H2_SUFFIX(H2Recv)(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* H2_SUFFIX(H2RecvInto)(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* H2_SUFFIX(H2SendRecv)(XLA_FFI_CallFrame*);
#ifdef H2JAX_CUDA
// device buffers: the buffered send is the plain one (its bytes leave from device memory)
#define H2_BSEND H2SendCuda
#else
extern "C" XLA_FFI_Error* H2BSendCpu(XLA_FFI_CallFrame*);
#define H2_BSEND H2BSendCpu
#endif

NB_MODULE(H2_MODULE, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["h2jax_send"] = nb::capsule(reinterpret_cast<void*>(H2_SUFFIX(H2Send)));
    d["h2jax_recv"] = nb::capsule(reinterpret_cast<void*>(H2_SUFFIX(H2Recv)));
    d["h2jax_recv_into"] = nb::capsule(reinterpret_cast<void*>(H2_SUFFIX(H2RecvInto)));
    d["h2jax_sendrecv"] = nb::capsule(reinterpret_cast<void*>(H2_SUFFIX(H2SendRecv)));
    d["h2jax_bsend"] = nb::capsule(reinterpret_cast<void*>(H2_BSEND));
    return d;
  });
  m.def("stash_stats", []() {
    // messages that arrived before their receive and waited in the engine's stash (each one
    // allocated and copied once more); the engine is per extension module
    h2::Engine& eng = h2::Engine::get();
    std::lock_guard<std::mutex> lock(eng.mu);
    nb::dict d;
    d["messages"] = eng.stashed_messages;
    d["bytes"] = eng.stashed_bytes;
    d["buffered_sends"] = eng.sends.sends;
    d["buffered_bytes"] = eng.sends.bytes;
    d["sends_in_flight"] = eng.sends.pending.size();
    return d;
  });
  // every buffered send of this process completed: "" or the first failure (a timeout names the send)
  m.def("flush_sends", []() {
    nb::gil_scoped_release release;
    return h2::FlushSends();
  });
  m.def("mpi_library_version", []() {
    char buf[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(buf, &len);
    return std::string(buf, len);
  });
#ifdef H2JAX_CUDA
  m.def("cuda_aware_mpi", []() { return H2CudaAwareMpi() == 1; });
#endif
}
