// pie-ctx CPU kernels for weights kept in a GGUF file's own block formats (Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0).
//
// Built at first use by runtime/model/kernels/__init__.py (block_ops()), like cpu_ops.cpp.
// Layouts (runtime/model/blocks.py makes them from the file's blocks, byte for byte):
//
//   4-bit (Q4_0, Q4_1): qs uint8 [N, nb * 16]: block b of output row n is the 16 bytes at
//     qs[n, 16 b:]: byte j holds element 32 b + j in its low nibble and 32 b + j + 16 in its
//     high nibble (ggml's order); d, m float16 [N, nb]: the weight is q * d + m (Q4_0 is
//     stored with m = -8 d, which is the same value as ggml's (q - 8) * d).
//   5-bit (Q5_0, Q5_1): qs uint8 [N, nb * 20]: block b of row n is the 20 bytes at
//     qs[n, 20 b:]: ggml's qh (4 bytes, a little-endian uint32 whose bit j is the 5th bit of
//     element 32 b + j) then its 16 bytes of low nibbles in the 4-bit order; d float16
//     [N, nb]; m float16 [N, nb] (Q5_1: the weight is q * d + m) or empty (Q5_0: the weight
//     is (q - 16) * d, formed as q * d + m with m = -16 d, exact in fp32 and the same value).
//   8-bit (Q8_0): qs int8 [N, nb * 32], element 32 b + j at qs[n, 32 b + j]; d float16
//     [N, nb]; the weight is q * d.
//
// Every weight is formed in fp32 as q * d + m with one rounding, which is exactly ggml's
// dequantized value (q * d is exact in fp32: an 11-bit mantissa times a 4- to 8-bit integer),
// then multiplied with fp32 activations: no activation rounding at all. A row's result
// depends only on that row (the sums run in a fixed order whatever the batch).
//
// Vectors: GCC vector extensions of 16 floats (one AVX-512 register, two AVX2 ones).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec16.h"

