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
// Thread safety: every MPI call and the stash sit behind one mutex; the per-device
// computations of one process (shard_map) may call in from several threads. MPI must be
// initialised with MPI_THREAD_MULTIPLE (mpi4py's default) when Python threads also use MPI.
#pragma once

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace h2 {

using Clock = std::chrono::steady_clock;

struct Engine {
  std::mutex mu;
  // (communicator, source rank, tag) -> messages that arrived before their recv
  std::map<std::tuple<MPI_Comm, int, int>, std::deque<std::vector<char>>> stash;

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
inline std::string CheckRoute(MPI_Comm comm, int peer, int tag, const char* what) {
  int size = 0, flag = 0, rank = -1;
  int* tag_ub = nullptr;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_get_attr(comm, MPI_TAG_UB, &tag_ub, &flag);
  std::ostringstream s;
  if (peer < 0 || peer >= size)
    s << "h2jax ffi on rank " << rank << ": " << what << " rank " << peer << " is not in 0.." << size - 1;
  else if (tag < 0 || (flag && tag > *tag_ub))
    s << "h2jax ffi on rank " << rank << ": tag " << tag << " is outside 0.." << (flag ? *tag_ub : 32767);
  return s.str();
}

// One transfer: an optional send of `sbytes` from `sbuf` to `dest` with `stag`, and an
// optional receive of exactly `rbytes` into `rbuf` from `src` with `rtag`. Returns "" on
// success, else a one-line error. `desc` names the tensor (dtype[shape]) for errors.
inline std::string Transfer(MPI_Comm comm, const void* sbuf, size_t sbytes, int dest, int stag,
                            void* rbuf, size_t rbytes, int src, int rtag, double timeout_s,
                            const std::string& op, const std::string& desc) {
  Engine& eng = Engine::get();
  const bool want_send = op != "recv";
  const bool want_recv = op != "send";
  if (want_send)
    if (std::string e = CheckRoute(comm, dest, stag, "destination"); !e.empty()) return e;
  if (want_recv)
    if (std::string e = CheckRoute(comm, src, rtag, "source"); !e.empty()) return e;
  if ((want_send && sbytes > size_t(INT_MAX)) || (want_recv && rbytes > size_t(INT_MAX)))
    return op + ": " + desc + " is over 2 GiB; split it into several transfers";
  int rank = -1;
  MPI_Comm_rank(comm, &rank);
  MPI_Request sreq = MPI_REQUEST_NULL;
  bool send_done = !want_send, recv_done = !want_recv;
  auto fail_prefix = [&]() {
    std::ostringstream s;
    s << "h2jax ffi " << op << " on rank " << rank << ": ";
    return s.str();
  };
  if (want_send) {
    std::lock_guard<std::mutex> lock(eng.mu);
    // MPI wants a non-const pointer in old headers; the buffer is never written
    int rc = MPI_Isend(const_cast<void*>(sbuf), int(sbytes), MPI_BYTE, dest, stag, comm, &sreq);
    if (rc != MPI_SUCCESS) return fail_prefix() + "MPI_Isend failed: " + MpiError(rc);
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  const auto spin_until = Clock::now() + std::chrono::milliseconds(5);
  std::string error;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(eng.mu);
      if (!recv_done) {  // an older message of (src, rtag) may sit in the stash
        auto it = eng.stash.find({comm, src, rtag});
        if (it != eng.stash.end() && !it->second.empty()) {
          std::vector<char>& msg = it->second.front();
          if (msg.size() != rbytes) {
            std::ostringstream s;
            s << fail_prefix() << "message from peer " << src << " tag " << rtag << " has " << msg.size()
              << " bytes, expected " << rbytes << " (" << desc << ")";
            error = s.str();
          } else {
            std::memcpy(rbuf, msg.data(), rbytes);
          }
          it->second.pop_front();
          recv_done = true;
        }
      }
      if (!send_done) {
        int flag = 0;
        MPI_Test(&sreq, &flag, MPI_STATUS_IGNORE);
        send_done = flag != 0;
      }
      // take everything that has arrived: ours into rbuf, the rest into the stash
      while (error.empty() && !(send_done && recv_done)) {
        int flag = 0;
        MPI_Message msg;
        MPI_Status st;
        MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &flag, &msg, &st);
        if (!flag) break;
        int count = 0;
        MPI_Get_count(&st, MPI_BYTE, &count);
        if (!recv_done && st.MPI_SOURCE == src && st.MPI_TAG == rtag && size_t(count) == rbytes) {
          MPI_Mrecv(rbuf, count, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
          recv_done = true;
        } else {
          std::vector<char> buf(static_cast<size_t>(count));
          MPI_Mrecv(buf.data(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
          if (!recv_done && st.MPI_SOURCE == src && st.MPI_TAG == rtag) {
            std::ostringstream s;
            s << fail_prefix() << "message from peer " << src << " tag " << rtag << " has " << count
              << " bytes, expected " << rbytes << " (" << desc << ")";
            error = s.str();
            recv_done = true;
          } else {
            eng.stash[{comm, st.MPI_SOURCE, st.MPI_TAG}].push_back(std::move(buf));
          }
        }
        if (!send_done) {
          MPI_Test(&sreq, &flag, MPI_STATUS_IGNORE);
          send_done = flag != 0;
        }
      }
      if (!error.empty() || (send_done && recv_done)) break;
      if (Clock::now() > deadline) {
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
    // poll with yields for latency (measured: a pure busy-poll loses badly once the cores are
    // oversubscribed, the peer cannot run), then sleep so a long wait costs no core
    if (Clock::now() < spin_until)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  if (!send_done) {
    // XLA frees the send buffer once we return: withdraw the request if MPI still can
    std::lock_guard<std::mutex> lock(eng.mu);
    MPI_Cancel(&sreq);
    MPI_Request_free(&sreq);
  }
  return error;
}

}  // namespace h2
