// pie-ctx's filtered sampling: a step's temperature / top-k / top-p / min-p draw for m rows
// of fp32 logits in one call (runtime/sampling.py calls it; its torch code is the fallback
// and the oracle of tests/test_sampling.py).
//
// Each row is computed by one thread with a fixed order of operations, so a row's token and
// distribution are the same bits alone or in any batch, whatever the thread count.
//
// A row: one pass for the max, one for exp((x / t) - max) of every token (the weights
// ``e``, kept), their sum and, at a few fixed weight thresholds, how many tokens lie above
// and their mass. The smallest threshold set whose count or mass shows it holds every
// token the filters keep is collected and sorted (most likely first, ties to the lower id);
// the filters then run on that sorted prefix exactly, and if the prefix turns out not to
// close the filters (rounding in the estimate) the next threshold's set is taken, down to
// the whole vocabulary.
//
// Filters (HF order): top-k keeps the k most likely; top-p the smallest prefix whose mass,
// normalised over the top-k set, reaches top_p (the first token always kept); min-p the
// tokens whose weight is at least min_p times the top token's. The draw walks the kept
// weights' cumulative sum to u * total.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec16.h"

// the same rounding in every copy of a function (inlined or handed to the threads)
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0, 0 below -87 (no subnormals); exp(0) is exactly 1 (vec16.h)
inline v16 exp_neg(v16 x) {
  const v16 y = exp_core_exact(x < splat(-87.f) ? splat(-87.f) : x);
  return x < splat(-87.f) ? splat(0.f) : y;
}

// Weight thresholds of the candidate sets (tokens with e >= THR[l]), largest first; after
// them, the whole vocabulary.
constexpr int LEVELS = 5;
constexpr float THR[LEVELS] = {0x1p-3f, 0x1p-7f, 0x1p-11f, 0x1p-16f, 0x1p-24f};

// Sort key: descending logit, then ascending token id, as one ascending integer.
inline uint64_t key(float s, int64_t i) {
  uint32_t u;
  std::memcpy(&u, &s, sizeof u);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // order-preserving as unsigned
  return (static_cast<uint64_t>(~u) << 32) | static_cast<uint64_t>(i);
}

// Sort keys collected in token order: std::sort for a few, else a stable LSD radix sort on
// the logit half (three passes of 11, 11 and 10 bits), which leaves equal logits in token
// order, as the full key would: the same order either way, ~10x faster for the vocabulary.
void sort_keys(std::vector<uint64_t>& keys, std::vector<uint64_t>& tmp) {
  const size_t n = keys.size();
  if (n < 4096) {
    std::sort(keys.begin(), keys.end());
    return;
  }
  tmp.resize(n);
  uint64_t* a = keys.data();
  uint64_t* b = tmp.data();
  for (int shift = 32; shift < 64; shift += 11) {
    size_t count[2048] = {};
    for (size_t i = 0; i < n; ++i) ++count[(a[i] >> shift) & 2047];
    size_t at = 0;
    for (size_t& c : count) {
      const size_t here = c;
      c = at;
      at += here;
    }
    for (size_t i = 0; i < n; ++i) b[count[(a[i] >> shift) & 2047]++] = a[i];
    std::swap(a, b);
  }
  if (a != keys.data()) std::memcpy(keys.data(), a, n * sizeof(uint64_t));
}

struct Scratch {
  std::vector<float> e;        // [V] the row's weights
  std::vector<uint64_t> keys;  // the candidates' sort keys
  std::vector<uint64_t> tmp;   // the radix sort's second buffer
  std::vector<int64_t> tok;    // the kept tokens, most likely first
  std::vector<float> w;        // their weights
};

struct Filter {
  float t;       // temperature (already clamped to MIN_TEMPERATURE)
  int64_t k;     // top-k, <= 0 or >= V: off
  double top_p;  // 1: off
  float min_p;   // 0: off
};

