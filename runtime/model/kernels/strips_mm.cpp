// pie-ctx's projection kernels over weights packed in strips of 16 output rows: x @ W.T for
// fp32 weights (f32_strips_mm) and for int8 weights times int8 activations
// (int8_strips_mm). Both are row-count invariant by construction: an output's sum runs
// one fixed chain whatever the call's row count, tile or threads (fp32), or is exact
// (int32), so deterministic numerics can use them at every row count; and they are fast
// where the library GEMMs are slow, a few rows (decode), without losing the chunks.
//
// int8 (``int8_strips``): the sums equal at::_int_mm's, and runtime/model/matmul.py
// dequantizes them with the same dequantize_int32 as ``int_mm``, so the two are one
// class of deterministic numerics and the choice at load takes whichever is faster per
// row bucket. Layout (pack_int8_strips): strip s holds, for every 4 input columns k4, the
// 16 rows' 4 bytes side by side: packed[s, k4, r, j] = q[16 s + r, 4 k4 + j] (zero past N
// or K). One vpdpbusd adds four products into each of 16 output lanes, with the row's 4
// activation bytes broadcast. vpdpbusd multiplies unsigned bytes by signed ones: the
// activations go in as x + 128 (their sign bit flipped) and 128 times each weight row's
// sum (sums[n]) comes off after. Bounds: |sum| <= K * 255 * 127 fits int32 for K < 66,000.
// AVX-512 VNNI only: elsewhere int8_strips_native() is false, matmul.py does not offer the
// kernel, and int8_strips_mm refuses to run (torch._int_mm serves those CPUs).
//
// fp32 (``f32_strips``): see f32_strips_mm below; any CPU (vec16.h's vectors).
//
// Built into the cpu_ops module (runtime/model/kernels/__init__.py, SOURCES).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec16.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PIE_CTX_INT8_VNNI 1
#endif

namespace {

constexpr int64_t LANES = 16;  // output rows of a strip
constexpr int64_t RT = 4;      // activation rows of one register tile
constexpr int64_t ST = 4;      // strips of one register tile

// Activations as vpdpbusd's unsigned operand: x + 128 per byte, rows padded to K4 * 4 bytes
// with 128 (zero), as int32 words (four bytes each) so each is broadcast in one load.
std::vector<int32_t> flipped(const torch::Tensor& xq, int64_t K4) {
  const int64_t M = xq.size(0), K = xq.size(1);
  std::vector<int32_t> out(M * K4);
  auto* bytes = reinterpret_cast<uint8_t*>(out.data());
  const int8_t* x = xq.data_ptr<int8_t>();
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* dst = bytes + m * K4 * 4;
    const int8_t* src = x + m * xq.stride(0);
    for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<uint8_t>(src[k]) ^ 0x80;
    for (int64_t k = K; k < K4 * 4; ++k) dst[k] = 0x80;
  }
  return out;
}

#ifdef PIE_CTX_INT8_VNNI
// rt activation rows x st strips: sums over every k4 into registers, then minus 128 times
// the weight rows' sums, stored to out's [rt, 16 * st] block (the last strip masked at N).
template <int R, int S>
inline void tile(const int32_t* x, int64_t K4, const int8_t* w, int64_t strip_bytes,
                 const int32_t* sums, int32_t* out, int64_t n0,
                 int64_t N) {
  __m512i acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_si512();
  for (int64_t k4 = 0; k4 < K4; ++k4) {
    __m512i wv[S];
    for (int s = 0; s < S; ++s)
      wv[s] = _mm512_loadu_si512(w + s * strip_bytes + k4 * 64);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(x[r * K4 + k4]);
      for (int s = 0; s < S; ++s) acc[r][s] = _mm512_dpbusd_epi32(acc[r][s], xb, wv[s]);
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t n = n0 + s * LANES;
    const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(sums + n), 7);
    const int64_t left = std::min<int64_t>(LANES, N - n);
    const __mmask16 mask = left >= LANES ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_epi32(out + r * N + n, mask, _mm512_sub_epi32(acc[r][s], off));
  }
}

template <int S>
inline void tile_rows(int rt, const int32_t* x, int64_t K4, const int8_t* w,
                      int64_t strip_bytes, const int32_t* sums, int32_t* out,
                      int64_t n0, int64_t N) {
  switch (rt) {
    case 1: return tile<1, S>(x, K4, w, strip_bytes, sums, out, n0, N);
    case 2: return tile<2, S>(x, K4, w, strip_bytes, sums, out, n0, N);
    case 3: return tile<3, S>(x, K4, w, strip_bytes, sums, out, n0, N);
    default: return tile<4, S>(x, K4, w, strip_bytes, sums, out, n0, N);
  }
}
#endif

}  // namespace

// Whether int8_strips_mm can run here (built with AVX-512 VNNI).
bool int8_strips_native() {
#ifdef PIE_CTX_INT8_VNNI
  return true;
#else
  return false;
#endif
}

