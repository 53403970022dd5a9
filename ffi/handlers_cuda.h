// XLA FFI handlers (CUDA platform) on device buffers, defined once over a byte-moving engine:
// handlers_cuda.cc instantiates them over MPI (mpi_engine.h), handlers_ucx_cuda.cc over UCX
// (ucx_engine.h).
//
// The stream XLA hands us orders the buffers: we synchronise it before the engine reads a send
// buffer, and the engine has finished writing a receive buffer before we return. Where the
// engine takes device pointers (an MPI library that is CUDA-aware, MPIX_Query_cuda_support() ==
// 1; UCX, which picks its own protocol for CUDA memory and says so in its protocol tables)
// they go straight to it; otherwise the bytes are staged through page-locked host memory (the
// always-correct path). Compiled only where the CUDA toolkit is present; never run on CPU-only
// machines.
//
// An engine is a type with
//   static bool DevicePointers();  // hand device pointers to Transfer (else stage through the host)
//   static std::string Transfer(int64_t comm, const void* sbuf, size_t sbytes, int dest, int stag,
//                               void* rbuf, size_t rbytes, int src, int rtag, double timeout_s,
//                               std::string_view op, std::string_view desc, bool device);
// (`device`: the buffers are device memory) returning "" or a one-line error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "handlers_host.h"
#include "xla/ffi/api/ffi.h"

namespace h2cuda {

namespace ffi = xla::ffi;
using h2::ToFfi;  // the host handlers' mapping of an engine's line to an FFI error

inline ffi::Error CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("h2jax ffi (cuda): ") + what + ": " + cudaGetErrorString(e));
}

// A grow-only page-locked host buffer (never freed: it lives as long as its thread, and
// freeing at thread exit could run after the CUDA context is gone).
struct Pinned {
  void* ptr = nullptr;
  size_t size = 0;
  ffi::Error Reserve(size_t n) {
    if (n <= size) return ffi::Error::Success();
    if (ptr != nullptr) cudaFreeHost(ptr);
    ptr = nullptr;
    size = 0;
    if (auto e = CudaCheck(cudaMallocHost(&ptr, n), "cudaMallocHost (staging buffer)"); e.failure()) return e;
    size = n;
    return ffi::Error::Success();
  }
};

// One transfer on device buffers. route = (peer, tag) for a one-sided operation,
// (dest, send_tag, source, recv_tag) for sendrecv.
template <class E>
ffi::Error DeviceTransfer(cudaStream_t stream, int64_t comm, const void* sbuf, size_t sbytes, const int32_t* route,
                          void* rbuf, size_t rbytes, const char* op, std::string_view desc, void* token,
                          bool has_send, bool has_recv, double timeout_s) {
  // the send buffer (and the route) must be complete before anyone reads them
  if (auto e = CudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); e.failure()) return e;
  int dest = -1, stag = 0, src = -1, rtag = 0;
  if (has_send && has_recv) {
    dest = route[0], stag = route[1], src = route[2], rtag = route[3];
  } else if (has_send) {
    dest = route[0], stag = route[1];
  } else {
    src = route[0], rtag = route[1];
  }
  std::string err;
  if (E::DevicePointers()) {
    err = E::Transfer(comm, sbuf, sbytes, dest, stag, rbuf, rbytes, src, rtag, timeout_s, op, desc, true);
  } else {
    // staged through page-locked host buffers (reused; one pair per calling thread, i.e.
    // per device): pageable staging ran at 0.78 GB/s one-way for 64 MiB on an H200
    thread_local Pinned hs, hr;
    if (has_send)
      if (auto e = hs.Reserve(sbytes); e.failure()) return e;
    if (has_recv)
      if (auto e = hr.Reserve(rbytes); e.failure()) return e;
    if (has_send && sbytes) {
      if (auto e = CudaCheck(cudaMemcpyAsync(hs.ptr, sbuf, sbytes, cudaMemcpyDeviceToHost, stream), "copy to host");
          e.failure())
        return e;
      if (auto e = CudaCheck(cudaStreamSynchronize(stream), "copy to host"); e.failure()) return e;
    }
    err = E::Transfer(comm, hs.ptr, sbytes, dest, stag, hr.ptr, rbytes, src, rtag, timeout_s, op, desc, false);
    if (err.empty() && has_recv && rbytes) {
      if (auto e = CudaCheck(cudaMemcpyAsync(rbuf, hr.ptr, rbytes, cudaMemcpyHostToDevice, stream), "copy to device");
          e.failure())
        return e;
      // hr is reused by this thread's next transfer, which may be on another stream
      if (auto e = CudaCheck(cudaStreamSynchronize(stream), "copy to device"); e.failure()) return e;
    }
  }
  if (auto e = CudaCheck(cudaMemsetAsync(token, 0, 1, stream), "token"); e.failure()) return e;
  return ToFfi(err);
}

