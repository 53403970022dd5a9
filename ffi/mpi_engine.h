// MPI point-to-point engine behind the h2jax FFI handlers: bytes only, no JAX types.
//
// Deadlock freedom without copying every send: a blocking operation (send, recv or
// sendrecv) posts its own requests, then polls until they complete, and while it waits it
// receives *every* message that arrives on the communicator. A message nobody is waiting
// for yet goes into a per-(comm, source, tag) FIFO stash; a later recv takes it from there
// (one extra memcpy, only in that case). So two neighbours that send large tensors to each
// other at the same time (1F1B) both make progress: each one's send completes once the
// other, blocked in its own send, stashes it. Messages of one (source, tag, comm) keep
// MPI's order: the stash is consulted before the network.
//
// Consequence: the communicator must belong to these handlers alone (Python duplicates
// one), because any message on it may be stashed.
//
// Sends are buffered (BufferedSend): the bytes are copied into an engine-owned buffer, an
// MPI_Isend of that copy is posted, and the call returns at once, so a stage's program goes
// on while its neighbour is still busy elsewhere (with MPI's rendezvous an unbuffered send
// waits until the receiver posts). Every later engine call on this process tests the sends
// in flight and recycles their buffers; a send nobody receives within its own timeout fails
// the next call (the error names the send), `Flush` waits for all of them, and MPI_Finalize
// flushes first (a delete callback on MPI_COMM_SELF, the standard hook), so no message is
// left half-sent when a process exits. The data of a large message is pulled by the
// receiver (rendezvous by get: CMA on one host, RDMA across hosts), so a buffered send
// needs no progress from its sender to arrive; where a transport does need it, the
// sender's next call gives it. The bookkeeping is buffered_sends.h's (the ucx engine's too).
//
// Thread safety: every MPI call and the stash sit behind one mutex; the per-device
// computations of one process (shard_map) may call in from several threads. MPI must be
// initialised with MPI_THREAD_MULTIPLE (mpi4py's default) when Python threads also use MPI.
#pragma once

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "buffered_sends.h"

namespace h2 {

struct Engine {
  std::mutex mu;
  // (communicator, source rank, tag) -> messages that arrived before their recv
  std::map<std::tuple<MPI_Comm, int, int>, std::deque<std::vector<char>>> stash;
  // communicators whose error handler is already MPI_ERRORS_RETURN
  std::set<MPI_Comm> errors_return;
  // messages (and bytes) that went through the stash: each costs an allocation and a copy
  uint64_t stashed_messages = 0, stashed_bytes = 0;
  using Sends = BufferedSends<MPI_Request, MPI_Comm>;
  Sends sends;  // buffered sends in flight (buffered_sends.h)
  bool finalize_hook = false;

  static Engine& get() {
    static Engine engine;
    return engine;
  }
};

inline MPI_Comm CommFromF(int64_t fhandle) { return MPI_Comm_f2c(static_cast<MPI_Fint>(fhandle)); }

inline std::string MpiError(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, len);
}

// Rank and tag must be valid for comm (they may come from device data, so check here).
// The common (valid) case builds no string.
inline std::string CheckRoute(MPI_Comm comm, int peer, int tag, const char* what) {
  int size = 0, flag = 0;
  int* tag_ub = nullptr;
  MPI_Comm_size(comm, &size);
  MPI_Comm_get_attr(comm, MPI_TAG_UB, &tag_ub, &flag);
  const int ub = flag ? *tag_ub : 32767;
  if (peer >= 0 && peer < size && tag >= 0 && tag <= ub) return {};
  int rank = -1;
  MPI_Comm_rank(comm, &rank);
  std::ostringstream s;
  if (peer < 0 || peer >= size)
    s << "h2jax ffi on rank " << rank << ": " << what << " rank " << peer << " is not in 0.." << size - 1;
  else
    s << "h2jax ffi on rank " << rank << ": tag " << tag << " is outside 0.." << ub;
  return s.str();
}

// Errors on the handlers' communicator come back as return codes (a truncated receive must
// become an error message, not an abort of the job). Set once per communicator.
inline void ReturnErrors(Engine& eng, MPI_Comm comm) {
  if (eng.errors_return.insert(comm).second) MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
}

