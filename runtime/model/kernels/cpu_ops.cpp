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
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

constexpr int W = 16;          // floats per vector
constexpr int BLOCK = 16;      // keys scored together before one softmax update
constexpr int64_t SPLIT_KEYS = 256;  // keys of one split: longer contexts are cut
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 splat(float x) { return v16{} + x; }

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

// exp(x) for x <= 0 (softmax after subtracting the max), ~1.2e-7 relative error:
// x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor series to r^6, 2^n in the exponent.
inline v16 exp_neg(v16 x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  const v16 t = x * 1.44269504088896341f;
  const v16 magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const v16 n = (t + magic) - magic;
  const v16 r = x - n * 0.693147180559945309f;
  v16 p = splat(1.f / 720.f);
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  return p * (v16)e;
}

constexpr int64_t PREFETCH = 32;  // keys asked for ahead of the one being read

template <typename KV>
inline void prefetch_kv(const KV* key, int64_t v_off, int64_t d) {
  for (int64_t c = 0; c < d; c += 64 / sizeof(KV)) {  // one 64-byte line at a time
    __builtin_prefetch(key + c, 0, 3);
    __builtin_prefetch(key + v_off + c, 0, 3);
  }
}

// The online-softmax state of one query head: running max, running sum, output.
struct Partial {
  float m;
  float l;
};

}  // namespace

// One unit of attention work: the new tokens of one sequence (all query heads of one KV
// head) over one split of its keys.
struct Task {
  int64_t g;           // KV head
  const int32_t* table;
  int64_t lo, hi;      // keys [lo, hi), within one split
  int64_t first, count;  // its rows: task_rows[first .. first + count)
};

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