// route: see handlers_cpu.cc; it lives in device memory here
inline ffi::Error ReadRoute(cudaStream_t stream, ffi::Buffer<ffi::S32> route, int32_t* out) {
  size_t n = route.element_count();
  if (auto e = CudaCheck(cudaMemcpyAsync(out, route.typed_data(), n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
                         "route");
      e.failure())
    return e;
  return ffi::Error::Success();  // DeviceTransfer synchronises the stream before use
}

template <class E>
ffi::Error SendImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> route, ffi::AnyBuffer x, ffi::AnyBuffer,
                    ffi::Result<ffi::AnyBuffer> token_out, int64_t comm, double timeout_s, std::string_view desc) {
  int32_t r[2];
  if (auto e = ReadRoute(stream, route, r); e.failure()) return e;
  return DeviceTransfer<E>(stream, comm, x.untyped_data(), x.size_bytes(), r, nullptr, 0, "send", desc,
                        token_out->untyped_data(), true, false, timeout_s);
}

template <class E>
ffi::Error RecvImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> route, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::AnyBuffer> token_out, int64_t comm, double timeout_s, std::string_view desc) {
  int32_t r[2];
  if (auto e = ReadRoute(stream, route, r); e.failure()) return e;
  return DeviceTransfer<E>(stream, comm, nullptr, 0, r, y->untyped_data(), y->size_bytes(), "recv", desc,
                        token_out->untyped_data(), false, true, timeout_s);
}

template <class E>
ffi::Error RecvIntoImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> route, ffi::AnyBuffer token,
                        ffi::AnyBuffer /*into: aliases y*/, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer> token_out, int64_t comm, double timeout_s, std::string_view desc) {
  return RecvImpl<E>(stream, route, token, y, token_out, comm, timeout_s, desc);
}

template <class E>
ffi::Error SendRecvImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> route, ffi::AnyBuffer x, ffi::AnyBuffer,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> token_out, int64_t comm,
                        double timeout_s, std::string_view desc) {
  int32_t r[4];
  if (auto e = ReadRoute(stream, route, r); e.failure()) return e;
  return DeviceTransfer<E>(stream, comm, x.untyped_data(), x.size_bytes(), r, y->untyped_data(), y->size_bytes(),
                        "sendrecv", desc, token_out->untyped_data(), true, true, timeout_s);
}

}  // namespace h2cuda

// The four exported handler symbols H2Send<Suffix>, H2Recv<Suffix>, H2RecvInto<Suffix> and
// H2SendRecv<Suffix> on the CUDA platform over `Engine`.
#define H2_DEFINE_CUDA_HANDLERS(Engine, Suffix) \
XLA_FFI_DEFINE_HANDLER_SYMBOL(H2Send##Suffix, h2cuda::SendImpl<Engine>, \
                              xla::ffi::Ffi::Bind() \
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>() \
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>() \
                                  .Arg<xla::ffi::AnyBuffer>() \
                                  .Arg<xla::ffi::AnyBuffer>() \
                                  .Ret<xla::ffi::AnyBuffer>() \
                                  .Attr<int64_t>("comm") \
                                  .Attr<double>("timeout_s") \
                                  .Attr<std::string_view>("desc")); \
 \
XLA_FFI_DEFINE_HANDLER_SYMBOL(H2Recv##Suffix, h2cuda::RecvImpl<Engine>, \
                              xla::ffi::Ffi::Bind() \
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>() \
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>() \
                                  .Arg<xla::ffi::AnyBuffer>() \
                                  .Ret<xla::ffi::AnyBuffer>() \
                                  .Ret<xla::ffi::AnyBuffer>() \
                                  .Attr<int64_t>("comm") \
                                  .Attr<double>("timeout_s") \
                                  .Attr<std::string_view>("desc")); \
 \
XLA_FFI_DEFINE_HANDLER_SYMBOL(H2RecvInto##Suffix, h2cuda::RecvIntoImpl<Engine>, \
                              xla::ffi::Ffi::Bind() \
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>() \
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>() \
                                  .Arg<xla::ffi::AnyBuffer>() \
                                  .Arg<xla::ffi::AnyBuffer>() \
                                  .Ret<xla::ffi::AnyBuffer>() \
                                  .Ret<xla::ffi::AnyBuffer>() \
                                  .Attr<int64_t>("comm") \
                                  .Attr<double>("timeout_s") \
                                  .Attr<std::string_view>("desc")); \
 \
XLA_FFI_DEFINE_HANDLER_SYMBOL(H2SendRecv##Suffix, h2cuda::SendRecvImpl<Engine>, \
                              xla::ffi::Ffi::Bind() \
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>() \
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>() \
                                  .Arg<xla::ffi::AnyBuffer>() \
                                  .Arg<xla::ffi::AnyBuffer>() \
                                  .Ret<xla::ffi::AnyBuffer>() \
                                  .Ret<xla::ffi::AnyBuffer>() \
                                  .Attr<int64_t>("comm") \
                                  .Attr<double>("timeout_s") \
                                  .Attr<std::string_view>("desc"))