inline std::string RankPrefix(MPI_Comm comm, std::string_view op) {
  int rank = -1;
  MPI_Comm_rank(comm, &rank);
  std::ostringstream s;
  s << "h2jax ffi " << op << " on rank " << rank << ": ";
  return s.str();
}

// Under eng.mu: test the buffered sends in flight (buffered_sends.h); one that failed or ran past
// its deadline is withdrawn as far as MPI can (MPI_Cancel; its buffer stays alive, MPI may still
// read it), its line waiting for the next call.
inline void ProgressSends(Engine& eng) {
  if (eng.sends.pending.empty()) return;
  eng.sends.Progress(
      [](Engine::Sends::Pending& p, std::string* why) {
        int flag = 0;
        const int rc = MPI_Test(&p.req, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) *why = MpiError(rc);
        return rc != MPI_SUCCESS ? SendState::kFailed : flag ? SendState::kDone : SendState::kInFlight;
      },
      [](Engine::Sends::Pending& p, SendState) {
        if (p.req != MPI_REQUEST_NULL) {
          MPI_Cancel(&p.req);
          MPI_Request_free(&p.req);
        }
      });
}

// Wait until every buffered send of this process has completed (or failed): buffered_sends.h's Flush.
inline std::string FlushSends(double max_wait_s = 1e300) {
  Engine& eng = Engine::get();
  return eng.sends.Flush(eng.mu, [&eng] { ProgressSends(eng); }, max_wait_s);
}

// MPI_Finalize deletes MPI_COMM_SELF's attributes first, while MPI still works: flush there.
// A run that ends normally has flushed every step already (the ffi channel); what is still in
// flight here belongs to a job that is failing, whose peer may be gone: wait briefly, then say so.
inline int FlushAtFinalize(MPI_Comm, int, void*, void*) {
  const std::string err = FlushSends(2.0);
  if (!err.empty()) std::fprintf(stderr, "%s (at exit)\n", err.c_str());
  Engine& eng = Engine::get();
  std::lock_guard<std::mutex> lock(eng.mu);
  for (Engine::Sends::Pending& p : eng.sends.pending) {  // withdrawn, so that MPI_Finalize does not wait on them
    MPI_Cancel(&p.req);
    MPI_Request_free(&p.req);
    eng.sends.abandoned.push_back(std::move(p.buf));
  }
  eng.sends.pending.clear();
  return MPI_SUCCESS;
}

// Send `sbytes` from `sbuf` to `dest` with `stag` without waiting for the receiver: copy the
// bytes into an engine buffer, post the MPI_Isend of the copy, return. Returns "" or a
// one-line error, which may be an earlier buffered send's.
inline std::string BufferedSend(MPI_Comm comm, const void* sbuf, size_t sbytes, int dest, int stag, double timeout_s,
                                std::string_view desc) {
  Engine& eng = Engine::get();
  if (std::string e = CheckRoute(comm, dest, stag, "destination"); !e.empty()) return e;
  if (sbytes > size_t(INT_MAX)) return "send: " + std::string(desc) + " is over 2 GiB; split it into several transfers";
  std::vector<char> buf;
  {
    std::lock_guard<std::mutex> lock(eng.mu);
    ReturnErrors(eng, comm);
    if (!eng.finalize_hook) {
      int key = MPI_KEYVAL_INVALID;
      MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, FlushAtFinalize, &key, nullptr);
      MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr);
      eng.finalize_hook = true;
    }
    ProgressSends(eng);
    if (std::string e = eng.sends.TakeError(); !e.empty()) return e;
    buf = eng.sends.Take(sbytes);
  }
  buf.resize(sbytes);  // within a reused buffer's capacity: no allocation
  if (sbytes) std::memcpy(buf.data(), sbuf, sbytes);  // outside the lock: other devices' calls go on
  std::lock_guard<std::mutex> lock(eng.mu);
  int rank = -1;
  MPI_Comm_rank(comm, &rank);
  MPI_Request req = MPI_REQUEST_NULL;
  const int rc = MPI_Isend(buf.data(), int(sbytes), MPI_BYTE, dest, stag, comm, &req);
  if (rc != MPI_SUCCESS) return RankPrefix(comm, "send") + "MPI_Isend failed: " + MpiError(rc);
  eng.sends.Posted(req, std::move(buf), comm, rank, dest, stag, timeout_s, desc, true);
  ProgressSends(eng);  // a small (eager) message is done already: its buffer is free again
  return {};
}

