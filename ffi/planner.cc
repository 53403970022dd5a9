// The planner's exact layer split (h2jax.plan._search, "Why the exact round is exact"), compiled:
// for one sequence of stages under one schedule, the split of the model's L blocks and the
// recompute flags that minimise
//
//     (m - 1) max_s t_s + sum_s fill_s + transfers + max_s g_s
//
// Every stage's time t, fill and end g are given per layer count l = 0..L (affine in l, priced
// by the cost model in Python) together with its memory, affine in l and in the microbatches
// the stage holds awaiting B (j) and W (q): a stage fits l blocks without recompute where
// mem1[l] + (j - 1) per_j[l] + q per_q[l] <= limit, else with recompute where that table fits.
// Thresholds B >= max t and G >= max g are enumerated in increasing order; under each the
// per-stage layer caps they imply bound a min-plus dynamic program over the stages (min sum
// fill); the walk stops as soon as (m - 1) B + G + min sum fill cannot beat the best.
//
// The search calls `solve` once per (configuration, stage order, schedule): thousands of
// times, so it is C++ (numpy spent most of its time in call overhead on arrays of ~100). So are
// the other loops the search runs thousands of times on small arrays: the memory caps of a
// stage shape (`caps_at`) and how many blocks a chip type's choices hold within a slot time
// (`Held`, `slot_time_bound`, `least_block_seconds`). Each computes what the numpy it replaced
// computed, in the same order of floating-point operations (the tests compare the plans).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/vector.h"

namespace nb = nanobind;