// KV: float (an fp32 pool), at::BFloat16 (kv_dtype "bf16": read widened, every sum and
// the softmax in fp32) or int8_t (kv_dtype "int8": each entry times its scale, in fp32).
template <typename KV>
torch::Tensor paged_attention_impl(torch::Tensor q, torch::Tensor pool, int64_t layer,
                                   torch::Tensor page_tables, torch::Tensor seq_start,
                                   torch::Tensor num_cached, double scale) {
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
  const float* qp = q.data_ptr<float>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const KV* base = pool.data_ptr<KV>();
  // Strides of the pool's dims [P, S, L, 2, KVH, D], whatever its physical order.
  const int64_t page_stride = pool.stride(0), slot_stride = pool.stride(1);
  const int64_t kv_off = layer * pool.stride(2);  // this layer's K of head 0
  const int64_t v_off = pool.stride(3);           // V after K
  const int64_t head_stride = pool.stride(4);
  const int64_t nv = D / W;

  // Rows of each task, and the last KV index each row sees.
  std::vector<int64_t> task_rows, row_limit(T), row_splits(T);
  std::vector<Task> per_head;  // the tasks of KV head 0; other heads repeat them
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
      if (split_pages > 0 && hi - lo == SPLIT_KEYS && cached[i] >= hi) {
        std::vector<int32_t> key(table + lo / S, table + lo / S + split_pages);
        key.push_back(static_cast<int32_t>(lo / SPLIT_KEYS));
        auto found = shared.find(key);
        if (found != shared.end()) {
          task = found->second;
        } else {
          shared.emplace(std::move(key), static_cast<int64_t>(per_head.size()));
        }
      }
      if (task < 0) {
        task = static_cast<int64_t>(per_head.size());
        per_head.push_back({0, table, lo, hi, 0, 0});
        rows_of.emplace_back();
      }
      for (int64_t r = starts[i]; r < starts[i + 1]; ++r) rows_of[task].push_back(r);
    }
  }
  for (size_t t = 0; t < per_head.size(); ++t) {
    per_head[t].first = static_cast<int64_t>(task_rows.size());
    per_head[t].count = static_cast<int64_t>(rows_of[t].size());
    task_rows.insert(task_rows.end(), rows_of[t].begin(), rows_of[t].end());
    max_count = std::max<int64_t>(max_count, per_head[t].count);
  }
  const int64_t per = static_cast<int64_t>(per_head.size());
  const int64_t nq = max_count * G;  // query heads of one task, at most

  auto out = torch::empty({T, H * D}, q.options());
  float* op = out.data_ptr<float>();
  const bool merge = max_splits > 1;
  // Every (row, head, split)'s partial result: m and l, then D outputs.
  std::vector<float> part_ml(merge ? T * H * max_splits * 2 : 0);
  std::vector<float> part_acc(merge ? T * H * max_splits * D : 0);

  // Tasks are ordered sequence (and split) first, then KV head: consecutive tasks read
  // the KV heads of the same slots, which sit side by side in the pool (an entry of a
  // slot and layer is [2, KVH, D]), so one memory page (and TLB entry) and neighbouring
  // cache lines serve them all; KV head first went to a new page every key.
  at::parallel_for(0, KVH * per, 1, [&](int64_t begin, int64_t end) {
    std::vector<v16> acc(nq * nv);
    std::vector<Partial> st(nq);
    std::vector<float> scores(nq * BLOCK);
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& task = per_head[ti / KVH];
      const int64_t g = ti % KVH;
      const int32_t* table = task.table;
      const int64_t lo = task.lo, hi = task.hi;
      const int64_t* rows = task_rows.data() + task.first;
      const int64_t nqt = task.count * G;  // query heads: (row j, head i) -> j * G + i
      for (int64_t a = 0; a < nqt * nv; ++a) acc[a] = v16{};
      for (int64_t a = 0; a < nqt; ++a) st[a] = {NEG_INF, 0.f};
      auto key_at = [&](int64_t idx) {
        return base + table[idx / S] * page_stride + (idx % S) * slot_stride + kv_off
               + g * head_stride;
      };
      // Each key and value is a few cache lines far from the next (the pool is page-major,
      // all layers of a slot together): ask for the ones PREFETCH keys ahead now, so the
      // loads overlap instead of waiting one after the other.
      for (int64_t idx = lo; idx < std::min(hi, lo + PREFETCH); ++idx)
        prefetch_kv(key_at(idx), v_off, width);
      for (int64_t k0 = lo; k0 < hi; k0 += BLOCK) {
        const int64_t kb = std::min<int64_t>(BLOCK, hi - k0);
        const KV* keys[BLOCK];
        for (int64_t k = 0; k < kb; ++k) keys[k] = key_at(k0 + k);
        for (int64_t idx = k0 + PREFETCH; idx < std::min(hi, k0 + PREFETCH + BLOCK); ++idx)
          prefetch_kv(key_at(idx), v_off, width);
        // int8: each key's and value's scale (lane k = key k0 + k)
        v16 k_scale{}, v_scale{};
        if constexpr (QUANT) {
          for (int64_t k = 0; k < kb; ++k) {
            k_scale[k] = entry_scale(keys[k], D);
            v_scale[k] = entry_scale(keys[k] + v_off, D);
          }
        }
        // scores of the block's keys for each query head (lane k = key k0 + k), then the
        // softmax update, leaving each key's weight in scores[qh][k]
        for (int64_t j = 0; j < task.count; ++j) {
          if (row_limit[rows[j]] < k0) {  // every key of this block is in its future
            for (int64_t i = 0; i < G; ++i) store(scores.data() + (j * G + i) * BLOCK, v16{});
            continue;
          }
          // keys after the query (causal) or past the block are out: -inf
          const v16 visible = splat(static_cast<float>(
              std::min<int64_t>(row_limit[rows[j]] - k0, kb - 1)));
          const auto out = LANE > visible;
          for (int64_t i = 0; i < G; ++i) {
            const float* qv = qp + rows[j] * q_row + (g * G + i) * q_head;
            v16 dots[BLOCK];
            for (int64_t k = 0; k < kb; ++k) {
              v16 d{};
              for (int64_t c = 0; c < nv; ++c) d += load(qv + c * W) * load_kv(keys[k] + c * W);
              dots[k] = d;
            }
            for (int64_t k = kb; k < BLOCK; ++k) dots[k] = v16{};
            v16 sc;
            if constexpr (QUANT)
              sc = out ? splat(NEG_INF) : sum16(dots) * k_scale * static_cast<float>(scale);
            else
              sc = out ? splat(NEG_INF) : sum16(dots) * static_cast<float>(scale);
            const int64_t a = j * G + i;
            float* s = scores.data() + a * BLOCK;
            const float bm = hmax(sc);
            if (bm == NEG_INF) {  // every key of this block is in its future
              store(s, v16{});
              continue;
            }
            Partial& p = st[a];
            const float m = std::max(p.m, bm);
            const v16 w = out ? v16{} : exp_neg(sc - m);
            if (p.m != NEG_INF && p.m != m) {
              const float alpha = std::exp(p.m - m);
              p.l *= alpha;
              for (int64_t c = 0; c < nv; ++c) acc[a * nv + c] *= alpha;
            }
            p.l += hsum(w);
            p.m = m;
            store(s, w);
          }
        }
        // weighted values: each query head's output stays in registers (up to 128 floats
        // at a time) while the block's values, hot in L1, stream past it
        for (int64_t c0 = 0; c0 < nv; c0 += 8) {
          const int64_t cn = std::min<int64_t>(8, nv - c0);
          for (int64_t a = 0; a < nqt; ++a) {
            v16 ac[8];
            for (int64_t c = 0; c < cn; ++c) ac[c] = acc[a * nv + c0 + c];
            const float* wa = scores.data() + a * BLOCK;
            for (int64_t k = 0; k < kb; ++k) {
              float wk = wa[k];
              if (wk == 0.f) continue;
              if constexpr (QUANT) wk *= v_scale[k];
              const KV* val = keys[k] + v_off + c0 * W;
              for (int64_t c = 0; c < cn; ++c) ac[c] += load_kv(val + c * W) * wk;
            }
            for (int64_t c = 0; c < cn; ++c) acc[a * nv + c0 + c] = ac[c];
          }
        }
      }
      // write out: the final result of a row with one split, else this split's partial
      const int64_t split = lo / SPLIT_KEYS;
      for (int64_t j = 0; j < task.count; ++j) {
        const int64_t row = rows[j];
        for (int64_t i = 0; i < G; ++i) {
          const int64_t a = j * G + i, h = g * G + i;
          const Partial& p = st[a];
          if (row_splits[row] == 1) {
            const float inv = p.l > 0.f ? 1.f / p.l : 0.f;
            float* o = op + row * H * D + h * D;
            for (int64_t c = 0; c < nv; ++c) store(o + c * W, acc[a * nv + c] * inv);
          } else {
            const int64_t slot = (row * H + h) * max_splits + split;
            part_ml[slot * 2] = p.m;
            part_ml[slot * 2 + 1] = p.l;
            float* o = part_acc.data() + slot * D;
            for (int64_t c = 0; c < nv; ++c) store(o + c * W, acc[a * nv + c]);
          }
        }
      }
    }
  });
  if (merge) {  // merge the splits of every (row, head) of a row with several
    at::parallel_for(0, T * H, 16, [&](int64_t begin, int64_t end) {
      v16 o[8];
      for (int64_t rh = begin; rh < end; ++rh) {
        const int64_t splits = row_splits[rh / H];
        if (splits == 1) continue;  // written already
        const float* ml = part_ml.data() + rh * max_splits * 2;
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
            const float* src = part_acc.data() + (rh * max_splits + s) * D;
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
// copy with it, so a row's bits depended on the row count (issue 35). The pragma covers
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
EXACT torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dtype() == torch::kFloat32 && gu.dim() == 2 && gu.stride(1) == 1,
              "silu_mul: float32 [T, 2I]");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({T, I}, gu.options());
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t row = gu.stride(0);
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = g + t * row;
      const float* up = gate + I;
      float* dst = o + t * I;
      for (int64_t i = 0; i < I; ++i) dst[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode_step(m);
  m.def("dequantize_int32", &dequantize_int32, "int8 projection's int32 result to fp32");
  m.def("rope_", &rope_, "rotate q and k heads of a qkv buffer in place");
  m.def("write_kv", &write_kv, "store new K/V into the pool");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("paged_attention", &paged_attention, "attention over the paged KV pool");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("quantize_rows", &quantize_rows, "symmetric int8 per row");
}