namespace {

typedef _Float16 v16h __attribute__((vector_size(32)));

constexpr int TILE = 8;  // activation rows that share one pass over a weight row

inline float hsum(v16 v) {
  float s[16];
  std::memcpy(s, &v, sizeof s);
  float a = 0.f;  // a fixed order: the same bits for a row whatever its batch
  for (int i = 0; i < 16; ++i) a += s[i];
  return a;
}

// 16 bytes -> 16 int32 lanes (GCC 12 scalarizes __builtin_convertvector from bytes: the
// sign- or zero-extending loads are spelled out where the CPU has them).
template <bool SIGNED>
inline v16i widen_bytes(const uint8_t* p) {
  v16i r;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i w = SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  std::memcpy(&r, &w, sizeof r);
#elif defined(__AVX2__)
  const __m128i b0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i b1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
  const __m256i w0 = SIGNED ? _mm256_cvtepi8_epi32(b0) : _mm256_cvtepu8_epi32(b0);
  const __m256i w1 = SIGNED ? _mm256_cvtepi8_epi32(b1) : _mm256_cvtepu8_epi32(b1);
  std::memcpy(&r, &w0, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &w1, 32);
#else
  for (int i = 0; i < 16; ++i)
    r[i] = SIGNED ? static_cast<int32_t>(static_cast<int8_t>(p[i])) : static_cast<int32_t>(p[i]);
#endif
  return r;
}

// The weights of one block of 32 (two vectors), formed exactly as ggml dequantizes them.
struct Q4 {
  static constexpr int64_t BYTES = 16;
  static inline void weights(const uint8_t* q, float d, float m, v16& lo, v16& hi) {
    const v16i qi = widen_bytes<false>(q);
    lo = __builtin_convertvector(qi & 15, v16) * d + m;
    hi = __builtin_convertvector(qi >> 4, v16) * d + m;
  }
};

// 5 bits: the 4-bit nibbles with their 5th bits (bit j of the block's qh) put back.
struct Q5 {
  static constexpr int64_t BYTES = 20;
  static inline void weights(const uint8_t* q, float d, float m, v16& lo, v16& hi) {
    typedef uint32_t v16u __attribute__((vector_size(64)));
    uint32_t h;
    std::memcpy(&h, q, 4);
    const v16u lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16u hv = v16u{} + h;
    const v16i h_lo = (v16i)(((hv >> lane) & 1) << 4);
    const v16i h_hi = (v16i)(((hv >> (lane + 16)) & 1) << 4);
    const v16i qi = widen_bytes<false>(q + 4);
    lo = __builtin_convertvector((qi & 15) | h_lo, v16) * d + m;
    hi = __builtin_convertvector((qi >> 4) | h_hi, v16) * d + m;
  }
};

struct Q8 {
  static constexpr int64_t BYTES = 32;
  static inline void weights(const uint8_t* q, float d, float, v16& lo, v16& hi) {
    lo = __builtin_convertvector(widen_bytes<true>(q), v16) * d;
    hi = __builtin_convertvector(widen_bytes<true>(q + 16), v16) * d;
  }
};

// Scales of one output row, float16 -> float32 (exact), 16 at a time.
inline void widen(const _Float16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16h h;
    std::memcpy(&h, src + i, sizeof h);
    const v16 f = __builtin_convertvector(h, v16);
    std::memcpy(dst + i, &f, sizeof f);
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// out[r, n + j] = sum_k x[r, k] * W[n + j, k] for R rows of x and NO output rows from n.
// Each (r, j) has its own accumulators, summed block after block in the same order whatever
// R and NO are: a row's result does not depend on its batch. Several output rows at once
// give one activation row independent chains (a lone row's single chain is latency bound).
template <class F, int R, int NO>
inline void dot_rows(const float* x, int64_t xs, const uint8_t* q, int64_t qrow,
                     const float* d, const float* m, int64_t nb, float* out, int64_t os) {
  v16 acc[R][NO][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NO; ++j) acc[r][j][0] = acc[r][j][1] = v16{};
  for (int64_t b = 0; b < nb; ++b) {
    v16 lo[NO], hi[NO];
    for (int j = 0; j < NO; ++j)
      F::weights(q + j * qrow + b * F::BYTES, d[j * nb + b], m ? m[j * nb + b] : 0.f, lo[j],
                 hi[j]);
    for (int r = 0; r < R; ++r) {
      const v16 x0 = load(x + r * xs + b * 32), x1 = load(x + r * xs + b * 32 + 16);
      for (int j = 0; j < NO; ++j) {
        acc[r][j][0] += x0 * lo[j];
        acc[r][j][1] += x1 * hi[j];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NO; ++j) out[r * os + j] = hsum(acc[r][j][0] + acc[r][j][1]);
}

constexpr int WIDE = 4;  // output rows per pass for batches of fewer than 4 rows

template <class F, int NO>
inline void rows_of(const float* x, int64_t M, int64_t xs, const uint8_t* q, int64_t qrow,
                    const float* d, const float* m, int64_t nb, float* out, int64_t N) {
  if (NO == WIDE) {  // M < 4
    switch (M) {
      case 1: dot_rows<F, 1, NO>(x, xs, q, qrow, d, m, nb, out, N); break;
      case 2: dot_rows<F, 2, NO>(x, xs, q, qrow, d, m, nb, out, N); break;
      default: dot_rows<F, 3, NO>(x, xs, q, qrow, d, m, nb, out, N); break;
    }
    return;
  }
  int64_t r = 0;
  for (; r + TILE <= M; r += TILE)
    dot_rows<F, TILE, 1>(x + r * xs, xs, q, qrow, d, m, nb, out + r * N, N);
  switch (M - r) {  // the rows left over, in one pass
    case 0: break;
    case 1: dot_rows<F, 1, 1>(x + r * xs, xs, q, qrow, d, m, nb, out + r * N, N); break;
    case 2: dot_rows<F, 2, 1>(x + r * xs, xs, q, qrow, d, m, nb, out + r * N, N); break;
    case 3: dot_rows<F, 3, 1>(x + r * xs, xs, q, qrow, d, m, nb, out + r * N, N); break;
    case 4: dot_rows<F, 4, 1>(x + r * xs, xs, q, qrow, d, m, nb, out + r * N, N); break;
    case 5: dot_rows<F, 5, 1>(x + r * xs, xs, q, qrow, d, m, nb, out + r * N, N); break;
    case 6: dot_rows<F, 6, 1>(x + r * xs, xs, q, qrow, d, m, nb, out + r * N, N); break;
    default: dot_rows<F, 7, 1>(x + r * xs, xs, q, qrow, d, m, nb, out + r * N, N); break;
  }
}

// The minimums of `n` blocks into dst: the stored ones (mp), or `offset` * d (Q5_0's -16 d,
// exact in fp32), or none (nullptr: Q8_0).
inline const float* minimums(const _Float16* mp, float offset, const float* d, float* dst,
                             int64_t n) {
  if (mp) {
    widen(mp, dst, n);
    return dst;
  }
  if (offset == 0.f) return nullptr;
  for (int64_t i = 0; i < n; ++i) dst[i] = offset * d[i];
  return dst;
}

template <class F>
void block_mm_impl(const float* x, int64_t M, int64_t xs, const uint8_t* qs,
                   const _Float16* dp, const _Float16* mp, float offset, int64_t N, int64_t nb,
                   float* out) {
  const int64_t qrow = nb * F::BYTES;
  const bool wide = M < 4;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> dbuf(WIDE * nb), mbuf(mp || offset != 0.f ? WIDE * nb : 0);
    for (int64_t n = begin; n < end;) {
      const int64_t no = wide && n + WIDE <= end ? WIDE : 1;
      widen(dp + n * nb, dbuf.data(), no * nb);
      const float* m = minimums(mp ? mp + n * nb : nullptr, offset, dbuf.data(), mbuf.data(),
                                no * nb);
      if (no == WIDE)
        rows_of<F, WIDE>(x, M, xs, qs + n * qrow, qrow, dbuf.data(), m, nb, out + n, N);
      else
        rows_of<F, 1>(x, M, xs, qs + n * qrow, qrow, dbuf.data(), m, nb, out + n, N);
      n += no;
    }
  });
}

// Bytes of a block of 32 for `bits` (4, 5 or 8) in the layouts above.
inline int64_t block_bytes(int64_t bits) {
  return bits == 4 ? Q4::BYTES : bits == 5 ? Q5::BYTES : Q8::BYTES;
}

void check(const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m,
           int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "block_mm: bits must be 4, 5 or 8");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.element_size() == 1,
              "block_mm: qs [N, bytes] of 1-byte elements");
  TORCH_CHECK(d.dtype() == torch::kFloat16 && d.dim() == 2 && d.is_contiguous() &&
              d.size(0) == qs.size(0), "block_mm: d float16 [N, nb]");
  TORCH_CHECK(qs.size(1) == d.size(1) * block_bytes(bits), "block_mm: qs/d sizes");
  TORCH_CHECK((bits == 8 && m.numel() == 0) || (bits == 5 && m.numel() == 0) ||
                  (m.sizes() == d.sizes() && m.dtype() == torch::kFloat16 && m.is_contiguous()),
              "block_mm: m float16 [N, nb] for 4 bits and Q5_1, empty for Q5_0 and 8 bits");
}