namespace {

constexpr double INF = std::numeric_limits<double>::infinity();

// One run of stages of one shape: tab[rc][k][l], rc in {no recompute, recompute}, k the
// quantity (below), l = 0..L.
enum Quantity { kT = 0, kFill = 1, kEnd = 2, kMem1 = 3, kPerJ = 4, kPerQ = 5, kLimit = 6, kQuantities = 7 };
using Table = nb::ndarray<const double, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
using Counts = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Matrix = nb::ndarray<const double, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using IntVec = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Vec = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Flat = nb::ndarray<const double, nb::c_contig, nb::device::cpu>;  // any shape, read flat

// A vector whose resize leaves new elements uninitialised (default-, not value-initialised):
// build_rows writes every entry, and zero-filling S x (L + 1) entries per call first cost as
// much as writing them.
template <typename T>
struct DefaultInit : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInit<U>;
  };
  DefaultInit() = default;
  template <typename U>
  DefaultInit(const DefaultInit<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
using Buffer = std::vector<double, DefaultInit<double>>;

// Per stage and layer count, row-major [S][L + 1].
struct Rows {
  int S = 0, L = 0;
  Buffer t, g, fill;
  std::vector<uint8_t, DefaultInit<uint8_t>> recompute;
  double at(const Buffer& a, int s, int l) const { return a[static_cast<size_t>(s) * (L + 1) + l]; }
};

// Whether a stage's fit is a threshold in l: with mem1, per_j and per_q non-decreasing and
// finite, the limit non-increasing, and the counts' coefficients j - 1 and q non-negative,
// mem1 + (j - 1) per_j + q per_q is non-decreasing in l as computed (rounding is monotone), so
// it fits on l = 0 .. e - 1 and nowhere after.
bool monotone_fit(const std::array<const double*, kQuantities>& q, int L) {
  for (int k : {kMem1, kPerJ, kPerQ, kLimit})
    for (int l = 0; l <= L; ++l)
      if (!std::isfinite(q[k][l])) return false;
  for (int l = 1; l <= L; ++l)
    if (!(q[kMem1][l] >= q[kMem1][l - 1] && q[kPerJ][l] >= q[kPerJ][l - 1] && q[kPerQ][l] >= q[kPerQ][l - 1] &&
          q[kLimit][l] <= q[kLimit][l - 1]))
      return false;
  return true;
}

// One stage shape's pricing over the layer count (what `solve` takes per run of stages): a copy of
// its table, with whether its fit is a threshold in l (monotone_fit) worked out once.
class Pricing {
 public:
  explicit Pricing(const Table& tab) {
    if (tab.shape(0) != 2 || tab.shape(1) != kQuantities || tab.shape(2) < 1)
      throw std::invalid_argument("Pricing: expected a table of shape (2, 7, L + 1)");
    L_ = static_cast<int>(tab.shape(2)) - 1;
    data_.assign(tab.data(), tab.data() + tab.size());
    monotone_ = monotone_fit(row(0), L_) && monotone_fit(row(1), L_);
  }
  int L() const { return L_; }
  bool monotone() const { return monotone_; }
  // q[k]: quantity k of flag rc over l
  std::array<const double*, kQuantities> row(int rc) const {
    std::array<const double*, kQuantities> q;
    for (int k = 0; k < kQuantities; ++k) q[k] = data_.data() + (static_cast<size_t>(rc) * kQuantities + k) * (L_ + 1);
    return q;
  }

 private:
  int L_ = 0;
  bool monotone_ = false;
  std::vector<double> data_;
};

Rows build_rows(const std::vector<const Pricing*>& tables, const std::vector<int64_t>& runs, const Counts& counts,
                bool allow_recompute, int chunks, bool has_fill) {
  if (tables.size() != runs.size()) throw std::invalid_argument("tables and runs differ in length");
  if (tables.empty()) throw std::invalid_argument("no stages");
  const int L = tables[0]->L();
  const int S = static_cast<int>(counts.shape(0));
  if (counts.shape(1) != 2) throw std::invalid_argument("counts: expected shape (stages, 2)");
  if (std::accumulate(runs.begin(), runs.end(), int64_t{0}) != S)
    throw std::invalid_argument("runs do not add up to the stage count");
  Rows r;
  r.S = S;
  r.L = L;
  const size_t n = static_cast<size_t>(S) * (L + 1);
  r.t.resize(n);
  r.g.resize(n);
  r.fill.resize(n);
  r.recompute.resize(n);
  int s = 0;
  for (size_t p = 0; p < tables.size(); ++p) {
    const Pricing& tab = *tables[p];
    if (tab.L() != L) throw std::invalid_argument("tables differ in their layer count");
    const std::array<const double*, kQuantities> q[2] = {tab.row(0), tab.row(1)};  // q[rc][quantity]
    for (int64_t i = 0; i < runs[p]; ++i, ++s) {
      // as numpy evaluates mem1 + (j - 1) * per_j + q * per_q <= limit, left to right
      const double j1 = static_cast<double>(counts.data()[2 * s] - 1);
      const double qw = static_cast<double>(counts.data()[2 * s + 1]);
      const size_t row = static_cast<size_t>(s) * (L + 1);
      auto fits_at = [&](int rc, int l) {
        return q[rc][kMem1][l] + j1 * q[rc][kPerJ][l] + qw * q[rc][kPerQ][l] <= q[rc][kLimit][l];
      };
      if (tab.monotone() && j1 >= 0 && qw >= 0) {
        // the same entries as the loop below, by ranges: plain on [0, e0), recompute on [e0, e1)
        int end[2];
        for (int rc = 0; rc < 2; ++rc) {
          int lo = 0, hi = L + 1;  // fits_at(rc, l) for l < lo; not for l >= hi
          while (lo < hi) {
            const int mid = lo + (hi - lo) / 2;
            if (fits_at(rc, mid))
              lo = mid + 1;
            else
              hi = mid;
          }
          end[rc] = lo;
        }
        const int e0 = end[0], e1 = allow_recompute ? std::max(end[0], end[1]) : end[0];
        double* t = r.t.data() + row;
        double* g = r.g.data() + row;
        double* f = r.fill.data() + row;
        uint8_t* rc = r.recompute.data() + row;
        std::copy(q[0][kT], q[0][kT] + e0, t);
        std::copy(q[1][kT] + e0, q[1][kT] + e1, t + e0);
        std::fill(t + e1, t + L + 1, INF);
        t[0] = INF;
        std::copy(q[0][kEnd], q[0][kEnd] + e0, g);
        std::copy(q[1][kEnd] + e0, q[1][kEnd] + L + 1, g + e0);
        std::fill(rc, rc + e0, uint8_t{0});
        std::fill(rc + e0, rc + L + 1, uint8_t{1});
        if (has_fill) {
          std::copy(q[0][kFill], q[0][kFill] + e0, f);
          std::copy(q[1][kFill] + e0, q[1][kFill] + e1, f + e0);
          std::fill(f + e1, f + L + 1, INF);
          std::fill(f, f + std::min(std::max(chunks, 0), L + 1), INF);  // a chunk holds at least one block
        } else {
          std::copy(t, t + L + 1, f);
        }
        continue;
      }
      for (int l = 0; l <= L; ++l) {
        auto fits = [&](int rc) { return fits_at(rc, l); };
        bool fit[2];
        fit[0] = fits(0);
        fit[1] = !fit[0] && allow_recompute && fits(1);  // asked only where the plain stage does not fit
        const double t = fit[0] ? q[0][kT][l] : fit[1] ? q[1][kT][l] : INF;
        r.t[row + l] = l == 0 ? INF : t;
        r.g[row + l] = fit[0] ? q[0][kEnd][l] : q[1][kEnd][l];
        r.recompute[row + l] = !fit[0];
        if (has_fill) {
          const double f = fit[0] ? q[0][kFill][l] : fit[1] ? q[1][kFill][l] : INF;
          r.fill[row + l] = l < chunks ? INF : f;  // a chunk holds at least one block
        } else {
          r.fill[row + l] = r.t[row + l];
        }
      }
    }
  }
  return r;
}

// min sum_s F[s][l_s] s.t. 1 <= l_s <= caps[s] (F is inf at l = 0), sum l_s = L; with the layer
// counts. The first minimum wins ties (numpy's argmin), so the split is the one the search
// has always returned.
std::optional<std::pair<double, std::vector<int>>> min_split(const double* F, int S, int L, const int64_t* caps) {
  std::vector<double> v(L + 1), next(L + 1);
  std::vector<int> back(static_cast<size_t>(S > 1 ? S - 1 : 0) * (L + 1));
  for (int n = 0; n <= L; ++n) v[n] = n <= caps[0] ? F[n] : INF;
  for (int s = 1; s < S; ++s) {
    const double* t = F + static_cast<size_t>(s) * (L + 1);
    const int cap = static_cast<int>(std::min<int64_t>(caps[s], L));
    int* arg = back.data() + static_cast<size_t>(s - 1) * (L + 1);
    for (int n = 0; n <= L; ++n) {
      double best = INF;
      int a = 0;
      const int top = std::min(cap, n);
      for (int l = 0; l <= top; ++l) {
        const double val = v[n - l] + t[l];
        if (val < best) {
          best = val;
          a = l;
        }
      }
      next[n] = best;
      arg[n] = a;
    }
    std::swap(v, next);
  }
  if (!std::isfinite(v[L])) return std::nullopt;
  std::vector<int> layers(S);
  int n = L;
  for (int s = S - 1; s >= 1; --s) {
    const int layer = back[static_cast<size_t>(s - 1) * (L + 1) + n];
    layers[s] = layer;
    n -= layer;
  }
  layers[0] = n;
  return std::make_pair(v[L], std::move(layers));
}

// A lower bound on min_split over F[:, 1:] (column c: c + 1 layers) in O(S L): each row from its
// first finite entry on grows at least by its least step, so the relaxation gives each stage its
// first finite count and the remaining blocks to the least steps first (inf: no split).
double least_fill_sum(const double* F, int S, int cols, const int64_t* full, int L, int stride) {
  std::vector<int> first(S);
  std::vector<double> step(S);
  int64_t rest = L, room_total = 0;
  double base = 0.0;
  for (int s = 0; s < S; ++s) {
    const double* row = F + static_cast<size_t>(s) * stride;
    int f = -1;
    for (int c = 0; c < cols; ++c)
      if (std::isfinite(row[c])) {
        f = c;
        break;
      }
    if (f < 0) return INF;
    first[s] = f;
    rest -= f + 1;
    room_total += full[s] - (f + 1);
    base += row[f];
    double least = INF;
    for (int c = 0; c + 1 < cols; ++c) {
      const double d = row[c + 1] - row[c];
      if (std::isfinite(d) && d < least) least = d;
    }
    step[s] = least;
  }
  if (rest < 0 || room_total < rest) return INF;
  std::vector<int> order(S);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return step[a] < step[b]; });
  double extra = 0.0;
  int64_t taken = 0;
  for (int s : order) {
    const int64_t room = full[s] - (first[s] + 1);
    const int64_t take = std::clamp<int64_t>(rest - taken, 0, std::max<int64_t>(room, 0));
    taken += room;
    if (take > 0) extra += static_cast<double>(take) * step[s];
  }
  return base + extra;
}

