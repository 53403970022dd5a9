// The buffered sends of an engine (mpi_engine.h, ucx_engine.h): the bookkeeping both share.
//
// A buffered send copies its bytes into a buffer of the engine, posts the engine's non-blocking
// send of the copy and returns. The sends in flight wait here, oldest first; every later call of
// the engine tests them (`Progress`, with the engine's own test of one request): one done gives
// its buffer back for reuse, one that failed or is not received within its timeout is given up
// on (the engine withdraws what it can; its buffer is kept alive, since the engine may still read
// it) and its line waits in `error` for the engine's next call, which fails with it. `Flush` waits
// for all of them. No engine call is made here: the engine holds its own lock around each of these.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace h2 {

using Clock = std::chrono::steady_clock;

// what an engine's test says of one send in flight
enum class SendState { kInFlight, kDone, kFailed };

// `Req`: the engine's request (MPI_Request, a UCP request pointer); `Comm`: its communicator
// handle, kept for the engine's withdrawal of a send.
template <class Req, class Comm>
struct BufferedSends {
  struct Pending {
    Req req;
    std::vector<char> buf;
    Comm comm;
    int rank, dest, tag;  // rank: the sender's, for the lines
    double timeout_s;
    Clock::time_point deadline;
    std::string desc;
  };
  std::deque<Pending> pending;               // in posting order
  std::vector<std::vector<char>> spare;      // buffers of completed sends, reused
  std::vector<std::vector<char>> abandoned;  // of sends given up on: never freed
  std::string error;                         // the first failure not yet told
  uint64_t sends = 0, bytes = 0;             // posted so far

  static std::string Prefix(int rank) { return "h2jax ffi send on rank " + std::to_string(rank) + ": "; }

  // A buffer of capacity >= n (a spare one where there is one, so reuse allocates nothing); the
  // caller resizes and fills it, outside the engine's lock.
  std::vector<char> Take(size_t n) {
    for (auto it = spare.begin(); it != spare.end(); ++it)
      if (it->capacity() >= n) {
        std::vector<char> b = std::move(*it);
        spare.erase(it);
        return b;
      }
    return {};
  }

  void Recycle(std::vector<char>&& b) {
    if (spare.size() < 16) spare.push_back(std::move(b));
  }

  // Count a send the engine posted (its request in flight: `in_flight`; else it completed at once).
  void Posted(Req req, std::vector<char>&& buf, Comm comm, int rank, int dest, int tag, double timeout_s,
              std::string_view desc, bool in_flight) {
    sends += 1;
    bytes += buf.size();
    if (!in_flight) return Recycle(std::move(buf));
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    pending.push_back(Pending{req, std::move(buf), comm, rank, dest, tag, timeout_s, deadline, std::string(desc)});
  }

  // Test every send in flight: `state(p, &why)` is the engine's test of one (kFailed: `why` says
  // why); `give_up(p, state)` withdraws one that failed or ran past its deadline.
  template <class State, class GiveUp>
  void Progress(State state, GiveUp give_up) {
    const auto now = Clock::now();
    for (auto it = pending.begin(); it != pending.end();) {
      std::string why;
      const SendState st = state(*it, &why);
      if (st == SendState::kInFlight && now <= it->deadline) {
        ++it;
        continue;
      }
      if (st == SendState::kDone) {
        Recycle(std::move(it->buf));
        it = pending.erase(it);
        continue;
      }
      if (error.empty()) {
        std::ostringstream s;
        s << Prefix(it->rank);
        if (st == SendState::kFailed)
          s << "send of " << it->desc << " (" << it->buf.size() << " bytes) to peer " << it->dest << " tag "
            << it->tag << " failed: " << why;
        else
          s << "timed out after " << it->timeout_s << " s: send of " << it->desc << " (" << it->buf.size()
            << " bytes) to peer " << it->dest << " tag " << it->tag << " was not received";
        error = s.str();
      }
      give_up(*it, st);
      abandoned.push_back(std::move(it->buf));
      it = pending.erase(it);
    }
  }

  // The first failure not yet told ("" if none), now told.
  std::string TakeError() { return std::exchange(error, {}); }

  // Wait until every send has completed or failed, `progress()` testing them under `mu`; returns
  // the first failure not yet told, else "". Each send waits at most its own timeout, all of them
  // together at most `max_wait_s` (then the sends still in flight are the line, left in flight).
  template <class Progress_>
  std::string Flush(std::mutex& mu, Progress_ progress, double max_wait_s) {
    const auto t_start = Clock::now();
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        progress();
        if (pending.empty()) return TakeError();
        if (std::chrono::duration<double>(Clock::now() - t_start).count() > max_wait_s) {
          if (!error.empty()) return TakeError();
          const Pending& p = pending.front();
          std::ostringstream s;
          s << Prefix(p.rank) << pending.size() << " buffered send(s) not received after " << max_wait_s
            << " s, the first: " << p.desc << " (" << p.buf.size() << " bytes) to peer " << p.dest << " tag " << p.tag;
          return s.str();
        }
      }
      if (Clock::now() - t_start < std::chrono::milliseconds(5))
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
};

}  // namespace h2
