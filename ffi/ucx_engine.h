// UCX (UCP tag API) point-to-point engine behind the h2jax FFI handlers: bytes only, no JAX
// types. The same operations, errors and deadlock freedom as mpi_engine.h, over UCP.
//
// One UCP context and one worker per process (UCP_FEATURE_TAG; the worker in
// UCS_THREAD_MODE_SERIALIZED: every UCP call and the stash sit behind one mutex, as in the MPI
// engine). Python bootstraps it over an mpi4py communicator (h2jax/comm/_ucx.py): every rank
// publishes Worker().address(), the ranks allgather them, and Connect(comm_id, rank, addresses)
// makes one endpoint per peer (the self one included) and returns a handle, the `comm` attribute
// of the handlers. Endpoints to the peers Python asks for use UCP_ERR_HANDLING_MODE_PEER with
// an error callback that marks the peer dead, so a wait on a dead peer fails at once with a line
// naming it. UCX 1.22's shared-memory transports (self, posix, sysv) have no peer failure
// handler, so that mode would route a same-host peer over tcp: Python asks for it only for
// peers on other hosts, and an endpoint that cannot have it falls back to
// UCP_ERR_HANDLING_MODE_NONE (a dead peer then shows as the wait's timeout, never a hang).
//
// Tags: 64 bits = comm id (12) | source rank (20) | user tag (32, >= 0 as int32). A receive
// matches (comm, source, tag) exactly (full mask), so no wildcard is ever needed.
//
// Deadlock freedom (1F1B: two neighbours each in a blocking send of a rendezvous-sized tensor
// to the other): while it waits, a transfer drains every unexpected message of its comm with
// ucp_tag_probe_nb(remove=1) + ucp_tag_msg_recv_nbx into a per-(comm, source, tag) FIFO stash,
// so the peer's send completes; a later recv consults the stash before posting to UCP (one
// extra copy in that case only), which keeps per-(source, tag) order. Spin, then yield, then
// sleep, as in the MPI engine.
//
// Buffered sends (BufferedSend), as in the MPI engine: the bytes are copied into a buffer of the
// engine, the UCP send of the copy is posted, and the call returns, so a stage's program goes on
// while its neighbour is busy elsewhere (a rendezvous holds a plain send until the receiver
// matches it). Every later call of the engine on this process tests the sends in flight and
// recycles their buffers; one not received within its timeout (or to a peer found dead) fails the
// next call, naming the send, and its endpoint is closed as a plain send's would be; `FlushSends`
// waits for all of them. On one host the receiver pulls a rendezvous's data (cma), so a buffered
// send needs no progress from its sender to arrive; its completion is seen at the sender's next call.
//
// Memory: host buffers only (UCS_MEMORY_TYPE_HOST); Transfer's `mem_type` is the one place a
// device variant passes UCS_MEMORY_TYPE_CUDA / _ROCM.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "buffered_sends.h"

namespace h2ucx {

using Clock = std::chrono::steady_clock;

constexpr int kCommBits = 12, kRankBits = 20;
constexpr uint64_t kMaxCommId = (uint64_t(1) << kCommBits) - 1;
constexpr int kMaxRanks = 1 << kRankBits;
constexpr int kTagUb = INT_MAX;
constexpr ucp_tag_t kFullMask = ~ucp_tag_t(0);
constexpr ucp_tag_t kCommMask = kMaxCommId << (64 - kCommBits);

inline ucp_tag_t MakeTag(uint32_t comm_id, int src, int tag) {
  return (ucp_tag_t(comm_id) << (64 - kCommBits)) | (ucp_tag_t(uint32_t(src)) << 32) | ucp_tag_t(uint32_t(tag));
}
inline int TagSource(ucp_tag_t t) { return int((t >> 32) & (kMaxRanks - 1)); }
inline int TagUser(ucp_tag_t t) { return int(uint32_t(t)); }

struct Comm;
struct PeerRef {  // the error callback's argument: which peer of which comm failed
  Comm* comm;
  int peer;
};

struct Comm {
  uint32_t id = 0;
  int rank = 0, size = 0;
  std::vector<ucp_ep_h> eps;
  std::vector<std::unique_ptr<PeerRef>> refs;
  std::vector<std::string> dead;  // per peer: "" while alive, else why not
  std::vector<bool> peer_errors;  // per peer: UCP_ERR_HANDLING_MODE_PEER in effect
};

// a message taken in before its receive was posted; `req` is its UCP receive until complete
struct Stashed {
  std::vector<char> buf;
  void* req = nullptr;
  std::string error;
};

struct Engine {
  std::mutex mu;
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  std::string init_error;
  std::vector<std::pair<std::string, std::string>> applied;  // defaults set by ucp_config_modify
  std::map<int64_t, std::unique_ptr<Comm>> comms;
  // (comm id, source rank, tag) -> messages that arrived before their recv
  std::map<std::tuple<uint32_t, int, int>, std::deque<std::unique_ptr<Stashed>>> stash;
  uint64_t stashed_messages = 0, stashed_bytes = 0;
  int64_t next_handle = 1;
  using Sends = h2::BufferedSends<void*, int64_t>;  // a UCP request; the comm's handle
  Sends sends;  // buffered sends in flight (buffered_sends.h)