struct Found {
  double value = INF;
  std::vector<int> layers;
  int dp_solves = 0;
};

// The best split of `r`'s stages if it beats `best` (value inf and no layers otherwise).
Found solve_rows(const Rows& r, int m, double transfers, double best) {
  Found out;
  const int S = r.S, L = r.L, W = L + 1;
  if (S > L) return out;
  const double mm = static_cast<double>(m - 1);
  // T, G: columns 1..L (layer counts); non-decreasing in l, inf where it does not fit
  auto T = [&](int s, int c) { return r.t[static_cast<size_t>(s) * W + c + 1]; };
  auto G = [&](int s, int c) { return r.g[static_cast<size_t>(s) * W + c + 1]; };
  std::vector<int64_t> full(S);
  int64_t full_sum = 0, full_min = L + 1;
  double g_floor = -INF, row_min_max = -INF, base = 0.0;
  std::vector<double> all;
  all.reserve(static_cast<size_t>(S) * L);
  for (int s = 0; s < S; ++s) {
    int64_t f = 0;
    double tmin = INF, fmin = INF;
    for (int c = 0; c < L; ++c) {
      const double t = T(s, c);
      if (std::isfinite(t)) ++f;
      tmin = std::min(tmin, t);
      fmin = std::min(fmin, r.fill[static_cast<size_t>(s) * W + c + 1]);
      all.push_back(t);
    }
    full[s] = f;
    full_sum += f;
    full_min = std::min(full_min, f);
    g_floor = std::max(g_floor, G(s, 0));
    row_min_max = std::max(row_min_max, tmin);
    base += fmin;
  }
  if (full_min < 1 || full_sum < L) return out;
  // smallest B whose caps can hold L layers: every stage holds a block and L entries of T lie at
  // or below it (its L-th smallest)
  std::nth_element(all.begin(), all.begin() + (L - 1), all.end());
  const double b0 = std::max(row_min_max, all[L - 1]);
  if (!std::isfinite(b0)) return out;
  if (mm * b0 + base + g_floor + transfers >= best) return out;
  if (mm * b0 + least_fill_sum(r.fill.data() + 1, S, L, full.data(), L, W) + g_floor + transfers >= best)
    return out;  // cheaper than the dynamic program below, and nearly as tight
  ++out.dp_solves;
  auto free = min_split(r.fill.data(), S, L, full.data());
  if (!free) return out;
  const double sum_free = free->first;
  if (mm * b0 + sum_free + g_floor + transfers >= best) return out;

  std::vector<double> cand_b;
  for (double t : all)
    if (t >= b0 && std::isfinite(t)) cand_b.push_back(t);
  std::sort(cand_b.begin(), cand_b.end());
  cand_b.erase(std::unique(cand_b.begin(), cand_b.end()), cand_b.end());

  // each stage's T and G sorted: a threshold's count is an upper bound in its row (log L, not L)
  std::vector<double> t_sorted(static_cast<size_t>(S) * L), g_sorted(static_cast<size_t>(S) * L);
  for (int s = 0; s < S; ++s) {
    for (int c = 0; c < L; ++c) {
      t_sorted[static_cast<size_t>(s) * L + c] = T(s, c);
      g_sorted[static_cast<size_t>(s) * L + c] = G(s, c);
    }
    std::sort(t_sorted.begin() + static_cast<size_t>(s) * L, t_sorted.begin() + static_cast<size_t>(s + 1) * L);
    std::sort(g_sorted.begin() + static_cast<size_t>(s) * L, g_sorted.begin() + static_cast<size_t>(s + 1) * L);
  }
  auto at_most = [&](const std::vector<double>& sorted, int s, double x) {  // entries of row s <= x
    auto row = sorted.begin() + static_cast<size_t>(s) * L;
    return static_cast<int64_t>(std::upper_bound(row, row + L, x) - row);
  };
  std::map<std::vector<int64_t>, std::optional<std::pair<double, std::vector<int>>>> seen;
  std::vector<int64_t> cap_b(S), prev_caps, caps(S);
  std::vector<double> cand_g;
  for (double b : cand_b) {
    if (mm * b + sum_free + g_floor + transfers >= best) break;
    for (int s = 0; s < S; ++s) cap_b[s] = at_most(t_sorted, s, b);
    if (!prev_caps.empty() && prev_caps == cap_b) continue;  // same caps as the previous B: larger B
    prev_caps = cap_b;
    double g_top = -INF;
    cand_g.clear();
    for (int s = 0; s < S; ++s) {
      g_top = std::max(g_top, G(s, static_cast<int>(cap_b[s]) - 1));
      for (int c = 0; c < cap_b[s]; ++c) cand_g.push_back(G(s, c));
    }
    std::sort(cand_g.begin(), cand_g.end());
    cand_g.erase(std::unique(cand_g.begin(), cand_g.end()), cand_g.end());
    for (double gthr : cand_g) {
      if (gthr < g_floor || gthr > g_top) continue;
      // each stage's caps under both thresholds; a split needs a block on every stage and L in all
      int64_t total = 0, least = L + 1;
      for (int s = 0; s < S; ++s) {
        caps[s] = std::min(cap_b[s], at_most(g_sorted, s, gthr));
        total += caps[s];
        least = std::min(least, caps[s]);
      }
      if (least < 1 || total < L) continue;
      if (mm * b + gthr + sum_free + transfers >= best) break;
      auto hit = seen.find(caps);
      if (hit == seen.end()) {
        ++out.dp_solves;
        hit = seen.emplace(caps, min_split(r.fill.data(), S, L, caps.data())).first;
      }
      if (!hit->second) continue;
      const std::vector<int>& layers = hit->second->second;
      double t_max = -INF, g_max = -INF, fills = 0.0;
      for (int s = 0; s < S; ++s) {
        const int l = layers[s];
        t_max = std::max(t_max, r.at(r.t, s, l));
        g_max = std::max(g_max, r.at(r.g, s, l));
        fills += r.at(r.fill, s, l);
      }
      const double value = mm * t_max + fills + transfers + g_max;
      if (value < best) {
        best = value;
        out.value = value;
        out.layers = layers;
      }
    }
  }
  return out;
}

