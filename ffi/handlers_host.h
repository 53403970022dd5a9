// XLA FFI handlers for host buffers: send / recv / recv_into / sendrecv of one buffer, defined
// once over a byte-moving engine. handlers_cpu.cc instantiates them over MPI (mpi_engine.h),
// handlers_ucx.cc over UCX (ucx_engine.h).
//
// Every handler takes a token buffer and returns a new one; Python threads the token
// through successive calls so that XLA cannot reorder them (a data dependency, the
// mpi4jax pattern; has_side_effect only keeps a call alive, it does not order it).
// The token's contents are meaningless.
//
// An engine is a type with
//   static std::string Transfer(int64_t comm, const void* sbuf, size_t sbytes, int dest, int stag,
//                               void* rbuf, size_t rbytes, int src, int rtag, double timeout_s,
//                               std::string_view op, std::string_view desc);
// returning "" or a one-line error ("timed out" in a timeout's line).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace h2 {
namespace ffi = xla::ffi;

inline ffi::Error ToFfi(const std::string& err) {
  if (err.empty()) return ffi::Error::Success();
  if (err.find("timed out") != std::string::npos) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, err);
  return ffi::Error(ffi::ErrorCode::kInternal, err);
}

inline void Touch(ffi::Result<ffi::AnyBuffer>& token) { std::memset(token->untyped_data(), 0, token->size_bytes()); }

// route: int32[2] = (peer, tag) for send / recv, int32[4] = (dest, send_tag, source,
// recv_tag) for sendrecv. An operand rather than attributes so that one program, run on
// every device of a shard_map, can address a different peer and tag per device.
template <class Engine>
struct HostHandlers {
  static ffi::Error Send(ffi::Buffer<ffi::S32> route, ffi::AnyBuffer x, ffi::AnyBuffer /*token*/,
                         ffi::Result<ffi::AnyBuffer> token_out, int64_t comm, double timeout_s, std::string_view desc) {
    const int32_t* r = route.typed_data();
    std::string err = Engine::Transfer(comm, x.untyped_data(), x.size_bytes(), r[0], r[1], nullptr, 0, -1, 0,
                                       timeout_s, "send", desc);
    Touch(token_out);
    return ToFfi(err);
  }

  static ffi::Error Recv(ffi::Buffer<ffi::S32> route, ffi::AnyBuffer /*token*/, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> token_out, int64_t comm, double timeout_s, std::string_view desc) {
    const int32_t* r = route.typed_data();
    std::string err = Engine::Transfer(comm, nullptr, 0, -1, 0, y->untyped_data(), y->size_bytes(), r[0], r[1],
                                       timeout_s, "recv", desc);
    Touch(token_out);
    return ToFfi(err);
  }

  static ffi::Error RecvInto(ffi::Buffer<ffi::S32> route, ffi::AnyBuffer token, ffi::AnyBuffer /*into: aliases y*/,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> token_out, int64_t comm,
                             double timeout_s, std::string_view desc) {
    return Recv(route, token, y, token_out, comm, timeout_s, desc);
  }

  static ffi::Error SendRecv(ffi::Buffer<ffi::S32> route, ffi::AnyBuffer x, ffi::AnyBuffer /*token*/,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> token_out, int64_t comm,
                             double timeout_s, std::string_view desc) {
    const int32_t* r = route.typed_data();
    std::string err = Engine::Transfer(comm, x.untyped_data(), x.size_bytes(), r[0], r[1], y->untyped_data(),
                                       y->size_bytes(), r[2], r[3], timeout_s, "sendrecv", desc);
    Touch(token_out);
    return ToFfi(err);
  }
};

}  // namespace h2

// The four exported handler symbols H2Send<Suffix>, H2Recv<Suffix>, H2RecvInto<Suffix> and
// H2SendRecv<Suffix> over `Engine` (one binding per op, shared by every engine).
// One send handler symbol `Name` over `Engine` (also used alone: the MPI engine's buffered send).
#define H2_DEFINE_HOST_SEND(Engine, Name)                                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Name, h2::HostHandlers<Engine>::Send,                                            \
                                xla::ffi::Ffi::Bind()                                                            \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()                                      \
                                    .Arg<xla::ffi::AnyBuffer>()                                                  \
                                    .Arg<xla::ffi::AnyBuffer>()                                                  \
                                    .Ret<xla::ffi::AnyBuffer>()                                                  \
                                    .Attr<int64_t>("comm")                                                       \
                                    .Attr<double>("timeout_s")                                                   \
                                    .Attr<std::string_view>("desc"))

#define H2_DEFINE_HOST_HANDLERS(Engine, Suffix)                                                                  \
  H2_DEFINE_HOST_SEND(Engine, H2Send##Suffix);                                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(H2Recv##Suffix, h2::HostHandlers<Engine>::Recv,                                  \
                                xla::ffi::Ffi::Bind()                                                            \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()                                      \
                                    .Arg<xla::ffi::AnyBuffer>()                                                  \
                                    .Ret<xla::ffi::AnyBuffer>()                                                  \
                                    .Ret<xla::ffi::AnyBuffer>()                                                  \
                                    .Attr<int64_t>("comm")                                                       \
                                    .Attr<double>("timeout_s")                                                   \
                                    .Attr<std::string_view>("desc"));                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(H2RecvInto##Suffix, h2::HostHandlers<Engine>::RecvInto,                          \
                                xla::ffi::Ffi::Bind()                                                            \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()                                      \
                                    .Arg<xla::ffi::AnyBuffer>()                                                  \
                                    .Arg<xla::ffi::AnyBuffer>()                                                  \
                                    .Ret<xla::ffi::AnyBuffer>()                                                  \
                                    .Ret<xla::ffi::AnyBuffer>()                                                  \
                                    .Attr<int64_t>("comm")                                                       \
                                    .Attr<double>("timeout_s")                                                   \
                                    .Attr<std::string_view>("desc"));                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(H2SendRecv##Suffix, h2::HostHandlers<Engine>::SendRecv,                          \
                                xla::ffi::Ffi::Bind()                                                            \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()                                      \
                                    .Arg<xla::ffi::AnyBuffer>()                                                  \
                                    .Arg<xla::ffi::AnyBuffer>()                                                  \
                                    .Ret<xla::ffi::AnyBuffer>()                                                  \
                                    .Ret<xla::ffi::AnyBuffer>()                                                  \
                                    .Attr<int64_t>("comm")                                                       \
                                    .Attr<double>("timeout_s")                                                   \
                                    .Attr<std::string_view>("desc"))