// The stored minimums, or none; and the offset that stands for them when none are stored
// (Q5_0's m = -16 d).
inline const _Float16* min_ptr(const torch::Tensor& m) {
  return m.numel() ? reinterpret_cast<const _Float16*>(m.data_ptr()) : nullptr;
}
inline float min_offset(int64_t bits, const torch::Tensor& m) {
  return bits == 5 && m.numel() == 0 ? -16.f : 0.f;
}

}  // namespace

// x [M, K] float32 (rows may be strided) times the block weight [N, K]^T -> [M, N] float32.
torch::Tensor block_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                       int64_t bits) {
  check(qs, d, m, bits);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "block_mm: x float32 [M, K]");
  const int64_t M = x.size(0), N = qs.size(0), nb = d.size(1);
  TORCH_CHECK(x.size(1) == nb * 32, "block_mm: x has ", x.size(1), " columns, weight ", nb * 32);
  auto out = torch::empty({M, N}, x.options());
  const auto* q = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const auto* dp = reinterpret_cast<const _Float16*>(d.data_ptr());
  const _Float16* mp = min_ptr(m);
  const float off = min_offset(bits, m);
  float* op = out.data_ptr<float>();
  if (bits == 4)
    block_mm_impl<Q4>(x.data_ptr<float>(), M, x.stride(0), q, dp, mp, off, N, nb, op);
  else if (bits == 5)
    block_mm_impl<Q5>(x.data_ptr<float>(), M, x.stride(0), q, dp, mp, off, N, nb, op);
  else
    block_mm_impl<Q8>(x.data_ptr<float>(), M, x.stride(0), q, dp, nullptr, 0.f, N, nb, op);
  return out;
}

