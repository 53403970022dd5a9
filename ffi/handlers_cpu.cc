// XLA FFI handlers (CPU platform): send / recv / sendrecv of one buffer over MPI.
//
// Every handler takes a token buffer and returns a new one; Python threads the token
// through successive calls so that XLA cannot reorder them (a data dependency, the
// mpi4jax pattern; has_side_effect only keeps a call alive, it does not order it).
// The token's contents are meaningless.
#include <cstring>
#include <string>
#include <string_view>

#include "mpi_engine.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error ToFfi(const std::string& err) {
  if (err.empty()) return ffi::Error::Success();
  if (err.find("timed out") != std::string::npos) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, err);
  return ffi::Error(ffi::ErrorCode::kInternal, err);
}

void Touch(ffi::Result<ffi::AnyBuffer>& token) { std::memset(token->untyped_data(), 0, token->size_bytes()); }

// route: int32[2] = (peer, tag) for send / recv, int32[4] = (dest, send_tag, source,
// recv_tag) for sendrecv. An operand rather than attributes so that one program, run on
// every device of a shard_map, can address a different peer and tag per device.
ffi::Error SendImpl(ffi::Buffer<ffi::S32> route, ffi::AnyBuffer x, ffi::AnyBuffer /*token*/,
                    ffi::Result<ffi::AnyBuffer> token_out, int64_t comm, double timeout_s, std::string_view desc) {
  const int32_t* r = route.typed_data();
  std::string err = h2::Transfer(h2::CommFromF(comm), x.untyped_data(), x.size_bytes(), r[0], r[1], nullptr, 0, -1,
                                 0, timeout_s, "send", desc);
  Touch(token_out);
  return ToFfi(err);
}

ffi::Error RecvImpl(ffi::Buffer<ffi::S32> route, ffi::AnyBuffer /*token*/, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::AnyBuffer> token_out, int64_t comm, double timeout_s, std::string_view desc) {
  const int32_t* r = route.typed_data();
  std::string err = h2::Transfer(h2::CommFromF(comm), nullptr, 0, -1, 0, y->untyped_data(), y->size_bytes(), r[0],
                                 r[1], timeout_s, "recv", desc);
  Touch(token_out);
  return ToFfi(err);
}

ffi::Error RecvIntoImpl(ffi::Buffer<ffi::S32> route, ffi::AnyBuffer token, ffi::AnyBuffer /*into: aliases y*/,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> token_out, int64_t comm,
                        double timeout_s, std::string_view desc) {
  return RecvImpl(route, token, y, token_out, comm, timeout_s, desc);
}

ffi::Error SendRecvImpl(ffi::Buffer<ffi::S32> route, ffi::AnyBuffer x, ffi::AnyBuffer /*token*/,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> token_out, int64_t comm,
                        double timeout_s, std::string_view desc) {
  const int32_t* r = route.typed_data();
  std::string err = h2::Transfer(h2::CommFromF(comm), x.untyped_data(), x.size_bytes(), r[0], r[1],
                                 y->untyped_data(), y->size_bytes(), r[2], r[3], timeout_s, "sendrecv",
                                 desc);
  Touch(token_out);
  return ToFfi(err);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(H2SendCpu, SendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm")
                                  .Attr<double>("timeout_s")
                                  .Attr<std::string_view>("desc"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(H2RecvCpu, RecvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm")
                                  .Attr<double>("timeout_s")
                                  .Attr<std::string_view>("desc"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(H2RecvIntoCpu, RecvIntoImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm")
                                  .Attr<double>("timeout_s")
                                  .Attr<std::string_view>("desc"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(H2SendRecvCpu, SendRecvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm")
                                  .Attr<double>("timeout_s")
                                  .Attr<std::string_view>("desc"));
