// The UCX Python extension h2jax.comm._ucx_ffi_cpu: the handler capsules, and the bootstrap
// (h2jax/comm/_ucx.py drives it over an mpi4py communicator): init with defaults, the worker's
// address, connect to every rank's address, the UCX version. Built only where UCX is found.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "ucx_engine.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* H2SendUcx(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* H2RecvUcx(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* H2RecvIntoUcx(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* H2SendRecvUcx(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* H2BSendUcx(XLA_FFI_CallFrame*);
#ifdef H2JAX_UCX_CUDA  // built with a CUDA toolkit: device-buffer handlers too (handlers_ucx_cuda.cc)
extern "C" XLA_FFI_Error* H2SendUcxCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* H2RecvUcxCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* H2RecvIntoUcxCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* H2SendRecvUcxCuda(XLA_FFI_CallFrame*);
#endif

namespace {
void Check(const std::string& err) {
  if (!err.empty()) throw std::runtime_error(err);
}
}  // namespace

NB_MODULE(_ucx_ffi_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["h2jax_ucx_send"] = nb::capsule(reinterpret_cast<void*>(H2SendUcx));
    d["h2jax_ucx_recv"] = nb::capsule(reinterpret_cast<void*>(H2RecvUcx));
    d["h2jax_ucx_recv_into"] = nb::capsule(reinterpret_cast<void*>(H2RecvIntoUcx));
    d["h2jax_ucx_sendrecv"] = nb::capsule(reinterpret_cast<void*>(H2SendRecvUcx));
    d["h2jax_ucx_bsend"] = nb::capsule(reinterpret_cast<void*>(H2BSendUcx));
    return d;
  });
#ifdef H2JAX_UCX_CUDA
  m.def("cuda_registrations", []() {  // the same targets on the CUDA platform
    nb::dict d;
    d["h2jax_ucx_send"] = nb::capsule(reinterpret_cast<void*>(H2SendUcxCuda));
    d["h2jax_ucx_recv"] = nb::capsule(reinterpret_cast<void*>(H2RecvUcxCuda));
    d["h2jax_ucx_recv_into"] = nb::capsule(reinterpret_cast<void*>(H2RecvIntoUcxCuda));
    d["h2jax_ucx_sendrecv"] = nb::capsule(reinterpret_cast<void*>(H2SendRecvUcxCuda));
    // device buffers: the buffered send is the plain one (its bytes leave from device memory)
    d["h2jax_ucx_bsend"] = nb::capsule(reinterpret_cast<void*>(H2SendUcxCuda));
    return d;
  });
#endif
  m.def(
      "init",
      [](const std::vector<std::pair<std::string, std::string>>& defaults) {
        std::string err;
        {
          nb::gil_scoped_release nogil;
          err = h2ucx::Init(defaults);
        }
        Check(err);
        h2ucx::Engine& eng = h2ucx::Engine::get();
        std::lock_guard<std::mutex> lock(eng.mu);
        return eng.applied;  // the defaults that took effect (the environment set the others)
      },
      nb::arg("defaults"),
      "Create the process's UCP context and worker once; `defaults` are (name without UCX_, value) "
      "pairs applied only where the environment does not set UCX_<name>. Returns those applied.");
  m.def("worker_address", []() {
    std::string addr;
    Check(h2ucx::WorkerAddress(&addr));
    return nb::bytes(addr.data(), addr.size());
  });
  m.def(
      "connect",
      [](uint32_t comm_id, int rank, const std::vector<nb::bytes>& addresses, const std::vector<bool>& peer_errors) {
        std::vector<std::string> addrs;
        for (const nb::bytes& a : addresses) addrs.emplace_back(a.c_str(), a.size());
        int64_t handle = 0;
        std::string err;
        {
          nb::gil_scoped_release nogil;
          err = h2ucx::Connect(comm_id, rank, addrs, peer_errors, &handle);
        }
        Check(err);
        h2ucx::Engine& eng = h2ucx::Engine::get();
        std::lock_guard<std::mutex> lock(eng.mu);
        const h2ucx::Comm* c = h2ucx::Find(eng, handle);
        return std::make_pair(handle, c->peer_errors);  // and where peer failure detection is on
      },
      nb::arg("comm_id"), nb::arg("rank"), nb::arg("addresses"), nb::arg("peer_errors"));
  m.def("ucx_version", []() { return std::string(ucp_get_version_string()); });
  m.def("tag_ub", []() { return h2ucx::kTagUb; });
  m.def("max_comm_id", []() { return h2ucx::kMaxCommId; });
  m.def("stash_stats", []() {
    h2ucx::Engine& eng = h2ucx::Engine::get();
    std::lock_guard<std::mutex> lock(eng.mu);
    nb::dict d;
    d["messages"] = eng.stashed_messages;
    d["bytes"] = eng.stashed_bytes;
    d["buffered_sends"] = eng.sends.sends;
    d["buffered_bytes"] = eng.sends.bytes;
    d["sends_in_flight"] = eng.sends.pending.size();
    return d;
  });
  // every buffered send of this process completed: "" or the first failure (a timeout names the
  // send); at most `max_wait_s` for all of them together
  m.def(
      "flush_sends",
      [](double max_wait_s) {
        nb::gil_scoped_release release;
        return h2ucx::FlushSends(max_wait_s);
      },
      nb::arg("max_wait_s") = 1e300);
  m.def(
      "protocols",
      [](int64_t handle, int peer) {
        // the endpoint's lanes and the protocol tables UCX has selected on it so far (per operation
        // and memory type: the message sizes' protocols and transports; h2jax.comm._paths parses them)
        h2ucx::Engine& eng = h2ucx::Engine::get();
        std::lock_guard<std::mutex> lock(eng.mu);
        const h2ucx::Comm* c = h2ucx::Find(eng, handle);
        if (c == nullptr || peer < 0 || peer >= int(c->eps.size()) || c->eps[peer] == nullptr) return std::string();
        char* buf = nullptr;
        size_t len = 0;
        FILE* f = open_memstream(&buf, &len);
        ucp_ep_print_info(c->eps[peer], f);
        fclose(f);
        std::string s(buf, len);
        free(buf);
        return s;
      },
      nb::arg("handle"), nb::arg("peer"));
  m.def("transports", []() {
    // what UCP chose for this process's context (ucp_context_print_info's text)
    h2ucx::Engine& eng = h2ucx::Engine::get();
    std::lock_guard<std::mutex> lock(eng.mu);
    if (eng.ctx == nullptr) return std::string();
    char* buf = nullptr;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    ucp_context_print_info(eng.ctx, f);
    fclose(f);
    std::string s(buf, len);
    free(buf);
    return s;
  });
}