// One transfer: an optional send of `sbytes` from `sbuf` to `dest` with `stag`, and an
// optional receive of exactly `rbytes` into `rbuf` from `src` with `rtag`. Returns "" on
// success, else a one-line error. `desc` names the tensor (dtype[shape]) for errors.
//
// The receive is posted as a real MPI_Irecv straight into `rbuf` (unless an earlier
// message of (src, rtag) already sits in the stash), so MPI matches it the moment it
// arrives and copies once. Posting and stashing both happen under the engine's mutex, and
// MPI matches posted receives before a probe can see a message, so a message is never
// both stashed and received. While waiting, the loop first spins on MPI_Test alone (a
// ping-pong answers within microseconds), and only then also drains every other message
// on the communicator into the stash (deadlock freedom: a peer blocked in a large send to
// us completes even though we wait on something else), yielding the core, and finally
// sleeping, so a long wait costs no core.
inline std::string Transfer(MPI_Comm comm, const void* sbuf, size_t sbytes, int dest, int stag,
                            void* rbuf, size_t rbytes, int src, int rtag, double timeout_s,
                            std::string_view op, std::string_view desc) {
  Engine& eng = Engine::get();
  const bool want_send = op != "recv";
  const bool want_recv = op != "send";
  if (want_send)
    if (std::string e = CheckRoute(comm, dest, stag, "destination"); !e.empty()) return e;
  if (want_recv)
    if (std::string e = CheckRoute(comm, src, rtag, "source"); !e.empty()) return e;
  if ((want_send && sbytes > size_t(INT_MAX)) || (want_recv && rbytes > size_t(INT_MAX)))
    return std::string(op) + ": " + std::string(desc) + " is over 2 GiB; split it into several transfers";
  MPI_Request sreq = MPI_REQUEST_NULL, rreq = MPI_REQUEST_NULL;
  bool send_done = !want_send, recv_done = !want_recv;
  std::string error;
  auto fail_prefix = [&]() { return RankPrefix(comm, op); };
  auto wrong_size = [&](size_t got) {
    std::ostringstream s;
    s << fail_prefix() << "message from peer " << src << " tag " << rtag << " has " << got << " bytes, expected "
      << rbytes << " (" << desc << ")";
    return s.str();
  };
  {
    std::lock_guard<std::mutex> lock(eng.mu);
    ReturnErrors(eng, comm);
    ProgressSends(eng);  // an earlier buffered send that failed fails this call
    if (std::string e = eng.sends.TakeError(); !e.empty()) return e;
    if (want_recv) {  // an older message of (src, rtag) may sit in the stash: MPI order
      auto it = eng.stash.find({comm, src, rtag});
      if (it != eng.stash.end() && !it->second.empty()) {
        std::vector<char>& msg = it->second.front();
        if (msg.size() != rbytes)
          error = wrong_size(msg.size());
        else
          std::memcpy(rbuf, msg.data(), rbytes);
        it->second.pop_front();
        recv_done = true;
      } else {
        int rc = MPI_Irecv(rbuf, int(rbytes), MPI_BYTE, src, rtag, comm, &rreq);
        if (rc != MPI_SUCCESS) return fail_prefix() + "MPI_Irecv failed: " + MpiError(rc);
      }
    }
    if (want_send && error.empty()) {
      // MPI wants a non-const pointer in old headers; the buffer is never written
      int rc = MPI_Isend(const_cast<void*>(sbuf), int(sbytes), MPI_BYTE, dest, stag, comm, &sreq);
      if (rc != MPI_SUCCESS) error = fail_prefix() + "MPI_Isend failed: " + MpiError(rc);
      send_done = rc != MPI_SUCCESS;
    }
  }
  const auto t_start = Clock::now();
  const auto spin_until = t_start + std::chrono::microseconds(20);
  const auto yield_until = t_start + std::chrono::milliseconds(5);
  const auto deadline = t_start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  for (uint64_t iter = 0; error.empty() && !(send_done && recv_done); ++iter) {
    const auto now = Clock::now();
    const bool spinning = now < spin_until;
    {
      std::lock_guard<std::mutex> lock(eng.mu);
      if (!recv_done) {
        int flag = 0;
        MPI_Status st;
        int rc = MPI_Test(&rreq, &flag, &st);
        // (MPI_Test reports a failed receive in its return code; status.MPI_ERROR is
        // set only by the multiple-completion calls)
        if (rc != MPI_SUCCESS) {
          int code = rc;
          int cls = 0;
          MPI_Error_class(code, &cls);
          error = cls == MPI_ERR_TRUNCATE ? fail_prefix() + "message from peer " + std::to_string(src) + " tag " +
                                                std::to_string(rtag) + " is larger than the expected " +
                                                std::to_string(rbytes) + " bytes (" + std::string(desc) + ")"
                                          : fail_prefix() + "receive failed: " + MpiError(code);
          recv_done = true;
          rreq = MPI_REQUEST_NULL;
        } else if (flag) {
          int count = 0;
          MPI_Get_count(&st, MPI_BYTE, &count);
          if (size_t(count) != rbytes) error = wrong_size(size_t(count));
          recv_done = true;
        }
      }
      if (!send_done) {
        int flag = 0;
        MPI_Test(&sreq, &flag, MPI_STATUS_IGNORE);
        send_done = flag != 0;
      }
      ProgressSends(eng);
      // past the spin: take every other message that has arrived into the stash (our own
      // receive is posted, so MPI never hands it to this probe)
      if (!spinning) {
        while (error.empty() && !(send_done && recv_done)) {
          int flag = 0;
          MPI_Message msg;
          MPI_Status st;
          MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &flag, &msg, &st);
          if (!flag) break;
          int count = 0;
          MPI_Get_count(&st, MPI_BYTE, &count);
          std::vector<char> buf(static_cast<size_t>(count));
          MPI_Mrecv(buf.data(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
          eng.stashed_messages += 1;
          eng.stashed_bytes += uint64_t(count);
          eng.stash[{comm, st.MPI_SOURCE, st.MPI_TAG}].push_back(std::move(buf));
        }
      }
      if (!error.empty() || (send_done && recv_done)) break;
      if (now > deadline) {
        std::ostringstream s;
        s << fail_prefix() << "timed out after " << timeout_s << " s:";
        if (!send_done) s << " send of " << desc << " (" << sbytes << " bytes) to peer " << dest << " tag " << stag
                          << " was not received;";
        if (!recv_done) s << " no message from peer " << src << " with tag " << rtag << " (expected " << desc << ", "
                          << rbytes << " bytes);";
        bool any = false;
        for (auto& [key, q] : eng.stash) {
          if (std::get<0>(key) != comm || q.empty()) continue;
          s << (any ? ", " : " unmatched messages waiting here: ") << "peer " << std::get<1>(key) << " tag "
            << std::get<2>(key) << " (" << q.front().size() << " bytes) x" << q.size();
          any = true;
        }
        if (!any) s << " nothing else arrived";
        error = s.str();
        break;
      }
    }
    // spin first (a neighbour's answer usually comes within microseconds), then yield the
    // core (measured: a long pure busy-poll loses badly once the cores are oversubscribed,
    // the peer cannot run), then sleep so a long wait costs no core
    if (spinning) continue;
    if (now < yield_until)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  if (!send_done || !recv_done) {
    // XLA frees the buffers once we return: withdraw what MPI still can
    std::lock_guard<std::mutex> lock(eng.mu);
    for (MPI_Request* r : {&sreq, &rreq}) {
      if (*r == MPI_REQUEST_NULL) continue;
      MPI_Cancel(r);
      MPI_Request_free(r);
    }
  }
  return error;
}

}  // namespace h2