// q [N, K] int8 -> (packed [ceil(N / 16), ceil(K / 4), 16, 4] int8, sums [ceil(N / 16) * 16]
// int32: each weight row's sum, zero past N).
std::vector<torch::Tensor> pack_int8_strips(torch::Tensor q) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2, "pack_int8_strips: int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  const int64_t strips = (N + LANES - 1) / LANES, K4 = (K + 3) / 4;
  auto padded = torch::zeros({strips * LANES, K4 * 4}, q.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(q);
  auto packed = padded.view({strips, LANES, K4, 4}).permute({0, 2, 1, 3}).contiguous();
  auto sums = padded.sum(1, /*keepdim=*/false, torch::kInt32);
  return {packed, sums};
}

// xq [M, K] int8 (rows contiguous) times the packed weight of N output rows: [M, N] int32,
// equal to at::_int_mm(xq, q.t()).
torch::Tensor int8_strips_mm(torch::Tensor xq, torch::Tensor packed, torch::Tensor sums,
                             int64_t N) {
  TORCH_CHECK(xq.dtype() == torch::kInt8 && xq.dim() == 2 && xq.stride(1) == 1 &&
              packed.dtype() == torch::kInt8 && packed.dim() == 4 && packed.is_contiguous() &&
              packed.size(1) == (xq.size(1) + 3) / 4 && packed.size(0) * LANES >= N &&
              sums.dtype() == torch::kInt32 && sums.numel() == packed.size(0) * LANES,
              "int8_strips_mm: int8 [M, K] activations and pack_int8_strips' layout");
  TORCH_CHECK(int8_strips_native(), "int8_strips_mm: needs AVX-512 VNNI (use torch._int_mm)");
  const int64_t M = xq.size(0), K4 = packed.size(1), strips = packed.size(0);
  auto out = torch::empty({M, N}, xq.options().dtype(torch::kInt32));
  if (M == 0 || N == 0) return out;
  const std::vector<int32_t> x = flipped(xq, K4);
  const int8_t* w = packed.data_ptr<int8_t>();
  const int32_t* sum = sums.data_ptr<int32_t>();
  int32_t* o = out.data_ptr<int32_t>();
  const int64_t strip_bytes = K4 * LANES * 4;
  const int64_t tiles = (strips + ST - 1) / ST;
  // a tile of strips a task; few enough tasks a call that the hand-off stays small
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, M * K4 * ST * 16));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s0 = t * ST, st = std::min(ST, strips - s0);
      for (int64_t m0 = 0; m0 < M; m0 += RT) {
        const int rt = static_cast<int>(std::min(RT, M - m0));
#ifdef PIE_CTX_INT8_VNNI  // (checked above: without it this loop never runs)
        const int32_t* xr = x.data() + m0 * K4;
        const int8_t* ws = w + s0 * strip_bytes;
        int32_t* orow = o + m0 * N;
        const int64_t n0 = s0 * LANES;
        switch (st) {
          case 1: tile_rows<1>(rt, xr, K4, ws, strip_bytes, sum, orow, n0, N); break;
          case 2: tile_rows<2>(rt, xr, K4, ws, strip_bytes, sum, orow, n0, N); break;
          case 3: tile_rows<3>(rt, xr, K4, ws, strip_bytes, sum, orow, n0, N); break;
          default: tile_rows<4>(rt, xr, K4, ws, strip_bytes, sum, orow, n0, N); break;
        }
#endif
      }
    }
  });
  return out;
}

// ---- fp32 weights in strips: a row's sums in one fixed order, whatever the call ----
//
// packed[s, k, r] = W[16 s + r, k] (zero past N): strip s is K vectors of its 16 rows'
// weights. out[m, n] = the chain fma(x[m, k], W[n, k], .) over k = 0, 1, ..., K - 1 from
// zero (one rounding each, vec16.h's fmadd), then + bias[n]: every (row, output) pair
// takes that chain whatever the row count, the tile it falls in or the threads, so the
// kernel is row-count invariant by construction (deterministic numerics' rule) on every
// CPU, and as fast as a GEMM's register tile allows.

#if defined(__AVX512F__)
constexpr int64_t FRT = 6;  // activation rows of one fp32 register tile
constexpr int64_t FST = 4;  // strips of one fp32 register tile (24 accumulators of 32)
#else
constexpr int64_t FRT = 4;  // AVX2: a v16 is two of its 16 registers
constexpr int64_t FST = 1;
#endif