// The fp32 weights of output rows ``rows`` (int64 [R]) -> [R, K]: ggml's dequantized values.
torch::Tensor block_rows(torch::Tensor qs, torch::Tensor d, torch::Tensor m, int64_t bits,
                         torch::Tensor rows) {
  check(qs, d, m, bits);
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.dim() == 1, "block_rows: rows int64 [R]");
  const int64_t R = rows.size(0), N = qs.size(0), nb = d.size(1);
  auto out = torch::empty({R, nb * 32}, d.options().dtype(torch::kFloat32));
  const auto* q = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const auto* dp = reinterpret_cast<const _Float16*>(d.data_ptr());
  const _Float16* mp = min_ptr(m);
  const float off = min_offset(bits, m);
  const int64_t bytes = block_bytes(bits);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "block_rows: row ", rp[i], " out of range");
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = rp[i];
      for (int64_t b = 0; b < nb; ++b) {
        const float db = static_cast<float>(dp[n * nb + b]);
        const float mb = mp ? static_cast<float>(mp[n * nb + b]) : off * db;
        v16 lo, hi;
        if (bits == 4) Q4::weights(q + (n * nb + b) * bytes, db, mb, lo, hi);
        else if (bits == 5) Q5::weights(q + (n * nb + b) * bytes, db, mb, lo, hi);
        else Q8::weights(q + (n * nb + b) * bytes, db, mb, lo, hi);
        std::memcpy(op + i * nb * 32 + b * 32, &lo, sizeof lo);
        std::memcpy(op + i * nb * 32 + b * 32 + 16, &hi, sizeof hi);
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------
// int8 activations ("blocks_q8"): llama.cpp's way of multiplying 4-, 5- and 8-bit blocks.
//
// Each activation row is quantized per group of 32 as llama.cpp's Q8_0 / Q8_1 blocks do:
// d_a = max|x| / 127, q_a = round(x * (1 / d_a)) (to nearest, ties to even), s_a = d_a *
// sum(q_a). A block's product is then an integer dot of the weight's quants with q_a (exact,
// int32), combined in fp32: d_w * d_a * isum (+ m_w * s_a with a minimum m: Q4_0, Q4_1,
// Q5_1). The weights are the file's, unchanged; only the activations are rounded.
//
// Layout (runtime/model/blocks.py's StripBlocks makes it from the file's blocks): output
// rows in strips of 16 (the last one padded with zero rows), S strips, nb blocks a row;
// within a strip, block b's quants for the 16 rows interleaved 4 bytes at a time, so that
// one 64-byte vector holds 4 consecutive quant bytes of each of the 16 rows (lane l = row l):
//   4-bit: qs uint8 [S, nb, 4, 16, 4]: [s, b, k, l, t] = ggml's byte 4k + t of row 16s + l's
//     block b (low nibble: element 4k + t, high nibble: element 16 + 4k + t);
//   5-bit: qs uint8 [S, nb, 320]: the 4-bit layout's 256 bytes of low nibbles, then the 5th
//     bits as 8 little-endian uint64 masks, mask (k, h) at byte 256 + 16 k + 8 h: its bit
//     4 l + t is the 5th bit of element 16 h + 4 k + t of row 16 s + l (the byte 4 l + t of
//     vector k holds that element's nibble): a masked byte add puts them back;
//   8-bit: qs uint8 [S, nb, 8, 16, 4]: q + 128 of element 4k + t;
//   d, m: float16 [S, nb, 16] (m: Q4_0 / Q4_1 / Q5_1; Q4_0 has m = -8 d; none for Q5_0 and
//     Q8_0).
// vpdpbusd (unsigned weight bytes x signed activation bytes, four products summed a lane)
// with 4 activation bytes broadcast then gives each row's block dot in its own int32 lane;
// 8 of them cover a block. The 8-bit weights are biased by 128 to be unsigned; the sum
// starts at -128 * (the block's activation sum), which cancels it exactly; Q5_0's q is its
// weight + 16 and starts at -16 * that sum (llama.cpp's integer dot of q - 16). Each lane is
// scaled per block in fp32 (a multiply and one or two fmas) into the row's accumulator:
// no horizontal sums.
//
// Determinism: output (row r, column n) is its lane's chain of the same instructions in the
// same order whatever the number of rows or the tile it falls in, and one thread computes
// it whole (threads split the strips): a row's bits do not depend on its batch. Without
// AVX-512 VNNI (and BW) portable loops compute the same lanes.

namespace q8 {

constexpr int64_t L = 16;  // output rows a strip
constexpr int64_t TWO_LEVELS = 256;  // flag in block_mm_q8's `bits`: activations in two levels

// A batch of activation rows quantized per group of 32, and the exact values of its
// outlier channels. The arrays live in the calling thread's buffers (no allocation a call
// once they are big enough); the worker threads of one call only read them.
//
// Two levels (a projection whose input the rounding hurts most, down_proj: its SiLU(gate) *
// up inputs are heavy-tailed within a group): each value is q * d + q2 * d2, where q2 / d2
// round the first level's error x - q * d (one fma) per group of 32 the same way. The error
// left is ~1/254 of one level's; the product costs a second integer dot a block.
struct Acts {
  int64_t nb = 0, K = 0;
  const int8_t* q = nullptr;      // [M, nb * 32]
  const float* d = nullptr;       // [M, nb]
  const float* s = nullptr;       // [M, nb]: d * sum(q) (+ d2 * sum(q2)) per block
  const int32_t* corr = nullptr;  // [M, nb]: -offset * sum(q) per block (Q8_0: 128, Q5_0: 16)
  const float* xo = nullptr;      // [M, K]: x[r, idx[k]] (the outlier split's inputs)
  const int8_t* q2 = nullptr;     // two levels: [M, nb * 32], the error's quants, or null
  const float* d2 = nullptr;      // [M, nb]
  const int32_t* corr2 = nullptr; // [M, nb]: -offset * sum(q2)
};

// One group of 32: q = round(x / d), d = max|x| / 127; returns sum(q). With `err`, also
// err[i] = x[i] - q[i] * d (one fma: the second level's input).
inline int32_t quantize_group(const float* xb, int8_t* qb, float& d_out, float* err) {
  int32_t sum = 0;
#if defined(__AVX512F__)
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0),
                                                        _mm512_abs_ps(x1)));
  const float d = amax / 127.f;
  const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
  constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 f0 = _mm512_roundscale_ps(_mm512_mul_ps(x0, id), RN);
  const __m512 f1 = _mm512_roundscale_ps(_mm512_mul_ps(x1, id), RN);
  const __m512i i0 = _mm512_cvtps_epi32(f0), i1 = _mm512_cvtps_epi32(f1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(i0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(i1));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
  if (err) {
    const __m512 vd = _mm512_set1_ps(d);
    _mm512_storeu_ps(err, _mm512_fnmadd_ps(f0, vd, x0));
    _mm512_storeu_ps(err + 16, _mm512_fnmadd_ps(f1, vd, x1));
  }
#else
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  for (int i = 0; i < 32; ++i) {
    const float f = std::nearbyint(xb[i] * id);  // ties to even
    qb[i] = static_cast<int8_t>(f);
    sum += static_cast<int32_t>(f);
    if (err) err[i] = std::fma(-f, d, xb[i]);
  }
#endif
  d_out = d;
  return sum;
}

// A row's nb groups; with q2 (two levels) also the groups of its first level's error.
inline void quantize_row(const float* x, int64_t nb, int8_t* q, float* dd, float* ss,
                         int32_t* cr, int8_t* q2, float* dd2, int32_t* cr2, int32_t offset) {
  alignas(64) float err[32];
  for (int64_t b = 0; b < nb; ++b) {
    float d;
    const int32_t sum = quantize_group(x + b * 32, q + b * 32, d, q2 ? err : nullptr);
    dd[b] = d;
    ss[b] = d * static_cast<float>(sum);
    if (cr) cr[b] = -offset * sum;
    if (q2) {
      float d2;
      const int32_t sum2 = quantize_group(err, q2 + b * 32, d2, nullptr);
      dd2[b] = d2;
      ss[b] = std::fma(d2, static_cast<float>(sum2), ss[b]);
      if (cr2) cr2[b] = -offset * sum2;
    }
  }
}

// The calling thread's buffers (grown, never shrunk).
struct Scratch {
  std::vector<int8_t> q, q2;
  std::vector<float> d, s, xo, row, d2;
  std::vector<int32_t> corr, corr2;
};