// Most blocks a middle stage holds without / with recompute if its (awaiting B, awaiting W) counts
// may be any of the points (js[p], qs[p]): the max over them. `mm`: per recompute flag its memory
// base (3), slope per block (3) and limit: mem = base . (1, j, q) + l slope . (1, j, q).
// Rounded up by a hair so floating-point noise can only loosen it (caps feed bounds, never a plan).
// `ranks` (or null): the N entries are rows of `width` stage ranks, and row r needs only its first
// ranks[r] (the rest are 0, unpriced).
void caps_at(const double* mm, const double* js, const double* qs, int P, size_t N, int L, bool allow_recompute,
             double* ln, double* lr, const int64_t* ranks = nullptr, size_t width = 0) {
  const double factor = 1 + 1e-9;
  for (int rc = 0; rc < (allow_recompute ? 2 : 1); ++rc) {
    const double* base = mm + rc * 7;
    const double* slope = base + 3;
    const double limit = base[6];
    double* out = rc == 0 ? ln : lr;
    for (size_t i = 0; i < N; ++i) {
      if (ranks != nullptr && static_cast<int64_t>(i % width) >= ranks[i / width]) {
        out[i] = 0.0;
        continue;
      }
      double best = -INF;
      for (int p = 0; p < P; ++p) {
        const double j = js[p * N + i], q = qs[p * N + i];
        const double room = limit - (base[0] + base[1] * j + base[2] * q);
        const double sl = slope[0] + slope[1] * j + slope[2] * q;
        double caps = sl > 0 ? std::floor(room / sl * factor + 1e-9) : room >= 0 ? L : 0.0;
        caps = std::min(std::max(caps, 0.0), static_cast<double>(L));
        best = p == 0 ? caps : std::max(best, caps);
      }
      out[i] = best;
    }
  }
  if (!allow_recompute) std::copy(ln, ln + N, lr);
}