// The row's kept tokens (sc.tok) and weights (sc.w), most likely first; returns how many.
__attribute__((noinline)) int64_t filter_row(const float* x, int64_t V, const Filter& f,
                                             Scratch& sc) {
  sc.e.resize(V);
  float* e = sc.e.data();
  const float t = f.t;
  int64_t i = 0;
  v16 mx = splat(NEG_INF);
  for (; i + W <= V; i += W) {
    const v16 v = load(x + i);
    mx = v > mx ? v : mx;
  }
  float xmax = NEG_INF;
  for (int l = 0; l < W; ++l) xmax = std::max(xmax, mx[l]);
  for (; i < V; ++i) xmax = std::max(xmax, x[i]);
  const float smax = xmax / t;  // division rounds monotonically: the max of x / t

  v16 z = {};
  v16i cnt[LEVELS] = {};
  v16 mass[LEVELS] = {};
  auto weigh = [&](v16 xv) {
    const v16 ev = exp_neg(xv / splat(t) - splat(smax));
    z += ev;
    for (int l = 0; l < LEVELS; ++l) {
      const v16i in = ev >= splat(THR[l]);
      cnt[l] -= in;
      mass[l] += (v16)((v16i)ev & in);
    }
    return ev;
  };
  for (i = 0; i + W <= V; i += W) store(e + i, weigh(load(x + i)));
  if (i < V) {  // the last partial vector, padded with -inf (weight 0)
    float buf[W];
    std::fill(buf, buf + W, NEG_INF);
    std::memcpy(buf, x + i, (V - i) * sizeof(float));
    store(buf, weigh(load(buf)));
    std::memcpy(e + i, buf, (V - i) * sizeof(float));
  }
  float zsum = 0.f;
  int64_t counts[LEVELS] = {};
  float masses[LEVELS] = {};
  for (int l = 0; l < W; ++l) {
    zsum += z[l];
    for (int j = 0; j < LEVELS; ++j) {
      counts[j] += cnt[j][l];
      masses[j] += mass[j][l];
    }
  }
  const double zv = zsum;
  const int64_t kk = (f.k <= 0 || f.k >= V) ? V : f.k;
  const bool top_p_on = f.top_p < 1.0;

  // the first level whose estimate says it closes the filters
  int level = 0;
  for (; level < LEVELS; ++level)
    if (counts[level] >= kk || (f.min_p > 0.f && THR[level] <= f.min_p) ||
        (top_p_on && masses[level] >= f.top_p * zv * (1.0 + 1e-5)))
      break;

  for (;; ++level) {
    auto& keys = sc.keys;
    keys.clear();
    if (level >= LEVELS) {
      for (int64_t j = 0; j < V; ++j) keys.push_back(key(x[j] / t, j));
    } else {
      const float thr = THR[level];
      for (i = 0; i + W <= V; i += W) {
        const v16i in = load(e + i) >= splat(thr);
        bool any = false;
        for (int l = 0; l < W; ++l) any |= in[l] != 0;
        if (!any) continue;
        for (int l = 0; l < W; ++l)
          if (in[l]) keys.push_back(key(x[i + l] / t, i + l));
      }
      for (; i < V; ++i)
        if (e[i] >= thr) keys.push_back(key(x[i] / t, i));
    }
    sort_keys(keys, sc.tmp);
    const int64_t c = static_cast<int64_t>(keys.size());
    auto id = [&](int64_t j) { return static_cast<int64_t>(keys[j] & 0xffffffffu); };

    // the top-k set's mass, which top-p is relative to
    double zk = zv;
    if (kk < V && c >= kk) {
      float s = 0.f;
      for (int64_t j = 0; j < kk; ++j) s += e[id(j)];
      zk = s;
    } else if (kk < V) {  // the top-k set reaches past the candidates: find its k-th key
      std::vector<uint64_t> all(V);
      for (int64_t j = 0; j < V; ++j) all[j] = key(x[j] / t, j);
      std::nth_element(all.begin(), all.begin() + (kk - 1), all.end());
      const uint64_t kth = all[kk - 1];
      float s = 0.f;
      for (int64_t j = 0; j < V; ++j)
        if (key(x[j] / t, j) <= kth) s += e[j];
      zk = s;
    }

    // top-p over the sorted prefix
    const int64_t span = std::min(c, kk);
    const double reach = f.top_p * zk;
    int64_t kept = 0;
    double cum = 0.0;
    for (; kept < span; ++kept) {
      if (kept > 0 && top_p_on && !(cum < reach)) break;
      cum += e[id(kept)];
    }
    const bool closed = c >= kk || kept < span || (top_p_on && cum >= reach) ||
                        (f.min_p > 0.f && level < LEVELS && THR[level] <= f.min_p);
    if (!closed) continue;

    // min-p (relative to the top token, whose weight is exactly 1), then no zero tail
    if (f.min_p > 0.f)
      while (kept > 1 && !(e[id(kept - 1)] >= f.min_p)) --kept;
    while (kept > 1 && !(e[id(kept - 1)] > 0.f)) --kept;
    sc.tok.resize(kept);
    sc.w.resize(kept);
    for (int64_t j = 0; j < kept; ++j) {
      sc.tok[j] = id(j);
      sc.w[j] = e[id(j)];
    }
    return kept;
  }
}