// Rows x [M, K] (row stride xs) quantized with the channels idx [K] zeroed first (so each
// group's scale follows its ordinary channels), and those channels' exact values kept.
// The rows are few in a decode (<= 8): one thread quantizes them (waking the pool costs
// more); a prefill chunk's rows are split between the threads. Either way each row is the
// same instructions: its bits do not depend on its batch.
// `offset`: the weights' quants are their values + offset (Q8_0: 128, Q5_0: 16), whose
// corrections -offset * sum(q) are kept; 0: none.
Acts quantize(const float* x, int64_t M, int64_t xs, int64_t nb, int32_t offset,
              const int64_t* idx, int64_t K, bool two) {
  thread_local Scratch t;
  const bool corr = offset != 0;
  const int64_t k32 = nb * 32;
  t.q.resize(std::max<size_t>(t.q.size(), M * k32));
  t.d.resize(std::max<size_t>(t.d.size(), M * nb));
  t.s.resize(std::max<size_t>(t.s.size(), M * nb));
  if (corr) t.corr.resize(std::max<size_t>(t.corr.size(), M * nb));
  if (K) t.xo.resize(std::max<size_t>(t.xo.size(), M * K));
  if (two) {
    t.q2.resize(std::max<size_t>(t.q2.size(), M * k32));
    t.d2.resize(std::max<size_t>(t.d2.size(), M * nb));
    if (corr) t.corr2.resize(std::max<size_t>(t.corr2.size(), M * nb));
  }
  Acts a;
  a.nb = nb;
  a.K = K;
  a.q = t.q.data();
  a.d = t.d.data();
  a.s = t.s.data();
  a.corr = corr ? t.corr.data() : nullptr;
  a.xo = K ? t.xo.data() : nullptr;
  a.q2 = two ? t.q2.data() : nullptr;
  a.d2 = two ? t.d2.data() : nullptr;
  a.corr2 = two && corr ? t.corr2.data() : nullptr;
  int8_t* q = t.q.data();
  int8_t* q2 = two ? t.q2.data() : nullptr;
  float* dd2 = two ? t.d2.data() : nullptr;
  int32_t* cr2 = two && corr ? t.corr2.data() : nullptr;
  float *dd = t.d.data(), *ss = t.s.data(), *xo = t.xo.data();
  int32_t* cr = corr ? t.corr.data() : nullptr;
  auto rows = [&](int64_t begin, int64_t end, float* row) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = x + r * xs;
      if (K) {  // the row with its outlier channels zeroed, and their values
        std::memcpy(row, src, k32 * sizeof(float));
        for (int64_t k = 0; k < K; ++k) {
          xo[r * K + k] = src[idx[k]];
          row[idx[k]] = 0.f;
        }
        src = row;
      }
      quantize_row(src, nb, q + r * k32, dd + r * nb, ss + r * nb, cr ? cr + r * nb : nullptr,
                   q2 ? q2 + r * k32 : nullptr, q2 ? dd2 + r * nb : nullptr,
                   cr2 ? cr2 + r * nb : nullptr, offset);
    }
  };
  if (M <= 16) {
    if (K) t.row.resize(std::max<size_t>(t.row.size(), k32));
    rows(0, M, t.row.data());
  } else {
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(K ? k32 : 0);
      rows(begin, end, row.data());
    });
  }
  return a;
}

inline float h2f(_Float16 h) { return static_cast<float>(h); }

// Where a tile's results go: out[r * os + column] (= if acc; += if acc, the residual),
// bias[column] added first when given (the eager ``.add_(b)``), and the outlier split's
// exact weights side[k * sn + column] (K of them, may be 0).
struct Dest {
  float* out;
  int64_t os;
  bool acc;
  const float* bias;
  const float* side;
  int64_t sn;
};

// out[r, 16 s + l] for R activation rows from r0 and NS strips from the one at w / d / m
// (strips `sw` bytes and `sd` scales apart); `cols`: the valid columns from this strip on;
// `col0`: the first column of this strip (bias and side columns are absolute).
//
// Value of (r, j): v = sum over blocks (in block order) of the block products; then, with
// outliers, v = v + (the fma chain over k of x[r, idx[k]] * side[k, j], from 0, in k
// order): exactly the two-pass form's bits (block_mm_q8's product, then its side product
// added); then v = v + bias[j]; then out = out + v with `acc`.
// Bytes of a block of a strip for 4-, 5- and 8-bit weights.
constexpr int64_t strip_block(int bits) { return bits == 4 ? 256 : bits == 5 ? 320 : 512; }