// W [N, K] float32 -> packed [ceil(N / 16), K, 16] float32.
torch::Tensor pack_f32_strips(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 2, "pack_f32_strips: float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), strips = (N + LANES - 1) / LANES;
  auto padded = torch::zeros({strips * LANES, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  auto packed = padded.view({strips, LANES, K}).transpose(1, 2).contiguous();
  return packed;
}

namespace {

// x in every lane, loaded straight into the register (vec16.h's splat adds it to zero: an
// extra add on the FMA ports a broadcast, 6 in 24 FMAs here)
inline v16 broadcast(const float* x) {
#if defined(__AVX512F__)
  return (v16)_mm512_set1_ps(*x);
#else
  return splat(*x);
#endif
}

template <int R, int S>
inline void f32_tile(const float* x, int64_t x_row, int64_t K, const float* w,
                     const float* bias, float* out, int64_t N, int64_t n0) {
  v16 acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    v16 wv[S];
    for (int s = 0; s < S; ++s) wv[s] = load(w + (s * K + k) * LANES);
    for (int r = 0; r < R; ++r) {
      const v16 xb = broadcast(x + r * x_row + k);
      for (int s = 0; s < S; ++s) acc[r][s] = fmadd(xb, wv[s], acc[r][s]);
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t n = n0 + s * LANES, left = std::min<int64_t>(LANES, N - n);
    float b[LANES] = {};
    if (bias != nullptr) std::memcpy(b, bias + n, left * sizeof(float));
    for (int r = 0; r < R; ++r) {
      float v[LANES];
      store(v, acc[r][s] + load(b));
      std::memcpy(out + r * N + n, v, left * sizeof(float));
    }
  }
}

template <int S>
inline void f32_rows(int rt, const float* x, int64_t x_row, int64_t K, const float* w,
                     const float* bias, float* out, int64_t N, int64_t n0) {
  switch (rt) {
    case 1: return f32_tile<1, S>(x, x_row, K, w, bias, out, N, n0);
    case 2: return f32_tile<2, S>(x, x_row, K, w, bias, out, N, n0);
    case 3: return f32_tile<3, S>(x, x_row, K, w, bias, out, N, n0);
    case 4: return f32_tile<4, S>(x, x_row, K, w, bias, out, N, n0);
    case 5: return f32_tile<5, S>(x, x_row, K, w, bias, out, N, n0);
    default: return f32_tile<6, S>(x, x_row, K, w, bias, out, N, n0);
  }
}

}  // namespace

// x [M, K] float32 (rows contiguous) times the packed weight of N output rows (+ bias [N]
// or empty): [M, N] float32.
torch::Tensor f32_strips_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor bias,
                            int64_t N) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1 &&
              packed.dtype() == torch::kFloat32 && packed.dim() == 3 &&
              packed.is_contiguous() && packed.size(1) == x.size(1) &&
              packed.size(0) * LANES >= N && packed.size(0) * LANES < N + LANES &&
              (bias.numel() == 0 || (bias.dtype() == torch::kFloat32 &&
                                     bias.is_contiguous() && bias.numel() == N)),
              "f32_strips_mm: float32 [M, K] activations, pack_f32_strips' layout, bias [N]");
  const int64_t M = x.size(0), K = x.size(1), strips = packed.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  // work items: a tile of strips x a block of rows (so 2 threads share 9 tiles evenly),
  // strip-major so a thread's consecutive items reuse one tile's weights from cache
  const int64_t x_row = x.stride(0), tiles = (strips + FST - 1) / FST;
  const int64_t rows_per = M <= 4 * FRT ? M : 8 * FRT, blocks = (M + rows_per - 1) / rows_per;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, rows_per * K * FST * 16));
  at::parallel_for(0, tiles * blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / blocks, mb = item % blocks;
      const int64_t s0 = t * FST, st = std::min(FST, strips - s0);
      const float* ws = w + s0 * K * LANES;
      for (int64_t m0 = mb * rows_per; m0 < std::min(M, (mb + 1) * rows_per); m0 += FRT) {
        const int rt = static_cast<int>(std::min(FRT, M - m0));
        const float* xr = xp + m0 * x_row;
        float* orow = o + m0 * N;
        switch (st) {
          case 1: f32_rows<1>(rt, xr, x_row, K, ws, b, orow, N, s0 * LANES); break;
          case 2: f32_rows<2>(rt, xr, x_row, K, ws, b, orow, N, s0 * LANES); break;
          case 3: f32_rows<3>(rt, xr, x_row, K, ws, b, orow, N, s0 * LANES); break;
          default: f32_rows<4>(rt, xr, x_row, K, ws, b, orow, N, s0 * LANES); break;
        }
      }
    }
  });
  return out;
}

void register_strips_mm(pybind11::module_& m) {
  m.def("pack_f32_strips", &pack_f32_strips, "a float32 weight in 16-row strips");
  m.def("f32_strips_mm", &f32_strips_mm, "float32 activations x packed weight, fixed order");
  m.def("int8_strips_native", &int8_strips_native, "int8_strips_mm runs on AVX-512 VNNI");
  m.def("pack_int8_strips", &pack_int8_strips, "an int8 weight in 16-row strips");
  m.def("int8_strips_mm", &int8_strips_mm, "int8 activations x packed int8 weight, int32");
}