// Blocks a stage rank holds within slot time b: no more than its memory allows without (ln) or
// with (lr) recompute, and no more than b pays for at a block's seconds without (a) or with (arc)
// recompute (inf: none, e.g. no recompute). Rounded up by a hair so floating-point noise can only
// loosen it.
inline double slots(double b, double a) { return std::isinf(a) ? 0.0 : std::floor(b / a * (1 + 1e-9)); }
inline double rank_holds(double ln, double lr, double xn, double xr) {
  return std::max(std::min(ln, xn), std::min(lr, xr));
}

// Every choice of one chip type at once: rows of per-rank caps (choices with one caps object share
// a row and differ in how many ranks they take: `col` + 1), per row the seconds of a block without
// (a) and with (arc) recompute; per choice its row, last rank and least fill per block.
class Held {
 public:
  Held(const Matrix& ln, const Matrix& lr, const Vec& a, const Vec& arc, const IntVec& row, const IntVec& col,
       const Vec& fill)
      : R_(static_cast<int>(ln.shape(0))), K_(static_cast<int>(ln.shape(1))) {
    if (lr.shape(0) != ln.shape(0) || lr.shape(1) != ln.shape(1) || static_cast<int>(a.shape(0)) != R_ ||
        static_cast<int>(arc.shape(0)) != R_ || row.shape(0) != col.shape(0) || fill.shape(0) != row.shape(0))
      throw std::invalid_argument("Held: inconsistent shapes");
    ln_.assign(ln.data(), ln.data() + ln.size());
    lr_.assign(lr.data(), lr.data() + lr.size());
    a_.assign(a.data(), a.data() + R_);
    arc_.assign(arc.data(), arc.data() + R_);
    row_.assign(row.data(), row.data() + row.shape(0));
    col_.assign(col.data(), col.data() + col.shape(0));
    fill_.assign(fill.data(), fill.data() + fill.shape(0));
    for (size_t c = 0; c < row_.size(); ++c)
      if (row_[c] < 0 || row_[c] >= R_ || col_[c] < 0 || col_[c] >= K_)
        throw std::invalid_argument("Held: a choice's row or rank is out of range");
    prefix_.resize(static_cast<size_t>(R_) * K_);
    last_xn_.assign(R_, std::numeric_limits<double>::quiet_NaN());  // NaN equals nothing: computed at first
    last_xr_.assign(R_, std::numeric_limits<double>::quiet_NaN());
  }
  size_t choices() const { return row_.size(); }