  static Engine& get() {
    static Engine engine;
    return engine;
  }
};

inline std::string Status(ucs_status_t s) { return ucs_status_string(s); }

// Create the context and worker once. `defaults` are UCX variables without the UCX_ prefix
// (e.g. {"TLS", "sm,self"}); each is applied only where the environment does not set UCX_<name>
// (the user's word wins). Returns "" or a one-line error. Caller holds no lock.
inline std::string Init(const std::vector<std::pair<std::string, std::string>>& defaults) {
  Engine& eng = Engine::get();
  std::lock_guard<std::mutex> lock(eng.mu);
  if (eng.worker != nullptr || !eng.init_error.empty()) return eng.init_error;
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return eng.init_error = "h2jax ucx: ucp_config_read failed: " + Status(st);
  for (auto& [name, value] : defaults) {
    if (std::getenv(("UCX_" + name).c_str()) != nullptr) continue;
    st = ucp_config_modify(config, name.c_str(), value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return eng.init_error = "h2jax ucx: UCX_" + name + "=" + value + " refused: " + Status(st);
    }
    eng.applied.emplace_back(name, value);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG;
  params.mt_workers_shared = 0;
  st = ucp_init(&params, config, &eng.ctx);
  ucp_config_release(config);
  if (st != UCS_OK) return eng.init_error = "h2jax ucx: ucp_init failed: " + Status(st);
  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // our mutex serialises every call
  st = ucp_worker_create(eng.ctx, &wparams, &eng.worker);
  if (st != UCS_OK) {
    ucp_cleanup(eng.ctx);
    eng.ctx = nullptr;
    return eng.init_error = "h2jax ucx: ucp_worker_create failed: " + Status(st);
  }
  return {};
}

inline std::string WorkerAddress(std::string* out) {
  Engine& eng = Engine::get();
  std::lock_guard<std::mutex> lock(eng.mu);
  if (eng.worker == nullptr) return "h2jax ucx: the engine is not initialised";
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  ucs_status_t st = ucp_worker_get_address(eng.worker, &addr, &len);
  if (st != UCS_OK) return "h2jax ucx: ucp_worker_get_address failed: " + Status(st);
  out->assign(reinterpret_cast<const char*>(addr), len);
  ucp_worker_release_address(eng.worker, addr);
  return {};
}

inline void OnPeerError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* ref = static_cast<PeerRef*>(arg);  // called from ucp_worker_progress: the lock is held
  if (ref->comm->dead[ref->peer].empty()) ref->comm->dead[ref->peer] = Status(status);
}

// One endpoint per peer of a new comm; *handle gets the handle for the handlers' `comm` attribute.
// `peer_errors[p]`: ask for UCP_ERR_HANDLING_MODE_PEER towards p (falls back to NONE).
inline std::string Connect(uint32_t comm_id, int rank, const std::vector<std::string>& addresses,
                           const std::vector<bool>& peer_errors, int64_t* handle) {
  Engine& eng = Engine::get();
  std::lock_guard<std::mutex> lock(eng.mu);
  if (eng.worker == nullptr) return "h2jax ucx: the engine is not initialised";
  const int size = int(addresses.size());
  if (comm_id > kMaxCommId) return "h2jax ucx: comm id " + std::to_string(comm_id) + " is over 4095";
  if (size > kMaxRanks) return "h2jax ucx: " + std::to_string(size) + " ranks, at most 1048576";
  if (peer_errors.size() != addresses.size()) return "h2jax ucx: one peer_errors flag per address";
  if (rank < 0 || rank >= size) return "h2jax ucx: rank " + std::to_string(rank) + " outside 0.." + std::to_string(size - 1);
  for (auto& [h, c] : eng.comms)
    if (c->id == comm_id) return "h2jax ucx: comm id " + std::to_string(comm_id) + " is already connected";
  auto comm = std::make_unique<Comm>();
  comm->id = comm_id;
  comm->rank = rank;
  comm->size = size;
  comm->dead.assign(size, "");
  comm->peer_errors.assign(size, false);
  for (int p = 0; p < size; ++p) {
    comm->refs.push_back(std::make_unique<PeerRef>(PeerRef{comm.get(), p}));
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(addresses[p].data());
    ep.err_mode = peer_errors[p] ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    ep.err_handler.cb = OnPeerError;
    ep.err_handler.arg = comm->refs.back().get();
    ucp_ep_h h = nullptr;
    ucs_status_t st = ucp_ep_create(eng.worker, &ep, &h);
    if (st == UCS_ERR_UNREACHABLE && peer_errors[p]) {  // no transport to p can report its failure
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      st = ucp_ep_create(eng.worker, &ep, &h);
    }
    comm->peer_errors[p] = st == UCS_OK && ep.err_mode == UCP_ERR_HANDLING_MODE_PEER;
    if (st != UCS_OK) {
      for (ucp_ep_h e : comm->eps) {
        ucp_request_param_t cp{};
        cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
        void* r = ucp_ep_close_nbx(e, &cp);
        if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
      }
      return "h2jax ucx on rank " + std::to_string(rank) + ": no endpoint to rank " + std::to_string(p) + ": " +
             Status(st);
    }
    comm->eps.push_back(h);
  }
  *handle = eng.next_handle++;
  eng.comms[*handle] = std::move(comm);
  return {};
}

// the comm behind a handle; caller holds the lock
inline Comm* Find(Engine& eng, int64_t handle) {
  auto it = eng.comms.find(handle);
  return it == eng.comms.end() ? nullptr : it->second.get();
}

inline std::string CheckRoute(const Comm& c, int peer, int tag, const char* what) {
  if (peer >= 0 && peer < c.size && tag >= 0) return {};  // tag <= kTagUb: it is an int32
  std::ostringstream s;
  if (peer < 0 || peer >= c.size)
    s << "h2jax ffi on rank " << c.rank << ": " << what << " rank " << peer << " is not in 0.." << c.size - 1;
  else
    s << "h2jax ffi on rank " << c.rank << ": tag " << tag << " is outside 0.." << kTagUb;
  return s.str();
}

// Take every unexpected message of comm `c` into the stash (their UCP receives run on; a
// Stashed is complete once its req is null). Caller holds the lock.
inline void Drain(Engine& eng, const Comm& c) {
  for (;;) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = ucp_tag_probe_nb(eng.worker, MakeTag(c.id, 0, 0), kCommMask, 1, &info);
    if (msg == nullptr) return;
    auto s = std::make_unique<Stashed>();
    s->buf.resize(info.length);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.memory_type = UCS_MEMORY_TYPE_HOST;
    void* r = ucp_tag_msg_recv_nbx(eng.worker, s->buf.data(), info.length, msg, &p);
    if (UCS_PTR_IS_ERR(r))
      s->error = Status(UCS_PTR_STATUS(r));
    else if (r != nullptr)
      s->req = r;
    eng.stashed_messages += 1;
    eng.stashed_bytes += info.length;
    eng.stash[{c.id, TagSource(info.sender_tag), TagUser(info.sender_tag)}].push_back(std::move(s));
  }
}