// BITS: 4, 5 or 8; MIN: the weights have minimums (m) to add, else an offset (corr) or none.
template <int BITS, bool MIN, int LV, int R, int NS>
inline void strip_tile(const Acts& a, int64_t r0, const uint8_t* w, int64_t sw,
                       const _Float16* dp, const _Float16* mp, int64_t sd, const Dest& o,
                       int64_t col0, int64_t cols) {
  const int64_t nb = a.nb, K = a.K;
  constexpr int64_t BLK = strip_block(BITS);
  constexpr bool NIB = BITS != 8;  // nibbles: 4 vectors a block, two elements a byte
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[R][NS];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < NS; ++s) acc[r][s] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[R][NS], isum2[LV == 2 ? R : 1][NS];
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < NS; ++s) {
        isum[r][s] = MIN ? _mm512_setzero_si512()
                         : _mm512_set1_epi32(a.corr[(r0 + r) * nb + b]);
        if (LV == 2)
          isum2[r][s] = MIN ? _mm512_setzero_si512()
                            : _mm512_set1_epi32(a.corr2[(r0 + r) * nb + b]);
      }
    // k outer, strips inner: each activation broadcast feeds every strip at once (with the
    // strips outer the compiler hoisted all R x 8 broadcasts of a block and spilled them)
    const int64_t i0 = (r0 * nb + b) * 32;
    for (int k = 0; k < (NIB ? 4 : 8); ++k) {
      __m512i lo[NS], hi[NS];
      for (int s = 0; s < NS; ++s) {
        const uint8_t* wk = w + s * sw + b * BLK;
        const __m512i v = _mm512_loadu_si512(wk + 64 * k);
        lo[s] = NIB ? _mm512_and_si512(v, low) : v;
        if (NIB) hi[s] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if (BITS == 5) {  // the 5th bits: + 16 in the bytes their masks name
          uint64_t h0, h1;
          std::memcpy(&h0, wk + 256 + 16 * k, 8);
          std::memcpy(&h1, wk + 256 + 16 * k + 8, 8);
          lo[s] = _mm512_mask_add_epi8(lo[s], _cvtu64_mask64(h0), lo[s], sixteen);
          hi[s] = _mm512_mask_add_epi8(hi[s], _cvtu64_mask64(h1), hi[s], sixteen);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = i0 + r * nb * 32 + 4 * k;
        for (int lv = 0; lv < LV; ++lv) {
          const int8_t* q = lv ? a.q2 : a.q;
          int32_t a0, a1 = 0;
          std::memcpy(&a0, q + i, 4);
          if (NIB) std::memcpy(&a1, q + i + 16, 4);
          const __m512i b0 = _mm512_set1_epi32(a0), b1 = _mm512_set1_epi32(a1);
          for (int s = 0; s < NS; ++s) {
            __m512i& acc_i = lv ? isum2[LV == 2 ? r : 0][s] : isum[r][s];
            acc_i = _mm512_dpbusd_epi32(acc_i, lo[s], b0);
            if (NIB) acc_i = _mm512_dpbusd_epi32(acc_i, hi[s], b1);
          }
        }
      }
    }
    for (int s = 0; s < NS; ++s) {
      const __m512 dw = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dp + s * sd + b * L)));
      __m512 mw = _mm512_setzero_ps();
      if (MIN)
        mw = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mp + s * sd + b * L)));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        acc[r][s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][s]),
                                    _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i])), acc[r][s]);
        if (LV == 2)
          acc[r][s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum2[r][s]),
                                      _mm512_mul_ps(dw, _mm512_set1_ps(a.d2[i])), acc[r][s]);
        if (MIN) acc[r][s] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[i]), acc[r][s]);
      }
    }
  }
  __mmask16 keep[NS];
  for (int s = 0; s < NS; ++s) {
    const int64_t left = cols - s * L;
    keep[s] = left >= L ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
  }
  if (K) {  // each (row, strip)'s chain over the channels in channel order, chains interleaved
    __m512 side[R][NS];
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < NS; ++s) side[r][s] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k)
      for (int s = 0; s < NS; ++s) {
        const __m512 sw_k = _mm512_maskz_loadu_ps(keep[s], o.side + k * o.sn + col0 + s * L);
        for (int r = 0; r < R; ++r)
          side[r][s] = _mm512_fmadd_ps(_mm512_set1_ps(a.xo[(r0 + r) * K + k]), sw_k,
                                       side[r][s]);
      }
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < NS; ++s) acc[r][s] = _mm512_add_ps(acc[r][s], side[r][s]);
  }
  for (int s = 0; s < NS; ++s) {
    const int64_t c = col0 + s * L;
    for (int r = 0; r < R; ++r) {
      __m512 v = acc[r][s];
      if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep[s], o.bias + c));
      float* dst = o.out + (r0 + r) * o.os + c;
      if (o.acc) v = _mm512_add_ps(_mm512_maskz_loadu_ps(keep[s], dst), v);
      _mm512_mask_storeu_ps(dst, keep[s], v);
    }
  }