  // blocks each row's ranks hold within slot time b, summed over the first k ranks (prefix_); a row
  // depends on b only through its block counts (xn, xr), which a bisection or a grid over b mostly
  // leaves as they were at the previous b: such rows keep their sums
  void fill_prefix(double b) {
    for (int r = 0; r < R_; ++r) {
      const double xn = slots(b, a_[r]), xr = slots(b, arc_[r]);
      if (xn == last_xn_[r] && xr == last_xr_[r]) continue;
      last_xn_[r] = xn;
      last_xr_[r] = xr;
      double run = 0.0;
      for (int k = 0; k < K_; ++k) {
        const size_t i = static_cast<size_t>(r) * K_ + k;
        run += rank_holds(ln_[i], lr_[i], xn, xr);
        prefix_[i] = run;
      }
    }
  }
  // the most blocks any choice holds within b (a row's full sum: its longest choice)
  double most(double b) {
    fill_prefix(b);
    double best = -INF;
    for (int r = 0; r < R_; ++r) best = std::max(best, prefix_[static_cast<size_t>(r) * K_ + K_ - 1]);
    return best;
  }
  // blocks each choice holds within b
  void each(double b, double* out) {
    fill_prefix(b);
    for (size_t c = 0; c < row_.size(); ++c) out[c] = prefix_[static_cast<size_t>(row_[c]) * K_ + col_[c]];
  }
  const std::vector<double>& fill() const { return fill_; }

 private:
  int R_, K_;
  std::vector<double> ln_, lr_, a_, arc_, fill_, prefix_, last_xn_, last_xr_;
  std::vector<int64_t> row_, col_;
};

// The smallest slot time b at which the chip types together hold all L blocks (each with its best
// choice): bisection on a non-decreasing step function from [0, top], the lower end returned, so it
// never overshoots (inf: not even at 1e12 s).
double slot_time_bound(std::vector<Held*>& helds, double top, int L) {
  auto total = [&](double b) {
    double sum = 0.0;
    for (Held* h : helds) sum += h->most(b);
    return sum;
  };
  double lo = 0.0, hi = top;
  while (total(hi) < L) {
    hi *= 2;
    if (hi > 1e12) return INF;
  }
  for (int i = 0; i < 64; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (total(mid) >= L)
      hi = mid;
    else
      lo = mid;
    if (hi - lo <= 1e-7 * hi) break;
  }
  return lo;
}

// The least seconds of L blocks given to the chip types (each at least one) when no stage may take
// longer than b: x blocks on a type cost at least x times the least fill per block of its choices
// that hold at least x blocks within b (a min-plus dynamic program over the types).
double least_block_seconds(std::vector<Held*>& helds, double b, int L) {
  std::vector<double> v, cost(L + 1), next(L + 1), held;
  for (Held* h : helds) {
    held.resize(h->choices());
    h->each(b, held.data());
    std::fill(cost.begin(), cost.end(), INF);
    for (size_t c = 0; c < held.size(); ++c) {
      const int n = static_cast<int>(std::min(std::max(held[c], 0.0), static_cast<double>(L)));
      cost[n] = std::min(cost[n], h->fill()[c]);
    }
    for (int n = L - 1; n >= 0; --n) cost[n] = std::min(cost[n], cost[n + 1]);  // holding h holds fewer too
    for (int n = 0; n <= L; ++n) cost[n] = n == 0 ? INF : n * cost[n];          // every type holds a block
    if (v.empty()) {
      v = cost;
      continue;
    }
    for (int n = 0; n <= L; ++n) {
      double best = INF;
      for (int l = 0; l <= n; ++l) best = std::min(best, v[n - l] + cost[l]);
      next[n] = best;
    }
    std::swap(v, next);
  }
  return v.empty() ? INF : v[L];
}