// Whether a stashed message's receive has finished (and then frees its request).
inline bool StashedDone(Stashed& s) {
  if (s.req == nullptr) return true;
  ucs_status_t st = ucp_request_check_status(s.req);
  if (st == UCS_INPROGRESS) return false;
  if (st != UCS_OK) s.error = Status(st);
  ucp_request_free(s.req);
  s.req = nullptr;
  return true;
}

// Close the endpoint to `peer` of `c` (force: drops what it still holds of our sends) and mark
// the peer, so later transfers to it fail at once with `why`. UCP cannot cancel a send, so this
// is how one that did not complete is given up on: if its rendezvous announcement already reached
// the peer, the peer may still match it later and read (cma) whatever the buffer then holds -- as
// with MPI, whose MPI_Cancel cannot withdraw a send either; a timed-out send is an error of the
// job, not a recoverable state. Caller holds the lock.
inline void CloseEndpoint(Engine& eng, Comm& c, int peer, const char* why) {
  if (c.eps[peer] != nullptr) {
    ucp_request_param_t cp{};
    cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(c.eps[peer], &cp);
    if (UCS_PTR_IS_PTR(r)) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(eng.worker);
      ucp_request_free(r);
    }
    c.eps[peer] = nullptr;
  }
  if (c.dead[peer].empty()) c.dead[peer] = why;
}