#else
  float acc[R][NS][L] = {};
  for (int64_t b = 0; b < nb; ++b) {
    for (int s = 0; s < NS; ++s) {
      const uint8_t* wb = w + s * sw + b * BLK;
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        for (int l = 0; l < L; ++l) {
          int32_t isum[2] = {0, 0};
          for (int lv = 0; lv < LV; ++lv) {
            const int8_t* aq = (lv ? a.q2 : a.q) + i * 32;
            isum[lv] = MIN ? 0 : (lv ? a.corr2 : a.corr)[i];
            for (int k = 0; k < (NIB ? 4 : 8); ++k)
              for (int t = 0; t < 4; ++t) {
                const uint8_t q = wb[64 * k + 4 * l + t];
                int32_t h0 = 0, h1 = 0;  // the 5th bits (16 or 0)
                if (BITS == 5) {
                  const int bit = 4 * l + t;
                  h0 = ((wb[256 + 16 * k + bit / 8] >> (bit % 8)) & 1) << 4;
                  h1 = ((wb[256 + 16 * k + 8 + bit / 8] >> (bit % 8)) & 1) << 4;
                }
                if (NIB)
                  isum[lv] += (int32_t{q & 15} | h0) * aq[4 * k + t] +
                              (int32_t{q >> 4} | h1) * aq[16 + 4 * k + t];
                else
                  isum[lv] += int32_t{q} * aq[4 * k + t];
              }
          }
          const float dw = h2f(dp[s * sd + b * L + l]);
          acc[r][s][l] = std::fma(static_cast<float>(isum[0]), dw * a.d[i], acc[r][s][l]);
          if (LV == 2)
            acc[r][s][l] = std::fma(static_cast<float>(isum[1]), dw * a.d2[i], acc[r][s][l]);
          if (MIN)
            acc[r][s][l] = std::fma(h2f(mp[s * sd + b * L + l]), a.s[i], acc[r][s][l]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < NS; ++s)
      for (int l = 0; l < L && s * L + l < cols; ++l) {
        const int64_t c = col0 + s * L + l;
        float v = acc[r][s][l];
        if (K) {
          float side = 0.f;
          for (int64_t k = 0; k < K; ++k)
            side = std::fma(a.xo[(r0 + r) * K + k], o.side[k * o.sn + c], side);
          v += side;
        }
        if (o.bias) v += o.bias[c];
        float& dst = o.out[(r0 + r) * o.os + c];
        dst = o.acc ? dst + v : v;
      }
#endif
}

template <int BITS, bool MIN, int LV, int NS>
void strips_rows(const Acts& a, int64_t M, const uint8_t* w, int64_t sw, const _Float16* dp,
                 const _Float16* mp, int64_t sd, const Dest& o, int64_t col0, int64_t cols) {
  // two levels hold twice the integer sums: tiles of 2 rows keep them in registers
  // (a row's bits do not depend on its tile)
  constexpr int RT = LV == 2 ? 2 : 4;
  int64_t r = 0;
  for (; r + RT <= M; r += RT)
    strip_tile<BITS, MIN, LV, RT, NS>(a, r, w, sw, dp, mp, sd, o, col0, cols);
  switch (M - r) {
    case 0: break;
    case 1: strip_tile<BITS, MIN, LV, 1, NS>(a, r, w, sw, dp, mp, sd, o, col0, cols); break;
    case 2: strip_tile<BITS, MIN, LV, 2, NS>(a, r, w, sw, dp, mp, sd, o, col0, cols); break;
    default: strip_tile<BITS, MIN, LV, 3, NS>(a, r, w, sw, dp, mp, sd, o, col0, cols); break;
  }
}

// One parallel region a call: threads split the strips; each tile adds its outlier
// product, bias and residual while its accumulators are in registers.
template <int BITS, bool MIN, int LV>
void mm(const Acts& a, int64_t M, const uint8_t* qs, const _Float16* dp, const _Float16* mp,
        int64_t N, const Dest& o) {
  const int64_t nb = a.nb, strips = (N + L - 1) / L;
  const int64_t sw = nb * strip_block(BITS), sd = nb * L;
  const int64_t group = M <= 2 ? 4 : 2;  // strips a tile: independent chains for few rows
  at::parallel_for(0, strips, group, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end;) {
      const int64_t ns = s + group <= end ? group : 1;
      const _Float16* m = MIN ? mp + s * sd : nullptr;
      const int64_t col0 = s * L, cols = N - col0;
      if (ns == 4)
        strips_rows<BITS, MIN, LV, 4>(a, M, qs + s * sw, sw, dp + s * sd, m, sd, o, col0, cols);
      else if (ns == 2)
        strips_rows<BITS, MIN, LV, 2>(a, M, qs + s * sw, sw, dp + s * sd, m, sd, o, col0, cols);
      else
        strips_rows<BITS, MIN, LV, 1>(a, M, qs + s * sw, sw, dp + s * sd, m, sd, o, col0, cols);
      s += ns;
    }
  });
}

}  // namespace q8