template <typename T, typename V>
nb::ndarray<nb::numpy, T, nb::ndim<2>> to_numpy(const V& v, int S, int L) {
  T* data = new T[v.size()];
  std::copy(v.begin(), v.end(), data);
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<2>>(data, {static_cast<size_t>(S), static_cast<size_t>(L + 1)}, owner);
}

nb::ndarray<nb::numpy, double, nb::ndim<1>> to_numpy1(const std::vector<double>& v) {
  double* data = new double[v.size()];
  std::copy(v.begin(), v.end(), data);
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<double*>(p); });
  return nb::ndarray<nb::numpy, double, nb::ndim<1>>(data, {v.size()}, owner);
}

}  // namespace

NB_MODULE(_planner, mod) {
  mod.doc() = "The planner's exact layer split of one stage sequence (h2jax.plan._search).";
  nb::class_<Pricing>(mod, "Pricing")
      .def(nb::init<const Table&>(), nb::arg("table"),
           "One stage shape's pricing: float64 (2, 7, L + 1), per recompute flag t, fill, end, mem1, per_j, per_q\n"
           "and limit over l (copied).")
      .def_prop_ro("monotone", &Pricing::monotone,
                   "Whether its memory fits on l = 0 .. e - 1 and nowhere after, for any counts (j >= 1, q >= 0).");
  mod.def(
      "solve",
      [](const std::vector<const Pricing*>& tables, const std::vector<int64_t>& runs, const Counts& counts,
         bool allow_recompute, int chunks, bool has_fill, int m, double transfers, double best) {
        const Rows r = build_rows(tables, runs, counts, allow_recompute, chunks, has_fill);
        const Found f = solve_rows(r, m, transfers, best);
        if (f.layers.empty()) return nb::make_tuple(INF, nb::none(), nb::none(), f.dp_solves);
        nb::list layers, recompute;
        for (int s = 0; s < r.S; ++s) {
          layers.append(f.layers[s]);
          recompute.append(nb::bool_(r.recompute[static_cast<size_t>(s) * (r.L + 1) + f.layers[s]] != 0));
        }
        return nb::make_tuple(f.value, layers, recompute, f.dp_solves);
      },
      nb::arg("tables"), nb::arg("runs"), nb::arg("counts"), nb::arg("allow_recompute"), nb::arg("chunks"),
      nb::arg("has_fill"), nb::arg("m"), nb::arg("transfers"), nb::arg("best"),
      "(value, layers, recompute, dp_solves) of the best split beating `best`; (inf, None, None, n) if none.\n"
      "`tables`: per run of stages of one shape, its Pricing; `runs`: stages per table, in order; `counts`: int64\n"
      "(S, 2) awaiting (B, W).");
  mod.def(
      "stage_rows",
      [](const std::vector<const Pricing*>& tables, const std::vector<int64_t>& runs, const Counts& counts,
         bool allow_recompute, int chunks, bool has_fill) {
        const Rows r = build_rows(tables, runs, counts, allow_recompute, chunks, has_fill);
        return nb::make_tuple(to_numpy<double>(r.t, r.S, r.L), to_numpy<double>(r.g, r.S, r.L),
                              to_numpy<bool>(r.recompute, r.S, r.L),
                              has_fill ? nb::object(nb::cast(to_numpy<double>(r.fill, r.S, r.L))) : nb::none());
      },
      nb::arg("tables"), nb::arg("runs"), nb::arg("counts"), nb::arg("allow_recompute"), nb::arg("chunks"),
      nb::arg("has_fill"), "What `solve` prices: (t, g, recompute, fill or None), each (S, L + 1).");
  mod.def(
      "min_split",
      [](const Matrix& F, const IntVec& caps) -> nb::object {
        const int S = static_cast<int>(F.shape(0)), L = static_cast<int>(F.shape(1)) - 1;
        if (static_cast<int>(caps.shape(0)) != S) throw std::invalid_argument("caps: one per row of F");
        auto res = min_split(F.data(), S, L, caps.data());
        if (!res) return nb::none();
        nb::list layers;
        for (int l : res->second) layers.append(l);
        return nb::make_tuple(res->first, layers);
      },
      nb::arg("fills"), nb::arg("caps"),
      "min sum_s F[s, l_s] over 1 <= l_s <= caps[s], sum l_s = L (F: (S, L + 1)): (value, layers) or None.");
  mod.def(
      "least_fill_sum",
      [](const Matrix& F, const IntVec& full, int L) {
        const int S = static_cast<int>(F.shape(0)), cols = static_cast<int>(F.shape(1));
        if (static_cast<int>(full.shape(0)) != S) throw std::invalid_argument("full: one per row of F");
        return least_fill_sum(F.data(), S, cols, full.data(), L, cols);
      },
      nb::arg("fills"), nb::arg("full"), nb::arg("L"),
      "A lower bound on min_split over F (column c: c + 1 layers), in O(S L).");
  mod.def(
      "caps_at",
      [](const nb::ndarray<const double, nb::shape<2, 7>, nb::c_contig, nb::device::cpu>& mm,
         const std::vector<Flat>& js, const std::vector<Flat>& qs, int L, bool allow_recompute,
         std::optional<IntVec> ranks) {
        const int P = static_cast<int>(js.size());
        if (P < 1 || qs.size() != js.size()) throw std::invalid_argument("caps_at: one or more (js, qs) points");
        const size_t N = js[0].size();
        const size_t rows = ranks ? ranks->shape(0) : 0;
        if (ranks && (rows == 0 || N % rows != 0)) throw std::invalid_argument("caps_at: points are not rows of ranks");
        std::vector<double> j(P * N), q(P * N);
        for (int p = 0; p < P; ++p) {
          if (js[p].size() != N || qs[p].size() != N) throw std::invalid_argument("caps_at: points differ in size");
          std::copy(js[p].data(), js[p].data() + N, j.begin() + p * N);
          std::copy(qs[p].data(), qs[p].data() + N, q.begin() + p * N);
        }
        std::vector<double> ln(N), lr(N);
        caps_at(mm.data(), j.data(), q.data(), P, N, L, allow_recompute, ln.data(), lr.data(),
                ranks ? ranks->data() : nullptr, ranks ? N / rows : 0);
        return nb::make_tuple(to_numpy1(ln), to_numpy1(lr));
      },
      nb::arg("mm"), nb::arg("js"), nb::arg("qs"), nb::arg("L"), nb::arg("allow_recompute"),
      nb::arg("ranks") = nb::none(),
      "Most blocks a middle stage holds (without, with recompute), each flat (N,): the max over the points\n"
      "(js[p], qs[p]) (arrays of N counts each) of awaiting (B, W) counts; `mm`: per flag base (3), slope (3),\n"
      "limit. `ranks` (int64, R): the points are R rows of stage ranks, row r priced for its first ranks[r]\n"
      "only (0 after them).");
  nb::class_<Held>(mod, "Held")
      .def(nb::init<const Matrix&, const Matrix&, const Vec&, const Vec&, const IntVec&, const IntVec&, const Vec&>(),
           nb::arg("ln"), nb::arg("lr"), nb::arg("a"), nb::arg("arc"), nb::arg("row"), nb::arg("col"),
           nb::arg("fill"))
      .def("most", &Held::most, nb::arg("b"))
      .def(
          "each",
          [](Held& h, double b) {
            std::vector<double> out(h.choices());
            h.each(b, out.data());
            return to_numpy1(out);
          },
          nb::arg("b"))
      .def(
          "each_on",
          [](Held& h, const Vec& grid) {
            const size_t C = h.choices(), G = grid.shape(0);
            std::vector<double> out(C * G), one(C);
            for (size_t g = 0; g < G; ++g) {
              h.each(grid.data()[g], one.data());
              for (size_t c = 0; c < C; ++c) out[c * G + g] = one[c];
            }
            return to_numpy<double>(out, static_cast<int>(C), static_cast<int>(G) - 1);
          },
          nb::arg("grid"));
  mod.def(
      "blocks_within",
      [](const Vec& ln, const Vec& lr, int k, double b, double a, double arc) {
        if (k < 0 || static_cast<size_t>(k) > ln.shape(0) || static_cast<size_t>(k) > lr.shape(0))
          throw std::invalid_argument("blocks_within: more ranks than caps");
        const double xn = slots(b, a), xr = slots(b, arc);
        double sum = 0.0;
        for (int i = 0; i < k; ++i) sum += rank_holds(ln.data()[i], lr.data()[i], xn, xr);
        return sum;
      },
      nb::arg("ln"), nb::arg("lr"), nb::arg("k"), nb::arg("b"), nb::arg("a"), nb::arg("arc"),
      "Blocks the first k ranks hold within slot time b (caps ln / lr without / with recompute, a block's\n"
      "seconds a / arc).");
  mod.def("slot_time_bound", &slot_time_bound, nb::arg("helds"), nb::arg("top"), nb::arg("L"));
  mod.def("least_block_seconds", &least_block_seconds, nb::arg("helds"), nb::arg("b"), nb::arg("L"));
}