constexpr const char* kSendGivenUp = "endpoint closed: an earlier send to it did not complete";

// the line of a buffered send to a peer already found dead (or whose endpoint was closed)
inline std::string Unreachable(const Comm& c, int dest) {
  return Engine::Sends::Prefix(c.rank) + "peer " + std::to_string(dest) + " is unreachable (" + c.dead[dest] + ")";
}

// Test the buffered sends in flight (buffered_sends.h): a send to a peer found dead has failed; one
// given up on while still in flight (past its deadline, or its peer dead) takes its endpoint with it
// (CloseEndpoint). Caller holds the lock.
inline void ProgressSends(Engine& eng) {
  if (eng.sends.pending.empty()) return;
  ucp_worker_progress(eng.worker);
  eng.sends.Progress(
      [&eng](Engine::Sends::Pending& p, std::string* why) {
        const ucs_status_t st = ucp_request_check_status(p.req);
        const Comm* c = Find(eng, p.comm);
        if (st == UCS_OK) return h2::SendState::kDone;
        if (st != UCS_INPROGRESS) *why = Status(st);
        else if (!c->dead[p.dest].empty()) *why = "the peer is unreachable (" + c->dead[p.dest] + ")";
        return why->empty() ? h2::SendState::kInFlight : h2::SendState::kFailed;
      },
      [&eng](Engine::Sends::Pending& p, h2::SendState) {
        if (ucp_request_check_status(p.req) == UCS_INPROGRESS)  // UCP cannot cancel it: give up its endpoint
          CloseEndpoint(eng, *Find(eng, p.comm), p.dest, kSendGivenUp);
        ucp_request_free(p.req);
      });
}

// Wait until every buffered send of this process has completed (or failed): buffered_sends.h's Flush.
inline std::string FlushSends(double max_wait_s = 1e300) {
  Engine& eng = Engine::get();
  return eng.sends.Flush(eng.mu, [&eng] { ProgressSends(eng); }, max_wait_s);
}

// Send `sbytes` from `sbuf` to `dest` with `stag` without waiting for the receiver: copy the bytes
// into an engine buffer, post the UCP send of the copy, return. Returns "" or a one-line error,
// which may be an earlier buffered send's.
inline std::string BufferedSend(int64_t handle, const void* sbuf, size_t sbytes, int dest, int stag, double timeout_s,
                                std::string_view desc) {
  Engine& eng = Engine::get();
  std::vector<char> buf;
  {
    std::lock_guard<std::mutex> lock(eng.mu);
    Comm* c = Find(eng, handle);
    if (c == nullptr) return "h2jax ffi send: no ucx comm with handle " + std::to_string(handle);
    if (std::string e = CheckRoute(*c, dest, stag, "destination"); !e.empty()) return e;
    ProgressSends(eng);
    if (std::string e = eng.sends.TakeError(); !e.empty()) return e;
    if (!c->dead[dest].empty()) return Unreachable(*c, dest);
    buf = eng.sends.Take(sbytes);
  }
  buf.resize(sbytes);                                  // within a reused buffer's capacity: no allocation
  if (sbytes) std::memcpy(buf.data(), sbuf, sbytes);  // outside the lock: other devices' calls go on
  std::lock_guard<std::mutex> lock(eng.mu);
  Comm* c = Find(eng, handle);
  if (!c->dead[dest].empty()) return Unreachable(*c, dest);
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  prm.memory_type = UCS_MEMORY_TYPE_HOST;
  void* r = ucp_tag_send_nbx(c->eps[dest], buf.data(), sbytes, MakeTag(c->id, c->rank, stag), &prm);
  if (UCS_PTR_IS_ERR(r))
    return Engine::Sends::Prefix(c->rank) + "send to peer " + std::to_string(dest) +
           " failed: " + Status(UCS_PTR_STATUS(r));
  // NULL: done at once (an eager message), the buffer free again
  eng.sends.Posted(r, std::move(buf), handle, c->rank, dest, stag, timeout_s, desc, r != nullptr);
  ProgressSends(eng);
  return {};
}