// x [M, K] float32 (rows may be strided) times a StripBlocks weight of N output rows, on
// int8-quantized activations (see the section's comment), into out [M, n] (rows may be
// strided): out = x W^T (+ bias), or out += that with `accumulate` (a residual).
//
// Outlier split (idx, side): the input channels idx (int64 [K], K may be 0) are zeroed before
// the rounding, so that each group's scale follows its ordinary channels, and added back
// exactly: out[r, j] gets + sum_k x[r, idx[k]] * side[k, j] (side float32 [K, n]: the file's
// dequantized weights of those columns), one fma chain a value in k order, added to the
// value's block sum in the tile that computes it: a row's bits do not depend on its batch.
//
// `bits`: the weights' 4, 5 or 8, plus TWO_LEVELS (256) for activations in two levels (Acts);
// 5 bits with m empty is Q5_0 (its quants are the weight + 16).
void block_mm_q8_out(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                     const torch::Tensor& m, int64_t code, int64_t n, const torch::Tensor& idx,
                     const torch::Tensor& side, const torch::Tensor& bias,
                     const torch::Tensor& out, bool accumulate) {
  const bool two = (code & q8::TWO_LEVELS) != 0;
  const int64_t bits = code & ~q8::TWO_LEVELS;
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8,
              "block_mm_q8: bits must be 4, 5 or 8 (+ 256: two levels)");
  TORCH_CHECK(d.dtype() == torch::kFloat16 && d.dim() == 3 && d.is_contiguous() &&
              d.size(2) == q8::L, "block_mm_q8: d float16 [strips, nb, 16]");
  const int64_t strips = d.size(0), nb = d.size(1);
  TORCH_CHECK(n > (strips - 1) * q8::L && n <= strips * q8::L, "block_mm_q8: ", n,
              " output rows in ", strips, " strips of 16");
  TORCH_CHECK(qs.is_contiguous() && qs.scalar_type() == torch::kUInt8 &&
              qs.numel() == strips * nb * q8::strip_block(bits), "block_mm_q8: qs sizes");
  const bool has_min = m.numel() != 0;
  TORCH_CHECK((bits == 4 ? has_min : bits == 8 ? !has_min : true) &&
                  (!has_min || (m.sizes() == d.sizes() && m.dtype() == torch::kFloat16 &&
                                m.is_contiguous())),
              "block_mm_q8: m float16 like d for 4 bits and Q5_1, empty for Q5_0 and 8 bits");
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "block_mm_q8: x float32 [M, K]");
  TORCH_CHECK(x.size(1) == nb * 32, "block_mm_q8: x has ", x.size(1), " columns, weight ",
              nb * 32);
  const int64_t M = x.size(0);
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.dim() == 2 && out.size(0) == M &&
              out.size(1) == n && out.stride(1) == 1, "block_mm_q8: out float32 [M, n]");
  const int64_t K = idx.numel();
  TORCH_CHECK(idx.scalar_type() == torch::kInt64 && idx.dim() == 1 && idx.is_contiguous(),
              "block_mm_q8: idx int64 [K]");
  TORCH_CHECK(side.scalar_type() == torch::kFloat32 && side.dim() == 2 &&
              side.is_contiguous() && side.size(0) == K && (K == 0 || side.size(1) == n),
              "block_mm_q8: side float32 [K, n]");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kFloat32 &&
                                    bias.is_contiguous() && bias.numel() == n),
              "block_mm_q8: bias float32 [n] or empty");
  if (M == 0) return;
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t k = 0; k < K; ++k)
    TORCH_CHECK(ip[k] >= 0 && ip[k] < nb * 32, "block_mm_q8: outlier channel out of range");
  const q8::Acts a =
      q8::quantize(x.data_ptr<float>(), M, x.stride(0), nb,
                   has_min ? 0 : bits == 8 ? 128 : 16, ip, K, two);
  const q8::Dest o{out.data_ptr<float>(), out.stride(0), accumulate,
                   bias.numel() ? bias.data_ptr<float>() : nullptr,
                   K ? side.data_ptr<float>() : nullptr, n};
  const auto* q = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const auto* dp = reinterpret_cast<const _Float16*>(d.data_ptr());
  const auto* mp = reinterpret_cast<const _Float16*>(m.data_ptr());
  if (bits == 4)
    two ? q8::mm<4, true, 2>(a, M, q, dp, mp, n, o) : q8::mm<4, true, 1>(a, M, q, dp, mp, n, o);
  else if (bits == 5 && has_min)
    two ? q8::mm<5, true, 2>(a, M, q, dp, mp, n, o) : q8::mm<5, true, 1>(a, M, q, dp, mp, n, o);
  else if (bits == 5)
    two ? q8::mm<5, false, 2>(a, M, q, dp, nullptr, n, o)
        : q8::mm<5, false, 1>(a, M, q, dp, nullptr, n, o);
  else
    two ? q8::mm<8, false, 2>(a, M, q, dp, nullptr, n, o)
        : q8::mm<8, false, 1>(a, M, q, dp, nullptr, n, o);
}

// The same into a new [M, n] (no bias: Python adds it).
torch::Tensor block_mm_q8(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                          int64_t bits, int64_t n, torch::Tensor idx, torch::Tensor side) {
  TORCH_CHECK(x.dim() == 2, "block_mm_q8: x float32 [M, K]");
  auto out = torch::empty({x.size(0), n}, x.options());
  static const torch::Tensor none = torch::empty({0}, torch::kFloat32);
  block_mm_q8_out(x, qs, d, m, bits, n, idx, side, none, out, false);
  return out;
}
// Also a dispatcher op, for C++ callers in other extensions (a fused decode step):
// c10::Dispatcher::singleton().findSchemaOrThrow("pie_ctx_blocks::block_mm", "") or, from
// Python, torch.ops.pie_ctx_blocks.block_mm(x, qs, d, m, bits). block_mm_q8_out's C++
// signature is decode_step.cpp's typed call: keep the two alike. (A build for another
// instruction set, kernels.build(march=...), leaves the names to the native build.)
#ifndef PIE_CTX_NO_DISPATCHER_OPS
TORCH_LIBRARY(pie_ctx_blocks, m) {
  m.def("block_mm(Tensor x, Tensor qs, Tensor d, Tensor m, int bits) -> Tensor", &block_mm);
  m.def("block_mm_q8(Tensor x, Tensor qs, Tensor d, Tensor m, int bits, int n, Tensor idx, "
        "Tensor side) -> Tensor",
        &block_mm_q8);
  m.def("block_mm_q8_out(Tensor x, Tensor qs, Tensor d, Tensor m, int bits, int n, "
        "Tensor idx, Tensor side, Tensor bias, Tensor(a!) out, bool accumulate) -> ()",
        &block_mm_q8_out);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_mm", &block_mm, "x @ W.T for W in GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)");
  m.def("block_mm_q8", &block_mm_q8,
        "x @ W.T for W in strips of GGUF blocks, on int8-quantized activations (VNNI)");
  m.def("block_mm_q8_out", &block_mm_q8_out,
        "block_mm_q8 into out (rows may be strided): = or += x @ W.T (+ bias)");
  m.def("block_rows", &block_rows, "rows of a GGUF block weight, dequantized to float32");
}