std::vector<Filter> filters(int64_t m, const std::vector<double>& temperature,
                            const std::vector<int64_t>& top_k, const std::vector<double>& top_p,
                            const std::vector<double>& min_p) {
  TORCH_CHECK(static_cast<int64_t>(temperature.size()) == m &&
              static_cast<int64_t>(top_k.size()) == m &&
              static_cast<int64_t>(top_p.size()) == m &&
              static_cast<int64_t>(min_p.size()) == m, "sampling: one setting per row");
  std::vector<Filter> out(m);
  for (int64_t r = 0; r < m; ++r)
    out[r] = {static_cast<float>(temperature[r]), top_k[r], top_p[r],
              static_cast<float>(min_p[r])};
  return out;
}

void check_logits(const torch::Tensor& x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() &&
              x.device().is_cpu() && x.size(1) > 0 && x.size(1) < (int64_t{1} << 32),
              "sampling: contiguous float32 CPU logits [m, V]");
}

// Every row's filtered tokens and weights (filter_row), a row per thread, handed to
// fn(row, scratch, kept, the kept weights' sum in order).
template <typename Fn>
void each_row(const torch::Tensor& x, const std::vector<Filter>& f, Fn fn) {
  const int64_t V = x.size(1);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch sc;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = filter_row(xp + r * V, V, f[r], sc);
      float total = 0.f;
      for (int64_t j = 0; j < n; ++j) total += sc.w[j];
      fn(r, sc, n, total);
    }
  });
}

// One filtered draw per row: logits [m, V], the row's settings and its uniform number u in
// [0, 1); returns the m tokens (int64).
torch::Tensor sample(torch::Tensor x, std::vector<double> temperature,
                     std::vector<int64_t> top_k, std::vector<double> top_p,
                     std::vector<double> min_p, std::vector<double> u) {
  check_logits(x);
  const int64_t m = x.size(0);
  const auto f = filters(m, temperature, top_k, top_p, min_p);
  TORCH_CHECK(static_cast<int64_t>(u.size()) == m, "sampling: one uniform number per row");
  auto out = torch::empty({m}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  each_row(x, f, [&](int64_t r, const Scratch& sc, int64_t n, float total) {
    const float target = static_cast<float>(u[r]) * total;
    int64_t pick = n - 1;
    float cdf = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      cdf += sc.w[j];
      if (cdf > target) { pick = j; break; }
    }
    o[r] = sc.tok[pick];
  });
  return out;
}

// The distribution each row is drawn from: [m, V] float32, the kept weights / their sum.
torch::Tensor filtered_probs(torch::Tensor x, std::vector<double> temperature,
                             std::vector<int64_t> top_k, std::vector<double> top_p,
                             std::vector<double> min_p) {
  check_logits(x);
  const int64_t m = x.size(0), V = x.size(1);
  const auto f = filters(m, temperature, top_k, top_p, min_p);
  auto out = torch::zeros({m, V}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  each_row(x, f, [&](int64_t r, const Scratch& sc, int64_t n, float total) {
    for (int64_t j = 0; j < n; ++j) o[r * V + sc.tok[j]] = sc.w[j] / total;
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample", &sample, "one filtered draw per logit row");
  m.def("filtered_probs", &filtered_probs, "the filtered distribution of each logit row");
}
