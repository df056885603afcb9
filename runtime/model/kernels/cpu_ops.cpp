// pie-ctx CPU kernels: attention of a few queries per sequence straight over the paged
// KV pool, and the small per-row ops of a decode step fused into one pass each.
//
// Built at first use by runtime/model/kernels/__init__.py (torch.utils.cpp_extension,
// -O3 -march=native on the machine that runs it); every op has an eager PyTorch twin in
// that module, which is the fallback and the oracle of tests/model/test_kernels.py.
//
// Vectors: GCC vector extensions of 16 floats (one AVX-512 register, two AVX2 ones), so
// the same source compiles to whatever the CPU has. Head dims must be multiples of 16.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace {

constexpr int BLOCK = 16;      // keys scored together before one softmax update
constexpr int64_t SPLIT_KEYS = 256;  // keys of one split: longer contexts are cut
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline v16 shuffle(v16 a, v16 b, v16i m) { return __builtin_shuffle(a, b, m); }

inline float hsum(v16 v) {
  v = v + shuffle(v, v, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v = v + shuffle(v, v, v16i{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v = v + shuffle(v, v, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v = v + shuffle(v, v, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

inline float hmax(v16 v) {
  auto mx = [](v16 a, v16 b) { return a > b ? a : b; };
  v = mx(v, shuffle(v, v, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = mx(v, shuffle(v, v, v16i{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  v = mx(v, shuffle(v, v, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  v = mx(v, shuffle(v, v, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return v[0];
}

// The sums of 16 vectors, lane k = sum of x[k], by a butterfly of shuffles (30 shuffles and
// 15 adds, against 16 separate horizontal sums). x is clobbered.
inline v16 sum16(v16* x) {
  for (int i = 0; i < 8; ++i)
    x[i] = shuffle(x[2 * i], x[2 * i + 1],
                   v16i{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           shuffle(x[2 * i], x[2 * i + 1],
                   v16i{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int i = 0; i < 4; ++i)
    x[i] = shuffle(x[2 * i], x[2 * i + 1],
                   v16i{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
           shuffle(x[2 * i], x[2 * i + 1],
                   v16i{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  for (int i = 0; i < 2; ++i)
    x[i] = shuffle(x[2 * i], x[2 * i + 1],
                   v16i{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
           shuffle(x[2 * i], x[2 * i + 1],
                   v16i{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  return shuffle(x[0], x[1], v16i{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         shuffle(x[0], x[1], v16i{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

const v16 LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// exp(x) for x <= 0 (softmax after subtracting the max), every multiply-add fused as in
// the paged kernel's other arithmetic; below -87 it gives exp(-87) ~ 1.6e-38 (the kernel
// zeroes the weights of masked keys itself)
inline v16 exp_neg(v16 x) { return exp_core_fused(x < splat(-87.f) ? splat(-87.f) : x); }

// Ask for every cache line of [p, p + bytes) (a hint: nothing waits for it). LOCALITY:
// __builtin_prefetch's, 3 (prefetcht0, every cache) to 1 (prefetcht2, the outer ones).
template <int LOCALITY>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + bytes - 1;
  for (uintptr_t a = first; a <= last; a += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, LOCALITY);
}

// The online-softmax state of one query head: running max, running sum.
struct Partial {
  float m;
  float l;
};

}  // namespace

// KV entries of a bf16 pool, widened to fp32 (exact: the bf16 bits are the top half).
inline v16 load_kv(const float* p) { return load(p); }
inline v16 load_kv(const at::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512i w = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  v16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
#else
  uint16_t h[W];
  std::memcpy(h, p, sizeof h);
  v16i bits;
  for (int i = 0; i < W; ++i) bits[i] = static_cast<int32_t>(h[i]) << 16;
  v16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}

// KV entries of an int8 pool (kv_dtype "int8", runtime/kv/layout.py): head_dim int8
// values, then the entry's fp32 scale in 4 bytes. Values widen exactly; the scale is
// applied to each key's dot product and folded into each value's softmax weight.
constexpr int64_t SCALE_BYTES = 4;
inline v16 load_kv(const int8_t* p) {  // (GCC's __builtin_convertvector scalarizes this)
  v16 v;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
#else
  for (int i = 0; i < W; ++i) v[i] = static_cast<float>(p[i]);
#endif
  return v;
}
inline float entry_scale(const int8_t* entry, int64_t d) {
  float s;
  std::memcpy(&s, entry + d, sizeof s);
  return s;
}

namespace {

// ---- the paged attention kernel ------------------------------------------------------
//
// Work: a task is the new tokens of one sequence (or the forks sharing one full split) over
// one split of its keys; a unit is a task over a range of KV heads. Per block of BLOCK keys
// and per KV head, the query heads (the task's rows x the G heads of the KV head) are taken
// QMAX at a time: each key's K (and V) vector is loaded and widened once for all of them, and
// their dot products and weighted sums are fused multiply-adds into registers. A query
// head's arithmetic is the same whatever it is grouped with (its own chain of FMAs over its
// own keys, in key order), so grouping, threads and batches never change its bits.

constexpr int QMAX = 4;           // query heads sharing each K/V load
constexpr int64_t PREFETCH = 32;  // keys asked for ahead of the block being read
#if defined(__AVX512F__)
constexpr int CMAX = 4;  // vectors of a value row held per pass (4 x 4 accumulators)
#else
constexpr int CMAX = 2;  // 16 ymm registers: fewer accumulators
#endif

// x in every lane. (splat adds x to +0: a -0 becomes +0. Neither a query nor a softmax
// weight meets that case in a sum here, so bcast is splat's bits without the add.)
inline v16 bcast(float x) {
  const v16 r = {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
  return r;
}

// The per-lane products of QN query heads with each of the block's kb keys, summed over
// the head dim's nv vectors (one FMA chain per key): dots[a][k].
template <typename T, int QN>
inline void qk_block(const float* const* q, const T* const* kp, int64_t kb, int64_t nv,
                     v16 (*dots)[BLOCK]) {
  if (nv == 4) {  // head dim 64: the QN queries' 4 vectors each stay in registers
    v16 qv[QN][4];
    for (int a = 0; a < QN; ++a)
      for (int c = 0; c < 4; ++c) qv[a][c] = load(q[a] + c * W);
    for (int64_t k = 0; k < kb; ++k) {
      v16 d[QN];
      for (int a = 0; a < QN; ++a) d[a] = v16{};
      for (int c = 0; c < 4; ++c) {  // the same FMA chain as below: the same bits
        const v16 kv = load_kv(kp[k] + c * W);
        for (int a = 0; a < QN; ++a) d[a] = fmadd(qv[a][c], kv, d[a]);
      }
      for (int a = 0; a < QN; ++a) dots[a][k] = d[a];
    }
    return;
  }
  for (int64_t k = 0; k < kb; ++k) {
    v16 d[QN];
    for (int a = 0; a < QN; ++a) d[a] = v16{};
    for (int64_t c = 0; c < nv; ++c) {
      const v16 kv = load_kv(kp[k] + c * W);
      for (int a = 0; a < QN; ++a) d[a] = fmadd(load(q[a] + c * W), kv, d[a]);
    }
    for (int a = 0; a < QN; ++a) dots[a][k] = d[a];
  }
}

// acc[a][c0 .. c0 + CN) += w[a][k] * V[k][c0 .. c0 + CN) for the block's kb keys, in key
// order, the accumulators in registers.
template <typename T, int QN, int CN>
inline void v_block(const T* const* vp, int64_t c0, int64_t kb, const float* w, v16* acc,
                    int64_t nv) {
  v16 ac[QN][CN];
  for (int a = 0; a < QN; ++a)
    for (int c = 0; c < CN; ++c) ac[a][c] = acc[a * nv + c0 + c];
  for (int64_t k = 0; k < kb; ++k) {
    v16 v[CN];
    for (int c = 0; c < CN; ++c) v[c] = load_kv(vp[k] + (c0 + c) * W);
    for (int a = 0; a < QN; ++a) {
      const v16 wk = bcast(w[a * BLOCK + k]);
      for (int c = 0; c < CN; ++c) ac[a][c] = fmadd(v[c], wk, ac[a][c]);
    }
  }
  for (int a = 0; a < QN; ++a)
    for (int c = 0; c < CN; ++c) acc[a * nv + c0 + c] = ac[a][c];
}

template <typename T, int QN>
inline void v_block_cn(int cn, const T* const* vp, int64_t c0, int64_t kb, const float* w,
                       v16* acc, int64_t nv) {
  if (cn == CMAX) return v_block<T, QN, CMAX>(vp, c0, kb, w, acc, nv);
  if (cn == 2) return v_block<T, QN, 2>(vp, c0, kb, w, acc, nv);
  return v_block<T, QN, 1>(vp, c0, kb, w, acc, nv);
}

// r[i] lane j <- r[j] lane i: a 16 x 16 transpose in four butterfly stages, each swapping
// the off-diagonal h x h blocks of every 2h x 2h block with two-vector shuffles.
template <int H>
inline void transpose_stage(v16* r, v16i lo, v16i hi) {
  for (int i = 0; i < W; ++i)
    if ((i & H) == 0) {
      const v16 a = r[i], b = r[i + H];
      r[i] = shuffle(a, b, lo);
      r[i + H] = shuffle(a, b, hi);
    }
}
inline void transpose16(v16* r) {
  transpose_stage<8>(r, v16i{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                     v16i{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  transpose_stage<4>(r, v16i{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                     v16i{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  transpose_stage<2>(r, v16i{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                     v16i{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  transpose_stage<1>(r, v16i{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
                     v16i{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
}

// The K vectors of a block's kb keys (kp[k]: key k's, any pool element), widened to fp32
// and transposed for qk_tree: kt[d * BLOCK + k] = K[k][d], keys past kb zero.
template <typename T>
inline void widen_transposed(const T* const* kp, int64_t kb, int64_t nv, float* kt) {
  for (int64_t cc = 0; cc < nv; ++cc) {
    v16 r[W];
    for (int64_t k = 0; k < W; ++k) r[k] = k < kb ? load_kv(kp[k] + cc * W) : v16{};
    transpose16(r);
    for (int l = 0; l < W; ++l) store(kt + (cc * W + l) * BLOCK, r[l]);
  }
}

// qk_block then sum16 for QN query heads, from the block's 16 keys held transposed
// (kt[d * BLOCK + k] = K[k][d], widened to fp32; missing keys zero): out[a] lane k is key
// k's score. Lane l of qk_block's dot vector is the chain of FMAs over the head dim's nv
// vectors of the elements d = l (mod 16), and sum16 adds lanes (l, l + 8), then those sums
// (l, l + 4), (l, l + 2), (l, l + 1). Here each lane's chain runs with the keys in lanes
// (query element broadcast, K's column loaded) and the tree is vertical adds: the same
// roundings in the same order, the same bits, with no shuffles and no spilled dots.
template <int QN>
struct Heads {
  v16 v[QN];
};

// A_j = d_j + d_{j+8} for QN query heads, the two chains interleaved. NV: the head dim's
// vectors, or 0 (then nv, at run time).
template <int QN, int NV>
__attribute__((always_inline)) inline Heads<QN> qk_pair(const float* const* q, const float* kt,
                                                        int j, int64_t nv) {
  const int64_t n = NV > 0 ? NV : nv;
  Heads<QN> x, y;
  for (int a = 0; a < QN; ++a) x.v[a] = y.v[a] = v16{};
  for (int64_t c = 0; c < n; ++c) {
    const v16 kx = load(kt + (c * W + j) * BLOCK);
    const v16 ky = load(kt + (c * W + j + 8) * BLOCK);
    for (int a = 0; a < QN; ++a) {
      x.v[a] = fmadd(bcast(q[a][c * W + j]), kx, x.v[a]);
      y.v[a] = fmadd(bcast(q[a][c * W + j + 8]), ky, y.v[a]);
    }
  }
  for (int a = 0; a < QN; ++a) x.v[a] = x.v[a] + y.v[a];
  return x;
}

template <int QN>
__attribute__((always_inline)) inline Heads<QN> add(const Heads<QN>& x, const Heads<QN>& y) {
  Heads<QN> r;
  for (int a = 0; a < QN; ++a) r.v[a] = x.v[a] + y.v[a];
  return r;
}

// C_h = (A_h + A_{h+4}) + (A_{h+2} + A_{h+6}); the scores are C_0 + C_1
template <int QN, int NV>
__attribute__((always_inline)) inline Heads<QN> qk_half(const float* const* q, const float* kt,
                                                        int h, int64_t nv) {
  const Heads<QN> b0 = add(qk_pair<QN, NV>(q, kt, h, nv), qk_pair<QN, NV>(q, kt, h + 4, nv));
  return add(b0, add(qk_pair<QN, NV>(q, kt, h + 2, nv), qk_pair<QN, NV>(q, kt, h + 6, nv)));
}

template <int QN, int NV>
void qk_tree_n(const float* const* qh, const float* kt, int64_t nv, v16* out) {
  const float* q[QN];
  for (int a = 0; a < QN; ++a) q[a] = qh[a];
  const Heads<QN> r = add(qk_half<QN, NV>(q, kt, 0, nv), qk_half<QN, NV>(q, kt, 1, nv));
  for (int a = 0; a < QN; ++a) out[a] = r.v[a];
}

template <int QN>
inline void qk_tree(const float* const* q, const float* kt, int64_t nv, v16* out) {
  if (nv == 4) return qk_tree_n<QN, 4>(q, kt, nv, out);    // head dim 64
  if (nv == 8) return qk_tree_n<QN, 8>(q, kt, nv, out);    // head dim 128
  qk_tree_n<QN, 0>(q, kt, nv, out);
}

// One unit of attention work: the new tokens of one sequence (or the forks sharing a split)
// over one split of its keys, for the KV heads [g0, g1).
struct Task {
  const int32_t* table;
  int64_t lo, hi;        // keys [lo, hi), within one split
  int64_t first, count;  // its rows: task_rows[first .. first + count)
};

// What every unit of one call reads.
template <typename KV>
struct Paged {
  const KV* base;
  int64_t S, page_stride, slot_stride, kv_off, v_off, head_stride, width;
  int64_t D, nv, G, H, max_splits, cn;
  const float* qp;
  int64_t q_row, q_head;
  float scale;
  const int64_t* task_rows;
  const int64_t* row_limit;  // the last key each row sees
  const int64_t* row_splits;
  float* out;                // [T, H * D]
  float* part_ml;            // per (row, head, split): m and l
  float* part_acc;           // per (row, head, split): D outputs
  // attention scores (paged_attention_scored; scores == nullptr: none asked): the scaled
  // logits of query row r, head h, key k at scores[(score_slot[r] * H + h) * score_len + k]
  // for the rows with a slot (>= 0)
  const int64_t* score_slot = nullptr;
  float* scores = nullptr;
  int64_t score_len = 0;
};

// A thread's buffers, reused from call to call.
struct Scratch {
  std::vector<v16> acc;
  std::vector<Partial> st;
  std::vector<float> w, kf, vf;
  std::vector<float> ks, vs;  // attend_rows on an int8 pool: each key's K and V scale
  std::vector<const float*> qs;  // each query head's query (see heads_of)
  std::vector<int64_t> lim;      // each query head's last key
  std::vector<float*> sd;        // each query head's row of scores, or nullptr
};

// Query heads [ab, ae) of KV head g in a task (row j, head i -> a = j * G + i): each one's
// query, qs[a - ab], the last key it sees, lim[a - ab], and where its scores go, sd[a - ab]
// (nullptr: not asked): worked out once for all the blocks a unit runs them over.
template <typename KV>
void heads_of(const Paged<KV>& c, const Task& task, int64_t g, int64_t ab, int64_t ae,
              const float** qs, int64_t* lim, float** sd) {
  const int64_t* rows = c.task_rows + task.first;
  for (int64_t a = ab; a < ae; ++a) {
    const int64_t row = rows[a / c.G], h = g * c.G + a % c.G;
    qs[a - ab] = c.qp + row * c.q_row + h * c.q_head;
    lim[a - ab] = c.row_limit[row];
    const int64_t slot = c.scores != nullptr ? c.score_slot[row] : -1;
    sd[a - ab] = slot >= 0 ? c.scores + (slot * c.H + h) * c.score_len : nullptr;
  }
}

// The scores, softmax update and weighted values of one KV head over one block, for na
// query heads (heads_of's qs, lim and sd; all nqt of a unit of whole tasks). kp, vp: each
// key's K and V; kt: the block's K transposed (qk_tree; kp then unused), or nullptr. acc,
// st, w: query head a's at a. A head with a row of scores gets the block's scaled logits
// there (keys it does not see: -inf), as the softmax reads them.
template <typename KV, typename T>
void head_block(const Paged<KV>& c, const float* const* qh, const int64_t* lim,
                float* const* sd, const T* const* kp, const T* const* vp, int64_t k0,
                int64_t kb, v16 k_scale, v16 v_scale, v16* acc, Partial* st, float* w,
                int64_t na, const float* kt = nullptr) {
  constexpr bool QUANT = std::is_same<KV, int8_t>::value;
  const int64_t nv = c.nv;
  bool live[64];  // chunk a0 / QMAX sees a key of this block (64 chunks; more: always)
  for (int64_t a0 = 0; a0 < na; a0 += QMAX) {
    const int an = static_cast<int>(std::min<int64_t>(QMAX, na - a0));
    bool any = false;
    for (int a = 0; a < an; ++a) any |= lim[a0 + a] >= k0;
    if (a0 / QMAX < 64) live[a0 / QMAX] = any;
    if (!any) {
      for (int a = 0; a < an; ++a) store(w + (a0 + a) * BLOCK, v16{});
      continue;
    }
    const float* const* qs = qh + a0;
    v16 dots[QMAX][BLOCK];
    v16 tree[QMAX];
    if (kt != nullptr) {
      switch (an) {
        case 1: qk_tree<1>(qs, kt, nv, tree); break;
        case 2: qk_tree<2>(qs, kt, nv, tree); break;
        case 3: qk_tree<3>(qs, kt, nv, tree); break;
        default: qk_tree<4>(qs, kt, nv, tree); break;
      }
    } else {
      switch (an) {
        case 1: qk_block<T, 1>(qs, kp, kb, nv, dots); break;
        case 2: qk_block<T, 2>(qs, kp, kb, nv, dots); break;
        case 3: qk_block<T, 3>(qs, kp, kb, nv, dots); break;
        default: qk_block<T, 4>(qs, kp, kb, nv, dots); break;
      }
    }
    for (int a = 0; a < an; ++a) {
      const int64_t qa = a0 + a;
      float* wa = w + qa * BLOCK;
      const int64_t limit = lim[qa];
      if (limit < k0) {  // every key of this block is in its future
        store(wa, v16{});
        continue;
      }
      v16 raw;  // the block's dot products, lane k = key k0 + k
      if (kt != nullptr) {
        raw = tree[a];
      } else {
        for (int64_t k = kb; k < BLOCK; ++k) dots[a][k] = v16{};
        raw = sum16(dots[a]);
      }
      // keys after the query (causal) or past the block are out: -inf
      const v16 visible = splat(static_cast<float>(std::min<int64_t>(limit - k0, kb - 1)));
      const auto out = LANE > visible;
      v16 sc;
      if constexpr (QUANT)
        sc = out ? splat(NEG_INF) : raw * k_scale * c.scale;
      else
        sc = out ? splat(NEG_INF) : raw * c.scale;
      if (sd[qa] != nullptr) {
        float lane[BLOCK];
        store(lane, sc);
        std::memcpy(sd[qa] + k0, lane, kb * sizeof(float));
      }
      const float bm = hmax(sc);
      if (bm == NEG_INF) {
        store(wa, v16{});
        continue;
      }
      Partial& p = st[qa];
      const float m = std::max(p.m, bm);
      v16 wv = out ? v16{} : exp_neg(sc - m);
      if (p.m != NEG_INF && p.m != m) {
        const float alpha = std::exp(p.m - m);
        p.l *= alpha;
        for (int64_t cc = 0; cc < nv; ++cc) acc[qa * nv + cc] *= alpha;
      }
      p.l += hsum(wv);
      p.m = m;
      if constexpr (QUANT) wv = wv * v_scale;  // each value's scale, in its weight
      store(wa, wv);
    }
  }
  // weighted values: CMAX vectors of QMAX heads' outputs in registers per pass
  for (int64_t c0 = 0; c0 < nv; c0 += c.cn) {
    for (int64_t a0 = 0; a0 < na; a0 += QMAX) {
      if (a0 / QMAX < 64 && !live[a0 / QMAX]) continue;
      const int an = static_cast<int>(std::min<int64_t>(QMAX, na - a0));
      const float* wa = w + a0 * BLOCK;
      v16* aa = acc + a0 * nv;
      const int cn = static_cast<int>(c.cn);
      switch (an) {
        case 1: v_block_cn<T, 1>(cn, vp, c0, kb, wa, aa, nv); break;
        case 2: v_block_cn<T, 2>(cn, vp, c0, kb, wa, aa, nv); break;
        case 3: v_block_cn<T, 3>(cn, vp, c0, kb, wa, aa, nv); break;
        default: v_block_cn<T, 4>(cn, vp, c0, kb, wa, aa, nv); break;
      }
    }
  }
}

template <typename KV>
void attend_unit(const Paged<KV>& c, const Task& task, int64_t g0, int64_t g1, Scratch& s) {
  constexpr bool QUANT = std::is_same<KV, int8_t>::value;
  const int64_t G = c.G, nv = c.nv, D = c.D, S = c.S;
  const int64_t nqt = task.count * G, heads = g1 - g0;
  const int64_t* rows = c.task_rows + task.first;
  s.acc.assign(heads * nqt * nv, v16{});
  s.st.assign(heads * nqt, Partial{NEG_INF, 0.f});
  s.w.resize(nqt * BLOCK);
  s.qs.resize(heads * nqt);
  s.lim.resize(nqt);
  s.sd.resize(heads * nqt);
  for (int64_t g = g0; g < g1; ++g)
    heads_of(c, task, g, 0, nqt, s.qs.data() + (g - g0) * nqt, s.lim.data(),
             s.sd.data() + (g - g0) * nqt);
  // several chunks of query heads read each key: K transposed once (qk_tree), and the
  // values of a pool that is not fp32 widened once, into fp32
  const bool transposed = nqt > QMAX;
  const bool widen = !std::is_same<KV, float>::value && transposed;
  if (transposed) s.kf.resize(BLOCK * D);
  if (widen) s.vf.resize(BLOCK * D);
  const int64_t lo = task.lo, hi = task.hi;
  const int32_t* table = task.table;
  auto entry_at = [&](int64_t idx) {  // this layer's K of head 0 for key idx
    return c.base + table[idx / S] * c.page_stride + (idx % S) * c.slot_stride + c.kv_off;
  };
  // the lines of every head [g0, g1) of one key, K and V
  const bool packed = c.head_stride == c.width;
  auto prefetch_key = [&](const KV* e) {
    if (packed) {
      prefetch_bytes<3>(e + g0 * c.head_stride, heads * c.width * sizeof(KV));
      prefetch_bytes<3>(e + c.v_off + g0 * c.head_stride, heads * c.width * sizeof(KV));
    } else {
      for (int64_t g = g0; g < g1; ++g) {
        prefetch_bytes<3>(e + g * c.head_stride, c.width * sizeof(KV));
        prefetch_bytes<3>(e + c.v_off + g * c.head_stride, c.width * sizeof(KV));
      }
    }
  };
  // Keys of one layer sit far apart (the pool is page-major, all layers of a slot
  // together): ask for the ones PREFETCH keys ahead, so the loads overlap.
  for (int64_t idx = lo; idx < std::min(hi, lo + PREFETCH); ++idx) prefetch_key(entry_at(idx));
  for (int64_t k0 = lo; k0 < hi; k0 += BLOCK) {
    const int64_t kb = std::min<int64_t>(BLOCK, hi - k0);
    const KV* entry[BLOCK];
    {
      int64_t page = k0 / S, slot = k0 % S;
      for (int64_t k = 0; k < kb; ++k) {
        entry[k] = c.base + table[page] * c.page_stride + slot * c.slot_stride + c.kv_off;
        if (++slot == S) slot = 0, ++page;
      }
    }
    {
      const int64_t p0 = k0 + PREFETCH, p1 = std::min(hi, k0 + PREFETCH + BLOCK);
      if (p0 < p1) {
        int64_t page = p0 / S, slot = p0 % S;
        for (int64_t idx = p0; idx < p1; ++idx) {
          prefetch_key(c.base + table[page] * c.page_stride + slot * c.slot_stride + c.kv_off);
          if (++slot == S) slot = 0, ++page;
        }
      }
    }
    for (int64_t g = g0; g < g1; ++g) {
      const KV* kp[BLOCK];
      const KV* vp[BLOCK];
      for (int64_t k = 0; k < kb; ++k) {
        kp[k] = entry[k] + g * c.head_stride;
        vp[k] = kp[k] + c.v_off;
      }
      v16 k_scale{}, v_scale{};  // int8: each key's and value's scale (lane k = key k0 + k)
      if constexpr (QUANT) {
        for (int64_t k = 0; k < kb; ++k) {
          k_scale[k] = entry_scale(kp[k], D);
          v_scale[k] = entry_scale(vp[k], D);
        }
      }
      v16* acc = s.acc.data() + (g - g0) * nqt * nv;
      Partial* st = s.st.data() + (g - g0) * nqt;
      const float* const* qs = s.qs.data() + (g - g0) * nqt;
      float* const* sd = s.sd.data() + (g - g0) * nqt;
      const float* kt = nullptr;  // the block's K transposed, or read through kp
      if (transposed) {
        widen_transposed(kp, kb, nv, s.kf.data());
        kt = s.kf.data();
      }
      if (widen) {
        const float* vf[BLOCK];
        for (int64_t k = 0; k < kb; ++k) {
          float* vd = s.vf.data() + k * D;
          for (int64_t cc = 0; cc < nv; ++cc) store(vd + cc * W, load_kv(vp[k] + cc * W));
          vf[k] = vd;
        }
        head_block<KV, float>(c, qs, s.lim.data(), sd, nullptr, vf, k0, kb, k_scale, v_scale,
                              acc, st, s.w.data(), nqt, kt);
      } else {
        head_block<KV, KV>(c, qs, s.lim.data(), sd, kp, vp, k0, kb, k_scale, v_scale, acc,
                           st, s.w.data(), nqt, kt);
      }
    }
  }
  // write out: the final result of a row with one split, else this split's partial
  const int64_t split = lo / SPLIT_KEYS, H = c.H;
  for (int64_t g = g0; g < g1; ++g) {
    const v16* acc = s.acc.data() + (g - g0) * nqt * nv;
    const Partial* st = s.st.data() + (g - g0) * nqt;
    for (int64_t j = 0; j < task.count; ++j) {
      const int64_t row = rows[j];
      for (int64_t i = 0; i < G; ++i) {
        const int64_t a = j * G + i, h = g * G + i;
        const Partial& p = st[a];
        if (c.row_splits[row] == 1) {
          const float inv = p.l > 0.f ? 1.f / p.l : 0.f;
          float* o = c.out + row * H * D + h * D;
          for (int64_t cc = 0; cc < nv; ++cc) store(o + cc * W, acc[a * nv + cc] * inv);
        } else {
          const int64_t slot = (row * H + h) * c.max_splits + split;
          c.part_ml[slot * 2] = p.m;
          c.part_ml[slot * 2 + 1] = p.l;
          float* o = c.part_acc + slot * D;
          for (int64_t cc = 0; cc < nv; ++cc) store(o + cc * W, acc[a * nv + cc]);
        }
      }
    }
  }
}

// A task of many query heads (a prefill chunk's rows over one split), query heads [ab, ae)
// of KV head g: the split's K (transposed per block, for qk_tree) and V of that head
// widened once into fp32 (exact), then ROWS_GROUP query heads at a time run over every
// block of the split, their accumulators and states staying in L1 (attend_unit would sweep
// all the task's query heads, megabytes of them, once per 16-key block). Blocks past the
// last key any of them sees are left out: every row would skip them. Each query head meets
// the same blocks in the same order, with the same arithmetic, as in attend_unit: the same
// bits. (qk_tree in place of qk_block and sum16 made a 512-row chunk over 8,192 keys 1.3x
// faster: sum16's shuffles and the spilled dots were paid per head and block.)
constexpr int64_t ROWS_HEADS = 64;  // query heads of a task from which attend_rows runs it
constexpr int64_t ROWS_PART = 192;  // query heads of one attend_rows unit
constexpr int64_t ROWS_GROUP = 32;  // query heads run together over a split's blocks
template <typename KV>
void attend_rows(const Paged<KV>& c, const Task& task, int64_t g, int64_t ab, int64_t ae,
                 Scratch& s) {
  constexpr bool QUANT = std::is_same<KV, int8_t>::value;
  const int64_t G = c.G, nv = c.nv, D = c.D, S = c.S, H = c.H;
  const int64_t lo = task.lo, hi = task.hi;
  const int64_t* rows = c.task_rows + task.first;
  int64_t last = lo - 1;
  for (int64_t a = ab; a < ae; ++a) last = std::max(last, c.row_limit[rows[a / G]]);
  const int64_t end = std::min(hi, last + 1);  // keys [lo, end) are seen by some row
  const int64_t n = std::max<int64_t>(0, end - lo);
  const int64_t blocks = std::max<int64_t>(1, (n + BLOCK - 1) / BLOCK);
  s.kf.resize(blocks * D * BLOCK);  // K transposed per block (qk_tree), zero-padded
  s.vf.resize(std::max<int64_t>(1, n) * D);
  if constexpr (QUANT) {
    s.ks.resize(std::max<int64_t>(1, n));
    s.vs.resize(std::max<int64_t>(1, n));
  }
  auto entry_at = [&](int64_t idx) {  // K of head g for key idx
    return c.base + task.table[idx / S] * c.page_stride + (idx % S) * c.slot_stride +
           c.kv_off + g * c.head_stride;
  };
  for (int64_t idx = lo; idx < std::min(end, lo + PREFETCH); ++idx) {
    prefetch_bytes<3>(entry_at(idx), c.width * sizeof(KV));
    prefetch_bytes<3>(entry_at(idx) + c.v_off, c.width * sizeof(KV));
  }
  for (int64_t b0 = lo; b0 < end; b0 += BLOCK) {
    const int64_t bn = std::min<int64_t>(BLOCK, end - b0);
    const KV* kp[BLOCK];
    for (int64_t k = 0; k < bn; ++k) {
      const int64_t idx = b0 + k;
      if (idx + PREFETCH < end) {
        prefetch_bytes<3>(entry_at(idx + PREFETCH), c.width * sizeof(KV));
        prefetch_bytes<3>(entry_at(idx + PREFETCH) + c.v_off, c.width * sizeof(KV));
      }
      kp[k] = entry_at(idx);
      const KV* vp = kp[k] + c.v_off;
      float* vd = s.vf.data() + (idx - lo) * D;
      for (int64_t cc = 0; cc < nv; ++cc) store(vd + cc * W, load_kv(vp + cc * W));
      if constexpr (QUANT) {
        s.ks[idx - lo] = entry_scale(kp[k], D);
        s.vs[idx - lo] = entry_scale(vp, D);
      }
    }
    widen_transposed(kp, bn, nv, s.kf.data() + (b0 - lo) * D);
  }
  const int64_t split = lo / SPLIT_KEYS;
  for (int64_t gb = ab; gb < ae; gb += ROWS_GROUP) {
    const int64_t ge = std::min(ae, gb + ROWS_GROUP), na = ge - gb;
    s.acc.assign(na * nv, v16{});
    s.st.assign(na, Partial{NEG_INF, 0.f});
    s.w.resize(na * BLOCK);
    s.qs.resize(na);
    s.lim.resize(na);
    s.sd.resize(na);
    heads_of(c, task, g, gb, ge, s.qs.data(), s.lim.data(), s.sd.data());
    int64_t group_end = lo;  // the keys this group sees
    for (int64_t a = 0; a < na; ++a) group_end = std::max(group_end, std::min(hi, s.lim[a] + 1));
    for (int64_t k0 = lo; k0 < group_end; k0 += BLOCK) {
      const int64_t kb = std::min<int64_t>(BLOCK, hi - k0);  // as attend_unit cuts them
      const float* vf[BLOCK];
      v16 k_scale{}, v_scale{};
      for (int64_t k = 0; k < kb; ++k) {
        // keys past `end` are seen by no row of this unit: any finite stand-in will do
        const int64_t at = std::min(k0 + k, end - 1) - lo;
        vf[k] = s.vf.data() + at * D;
        if constexpr (QUANT) {
          k_scale[k] = s.ks[at];
          v_scale[k] = s.vs[at];
        }
      }
      head_block<KV, float>(c, s.qs.data(), s.lim.data(), s.sd.data(), nullptr, vf, k0, kb,
                            k_scale, v_scale, s.acc.data(), s.st.data(), s.w.data(), na,
                            s.kf.data() + (k0 - lo) / BLOCK * D * BLOCK);
    }
    for (int64_t a = gb; a < ge; ++a) {  // write out, as attend_unit does
      const int64_t row = rows[a / G], h = g * G + a % G;
      const Partial& p = s.st[a - gb];
      const v16* acc = s.acc.data() + (a - gb) * nv;
      if (c.row_splits[row] == 1) {
        const float inv = p.l > 0.f ? 1.f / p.l : 0.f;
        float* o = c.out + row * H * D + h * D;
        for (int64_t cc = 0; cc < nv; ++cc) store(o + cc * W, acc[cc] * inv);
      } else {
        const int64_t slot = (row * H + h) * c.max_splits + split;
        c.part_ml[slot * 2] = p.m;
        c.part_ml[slot * 2 + 1] = p.l;
        float* o = c.part_acc + slot * D;
        for (int64_t cc = 0; cc < nv; ++cc) store(o + cc * W, acc[cc]);
      }
    }
  }
}

// Units to threads: each unit costs the (query head, key) pairs it scores, the keys
// after a row's position (causal) left out; the longest first, each to the least loaded
// thread. A unit is a task over KV heads [g0, g1) (attend_unit), or, for a task of more
// than ROWS_HEADS query heads (prefill chunks), the query heads [a0, a1) of one KV head
// (attend_rows), ROWS_PART of them a unit so the threads share a split's rows. Returns the
// busiest thread's cost.
struct Unit {
  int64_t task, g0, g1, a0, a1, cost;  // a1 > 0: attend_rows over query heads [a0, a1)
};
inline int64_t plan_units(const std::vector<Task>& tasks, int64_t KVH, int64_t G,
                          int64_t per_unit, int64_t threads, const int64_t* task_rows,
                          const int64_t* row_limit, std::vector<Unit>& units,
                          std::vector<int64_t>& owner) {
  units.clear();
  for (size_t t = 0; t < tasks.size(); ++t) {
    const Task& k = tasks[t];
    auto live = [&](int64_t j) {  // keys of the task that its row j sees
      return std::max<int64_t>(0, std::min(k.hi, row_limit[task_rows[k.first + j]] + 1) - k.lo);
    };
    const int64_t nqt = k.count * G;
    if (nqt > ROWS_HEADS) {
      for (int64_t g = 0; g < KVH; ++g)
        for (int64_t a0 = 0; a0 < nqt; a0 += ROWS_PART) {
          const int64_t a1 = std::min(nqt, a0 + ROWS_PART);
          int64_t cost = 1;
          for (int64_t a = a0; a < a1; ++a) cost += live(a / G);
          units.push_back({static_cast<int64_t>(t), g, g + 1, a0, a1, cost});
        }
      continue;
    }
    int64_t pairs = 0;
    for (int64_t j = 0; j < k.count; ++j) pairs += live(j);
    for (int64_t g = 0; g < KVH; g += per_unit)
      units.push_back({static_cast<int64_t>(t), g, std::min(KVH, g + per_unit), 0, 0,
                       pairs * (std::min(KVH, g + per_unit) - g)});
  }
  std::vector<int64_t> order(units.size()), load(threads, 0);
  for (size_t u = 0; u < units.size(); ++u) order[u] = static_cast<int64_t>(u);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return units[a].cost > units[b].cost; });
  owner.assign(units.size(), 0);
  for (int64_t u : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    owner[u] = t;
    load[t] += units[u].cost;
  }
  return *std::max_element(load.begin(), load.end());
}

}  // namespace

// Attention of each new token over its own sequence's KV entries, read in place from the
// pool, causal. Keys are cut into splits of SPLIT_KEYS at fixed positions (0, SPLIT_KEYS,
// ...) whatever else is in the batch, and a row's splits are merged by their log-sum-exp:
// so a row's result does not depend on its batch (nor on the threads).
//
// Args:
//   q: [T, H, D] float32 queries (rows of one sequence consecutive; row stride free).
//   pool: [P, S, L, 2, KVH, D] float32 (any strides, D contiguous).
//   layer: which layer's K/V to read.
//   page_tables: [N, max_pages] int32, the sequences' pages in KV order.
//   seq_start: [N + 1] int32, sequence i's queries are rows seq_start[i]..seq_start[i+1].
//   num_cached: [N] int32, KV entries before each sequence's first new token (query j of
//     sequence i sees KV entries 0 .. num_cached[i] + j).
//   scale: the softmax scale (1 / sqrt(D)).
// Returns: [T, H * D] float32.
// KV: float (an fp32 pool), at::BFloat16 (kv_dtype "bf16": read widened, every sum and
// the softmax in fp32) or int8_t (kv_dtype "int8": each entry times its scale, in fp32).
// score_slot, scores, score_len: see Paged (nullptr scores: none asked).
template <typename KV>
torch::Tensor paged_attention_wave(torch::Tensor q, torch::Tensor pool, int64_t layer,
                                   torch::Tensor page_tables, torch::Tensor seq_start,
                                   torch::Tensor num_cached, double scale,
                                   const int64_t* score_slot = nullptr,
                                   float* scores = nullptr, int64_t score_len = 0) {
  TORCH_CHECK(pool.dim() == 6 && pool.stride(5) == 1, "paged_attention: pool layout");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q [T, H, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  constexpr bool QUANT = std::is_same<KV, int8_t>::value;  // entries carry a scale
  const int64_t S = pool.size(1), L = pool.size(2), KVH = pool.size(4);
  const int64_t width = pool.size(5);  // an entry's elements (int8: D + SCALE_BYTES)
  TORCH_CHECK(width == D + (QUANT ? SCALE_BYTES : 0) && D % W == 0 && H % KVH == 0 &&
              layer < L, "paged_attention: shapes");
  const int64_t G = H / KVH;
  const int64_t N = num_cached.size(0);
  const int64_t max_pages = page_tables.size(1);
  TORCH_CHECK(N > 0 && seq_start.size(0) == N + 1, "paged_attention: sequence tables");
  const int32_t* tables = page_tables.data_ptr<int32_t>();
  const int32_t* starts = seq_start.data_ptr<int32_t>();
  const int32_t* cached = num_cached.data_ptr<int32_t>();

  // Rows of each task, and the last KV index each row sees.
  std::vector<int64_t> task_rows, row_limit(T), row_splits(T);
  std::vector<Task> tasks;
  int64_t max_splits = 1, max_count = 1;
  // A full split whose pages are the same pages in several sequences (forks of one
  // prompt) is one task for all their rows: its keys are read once. Each row's arithmetic
  // is the same as in a task of its own (rows never mix), so its bits are too.
  std::vector<std::vector<int64_t>> rows_of;  // per task
  std::map<std::vector<int32_t>, int64_t> shared;  // (lo, page ids) of a full split -> task
  const int64_t split_pages = SPLIT_KEYS % S == 0 ? SPLIT_KEYS / S : 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t kv_len = cached[i] + starts[i + 1] - starts[i];
    const int64_t splits = (kv_len + SPLIT_KEYS - 1) / SPLIT_KEYS;
    max_splits = std::max(max_splits, splits);
    for (int64_t r = starts[i]; r < starts[i + 1]; ++r) {
      row_limit[r] = cached[i] + (r - starts[i]);
      row_splits[r] = splits;
    }
    const int32_t* table = tables + i * max_pages;
    for (int64_t lo = 0; lo < kv_len; lo += SPLIT_KEYS) {
      const int64_t hi = std::min(kv_len, lo + SPLIT_KEYS);
      int64_t task = -1;
      if (N > 1 && split_pages > 0 && hi - lo == SPLIT_KEYS && cached[i] >= hi) {
        std::vector<int32_t> key(table + lo / S, table + lo / S + split_pages);
        key.push_back(static_cast<int32_t>(lo / SPLIT_KEYS));
        auto found = shared.find(key);
        if (found != shared.end()) {
          task = found->second;
        } else {
          shared.emplace(std::move(key), static_cast<int64_t>(tasks.size()));
        }
      }
      if (task < 0) {
        task = static_cast<int64_t>(tasks.size());
        tasks.push_back({table, lo, hi, 0, 0});
        rows_of.emplace_back();
      }
      for (int64_t r = starts[i]; r < starts[i + 1]; ++r) rows_of[task].push_back(r);
    }
  }
  for (size_t t = 0; t < tasks.size(); ++t) {
    tasks[t].first = static_cast<int64_t>(task_rows.size());
    tasks[t].count = static_cast<int64_t>(rows_of[t].size());
    task_rows.insert(task_rows.end(), rows_of[t].begin(), rows_of[t].end());
    max_count = std::max<int64_t>(max_count, tasks[t].count);
  }

  auto out = torch::empty({T, H * D}, q.options());
  const bool merge = max_splits > 1;
  // Every (row, head, split)'s partial result: m and l, then D outputs.
  // (not zeroed: a row's splits are each written once before the merge reads them)
  std::unique_ptr<float[]> part_ml(merge ? new float[T * H * max_splits * 2] : nullptr);
  std::unique_ptr<float[]> part_acc(merge ? new float[T * H * max_splits * D] : nullptr);

  Paged<KV> c;
  c.base = pool.data_ptr<KV>();
  // Strides of the pool's dims [P, S, L, 2, KVH, D], whatever its physical order.
  c.S = S;
  c.page_stride = pool.stride(0);
  c.slot_stride = pool.stride(1);
  c.kv_off = layer * pool.stride(2);  // this layer's K of head 0
  c.v_off = pool.stride(3);           // V after K
  c.head_stride = pool.stride(4);
  c.width = width;
  c.D = D;
  c.nv = D / W;
  c.cn = c.nv % CMAX == 0 ? CMAX : c.nv % 2 == 0 ? 2 : 1;
  c.G = G;
  c.H = H;
  c.max_splits = max_splits;
  c.qp = q.data_ptr<float>();
  c.q_row = q.stride(0);
  c.q_head = q.stride(1);
  c.scale = static_cast<float>(scale);
  c.task_rows = task_rows.data();
  c.row_limit = row_limit.data();
  c.row_splits = row_splits.data();
  c.out = out.data_ptr<float>();
  c.part_ml = part_ml.get();
  c.part_acc = part_acc.get();
  c.score_slot = score_slot;
  c.scores = scores;
  c.score_len = score_len;

  // A unit takes every KV head of its task (each key's entry, all heads side by side in
  // the pool, is read as one run of lines) when the threads stay as busy so; one head a
  // unit otherwise (and for many rows, whose state would not stay in cache).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<Unit> units, whole;
  std::vector<int64_t> owner, whole_owner;
  const int64_t per_head = plan_units(tasks, KVH, G, 1, threads, task_rows.data(),
                                      row_limit.data(), units, owner);
  if (KVH > 1 && max_count * G <= 4 * QMAX) {
    const int64_t grouped = plan_units(tasks, KVH, G, KVH, threads, task_rows.data(),
                                       row_limit.data(), whole, whole_owner);
    if (grouped * 8 <= per_head * 9) {
      units.swap(whole);
      owner.swap(whole_owner);
    }
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    static thread_local Scratch scratch;
    for (int64_t t = begin; t < end; ++t)
      for (size_t u = 0; u < units.size(); ++u)
        if (owner[u] != t)
          continue;
        else if (units[u].a1 > 0)
          attend_rows(c, tasks[units[u].task], units[u].g0, units[u].a0, units[u].a1, scratch);
        else
          attend_unit(c, tasks[units[u].task], units[u].g0, units[u].g1, scratch);
  });
  float* op = c.out;
  const int64_t nv = c.nv;
  if (merge) {  // merge the splits of every (row, head) of a row with several
    at::parallel_for(0, T * H, 16, [&](int64_t begin, int64_t end) {
      v16 o[8];
      for (int64_t rh = begin; rh < end; ++rh) {
        const int64_t splits = row_splits[rh / H];
        if (splits == 1) continue;  // written already
        const float* ml = part_ml.get() + rh * max_splits * 2;
        float m = NEG_INF;
        for (int64_t s = 0; s < splits; ++s) m = std::max(m, ml[s * 2]);
        float* dst = op + rh * D;
        for (int64_t c0 = 0; c0 < nv; c0 += 8) {
          const int64_t cn = std::min<int64_t>(8, nv - c0);
          for (int64_t c = 0; c < cn; ++c) o[c] = v16{};
          float l = 0.f;
          for (int64_t s = 0; s < splits; ++s) {
            if (ml[s * 2] == NEG_INF) continue;
            const float f = std::exp(ml[s * 2] - m);
            l += ml[s * 2 + 1] * f;
            const float* src = part_acc.get() + (rh * max_splits + s) * D;
            for (int64_t c = 0; c < cn; ++c) o[c] += load(src + (c0 + c) * W) * f;
          }
          const float inv = l > 0.f ? 1.f / l : 0.f;
          for (int64_t c = 0; c < cn; ++c) store(dst + (c0 + c) * W, o[c] * inv);
        }
      }
    });
  }
  return out;
}

// Rows of a call whose splits' partial results would pass this many floats (16 MiB) run
// in waves of consecutive rows, each with its own partials, merged before the next: a long
// prefill chunk's partials (a row of a context of 8,192 keys has 32 splits per head) would
// otherwise fill a buffer of hundreds of megabytes, written and read back through memory.
// A wave is a call over a range of rows (a sequence cut between rows becomes two pieces,
// the second with the first's rows among its cached keys): each row meets the same keys
// in the same splits, so its bits are the same whatever the waves.
constexpr int64_t WAVE_PARTIALS = int64_t{4} << 20;
constexpr int64_t WAVE_MIN_HEADS = 192;  // query heads of a KV head that a wave keeps at least

template <typename KV>
torch::Tensor paged_attention_impl(torch::Tensor q, torch::Tensor pool, int64_t layer,
                                   torch::Tensor page_tables, torch::Tensor seq_start,
                                   torch::Tensor num_cached, double scale,
                                   const int64_t* score_slot = nullptr,
                                   float* scores = nullptr, int64_t score_len = 0) {
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 6 && num_cached.dim() == 1 &&
              seq_start.size(0) == num_cached.size(0) + 1 && page_tables.dim() == 2,
              "paged_attention: shapes");
  const int64_t N = num_cached.size(0), H = q.size(1), D = q.size(2);
  const int64_t G = std::max<int64_t>(1, H / std::max<int64_t>(1, pool.size(4)));
  const int32_t* starts = seq_start.data_ptr<int32_t>();
  const int32_t* cached = num_cached.data_ptr<int32_t>();
  // pieces: (sequence, first row, end row) in row order, cut so a wave's partials fit
  struct Piece {
    int64_t seq, r0, r1;
  };
  std::vector<std::vector<Piece>> waves(1);
  int64_t load = 0;
  const int64_t min_rows = std::max<int64_t>(1, WAVE_MIN_HEADS / G);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t n = starts[i + 1] - starts[i];
    const int64_t splits = (cached[i] + n + SPLIT_KEYS - 1) / SPLIT_KEYS;
    const int64_t per_row = splits > 1 ? splits * H * D : 0;
    int64_t r = 0;
    while (r < n) {
      int64_t take = n - r;
      if (per_row > 0 && load + take * per_row > WAVE_PARTIALS) {
        const int64_t room = (WAVE_PARTIALS - load) / per_row;
        if (room < std::min(take, min_rows) && !waves.back().empty()) {  // a new wave
          waves.emplace_back();
          load = 0;
          continue;
        }
        take = std::max(room, std::min(take, min_rows));
      }
      waves.back().push_back({i, r, r + take});
      load += take * per_row;
      r += take;
    }
  }
  if (waves.size() == 1)
    return paged_attention_wave<KV>(q, pool, layer, page_tables, seq_start, num_cached, scale,
                                    score_slot, scores, score_len);
  auto out = torch::empty({q.size(0), H * D}, q.options());
  for (const auto& wave : waves) {
    const int64_t row0 = starts[wave.front().seq] + wave.front().r0;
    std::vector<int32_t> st{0}, nc;
    std::vector<int64_t> seqs;
    for (const Piece& p : wave) {
      st.push_back(st.back() + static_cast<int32_t>(p.r1 - p.r0));
      nc.push_back(static_cast<int32_t>(cached[p.seq] + p.r0));
      seqs.push_back(p.seq);
    }
    const int64_t rows = st.back();
    auto i32 = [](const std::vector<int32_t>& v) {
      return torch::from_blob(const_cast<int32_t*>(v.data()), {static_cast<int64_t>(v.size())},
                              torch::kInt32);
    };
    auto tables = page_tables.index_select(
        0, torch::from_blob(seqs.data(), {static_cast<int64_t>(seqs.size())}, torch::kInt64));
    out.narrow(0, row0, rows).copy_(paged_attention_wave<KV>(
        q.narrow(0, row0, rows), pool, layer, tables, i32(st), i32(nc), scale,
        score_slot != nullptr ? score_slot + row0 : nullptr, scores, score_len));
  }
  return out;
}

// Ask for the K/V entries (all KV heads) of one layer that paged_attention over the same
// tables would read, each page once, at most PREFETCH_KV_BYTES of them (the first keys of
// each sequence first). The fused decode step calls it for the next layer while this
// one's projections still run, so the keys' memory latency (all layers of a slot sit
// together: one layer's consecutive keys are a layer-stride apart) overlaps them. Past the
// cap the requests only stall this thread on the line-fill buffers and push the weights
// out of cache: asking for every key of an 8,000-token context (12 MB a layer for the
// default model) made its decode 1.4x slower than not prefetching.
constexpr int64_t PREFETCH_KV_BYTES = int64_t{1} << 20;
void prefetch_paged_kv(torch::Tensor pool, int64_t layer, torch::Tensor page_tables,
                       torch::Tensor seq_start, torch::Tensor num_cached) {
  const int64_t P = pool.size(0), S = pool.size(1), KVH = pool.size(4);
  const int64_t N = num_cached.size(0), max_pages = page_tables.size(1);
  const int64_t es = pool.element_size();
  const int64_t span = (pool.stride(3) + (KVH - 1) * pool.stride(4) + pool.size(5)) * es;
  const bool packed = pool.stride(4) == pool.size(5) && pool.stride(3) == KVH * pool.size(5);
  const char* base = static_cast<const char*>(pool.data_ptr()) + layer * pool.stride(2) * es;
  const int32_t* tables = page_tables.data_ptr<int32_t>();
  const int32_t* starts = seq_start.data_ptr<int32_t>();
  const int32_t* cached = num_cached.data_ptr<int32_t>();
  // the pages to read (each once: forks share theirs) and how many of their slots
  static thread_local std::vector<uint8_t> seen;
  static thread_local std::vector<std::pair<int32_t, int32_t>> todo;
  seen.assign(P, 0);
  todo.clear();
  int64_t budget = PREFETCH_KV_BYTES / std::max<int64_t>(1, span);  // slots
  for (int64_t p = 0; budget > 0; ++p) {  // page p of every sequence, then p + 1
    bool more = false;
    for (int64_t i = 0; i < N && budget > 0; ++i) {
      const int64_t kv_len = cached[i] + starts[i + 1] - starts[i];
      if (p * S >= kv_len) continue;
      more = true;
      const int32_t page = tables[i * max_pages + p];
      if (page < 0 || page >= P || seen[page]) continue;
      seen[page] = 1;
      const int64_t n = std::min({S, kv_len - p * S, budget});
      todo.emplace_back(page, static_cast<int32_t>(n));
      budget -= n;
    }
    if (!more) break;
  }
  auto fetch = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t s = 0; s < todo[t].second; ++s) {
        const char* e = base + (todo[t].first * pool.stride(0) + s * pool.stride(1)) * es;
        if (packed) {
          prefetch_bytes<1>(e, span);
        } else {
          for (int64_t kv = 0; kv < 2; ++kv)
            for (int64_t g = 0; g < KVH; ++g)
              prefetch_bytes<1>(e + (kv * pool.stride(3) + g * pool.stride(4)) * es,
                                pool.size(5) * es);
        }
      }
    }
  };
  const int64_t n = static_cast<int64_t>(todo.size());
  // One thread issues them: both threads took no clearly shorter time in a noisy probe, and
  // a parallel region per layer more is one more wait on a descheduled thread on a busy
  // machine.
  fetch(0, n);
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor pool, int64_t layer,
                              torch::Tensor page_tables, torch::Tensor seq_start,
                              torch::Tensor num_cached, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 &&
              (pool.dtype() == torch::kFloat32 || pool.dtype() == torch::kBFloat16 ||
               pool.dtype() == torch::kInt8),
              "paged_attention: float32 queries, a float32, bfloat16 or int8 pool");
  if (pool.dtype() == torch::kInt8)
    return paged_attention_impl<int8_t>(q, pool, layer, page_tables, seq_start, num_cached,
                                        scale);
  if (pool.dtype() == torch::kBFloat16)
    return paged_attention_impl<at::BFloat16>(q, pool, layer, page_tables, seq_start,
                                              num_cached, scale);
  return paged_attention_impl<float>(q, pool, layer, page_tables, seq_start, num_cached, scale);
}

// paged_attention, and the attention scores of the rows with a slot: score_slot [T] int64
// (-1: none), scores [R, H, L] float32: row slot's scaled logits, what the softmax reads
// (keys it does not see are -inf, or left as they were past the block of its last key:
// fill it with -inf first; its weights are their softmax). L covers the longest asking
// sequence's keys. runtime/model/scores.py's ScoreCapture hands the buffers.
torch::Tensor paged_attention_scored(torch::Tensor q, torch::Tensor pool, int64_t layer,
                                     torch::Tensor page_tables, torch::Tensor seq_start,
                                     torch::Tensor num_cached, double scale,
                                     torch::Tensor score_slot, torch::Tensor scores) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 &&
              (pool.dtype() == torch::kFloat32 || pool.dtype() == torch::kBFloat16 ||
               pool.dtype() == torch::kInt8),
              "paged_attention: float32 queries, a float32, bfloat16 or int8 pool");
  const int64_t T = q.size(0), H = q.size(1);
  TORCH_CHECK(score_slot.dtype() == torch::kInt64 && score_slot.numel() == T &&
              score_slot.is_contiguous() && scores.dtype() == torch::kFloat32 &&
              scores.dim() == 3 && scores.size(1) == H && scores.is_contiguous(),
              "paged_attention_scored: slots [T] int64, scores [R, H, L] float32");
  const int64_t* slot = score_slot.data_ptr<int64_t>();
  const int32_t* starts = seq_start.data_ptr<int32_t>();
  const int32_t* cached = num_cached.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_cached.size(0); ++i)  // every asked row's keys fit
    for (int64_t r = starts[i]; r < starts[i + 1]; ++r)
      TORCH_CHECK(slot[r] < scores.size(0) &&
                  (slot[r] < 0 || cached[i] + starts[i + 1] - starts[i] <= scores.size(2)),
                  "paged_attention_scored: a slot past scores, or keys past its length");
  float* sc = scores.data_ptr<float>();
  const int64_t L = scores.size(2);
  if (pool.dtype() == torch::kInt8)
    return paged_attention_impl<int8_t>(q, pool, layer, page_tables, seq_start, num_cached,
                                        scale, slot, sc, L);
  if (pool.dtype() == torch::kBFloat16)
    return paged_attention_impl<at::BFloat16>(q, pool, layer, page_tables, seq_start,
                                              num_cached, scale, slot, sc, L);
  return paged_attention_impl<float>(q, pool, layer, page_tables, seq_start, num_cached, scale,
                                     slot, sc, L);
}

// RMSNorm of each row: x / sqrt(mean(x^2) + eps) * weight, in float32.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32,
              "rms_norm: float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous(), "rms_norm: x [T, N]");
  const int64_t T = x.size(0), N = x.size(1);
  auto out = torch::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* r = xp + t * xs;
      double ss = 0.0;  // as torch accumulates a float reduction: in a wider type
      for (int64_t n = 0; n < N; ++n) ss += static_cast<double>(r[n]) * r[n];
      const float inv = 1.f / std::sqrt(static_cast<float>(ss / N) + static_cast<float>(eps));
      float* o = op + t * N;
      for (int64_t n = 0; n < N; ++n) o[n] = wp[n] * (r[n] * inv);
    }
  });
  return out;
}

// Symmetric int8 per row: scale = max|x| / 127 (at least 1e-12 / 127), q = round(x / scale).
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "quantize_rows: float32 [T, N]");
  const int64_t T = x.size(0), N = x.size(1);
  auto q = torch::empty({T, N}, x.options().dtype(torch::kInt8));
  auto scales = torch::empty({T, 1}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* r = xp + t * xs;
      float mx = 0.f;
      for (int64_t n = 0; n < N; ++n) mx = std::max(mx, std::fabs(r[n]));
      const float s = std::max(mx, 1e-12f) / 127.f;
      sp[t] = s;
      int8_t* o = qp + t * N;
      for (int64_t n = 0; n < N; ++n) {
        const float v = std::nearbyint(r[n] / s);
        o[n] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
      }
    }
  });
  return {q, scales};
}

// The elementwise glue of a decoder layer, one pass each and without FMA contraction, so
// every value is the eager op's bit for bit.
// The attribute alone does not reach the lambdas handed to at::parallel_for (their
// operator() is a function of its own): one copy ran inlined without FMA, the threads'
// copy with it, so a row's bits depended on the row count. The pragma covers
// every function defined down to PYBIND11_MODULE, lambdas included.
#define EXACT __attribute__((optimize("fp-contract=off")))
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// Rotate the query and key heads of a fused qkv buffer in place ("rotate half", HF Llama):
// x[:half] * cos - x[half:] * sin, x[half:] * cos + x[:half] * sin.
// qkv: [T, (H + 2 * KVH) * D]; cos, sin: [T, D] (both halves equal).
EXACT void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                 int64_t head_dim) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 &&
              sin.dtype() == torch::kFloat32 && qkv.dim() == 2 && qkv.stride(1) == 1 &&
              cos.is_contiguous() && sin.is_contiguous(), "rope_: float32 qkv [T, N]");
  const int64_t T = qkv.size(0), half = head_dim / 2, row = qkv.stride(0);
  float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + t * head_dim;
      const float* st = s + t * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + t * row + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          const float lo = a * ct[i] + (-b) * st[i];
          const float hi = b * ct[i + half] + a * st[i + half];
          v[i] = lo;
          v[i + half] = hi;
        }
      }
    }
  });
}

// One entry (D fp32 values) in a pool's storage form, bit for bit what
// runtime/kv/layout.py's encode() stores: bf16 rounded to nearest even (torch's
// ``.to(torch.bfloat16)``), int8 as round(x / scale) with scale = max(max|x|, 1e-12) / 127
// (torch's ``amax().clamp_min_(1e-12).div_(127)``, ``div().round_()``) and the scale's
// bytes after the values.
inline void encode_entry(const float* x, at::BFloat16* dst, int64_t D) {
  for (int64_t c = 0; c < D; ++c) dst[c] = at::BFloat16(x[c]);
}
inline void encode_entry(const float* x, int8_t* dst, int64_t D) {
  float mx = 0.f;
  for (int64_t c = 0; c < D; ++c) mx = std::max(mx, std::fabs(x[c]));
  const float s = std::max(mx, 1e-12f) / 127.f;
  for (int64_t c = 0; c < D; ++c) dst[c] = static_cast<int8_t>(std::nearbyint(x[c] / s));
  std::memcpy(dst + D, &s, sizeof s);
}
inline void encode_entry(const float* x, float* dst, int64_t D) {
  std::memcpy(dst, x, D * sizeof(float));
}

template <typename KV>
void write_kv_impl(torch::Tensor pool, int64_t layer, torch::Tensor kv, torch::Tensor pages,
                   torch::Tensor slots) {
  const int64_t T = kv.size(0), KVH = kv.size(2), D = kv.size(3);
  const int64_t* pp = pages.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  KV* base = pool.data_ptr<KV>();
  const float* src = kv.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t which = 0; which < 2; ++which) {
      for (int64_t h = 0; h < KVH; ++h) {
        KV* dst = base + pp[t] * pool.stride(0) + sp[t] * pool.stride(1)
                  + layer * pool.stride(2) + which * pool.stride(3) + h * pool.stride(4);
        const float* from = src + t * kv.stride(0) + which * kv.stride(1) + h * kv.stride(2);
        encode_entry(from, dst, D);
      }
    }
  }
}

// Store the new tokens' K and V of one layer into their pool slots.
// pool: [P, S, L, 2, KVH, W] float32, bfloat16 (W = D) or int8 (W = D + SCALE_BYTES);
// kv: [T, 2, KVH, D] float32 (any strides, D contiguous); pages, slots: [T] int64.
void write_kv(torch::Tensor pool, int64_t layer, torch::Tensor kv, torch::Tensor pages,
              torch::Tensor slots) {
  const bool quant = pool.dtype() == torch::kInt8;
  TORCH_CHECK(kv.dtype() == torch::kFloat32 && pool.stride(5) == 1 && kv.stride(3) == 1 &&
              (pool.dtype() == torch::kFloat32 || pool.dtype() == torch::kBFloat16 || quant) &&
              pool.size(5) == kv.size(3) + (quant ? SCALE_BYTES : 0),
              "write_kv: float32 kv into a float32, bfloat16 or int8 pool");
  if (quant) return write_kv_impl<int8_t>(pool, layer, kv, pages, slots);
  if (pool.dtype() == torch::kBFloat16)
    return write_kv_impl<at::BFloat16>(pool, layer, kv, pages, slots);
  write_kv_impl<float>(pool, layer, kv, pages, slots);
}

// silu(gate) * up of a fused [T, 2I] gate/up output: [T, I].
// exp(x) for x in [-87, 88] (clamped): vec16.h's exp_core_exact (no contraction: the
// pragma's rule; the paged kernel's exp_neg is the same arithmetic, fused roundings).
EXACT inline v16 exp_clamped(v16 x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  return exp_core_exact(x > splat(88.f) ? splat(88.f) : x);
}

// silu(gate) * up = gate / (1 + exp(-gate)) * up, 16 values at a time (a row's last
// partial vector through a zero-padded copy, so every value takes the same arithmetic);
// within ~2e-7 relative of torch's F.silu(gate) * up. Calls of a few rows (decode steps)
// run on the calling thread: ~2 us of work, less than a parallel region's hand-off.
EXACT torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dtype() == torch::kFloat32 && gu.dim() == 2 && gu.stride(1) == 1,
              "silu_mul: float32 [T, 2I]");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({T, I}, gu.options());
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t row = gu.stride(0);
  auto silu16 = [](v16 x, v16 u) { return x / (splat(1.f) + exp_clamped(-x)) * u; };
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = g + t * row;
      const float* up = gate + I;
      float* dst = o + t * I;
      int64_t i = 0;
      for (; i + W <= I; i += W) store(dst + i, silu16(load(gate + i), load(up + i)));
      if (i < I) {
        float a[W] = {}, b[W] = {}, c[W];
        std::memcpy(a, gate + i, (I - i) * sizeof(float));
        std::memcpy(b, up + i, (I - i) * sizeof(float));
        store(c, silu16(load(a), load(b)));
        std::memcpy(dst + i, c, (I - i) * sizeof(float));
      }
    }
  });
  return out;
}

// The fp32 result of an int8 projection: acc * x_scale * w_scale (+ bias), in that order
// (torch's ``acc.float().mul_(xs).mul_(ws).add_(b)``, bit for bit), in one pass.
// acc: [M, N] int32 contiguous; xs: [M] or [M, 1] float32; ws: [N] float32; bias: [N] or
// empty.
EXACT torch::Tensor dequantize_int32(torch::Tensor acc, torch::Tensor xs, torch::Tensor ws,
                                     torch::Tensor bias) {
  TORCH_CHECK(acc.dtype() == torch::kInt32 && acc.dim() == 2 && acc.is_contiguous() &&
              xs.dtype() == torch::kFloat32 && xs.is_contiguous() &&
              xs.numel() == acc.size(0) && ws.dtype() == torch::kFloat32 &&
              ws.is_contiguous() && ws.numel() == acc.size(1) &&
              (bias.numel() == 0 || (bias.dtype() == torch::kFloat32 &&
                                     bias.is_contiguous() && bias.numel() == acc.size(1))),
              "dequantize_int32: int32 [M, N], fp32 scales [M] and [N], bias [N] or empty");
  const int64_t M = acc.size(0), N = acc.size(1);
  auto out = torch::empty({M, N}, acc.options().dtype(torch::kFloat32));
  const int32_t* a = acc.data_ptr<int32_t>();
  const float* x = xs.data_ptr<float>();
  const float* w = ws.data_ptr<float>();
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int32_t* row = a + m * N;
      float* dst = o + m * N;
      const float sx = x[m];
      if (b != nullptr) {
        for (int64_t n = 0; n < N; ++n) dst[n] = static_cast<float>(row[n]) * sx * w[n] + b[n];
      } else {
        for (int64_t n = 0; n < N; ++n) dst[n] = static_cast<float>(row[n]) * sx * w[n];
      }
    }
  });
  return out;
}

#pragma GCC pop_options

// decode_step.cpp: the whole decode step in one call (its class joins this module)
void register_decode_step(pybind11::module_& m);
// strips_mm.cpp: projection kernels over weights packed in 16-row strips (same module)
void register_strips_mm(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode_step(m);
  register_strips_mm(m);
  m.def("dequantize_int32", &dequantize_int32, "int8 projection's int32 result to fp32");
  m.def("rope_", &rope_, "rotate q and k heads of a qkv buffer in place");
  m.def("write_kv", &write_kv, "store new K/V into the pool");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("paged_attention", &paged_attention, "attention over the paged KV pool");
  m.def("paged_attention_scored", &paged_attention_scored,
        "paged_attention, and the scores of the rows that ask");
  m.def("prefetch_paged_kv", &prefetch_paged_kv, "ask for one layer's K/V entries ahead");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("quantize_rows", &quantize_rows, "symmetric int8 per row");
}