// One transfer, as h2::Transfer in mpi_engine.h: an optional send of `sbytes` from `sbuf` to
// `dest` with `stag`, an optional receive of exactly `rbytes` into `rbuf` from `src` with
// `rtag`. Returns "" on success, else a one-line error ("timed out" in a timeout's line).
inline std::string Transfer(int64_t handle, const void* sbuf, size_t sbytes, int dest, int stag, void* rbuf,
                            size_t rbytes, int src, int rtag, double timeout_s, std::string_view op,
                            std::string_view desc, ucs_memory_type_t mem_type = UCS_MEMORY_TYPE_HOST) {
  Engine& eng = Engine::get();
  const bool want_send = op != "recv";
  const bool want_recv = op != "send";
  std::unique_lock<std::mutex> lock(eng.mu);
  Comm* c = Find(eng, handle);
  if (c == nullptr) return "h2jax ffi " + std::string(op) + ": no ucx comm with handle " + std::to_string(handle);
  if (want_send)
    if (std::string e = CheckRoute(*c, dest, stag, "destination"); !e.empty()) return e;
  if (want_recv)
    if (std::string e = CheckRoute(*c, src, rtag, "source"); !e.empty()) return e;
  ProgressSends(eng);  // an earlier buffered send that failed fails this call
  if (std::string e = eng.sends.TakeError(); !e.empty()) return e;
  void* sreq = nullptr;
  void* rreq = nullptr;
  Stashed* from_stash = nullptr;  // the receive is the front of the stash, maybe still arriving
  bool send_done = !want_send, recv_done = !want_recv;
  std::string error;
  const std::string prefix = "h2jax ffi " + std::string(op) + " on rank " + std::to_string(c->rank) + ": ";
  auto wrong_size = [&](size_t got) {
    std::ostringstream s;
    s << prefix << "message from peer " << src << " tag " << rtag << " has " << got << " bytes, expected " << rbytes
      << " (" << desc << ")";
    return s.str();
  };
  auto larger = [&]() {
    return prefix + "message from peer " + std::to_string(src) + " tag " + std::to_string(rtag) +
           " is larger than the expected " + std::to_string(rbytes) + " bytes (" + std::string(desc) + ")";
  };
  auto dead_line = [&](int peer) {
    return prefix + "peer " + std::to_string(peer) + " is unreachable (" + c->dead[peer] + ")";
  };
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  prm.memory_type = mem_type;
  const std::tuple<uint32_t, int, int> key{c->id, src, rtag};
  if (want_recv) {  // an older message of (src, rtag) may sit in the stash: keep the order
    auto it = eng.stash.find(key);
    if (it != eng.stash.end() && !it->second.empty()) {
      from_stash = it->second.front().release();
      it->second.pop_front();
    } else {
      // a receive that completes at once returns NULL and reports its length here only
      ucp_tag_recv_info_t info{};
      ucp_request_param_t rp = prm;
      rp.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
      rp.recv_info.tag_info = &info;
      void* r = ucp_tag_recv_nbx(eng.worker, rbuf, rbytes, MakeTag(c->id, src, rtag), kFullMask, &rp);
      if (UCS_PTR_IS_ERR(r)) {
        ucs_status_t st = UCS_PTR_STATUS(r);
        if (st != UCS_ERR_MESSAGE_TRUNCATED) return prefix + "ucp_tag_recv_nbx failed: " + Status(st);
        error = larger();
        recv_done = true;
      } else if (r == nullptr) {
        if (info.length != rbytes) error = wrong_size(info.length);
        recv_done = true;
      } else {
        rreq = r;
      }
    }
  }
  if (want_send && error.empty()) {
    if (!c->dead[dest].empty()) {
      error = dead_line(dest);
      send_done = true;  // nothing was posted
    } else {
      void* r = ucp_tag_send_nbx(c->eps[dest], sbuf, sbytes, MakeTag(c->id, c->rank, stag), &prm);
      if (UCS_PTR_IS_ERR(r))
        error = prefix + "send to peer " + std::to_string(dest) + " failed: " + Status(UCS_PTR_STATUS(r));
      else
        sreq = r;
      send_done = r == nullptr || UCS_PTR_IS_ERR(r);
    }
  }
  const auto t_start = Clock::now();
  const auto spin_until = t_start + std::chrono::microseconds(20);
  const auto yield_until = t_start + std::chrono::milliseconds(5);
  const auto deadline = t_start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (error.empty()) {
    const auto now = Clock::now();
    const bool spinning = now < spin_until;
    ucp_worker_progress(eng.worker);
    if (!recv_done && rreq != nullptr) {
      ucp_tag_recv_info_t info{};
      ucs_status_t st = ucp_tag_recv_request_test(rreq, &info);
      if (st != UCS_INPROGRESS) {
        if (st == UCS_ERR_MESSAGE_TRUNCATED)
          error = larger();
        else if (st != UCS_OK)
          error = prefix + "receive failed: " + Status(st);
        else if (info.length != rbytes)
          error = wrong_size(info.length);
        ucp_request_free(rreq);
        rreq = nullptr;
        recv_done = true;
      }
    }
    if (!recv_done && from_stash != nullptr && StashedDone(*from_stash)) {
      if (!from_stash->error.empty())
        error = prefix + "receive failed: " + from_stash->error;
      else if (from_stash->buf.size() != rbytes)
        error = wrong_size(from_stash->buf.size());
      else if (rbytes > 0)
        std::memcpy(rbuf, from_stash->buf.data(), rbytes);
      delete from_stash;
      from_stash = nullptr;
      recv_done = true;
    }
    if (!send_done) {
      ucs_status_t st = ucp_request_check_status(sreq);
      if (st != UCS_INPROGRESS) {
        if (st != UCS_OK) error = prefix + "send to peer " + std::to_string(dest) + " failed: " + Status(st);
        ucp_request_free(sreq);
        sreq = nullptr;
        send_done = true;
      }
    }
    if (error.empty() && !send_done && !c->dead[dest].empty()) error = dead_line(dest);
    if (error.empty() && !recv_done && !c->dead[src].empty()) error = dead_line(src);
    if (!error.empty() || (send_done && recv_done)) break;
    // past the spin: take every other message of this comm into the stash (our own receive is
    // posted, so UCP matches it before a probe can see it)
    if (!spinning) Drain(eng, *c);
    if (now > deadline) {
      std::ostringstream s;
      s << prefix << "timed out after " << timeout_s << " s:";
      if (!send_done)
        s << " send of " << desc << " (" << sbytes << " bytes) to peer " << dest << " tag " << stag
          << " was not received;";
      if (!recv_done)
        s << " no message from peer " << src << " with tag " << rtag << " (expected " << desc << ", " << rbytes
          << " bytes);";
      bool any = false;
      for (auto& [k, q] : eng.stash) {
        if (std::get<0>(k) != c->id || q.empty()) continue;
        s << (any ? ", " : " unmatched messages waiting here: ") << "peer " << std::get<1>(k) << " tag "
          << std::get<2>(k) << " (" << q.front()->buf.size() << " bytes) x" << q.size();
        any = true;
      }
      if (!any) s << " nothing else arrived";
      error = s.str();
      break;
    }
    if (spinning) continue;
    lock.unlock();  // let the other threads of this process in while we wait
    if (now < yield_until)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    lock.lock();
  }
  // XLA frees the buffers once we return: withdraw what is still in flight
  if (rreq != nullptr) {
    ucp_request_cancel(eng.worker, rreq);
    while (ucp_request_check_status(rreq) == UCS_INPROGRESS) ucp_worker_progress(eng.worker);
    ucp_request_free(rreq);
  }
  if (from_stash != nullptr) {
    // the stashed message was ours: put it back at the front, its order intact
    eng.stash[key].push_front(std::unique_ptr<Stashed>(from_stash));
  }
  if (sreq != nullptr) {  // UCP cannot cancel a send: give it up with its endpoint (CloseEndpoint)
    CloseEndpoint(eng, *c, dest, kSendGivenUp);
    ucp_request_free(sreq);
  }
  return error;
}

}  // namespace h2ucx
