// pie-ctx CPU kernels for weights in a GGUF file's K-quant super-blocks (Q4_K, Q5_K, Q6_K).
//
// Built at first use by runtime/model/kernels/__init__.py (kquant_ops()), with
// -ffp-contract=off: every a * b + c below is two roundings unless it is spelled as an fma.
// The weights are read in ggml's own byte layout, straight from the file (a uint8 tensor
// [N, row bytes] whose rows are the super-blocks of one output row; rows may be strided):
//
//   Q4_K (144 bytes / 256 weights): d, dmin (fp16), scales[12] (eight 6-bit scales and
//     eight 6-bit mins), qs[128]: weight 64 j + l is the low nibble of qs[32 j + l] (sub-block
//     2 j), weight 64 j + 32 + l its high nibble (sub-block 2 j + 1);
//     w = (d * sc) * q - (dmin * m) with the scale and min of its sub-block of 32.
//   Q5_K (176): d, dmin, scales[12], qh[32], qs[128]: as Q4_K with a fifth bit, bit s of
//     qh[l] for the weight l of sub-block s.
//   Q6_K (210): ql[128], qh[64], scales[16] (int8), d: weight 128 h + 32 k + l is
//     (nibble of ql[64 h + l + 32 (k & 1)], low for k < 2) | ((qh[32 h + l] >> 2 k) & 3) << 4,
//     minus 32; w = (d * sc) * q with the scale of its sub-block of 16.
//
// Two products (kquant_mm_parts, over a weight's parts in one parallel region), both with
// a row's result independent of its batch (each (row, column) is one chain of the same
// instructions in the same order whatever the number of rows, and one thread computes it
// whole: threads split the output columns):
//
// * exact (q8 false): fp32 activations times the weights dequantized exactly as ggml (and
//   gguf.quants.dequantize) form them: the file's model, no activation rounding.
// * q8 true: llama.cpp's way: each activation row quantized per 256 to q8_K
//   (iscale = -127 / (the value of largest magnitude), q = round(x * iscale) ties to even,
//   d = 1 / iscale, sums per 16), then integer dots with the weights' sub-block scales (and
//   mins) per super-block, scaled once a super-block in fp32. Three code paths, chosen by
//   the caller (``isa``): AVX-512 VNNI (few rows: maddubs then dpwssd with the scales; many
//   rows: columns in lanes, dpbusd; a packed weight (below): its own kernel at every size;
//   all the same chain per (row, column)), AVX2 (maddubs then madd), and portable C++; each
//   keeps the invariance above. A packed weight on a path other than its kernel is read
//   row by row, gathered back into the file's layout.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec16.h"

namespace {

constexpr int64_t QK = 256;  // weights a super-block
// ggml's type ids: the kind argument (runtime/model/kquants.py's table passes them)
constexpr int64_t Q4_K = 12, Q5_K = 13, Q6_K = 14;
// code paths of the q8_K product (kquants.py's ISAS)
constexpr int64_t PORTABLE = 0, AVX2 = 1, AVX512 = 2;

constexpr int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

// ---------------------------------------------------------------- the packed layout
//
// A part whose output rows are a multiple of PACK may be stored packed (its kind code plus
// PACKED; kquant_pack makes it from the file's bytes at load, on AVX-512 builds): the same
// bytes, reordered so that 16 output columns sit in the 16 dword lanes of one vector. Each
// group of PACK consecutive output rows is one run of PACK rows' bytes; in it, super-block
// b takes PACK * padded_bytes bytes, its dword k of column c at (k * PACK + c) * 4 (a block
// padded to whole dwords: Q6_K's 210 bytes to 212, the pad zero), k the block's own dword
// order except for Q6_K, whose dwords come in the order its kernel reads them (so that a
// group is read front to back, as the hardware prefetchers follow: natural_dword). The q8_K
// product then reads a super-block of 16 columns as 36-53 aligned vectors, as llama.cpp's repacked
// layouts do, where the file's layout needs each column's scales decoded and its sums
// folded across lanes (tile_512) or the columns transposed at every call (unpack_group).
constexpr int64_t PACK = 16, PACKED = 100;

constexpr int64_t padded_bytes(int64_t kind) { return (block_bytes(kind) + 3) / 4 * 4; }

// The block's own dword at packed position p. Q6_K: d (dword 52), the scales (48..51), then
// per (h, half of l4, l4) its ql dwords 16 h + l4 and 16 h + 8 + l4 and its qh dword 32 + 8 h
// + l4 (packed_tile's loop).
constexpr int64_t natural_dword(int64_t kind, int64_t p) {
  if (kind != Q6_K) return p;
  if (p == 0) return 52;
  if (p <= 4) return 48 + p - 1;
  const int64_t i = (p - 5) / 3, which = (p - 5) % 3, h = i / 8, l4 = i % 8;
  return which == 0 ? 16 * h + l4 : which == 1 ? 16 * h + 8 + l4 : 32 + 8 * h + l4;
}

// Super-block of column c copied from ``from`` to ``to``: from the file's layout (its
// block_bytes) into a packed group's super-block (PACK * padded_bytes bytes), or back.
template <bool to_packed>
inline void move_block(int64_t kind, const uint8_t* from, uint8_t* to, int64_t c) {
  const int64_t bb = block_bytes(kind);
  for (int64_t p = 0; p < padded_bytes(kind) / 4; ++p) {
    const int64_t at = 4 * natural_dword(kind, p), in_group = (p * PACK + c) * 4;
    const int64_t n = std::min<int64_t>(4, bb - at);
    if constexpr (to_packed) std::memcpy(to + in_group, from + at, n);
    else std::memcpy(to + at, from + in_group, n);
  }
}

// A kind code as the kernels take it: the format, and whether the part is packed.
inline int64_t format_of(int64_t code) { return code >= PACKED ? code - PACKED : code; }

// Output row n of a weight (``w``: its bytes, ``ws``: a row's stride) in the file's layout:
// in place, or gathered from the packed groups into ``buf`` (nb * block_bytes bytes).
const uint8_t* natural_row(const uint8_t* w, int64_t ws, int64_t kind, bool packed, int64_t n,
                           int64_t nb, std::vector<uint8_t>& buf) {
  if (!packed) return w + n * ws;
  const int64_t bb = block_bytes(kind), bbp = padded_bytes(kind);
  buf.resize(nb * bb);
  const uint8_t* group = w + (n - n % PACK) * ws;
  const int64_t c = n % PACK;
  for (int64_t b = 0; b < nb; ++b)
    move_block<false>(kind, group + b * PACK * bbp, buf.data() + b * bb, c);
  return buf.data();
}

inline float half(const uint8_t* p) {
  _Float16 h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// The eight 6-bit scales and mins of a Q4_K / Q5_K super-block's 12 bytes, one a byte of
// ``sc`` and ``m`` (in registers: a vector path widens them without a trip through memory).
inline void scales_mins64(const uint8_t* s, uint64_t& sc, uint64_t& m) {
  uint32_t u0, u1, u2;
  std::memcpy(&u0, s, 4);
  std::memcpy(&u1, s + 4, 4);
  std::memcpy(&u2, s + 8, 4);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  const uint32_t m_hi = ((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4);
  const uint32_t m_lo = u1 & k1;
  const uint32_t sc_hi = (u2 & k2) | (((u0 >> 6) & k3) << 4);
  sc = (u0 & k1) | (uint64_t{sc_hi} << 32);
  m = m_lo | (uint64_t{m_hi} << 32);
}

inline void scales_mins(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  uint64_t a, b;
  scales_mins64(s, a, b);
  std::memcpy(sc, &a, 8);
  std::memcpy(m, &b, 8);
}

// ----------------------------------------------------------------- exact dequantization

// 256 weights of one super-block, as ggml's dequantize_row_q*_K forms them.
void dequant(int64_t kind, const uint8_t* b, float* y) {
  if (kind == Q6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    for (int h = 0; h < 2; ++h) {
      float ds[8];
      for (int i = 0; i < 8; ++i) ds[i] = d * static_cast<float>(sc[8 * h + i]);
      for (int k = 0; k < 4; ++k) {  // (loops the compiler vectorises: one scale, one shift)
        const int shift = k < 2 ? 0 : 4;
        for (int half = 0; half < 2; ++half) {
          const float scale = ds[2 * k + half];
          const uint8_t* lo = ql + 64 * h + 32 * (k & 1) + 16 * half;
          const uint8_t* hi = qh + 32 * h + 16 * half;
          float* out = y + 128 * h + 32 * k + 16 * half;
          for (int l = 0; l < 16; ++l) {
            const int q = (((lo[l] >> shift) & 15) | (((hi[l] >> (2 * k)) & 3) << 4)) - 32;
            out[l] = scale * static_cast<float>(q);
          }
        }
      }
    }
    return;
  }
  const float d = half(b), dmin = half(b + 2);
  uint8_t sc[8], mn[8];
  scales_mins(b + 4, sc, mn);
  const uint8_t* qh = b + 16;  // Q5_K
  const uint8_t* qs = b + (kind == Q5_K ? 48 : 16);
  for (int s = 0; s < 8; ++s) {
    const float ds = d * static_cast<float>(sc[s]), ms = dmin * static_cast<float>(mn[s]);
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = qs[32 * (s / 2) + l];
      int q = s & 1 ? byte >> 4 : byte & 15;
      if (kind == Q5_K) q |= ((qh[l] >> s) & 1) << 4;
      y[32 * s + l] = ds * static_cast<float>(q) - ms;  // two roundings, as ggml
    }
  }
}

void dequant_row(int64_t kind, const uint8_t* row, int64_t nb, float* y) {
  const int64_t bb = block_bytes(kind);
  for (int64_t b = 0; b < nb; ++b) dequant(kind, row + b * bb, y + b * QK);
}

inline float hsum(v16 v) {
  float s[16];
  std::memcpy(s, &v, sizeof s);
  float a = 0.f;  // a fixed order
  for (int i = 0; i < 16; ++i) a += s[i];
  return a;
}

// out[r * os + c] = x[r] . w[c] for R rows of x and C weight rows (K floats each, ``ws``
// apart): each (row, column)'s two chains of fmas over K in the same order whatever R and C.
template <int R, int C>
void dot_tile(const float* x, int64_t xs, const float* w, int64_t ws, int64_t K, float* out,
              int64_t os) {
  v16 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = v16{};
  for (int64_t k = 0; k < K; k += 32) {
    v16 w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
      w0[c] = load(w + c * ws + k);
      w1[c] = load(w + c * ws + k + 16);
    }
    for (int r = 0; r < R; ++r) {
      const v16 x0 = load(x + r * xs + k), x1 = load(x + r * xs + k + 16);
      for (int c = 0; c < C; ++c) {
        acc[r][c][0] = fmadd(x0, w0[c], acc[r][c][0]);
        acc[r][c][1] = fmadd(x1, w1[c], acc[r][c][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * os + c] = hsum(acc[r][c][0] + acc[r][c][1]);
}

void check_weight(const torch::Tensor& raw, int64_t code, const char* op) {
  const int64_t kind = format_of(code);
  TORCH_CHECK(block_bytes(kind) > 0, op, ": kind must be Q4_K (12), Q5_K (13) or Q6_K (14), "
              "plus 100 when packed");
  TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.stride(1) == 1 &&
              raw.size(1) % (code >= PACKED ? padded_bytes(kind) : block_bytes(kind)) == 0, op,
              ": raw uint8 [N, row bytes]");
  if (code >= PACKED)
    TORCH_CHECK(raw.size(0) % PACK == 0 && raw.stride(0) == raw.size(1), op, ": a packed part is contiguous uint8 "
                "[N, row bytes], N a multiple of 16");
}

}  // namespace

// The fp32 weights of output rows ``rows`` (int64 [R]) -> [R, K]: ggml's dequantized values.
torch::Tensor kquant_rows(torch::Tensor raw, int64_t code, torch::Tensor rows) {
  check_weight(raw, code, "kquant_rows");
  const int64_t kind = format_of(code);
  const bool packed = code >= PACKED;
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.dim() == 1 && rows.is_contiguous(),
              "kquant_rows: rows int64 [R]");
  const int64_t R = rows.size(0), N = raw.size(0),
                nb = raw.size(1) / (packed ? padded_bytes(kind) : block_bytes(kind));
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "kquant_rows: row ", rp[i], " out of range");
  auto out = torch::empty({R, nb * QK}, torch::kFloat32);
  const uint8_t* w = raw.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ws = raw.stride(0);
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> buf;
    for (int64_t i = begin; i < end; ++i)
      dequant_row(kind, natural_row(w, ws, kind, packed, rp[i], nb, buf), nb, op + i * nb * QK);
  });
  return out;
}

// The file's bytes [N, row bytes] of ``kind`` (N a multiple of 16) in the packed layout.
torch::Tensor kquant_pack(torch::Tensor raw, int64_t kind) {
  check_weight(raw, kind, "kquant_pack");
  TORCH_CHECK(raw.size(0) % PACK == 0, "kquant_pack: rows must be a multiple of 16");
  const int64_t N = raw.size(0), bb = block_bytes(kind), bbp = padded_bytes(kind),
                nb = raw.size(1) / bb, ws = raw.stride(0);
  auto out = torch::zeros({N, nb * bbp}, torch::kUInt8);
  const uint8_t* w = raw.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / PACK, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t c = 0; c < PACK; ++c) {
        const uint8_t* row = w + (g * PACK + c) * ws;
        uint8_t* group = o + g * PACK * nb * bbp;
        for (int64_t b = 0; b < nb; ++b)
          move_block<true>(kind, row + b * bb, group + b * PACK * bbp, c);
      }
  });
  return out;
}

// A packed part's bytes back in the file's layout (kquant_pack's inverse).
torch::Tensor kquant_unpack(torch::Tensor packed, int64_t kind) {
  check_weight(packed, kind + PACKED, "kquant_unpack");
  const int64_t N = packed.size(0), bb = block_bytes(kind), nb = packed.size(1) / padded_bytes(kind);
  auto out = torch::empty({N, nb * bb}, torch::kUInt8);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, PACK, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> buf;
    for (int64_t n = begin; n < end; ++n)
      std::memcpy(o + n * nb * bb, natural_row(w, packed.stride(0), kind, true, n, nb, buf), nb * bb);
  });
  return out;
}

// ---------------------------------------------------------------------------- q8_K

namespace {

// One activation row quantized to q8_K per super-block (llama.cpp's quantize_row_q8_K_ref):
// q [K], d [nb], bsums [nb * 16] (sums of 16 quants).
void quantize_q8k(const float* x, int64_t nb, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t i = 0; i < nb; ++i) {
    const float* xb = x + i * QK;
    int8_t* qb = q + i * QK;
    float amax = 0.f;  // (a max the compiler vectorises, then its first position)
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
    float mx = 0.f;
    for (int j = 0; j < QK; ++j)
      if (std::fabs(xb[j]) == amax) {
        mx = xb[j];
        break;
      }
    if (amax == 0.f) {
      d[i] = 0.f;
      std::memset(qb, 0, QK);
      std::memset(bsums + 16 * i, 0, 32);
      continue;
    }
    const float iscale = -127.f / mx;
    for (int j = 0; j < QK; ++j)
      qb[j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * xb[j]))));
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += qb[16 * g + j];
      bsums[16 * i + g] = static_cast<int16_t>(s);
    }
    d[i] = 1.f / iscale;
  }
}

// A batch of q8_K rows as a path reads them: quants (Q4_K / Q5_K on the vector paths: each
// 128 reordered as [0, 64, 32, 96] + 0..31, the order of a 64-byte load's low then high
// nibbles), scales, and per super-block 16 int16 sums: Q6_K's sums of 16; Q4_K / Q5_K's
// sums of 32 in the first 8 (the rest 0).
struct Acts {
  int64_t nb = 0, K = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bs;
};

void prepare(const float* x, int64_t M, int64_t xs, int64_t nb, int64_t kind, bool reorder,
             Acts& a) {
  a.nb = nb;
  a.K = nb * QK;
  a.q.resize(M * a.K);
  a.d.resize(M * nb);
  a.bs.assign(M * nb * 16, 0);
  // (a parallel region only where there are rows enough: each is a rendezvous of threads)
  at::parallel_for(0, M, 32, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> q(a.K);
    std::vector<int16_t> s16(nb * 16);
    for (int64_t r = begin; r < end; ++r) {
      quantize_q8k(x + r * xs, nb, q.data(), a.d.data() + r * nb, s16.data());
      int8_t* qr = a.q.data() + r * a.K;
      int16_t* br = a.bs.data() + r * nb * 16;
      if (kind == Q6_K) {
        std::memcpy(qr, q.data(), a.K);
        std::memcpy(br, s16.data(), nb * 32);
        continue;
      }
      for (int64_t b = 0; b < nb; ++b) {
        for (int j = 0; j < 8; ++j)
          br[16 * b + j] = static_cast<int16_t>(s16[16 * b + 2 * j] + s16[16 * b + 2 * j + 1]);
        const int8_t* src = q.data() + b * QK;
        int8_t* dst = qr + b * QK;
        if (!reorder) {
          std::memcpy(dst, src, QK);
          continue;
        }
        static constexpr int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};  // sub-block at slot
        for (int k = 0; k < 8; ++k) std::memcpy(dst + 32 * k, src + 32 * order[k], 32);
      }
    }
  });
}

// The parts of a weight stacked along its output rows (one, or a fused projection's), each
// its own format, all with the same input width.
struct Part {
  const uint8_t* w;
  int64_t ws, kind, lo, hi;  // row stride; format; its output columns [lo, hi)
  bool packed;  // in the packed layout (w: its first group)

  // Output row n (lo <= n < hi) in the file's layout (``buf``: where a packed one is gathered).
  const uint8_t* row(int64_t n, int64_t nb, std::vector<uint8_t>& buf) const {
    return natural_row(w, ws, kind, packed, n - lo, nb, buf);
  }
};

// One super-block's quants as unsigned bytes in natural order (Q6_K's before its -32), its
// sub-block scales (Q6_K: 16 of them, else 8) and mins, d and dmin.
struct Unpacked {
  uint8_t q[QK];
  int32_t sc[16] = {}, mn[8] = {};
  float d = 0.f, dmin = 0.f;
};

void unpack(int64_t kind, const uint8_t* blk, Unpacked& u) {
  if (kind == Q6_K) {
    u.d = half(blk + 208);
    for (int i = 0; i < 16; ++i) u.sc[i] = reinterpret_cast<const int8_t*>(blk + 192)[i];
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 32; ++l) {
          const uint8_t lo = blk[64 * h + l + 32 * (k & 1)];
          u.q[128 * h + 32 * k + l] = static_cast<uint8_t>(
              (k < 2 ? lo & 15 : lo >> 4) | (((blk[128 + 32 * h + l] >> (2 * k)) & 3) << 4));
        }
    return;
  }
  u.d = half(blk);
  u.dmin = half(blk + 2);
  uint8_t s8[8], m8[8];
  scales_mins(blk + 4, s8, m8);
  for (int s = 0; s < 8; ++s) {
    u.sc[s] = s8[s];
    u.mn[s] = m8[s];
  }
  const uint8_t* qs = blk + (kind == Q5_K ? 48 : 16);
  for (int s = 0; s < 8; ++s)
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = qs[32 * (s / 2) + l];
      int q = s & 1 ? byte >> 4 : byte & 15;
      if (kind == Q5_K) q |= ((blk[16 + l] >> s) & 1) << 4;
      u.q[32 * s + l] = static_cast<uint8_t>(q);
    }
}

// ---- portable: one super-block's integer sums, then two fmas a super-block

template <int R>
void tile_portable(int64_t kind, const uint8_t* w, const Acts& a, int64_t r0, float* out,
                   int64_t os) {
  const int64_t nb = a.nb, bb = block_bytes(kind);
  const int nsub = kind == Q6_K ? 16 : 8, len = QK / nsub, offset = kind == Q6_K ? 32 : 0;
  float acc[R] = {}, accm[R] = {};
  Unpacked u;
  for (int64_t b = 0; b < nb; ++b) {
    unpack(kind, w + b * bb, u);
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* aq = a.q.data() + row * a.K + b * QK;
      int32_t isum = 0, imin = 0;
      for (int s = 0; s < nsub; ++s) {
        int32_t dot = 0;
        for (int l = 0; l < len; ++l) dot += (int32_t{u.q[s * len + l]} - offset) * aq[s * len + l];
        isum += u.sc[s] * dot;
      }
      const int16_t* bs = a.bs.data() + (row * nb + b) * 16;
      for (int s = 0; s < 8; ++s) imin += u.mn[s] * bs[s];
      const float da = a.d[row * nb + b];
      acc[r] = std::fma(static_cast<float>(isum), u.d * da, acc[r]);
      accm[r] = std::fma(static_cast<float>(imin), u.dmin * da, accm[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * os] = acc[r] - accm[r];
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// ---- AVX-512 VNNI. A (row, column) is the same on its two kernels (few rows and many): per
// super-block b the exact integer sums isum = sum_j sc_j (q . a)_j (less Q6_K's offset of 32)
// and imin = sum_j m_j bsum_j (Q4_K / Q5_K), then four chains of fp32 sums, super-block b
// feeding chain b % 4 with fma(isum, d * da, .) and fma(imin, dmin * da, .), and at the end
// ((c0 + c1) + (c2 + c3)) of the first chains less that of the second.
//
// Few rows (tile_512): a super-block's weights as four 64-byte unsigned vectors (in the order
// prepare() gives the activations) and four int16 scale vectors; per activation row four
// maddubs + dpwssd, the integer sums of four super-blocks folded into one 4-lane vector.

struct Block512 {
  __m512i q[4], s[4];
  float d, dmin;
  __m128i mins;  // Q4_K / Q5_K: 8 int16
  __m256i sc16;  // Q6_K: 16 int16 scales (for the -32 offset)
};

inline __m512i idx16(int a, int b) {  // int16 lanes: 0..15 -> a, 16..31 -> b
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(a)), _mm256_set1_epi16(b), 1);
}

// the permutexvar indices spreading a super-block's scales over its four vectors' lanes
struct Spread {
  __m512i q45[4], q6[4];
  Spread() {
    static const int pairs[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int v = 0; v < 4; ++v) {
      q45[v] = idx16(pairs[v][0], pairs[v][1]);
      alignas(64) int16_t idx[32];  // Q6_K: 64 weights = 4 sub-blocks of 16 = 8 lanes each
      for (int i = 0; i < 32; ++i) idx[i] = static_cast<int16_t>(4 * v + i / 8);
      q6[v] = _mm512_load_si512(idx);
    }
  }
};

inline void load_q45(int64_t kind, const uint8_t* blk, const Spread& sp, Block512& o) {
  o.d = half(blk);
  o.dmin = half(blk + 2);
  uint64_t sc8, m8;
  scales_mins64(blk + 4, sc8, m8);
  o.mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(m8)));
  const __m512i sc = _mm512_castsi128_si512(
      _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc8))));
  static constexpr int pairs[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
  for (int v = 0; v < 4; ++v) o.s[v] = _mm512_permutexvar_epi16(sp.q45[v], sc);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* qs = blk + (kind == Q5_K ? 48 : 16);
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_loadu_si512(qs + 64 * h);
    o.q[2 * h] = _mm512_and_si512(v, low);
    o.q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
  if (kind == Q5_K) {
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
    const __m512i bit = _mm512_set1_epi8(0x10);
    for (int v = 0; v < 4; ++v) {  // vector v holds sub-blocks pairs[v]: their qh bits
      const __m512i cnt = _mm512_inserti64x4(_mm512_set1_epi64(pairs[v][0]),
                                             _mm256_set1_epi64x(pairs[v][1]), 1);
      const __m512i hb = _mm512_and_si512(_mm512_slli_epi64(_mm512_srlv_epi64(qh, cnt), 4), bit);
      o.q[v] = _mm512_or_si512(o.q[v], hb);
    }
  }
}

inline void load_q6(const uint8_t* blk, const Spread& sp, Block512& o) {
  o.d = half(blk + 208);
  o.dmin = 0.f;
  o.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
  const __m512i sc = _mm512_castsi256_si512(o.sc16);
  for (int v = 0; v < 4; ++v) o.s[v] = _mm512_permutexvar_epi16(sp.q6[v], sc);
  const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
  for (int h = 0; h < 2; ++h) {
    const __m512i l = _mm512_loadu_si512(blk + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
    for (int k = 0; k < 2; ++k) {  // k 0: weights 0..63 of the half (low nibbles), 1: 64..127
      const __m512i nib = k ? _mm512_and_si512(_mm512_srli_epi16(l, 4), low) : _mm512_and_si512(l, low);
      const __m512i cnt = _mm512_inserti64x4(_mm512_set1_epi64(4 * k),
                                             _mm256_set1_epi64x(4 * k + 2), 1);
      const __m512i hb = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(qh, cnt), two), 4);
      o.q[2 * h + k] = _mm512_or_si512(nib, hb);
    }
  }
}

// One super-block of ``kind`` at ``blk`` decoded into ``o``.
inline void load_block(int64_t kind, const uint8_t* blk, const Spread& sp, Block512& o) {
  if (kind == Q6_K) load_q6(blk, sp, o);
  else load_q45(kind, blk, sp, o);
}

// Super-block b of a weight row (decoded: ``blk``) times activation row ``row``: its integer
// sum isum as 16 int32 partials (the mins' part: tile_512).
inline __m512i sums_512(int64_t kind, const Block512& blk, const Acts& a, int64_t row, int64_t b) {
  const int8_t* aq = a.q.data() + row * a.K + b * QK;
  __m512i p[4];
  for (int v = 0; v < 4; ++v) p[v] = _mm512_maddubs_epi16(blk.q[v], _mm512_loadu_si512(aq + 64 * v));
  const __m512i isum = _mm512_add_epi32(  // two chains: half the latency (exact integers)
      _mm512_dpwssd_epi32(_mm512_madd_epi16(p[0], blk.s[0]), p[2], blk.s[2]),
      _mm512_dpwssd_epi32(_mm512_madd_epi16(p[1], blk.s[1]), p[3], blk.s[3]));
  if (kind != Q6_K) return isum;
  // (q - 32): less 32 * the scaled sums of 16
  const __m256i off = _mm256_madd_epi16(
      blk.sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bs.data() + (row * a.nb + b) * 16)));
  return _mm512_sub_epi32(isum, _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
}

// lanes 4i..4i+3 of the result: (the sum of lanes of x's, y's part) interleaved, so that two
// levels of pairs leave in each 128-bit lane one partial sum of each of four vectors.
inline __m512i pair_sums(__m512i x, __m512i y) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y));
}
inline __m512i quad_sums(__m512i xy, __m512i zw) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(xy, zw), _mm512_unpackhi_epi64(xy, zw));
}
inline __m128i pair_sums(__m128i x, __m128i y) {
  return _mm_add_epi32(_mm_unpacklo_epi32(x, y), _mm_unpackhi_epi32(x, y));
}
inline __m128i quad_sums(__m128i xy, __m128i zw) {
  return _mm_add_epi32(_mm_unpacklo_epi64(xy, zw), _mm_unpackhi_epi64(xy, zw));
}
inline __m128i lane_sums(__m512i v) {  // the four 128-bit lanes added
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

inline float finish_512(__m128 acc, __m128 accm) {
  alignas(16) float v[4], m[4];
  _mm_store_ps(v, acc);
  _mm_store_ps(m, accm);
  return ((v[0] + v[1]) + (v[2] + v[3])) - ((m[0] + m[1]) + (m[2] + m[3]));
}

// Super-block b of every row of a tile: its integer sums into ``isum`` (second of a pair:
// pair_sums'd with what is there), its mins and scales (zeros past the row's end: a tail
// of fewer than four super-blocks).
template <int R, bool second, bool full>
inline void tile_sums(int64_t kind, const uint8_t* w, int64_t b, int64_t nb, const Spread& sp,
                      const Acts& a, int64_t r0, Block512& blk, float& d, float& dmin,
                      __m128i& mins, __m512i (&isum)[R]) {
  const bool in = full || b < nb;
  if (in) load_block(kind, w + b * block_bytes(kind), sp, blk);
  d = in ? blk.d : 0.f;
  dmin = in ? blk.dmin : 0.f;
  mins = in ? blk.mins : _mm_setzero_si128();
  for (int r = 0; r < R; ++r) {
    const __m512i s = in ? sums_512(kind, blk, a, r0 + r, b) : _mm512_setzero_si512();
    isum[r] = second ? pair_sums(isum[r], s) : s;
  }
}

// Super-blocks b0..b0 + 3 of a weight row into the chains (``full``: all four exist).
template <int R, int64_t kind, bool full>
inline void tile_512_four(const uint8_t* w, const Acts& a, int64_t r0, int64_t b0,
                          const Spread& sp, Block512& blk, __m128 (&acc)[R], __m128 (&accm)[R]) {
  const int64_t nb = a.nb;
  alignas(16) float d4[4], dmin4[4];
  __m128i mins[4];
  __m512i xy[R], zw[R];  // the sums of super-blocks b0, b0 + 1 and b0 + 2, b0 + 3
  tile_sums<R, false, full>(kind, w, b0, nb, sp, a, r0, blk, d4[0], dmin4[0], mins[0], xy);
  tile_sums<R, true, full>(kind, w, b0 + 1, nb, sp, a, r0, blk, d4[1], dmin4[1], mins[1], xy);
  tile_sums<R, false, full>(kind, w, b0 + 2, nb, sp, a, r0, blk, d4[2], dmin4[2], mins[2], zw);
  tile_sums<R, true, full>(kind, w, b0 + 3, nb, sp, a, r0, blk, d4[3], dmin4[3], mins[3], zw);
  const int n = full ? 4 : static_cast<int>(std::min<int64_t>(4, nb - b0));
  const __mmask8 k = static_cast<__mmask8>((1 << n) - 1);
  const __m128 d = _mm_load_ps(d4), dmin = _mm_load_ps(dmin4);
  for (int r = 0; r < R; ++r) {
    const __m128i isum4 = lane_sums(quad_sums(xy[r], zw[r]));
    const __m128 da = _mm_maskz_loadu_ps(k, a.d.data() + (r0 + r) * nb + b0);
    acc[r] = _mm_mask3_fmadd_ps(_mm_cvtepi32_ps(isum4), _mm_mul_ps(d, da), acc[r], k);
    if (kind == Q6_K) continue;
    // the mins' sums m . bsum32 of the four super-blocks (Q6_K has none)
    const int16_t* bs = a.bs.data() + ((r0 + r) * nb + b0) * 16;
    __m128i m[4];
    for (int q = 0; q < 4; ++q)
      m[q] = _mm_madd_epi16(mins[q], _mm_loadu_si128(reinterpret_cast<const __m128i*>(bs + 16 * std::min(q, n - 1))));
    const __m128i imin4 = quad_sums(pair_sums(m[0], m[1]), pair_sums(m[2], m[3]));
    accm[r] = _mm_mask3_fmadd_ps(_mm_cvtepi32_ps(imin4), _mm_mul_ps(dmin, da), accm[r], k);
  }
}

// (the format a template argument: its loads and sums compiled without a branch on it)
template <int R, int64_t kind>
void tile_512k(const uint8_t* w, const Acts& a, int64_t r0, float* out, int64_t os,
               const Spread& sp) {
  const int64_t nb = a.nb;
  __m128 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm_setzero_ps();
  Block512 blk;
  int64_t b0 = 0;
  for (; b0 + 4 <= nb; b0 += 4) tile_512_four<R, kind, true>(w, a, r0, b0, sp, blk, acc, accm);
  if (b0 < nb) tile_512_four<R, kind, false>(w, a, r0, b0, sp, blk, acc, accm);
  for (int r = 0; r < R; ++r) out[r * os] = finish_512(acc[r], accm[r]);
}

template <int R>
void tile_512(int64_t kind, const uint8_t* w, const Acts& a, int64_t r0, float* out, int64_t os,
              const Spread& sp) {
  if (kind == Q4_K) tile_512k<R, Q4_K>(w, a, r0, out, os, sp);
  else if (kind == Q5_K) tile_512k<R, Q5_K>(w, a, r0, out, os, sp);
  else tile_512k<R, Q6_K>(w, a, r0, out, os, sp);
}

// Many rows (gemm_tile): columns in lanes. GEMM_COLS output columns of one part are unpacked
// once per call into vectors whose lane c holds column c's weights 4g..4g+3 (vpdpbusd's
// operand: one instruction is 16 columns x 4 weights of an activation row), with each
// super-block's scales, mins and d's as vectors over the columns. Tiles of GEMM_ROWS rows x
// GEMM_COLS columns pass over it: each weight vector serves 4 rows, each activation
// broadcast two vectors of columns, and a sub-block's dot is scaled once (mullo), not once
// per pair of weights as in tile_512.
constexpr int GEMM_COLS = 32, GEMM_VECS = GEMM_COLS / 16, GEMM_ROWS = 4;

struct Group512 {
  int64_t kind = 0, nb = 0;
  int cols = 0;
  std::vector<uint8_t> q;       // [nb][GEMM_VECS][64][16 columns][4 weights]
  std::vector<int32_t> sc;      // [nb][GEMM_VECS][16 sub-blocks][16 columns]
  std::vector<int32_t> pairs;   // [nb][GEMM_VECS][8][16]: int16 pairs (mins, Q6_K: scales)
  std::vector<float> d, dmin;   // [nb][GEMM_VECS][16]
};

// Columns [n0, n0 + cols) of part p (cols <= GEMM_COLS; the rest of the lanes zero).
void unpack_group(const Part& p, int64_t n0, int cols, int64_t nb, Group512& g) {
  g.kind = p.kind;
  g.nb = nb;
  g.cols = cols;
  const int64_t bb = block_bytes(p.kind), vecs = nb * GEMM_VECS;
  g.q.resize(vecs * 64 * 64);
  g.sc.assign(vecs * 16 * 16, 0);
  g.pairs.assign(vecs * 8 * 16, 0);
  g.d.assign(vecs * 16, 0.f);
  g.dmin.assign(vecs * 16, 0.f);
  const int npairs = p.kind == Q6_K ? 8 : 4;
  // A super-block of 16 columns in natural order, then transposed. Lanes past the last
  // column keep other columns' weights: their zero scales and the masked store drop them.
  Unpacked u[16];
  for (auto& x : u) std::memset(x.q, 0, QK);
  std::vector<uint8_t> buf;
  const __m512i rows = _mm512_mullo_epi32(_mm512_set1_epi32(sizeof(Unpacked)),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (int64_t b = 0; b < nb; ++b)
    for (int v = 0; v < GEMM_VECS; ++v) {
      const int64_t at = b * GEMM_VECS + v;
      const int n = std::clamp(cols - 16 * v, 0, 16);
      for (int lane = 0; lane < n; ++lane) {
        unpack(p.kind, p.row(n0 + 16 * v + lane, nb, buf) + b * bb, u[lane]);
        const Unpacked& x = u[lane];
        for (int j = 0; j < 16; ++j) g.sc[(at * 16 + j) * 16 + lane] = x.sc[j];
        const int32_t* pv = p.kind == Q6_K ? x.sc : x.mn;
        for (int i = 0; i < npairs; ++i)
          g.pairs[(at * 8 + i) * 16 + lane] = static_cast<int32_t>(
              static_cast<uint16_t>(pv[2 * i]) | (static_cast<uint32_t>(static_cast<uint16_t>(pv[2 * i + 1])) << 16));
        g.d[at * 16 + lane] = x.d;
        g.dmin[at * 16 + lane] = x.dmin;
      }
      uint8_t* dst = g.q.data() + at * 4096;
      for (int i = 0; i < 64; ++i)  // lane c: column c's weights 4i..4i+3
        _mm512_storeu_si512(dst + 64 * i, _mm512_i32gather_epi32(rows, u[0].q + 4 * i, 1));
    }
}

inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Activation rows [r0, r0 + R) (natural order) over a group: out[r * os + c], c < g.cols.
template <int R, bool q6>
void gemm_tile(const Group512& g, const Acts& a, int64_t r0, float* out, int64_t os) {
  const int64_t nb = g.nb;
  constexpr int nsub = q6 ? 16 : 8, per = q6 ? 4 : 8;  // sub-blocks; their groups of 4 weights
  constexpr int npairs = q6 ? 8 : 4;
  __m512 acc[R][GEMM_VECS][4], accm[R][GEMM_VECS][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < GEMM_VECS; ++v)
      for (int c = 0; c < 4; ++c) acc[r][v][c] = accm[r][v][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* aq[R];
    for (int r = 0; r < R; ++r) aq[r] = a.q.data() + (r0 + r) * a.K + b * QK;
    const uint8_t* wq = g.q.data() + b * GEMM_VECS * 4096;
    const int32_t* sc = g.sc.data() + b * GEMM_VECS * 256;
    __m512i isum[R][GEMM_VECS];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < GEMM_VECS; ++v) isum[r][v] = _mm512_setzero_si512();
    for (int j = 0; j < nsub; ++j) {
      __m512i dot[R][GEMM_VECS];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < GEMM_VECS; ++v) dot[r][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = j * per; i < (j + 1) * per; ++i) {
        __m512i wv[GEMM_VECS];
        for (int v = 0; v < GEMM_VECS; ++v) wv[v] = _mm512_loadu_si512(wq + v * 4096 + 64 * i);
        for (int r = 0; r < R; ++r) {
          const __m512i x = bcast32(aq[r] + 4 * i);
          for (int v = 0; v < GEMM_VECS; ++v) dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], wv[v], x);
        }
      }
      for (int v = 0; v < GEMM_VECS; ++v) {
        const __m512i s = _mm512_loadu_si512(sc + (v * 16 + j) * 16);
        for (int r = 0; r < R; ++r)
          isum[r][v] = _mm512_add_epi32(isum[r][v], _mm512_mullo_epi32(dot[r][v], s));
      }
    }
    const int c = static_cast<int>(b % 4);
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int16_t* bs = a.bs.data() + (row * nb + b) * 16;
      const __m512 da = _mm512_set1_ps(a.d[row * nb + b]);
      for (int v = 0; v < GEMM_VECS; ++v) {
        const int64_t at = b * GEMM_VECS + v;
        __m512i ip = _mm512_setzero_si512();
        for (int i = 0; i < npairs; ++i)
          ip = _mm512_dpwssd_epi32(ip, _mm512_loadu_si512(g.pairs.data() + (at * 8 + i) * 16),
                                   bcast32(bs + 2 * i));
        __m512i is = isum[r][v];
        if (q6) is = _mm512_sub_epi32(is, _mm512_slli_epi32(ip, 5));
        acc[r][v][c] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(is), _mm512_mul_ps(_mm512_loadu_ps(g.d.data() + at * 16), da),
            acc[r][v][c]);
        if (!q6)
          accm[r][v][c] = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(ip),
              _mm512_mul_ps(_mm512_loadu_ps(g.dmin.data() + at * 16), da), accm[r][v][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < GEMM_VECS; ++v) {
      const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[r][v][0], acc[r][v][1]),
                                     _mm512_add_ps(acc[r][v][2], acc[r][v][3]));
      const __m512 m = _mm512_add_ps(_mm512_add_ps(accm[r][v][0], accm[r][v][1]),
                                     _mm512_add_ps(accm[r][v][2], accm[r][v][3]));
      const int n = std::clamp(g.cols - 16 * v, 0, 16);
      _mm512_mask_storeu_ps(out + r * os + 16 * v, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_sub_ps(s, m));
    }
}

// Every activation row over a group: tiles of GEMM_ROWS rows, then one at a time.
template <bool q6>
void gemm_rows(const Group512& g, const Acts& a, int64_t M, float* out, int64_t os) {
  int64_t r = 0;
  for (; r + GEMM_ROWS <= M; r += GEMM_ROWS) gemm_tile<GEMM_ROWS, q6>(g, a, r, out + r * os, os);
  for (; r < M; ++r) gemm_tile<1, q6>(g, a, r, out + r * os, os);
}

// Packed parts (the packed layout above): 16 columns in lanes, read as stored. Per super-block
// b and activation row, vpdpbusd accumulates a sub-block's dots of the 16 columns (one
// broadcast of 4 activations, one vector of 4 weights a column), the dots are scaled once
// (mullo) and the mins (Q4_K / Q5_K) taken by dpwssd from int16 pairs: the integer sums
// isum, imin of tile_512 and gemm_tile exactly, then the same four fp32 chains, so a
// (row, column) has the same bits on every kernel of this path.
constexpr int PACKED_ROWS = 4;  // activation rows a pass over a group's weights serves
// (No software prefetch: a group is one run of bytes, which the hardware prefetchers follow.
// Measured 1 row, 2 threads, the 1B shape from memory (EPYC): none 41.0 GB/s, 2-16 KB
// ahead 39.4-31.8.)

struct Lanes {  // vpshufb controls over the dwords of a vector
  __m512i byte[4];  // byte i of each dword, zero-extended
  __m512i top[4];   // byte i of each dword in its top byte (then srai 24: sign-extended)
  __m512i pair[2];  // bytes 2i, 2i + 1 as two zero-extended int16
  Lanes() {
    alignas(64) int8_t c[64];
    auto make = [&](auto f) {
      for (int at = 0; at < 64; ++at) c[at] = f(at % 16 / 4 * 4, at % 4);
      return _mm512_load_si512(c);
    };
    for (int i = 0; i < 4; ++i) {
      byte[i] = make([i](int q, int k) { return static_cast<int8_t>(k == 0 ? q + i : -128); });
      top[i] = make([i](int q, int k) { return static_cast<int8_t>(k == 3 ? q + i : -128); });
    }
    for (int i = 0; i < 2; ++i)
      pair[i] = make([i](int q, int k) {
        return static_cast<int8_t>(k == 0 ? q + 2 * i : k == 2 ? q + 2 * i + 1 : -128);
      });
  }
};

inline __m512i lanes_at(const uint8_t* blk, int k) { return _mm512_loadu_si512(blk + 64 * k); }
inline __m512 halves_ps(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
inline __m512i bit_at4(__m512i v, int s) {  // bit s of each byte moved to bit 4
  return s < 4 ? _mm512_slli_epi32(v, 4 - s) : s > 4 ? _mm512_srli_epi32(v, s - 4) : v;
}
constexpr int OR_AND = 0xF8;  // ternary logic: a | (b & c)

template <int R, int64_t kind>
void packed_tile(const uint8_t* group, int64_t nb, const Acts& a, int64_t r0, float* out,
                 int64_t os, const Lanes& ln) {
  constexpr int64_t step = PACK * padded_bytes(kind);  // a super-block's bytes
  const __m512i m0f = _mm512_set1_epi8(0x0F), mf0 = _mm512_set1_epi8(static_cast<char>(0xF0));
  const __m512i m30 = _mm512_set1_epi8(0x30), m10 = _mm512_set1_epi8(0x10);
  __m512 acc[R][4], accm[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = accm[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * step;
    const int8_t* aq[R];
    const int16_t* bs[R];
    for (int r = 0; r < R; ++r) {
      aq[r] = a.q.data() + (r0 + r) * a.K + b * QK;
      bs[r] = a.bs.data() + ((r0 + r) * nb + b) * 16;
    }
    __m512i isum[R], imin[R];
    for (int r = 0; r < R; ++r) isum[r] = imin[r] = _mm512_setzero_si512();
    __m512 d, dmin = _mm512_setzero_ps();
    if constexpr (kind == Q6_K) {
      d = halves_ps(lanes_at(blk, 0));
      for (int h = 0; h < 2; ++h)
        for (int half = 0; half < 2; ++half) {
          __m512i dot[4][R];
          for (int k = 0; k < 4; ++k)
            for (int r = 0; r < R; ++r) dot[k][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int l4 = 4 * half; l4 < 4 * half + 4; ++l4) {
            const int at = 5 + 3 * (8 * h + l4);  // its ql, ql and qh dwords (natural_dword)
            const __m512i A = lanes_at(blk, at), B = lanes_at(blk, at + 1), C = lanes_at(blk, at + 2);
            __m512i w[4];  // the weights 128 h + 32 k + 4 l4 + 0..3 of each column, 0..63
            w[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(A, m0f), _mm512_slli_epi32(C, 4), m30, OR_AND);
            w[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(B, m0f), _mm512_slli_epi32(C, 2), m30, OR_AND);
            w[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(A, 4), m0f), C, m30, OR_AND);
            w[3] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(B, 4), m0f),
                                             _mm512_srli_epi32(C, 2), m30, OR_AND);
            for (int k = 0; k < 4; ++k)
              for (int r = 0; r < R; ++r)
                dot[k][r] = _mm512_dpbusd_epi32(dot[k][r], w[k], bcast32(aq[r] + 128 * h + 32 * k + 4 * l4));
          }
          for (int k = 0; k < 4; ++k) {
            const int sub = 8 * h + 2 * k + half;  // its sub-block of 16, scale int8
            const __m512i sc = _mm512_srai_epi32(
                _mm512_shuffle_epi8(lanes_at(blk, 1 + sub / 4), ln.top[sub % 4]), 24);
            for (int r = 0; r < R; ++r)  // (q - 32) . a = q . a - 32 * (the sum of 16)
              isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(
                  _mm512_sub_epi32(dot[k][r], _mm512_set1_epi32(32 * bs[r][sub])), sc));
          }
        }
    } else {
      const __m512i dd = lanes_at(blk, 0);
      d = halves_ps(dd);
      dmin = halves_ps(_mm512_srli_epi32(dd, 16));
      const __m512i u0 = lanes_at(blk, 1), u1 = lanes_at(blk, 2), u2 = lanes_at(blk, 3);
      const __m512i k1 = _mm512_set1_epi8(0x3F), k3 = _mm512_set1_epi8(0x03);
      // scales_mins64 over 16 columns: sub-blocks 0..3 in lo, 4..7 in hi, a byte each
      const __m512i sc_lo = _mm512_and_si512(u0, k1), m_lo = _mm512_and_si512(u1, k1);
      const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(u2, m0f),
          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), k3), 4));
      const __m512i m_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m0f),
          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), k3), 4));
      for (int i = 0; i < 4; ++i) {
        const __m512i mp = _mm512_shuffle_epi8(i < 2 ? m_lo : m_hi, ln.pair[i % 2]);
        for (int r = 0; r < R; ++r) imin[r] = _mm512_dpwssd_epi32(imin[r], mp, bcast32(bs[r] + 2 * i));
      }
      constexpr int qs0 = kind == Q5_K ? 12 : 4;  // dwords: Q5_K's qh are 4..11
      for (int j = 0; j < 4; ++j) {  // sub-blocks 2 j (low nibbles) and 2 j + 1 (high)
        __m512i dlo[R], dhi[R];
        for (int r = 0; r < R; ++r) dlo[r] = dhi[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int l4 = 0; l4 < 8; ++l4) {
          const __m512i v = lanes_at(blk, qs0 + 8 * j + l4);
          __m512i lo = _mm512_and_si512(v, m0f), hi;
          if constexpr (kind == Q5_K) {
            const __m512i qh = lanes_at(blk, 4 + l4);
            lo = _mm512_ternarylogic_epi32(lo, bit_at4(qh, 2 * j), m10, OR_AND);
            hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 4), m0f),
                                           bit_at4(qh, 2 * j + 1), m10, OR_AND);
          } else {
            hi = _mm512_and_si512(v, mf0);  // 16 x the high nibble: the dot shifted back below
          }
          for (int r = 0; r < R; ++r) {
            dlo[r] = _mm512_dpbusd_epi32(dlo[r], lo, bcast32(aq[r] + 64 * j + 4 * l4));
            dhi[r] = _mm512_dpbusd_epi32(dhi[r], hi, bcast32(aq[r] + 64 * j + 32 + 4 * l4));
          }
        }
        const __m512i s0 = _mm512_shuffle_epi8(j < 2 ? sc_lo : sc_hi, ln.byte[(2 * j) % 4]);
        const __m512i s1 = _mm512_shuffle_epi8(j < 2 ? sc_lo : sc_hi, ln.byte[(2 * j + 1) % 4]);
        for (int r = 0; r < R; ++r) {
          const __m512i dh = kind == Q5_K ? dhi[r] : _mm512_srai_epi32(dhi[r], 4);  // exact
          isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(dlo[r], s0),
                                                                _mm512_mullo_epi32(dh, s1)));
        }
      }
    }
    const int c = static_cast<int>(b % 4);
    for (int r = 0; r < R; ++r) {
      const __m512 da = _mm512_set1_ps(a.d[(r0 + r) * nb + b]);
      acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, da), acc[r][c]);
      if constexpr (kind != Q6_K)
        accm[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin[r]), _mm512_mul_ps(dmin, da), accm[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
    const __m512 m = _mm512_add_ps(_mm512_add_ps(accm[r][0], accm[r][1]), _mm512_add_ps(accm[r][2], accm[r][3]));
    _mm512_storeu_ps(out + r * os, _mm512_sub_ps(s, m));
  }
}

// Every activation row over one packed group of 16 columns.
template <int64_t kind>
void packed_rows(const uint8_t* group, int64_t nb, const Acts& a, int64_t M, float* out,
                 int64_t os, const Lanes& ln) {
  int64_t r = 0;
  for (; r + PACKED_ROWS <= M; r += PACKED_ROWS)
    packed_tile<PACKED_ROWS, kind>(group, nb, a, r, out + r * os, os, ln);
  for (; r < M; ++r) packed_tile<1, kind>(group, nb, a, r, out + r * os, os, ln);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// ---- AVX2: the same with 32-byte vectors (maddubs then madd with the scales).

template <int R>
void tile_avx2(int64_t kind, const uint8_t* w, const Acts& a, int64_t r0, float* out, int64_t os) {
  const int64_t nb = a.nb, bb = block_bytes(kind);
  __m256 acc[R];
  __m128 accm[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    accm[r] = _mm_setzero_ps();
  }
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bb;
    __m256i q[8], s[8];  // 32 weights a vector, in the order of the activations
    float dw, dmin = 0.f;
    __m128i mins = _mm_setzero_si128();
    __m256i sc16 = _mm256_setzero_si256();
    if (kind == Q6_K) {
      dw = half(blk + 208);
      sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      alignas(32) int16_t scs[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(scs), sc16);
      const __m256i two = _mm256_set1_epi8(0x03);
      for (int h = 0; h < 2; ++h) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        for (int k = 0; k < 4; ++k) {
          const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (k & 1)));
          const __m256i nib = k < 2 ? _mm256_and_si256(l, low)
                                    : _mm256_and_si256(_mm256_srli_epi16(l, 4), low);
          const __m256i hb = _mm256_slli_epi16(
              _mm256_and_si256(_mm256_srl_epi64(qh, _mm_cvtsi32_si128(2 * k)), two), 4);
          q[4 * h + k] = _mm256_or_si256(nib, hb);
          const int s0 = scs[8 * h + 2 * k], s1 = scs[8 * h + 2 * k + 1];
          s[4 * h + k] = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(s1)),
                                          _mm_set1_epi16(static_cast<int16_t>(s0)));
        }
      }
    } else {
      dw = half(blk);
      dmin = half(blk + 2);
      uint64_t sc8, m8;
      scales_mins64(blk + 4, sc8, m8);
      mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(m8)));
      const uint8_t* qs = blk + (kind == Q5_K ? 48 : 16);
      const __m256i qh = kind == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16))
                                      : _mm256_setzero_si256();
      for (int sb = 0; sb < 8; ++sb) {  // sub-block sb (natural activation order)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (sb / 2)));
        __m256i n = sb & 1 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low) : _mm256_and_si256(v, low);
        if (kind == Q5_K)
          n = _mm256_or_si256(n, _mm256_and_si256(
              _mm256_slli_epi64(_mm256_srl_epi64(qh, _mm_cvtsi32_si128(sb)), 4), _mm256_set1_epi8(0x10)));
        q[sb] = n;
        s[sb] = _mm256_set1_epi16(static_cast<int16_t>((sc8 >> (8 * sb)) & 0xFF));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* aq = a.q.data() + row * a.K + b * QK;
      __m256i isum = _mm256_setzero_si256();
      for (int v = 0; v < 8; ++v) {
        const __m256i p = _mm256_maddubs_epi16(q[v], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + 32 * v)));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, s[v]));
      }
      const int16_t* bs = a.bs.data() + (row * nb + b) * 16;
      const float da = a.d[row * nb + b];
      if (kind == Q6_K) {
        const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)));
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(off, 5));
      } else {
        const __m128i imin = _mm_madd_epi16(mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(bs)));
        accm[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(imin), _mm_set1_ps(dmin * da), accm[r]);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dw * da), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float v[8], m[4];
    _mm256_storeu_ps(v, acc[r]);
    _mm_storeu_ps(m, accm[r]);
    out[r * os] = (((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))) -
                  ((m[0] + m[1]) + (m[2] + m[3]));
  }
}
#endif

bool has_isa(int64_t isa) {
  if (isa == PORTABLE) return true;
#if defined(__AVX2__) && defined(__FMA__)
  if (isa == AVX2) return true;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (isa == AVX512) return true;
#endif
  return false;
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
struct Spread {};
#endif

template <int R>
void tile(int64_t isa, int64_t kind, const uint8_t* w, const Acts& a, int64_t r0, float* out,
          int64_t os, const Spread& sp) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (isa == AVX512) return tile_512<R>(kind, w, a, r0, out, os, sp);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa == AVX2) return tile_avx2<R>(kind, w, a, r0, out, os);
#endif
  tile_portable<R>(kind, w, a, r0, out, os);
}

}  // namespace

// The q8_K product's paths this build has: 0 portable, 1 AVX2, 2 AVX-512 VNNI.
std::vector<int64_t> kquant_isas() {
  std::vector<int64_t> out;
  for (int64_t i : {PORTABLE, AVX2, AVX512})
    if (has_isa(i)) out.push_back(i);
  return out;
}

// x [M, K] float32 rounded to q8_K: (q int8 [M, K], d float32 [M, K / 256], bsums int16
// [M, K / 16]) in natural order (the eager twin's test).
std::vector<torch::Tensor> q8k_quantize(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1 &&
              x.size(1) % QK == 0, "q8k_quantize: x float32 [M, K], K a multiple of 256");
  const int64_t M = x.size(0), nb = x.size(1) / QK;
  auto q = torch::empty({M, nb * QK}, torch::kInt8);
  auto d = torch::empty({M, nb}, torch::kFloat32);
  auto s = torch::empty({M, nb * 16}, torch::kInt16);
  for (int64_t r = 0; r < M; ++r)
    quantize_q8k(x.data_ptr<float>() + r * x.stride(0), nb, q.data_ptr<int8_t>() + r * nb * QK,
                 d.data_ptr<float>() + r * nb, s.data_ptr<int16_t>() + r * nb * 16);
  return {q, d, s};
}

namespace {

std::vector<Part> parts_of(const std::vector<torch::Tensor>& raws, const int64_t* kinds,
                           int64_t& N, int64_t& nb) {
  std::vector<Part> parts;
  N = 0;
  nb = -1;
  for (size_t i = 0; i < raws.size(); ++i) {
    check_weight(raws[i], kinds[i], "kquant_mm");
    const int64_t kind = format_of(kinds[i]);
    const bool packed = kinds[i] >= PACKED;
    const int64_t pnb = raws[i].size(1) / (packed ? padded_bytes(kind) : block_bytes(kind));
    TORCH_CHECK(nb < 0 || pnb == nb, "kquant_mm: parts of different input widths");
    nb = pnb;
    parts.push_back({raws[i].data_ptr<uint8_t>(), raws[i].stride(0), kind, N,
                     N + raws[i].size(0), packed});
    N += raws[i].size(0);
  }
  return parts;
}

void check_io(const torch::Tensor& x, const torch::Tensor& out, int64_t N, int64_t K) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1 &&
              x.size(1) == K, "kquant_mm: x float32 [M, ", K, "]");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.dim() == 2 && out.size(0) == x.size(0) &&
              out.size(1) == N && out.stride(1) == 1, "kquant_mm: out float32 [M, N]");
}

inline const Part& part_of(const std::vector<Part>& parts, int64_t n) {
  size_t i = 0;
  while (n >= parts[i].hi) ++i;
  return parts[i];
}

// out [M, N] = x @ W^T on the exact weights: one parallel region (threads split the output
// columns). A block of output rows is dequantized at a time (at most 512 KB, so it stays in
// L2) and every activation row passes over the block: the activations are read once a
// block, not once an output row (which made many rows memory-bound).
#ifdef __AVX512F__
constexpr int EXACT_COLS = 2;  // 4 x 2 tiles: 16 accumulators + 6 operands in 32 registers
#else
constexpr int EXACT_COLS = 1;  // 4 x 1: AVX2 holds a v16 in two of its 16 registers
#endif

// R activation rows over ``cols`` dequantized weight rows (K floats each, in ``w``).
template <int R>
void exact_cols(const float* x, int64_t xs, const float* w, int64_t K, int64_t cols, float* out,
                int64_t os) {
  int64_t c = 0;
  for (; c + EXACT_COLS <= cols; c += EXACT_COLS)
    dot_tile<R, EXACT_COLS>(x, xs, w + c * K, K, K, out + c, os);
  for (; c < cols; ++c) dot_tile<R, 1>(x, xs, w + c * K, K, K, out + c, os);
}

void exact_parts(const torch::Tensor& x, const std::vector<Part>& parts, int64_t N, int64_t nb,
                 const torch::Tensor& out) {
  const int64_t M = x.size(0), K = nb * QK;
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t block = std::max<int64_t>(EXACT_COLS, std::min<int64_t>(16, (128 << 10) / K));
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> wbuf(block * K);
    std::vector<uint8_t> buf;
    for (int64_t n0 = begin; n0 < end; n0 += block) {
      const int64_t cols = std::min(block, end - n0);
      for (int64_t c = 0; c < cols; ++c) {
        const Part& p = part_of(parts, n0 + c);
        dequant_row(p.kind, p.row(n0 + c, nb, buf), nb, wbuf.data() + c * K);
      }
      const float* w = wbuf.data();
      float* o = op + n0;
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) exact_cols<4>(xp + r * xs, xs, w, K, cols, o + r * os, os);
      for (; r < M; ++r) exact_cols<1>(xp + r * xs, xs, w, K, cols, o + r * os, os);
    }
  });
}

// AVX-512 from GEMM_MIN_ROWS rows on: gemm_tile's columns in lanes. Unpacking the columns
// costs what ~25 rows' products do; measured on the 1B shape (Xeon, 2 threads), Q4_K
// 16384x2048 at 16 rows 4.8 ms on either kernel, at 64 rows 17.6 -> 10.2 ms, at 256 rows
// 72 -> 31 ms (Q6_K 2048x8192: 2.8 -> 3.1, 11.2 -> 6.7, 41 -> 20 ms).
constexpr int64_t GEMM_MIN_ROWS = 16;
// Few rows: each weight row's bytes are prefetched PREFETCH_ROWS rows ahead. The hardware
// prefetchers stop at every 4 KB page, which a Q4_K row of 2048 weights (1152 bytes)
// crosses every 3-4 rows. Measured on the 1B shape's 16 layers from memory (1 row, Xeon,
// 2 threads): Q4_K gate_up 1.39 -> 1.06-1.09 ms, Q6_K down 0.73 -> 0.53-0.66 ms; 4, 8 and
// 16 rows, and 4-64 KB ahead, measured no better.
constexpr int64_t PREFETCH_ROWS = 2;

// out [M, N] = q8_K(x) @ W^T on path isa: the activations quantized once per layout the
// parts need, then one parallel region (threads split the output columns; a few
// activation rows share each pass over a weight row).
void q8_parts(const torch::Tensor& x, const std::vector<Part>& parts, int64_t N, int64_t nb,
              const torch::Tensor& out, int64_t isa) {
  if (isa < 0) isa = kquant_isas().back();
  TORCH_CHECK(has_isa(isa), "kquant_mm_parts: path ", isa, " is not built here");
  const int64_t M = x.size(0);
  if (M == 0 || N == 0) return;
  thread_local Acts buffers[2];  // the caller's (Q4_K / Q5_K layout, Q6_K's), reused
  Acts& a45 = buffers[0];  // (by name, a worker thread would find its own)
  Acts& a6 = buffers[1];
  bool need45 = false, need6 = false;
  for (const Part& p : parts) (p.kind == Q6_K ? need6 : need45) = true;
  bool packed = isa == AVX512;  // every part packed: its kernel, natural order
  for (const Part& p : parts) packed = packed && p.packed;
  const bool gemm = isa == AVX512 && M >= GEMM_MIN_ROWS;  // (natural order, as Q6_K's)
  if (need45)
    prepare(x.data_ptr<float>(), M, x.stride(0), nb, Q4_K, isa == AVX512 && !gemm && !packed, a45);
  if (need6) prepare(x.data_ptr<float>(), M, x.stride(0), nb, Q6_K, false, a6);
  float* op = out.data_ptr<float>();
  const int64_t os = out.stride(0);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (packed) {  // threads split the groups of 16 columns, as many bytes each
    std::vector<std::pair<const Part*, int64_t>> groups;
    std::vector<int64_t> upto{0};  // bytes of the groups before each
    for (const Part& p : parts)
      for (int64_t n0 = p.lo; n0 < p.hi; n0 += PACK) {
        groups.emplace_back(&p, n0);
        upto.push_back(upto.back() + padded_bytes(p.kind));
      }
    const int64_t shares = std::min<int64_t>(at::get_num_threads(), groups.size());
    at::parallel_for(0, shares, 1, [&](int64_t first, int64_t last) {
      const Lanes ln;
      // share t: the groups whose first byte lies in [t, t + 1) x total / shares
      const auto at_share = [&](int64_t t) {
        return std::lower_bound(upto.begin(), upto.end() - 1, upto.back() * t / shares) - upto.begin();
      };
      for (int64_t i = at_share(first); i < at_share(last); ++i) {
        const auto [p, n0] = groups[i];
        const uint8_t* g = p->w + (n0 - p->lo) * p->ws;
        if (p->kind == Q4_K) packed_rows<Q4_K>(g, nb, a45, M, op + n0, os, ln);
        else if (p->kind == Q5_K) packed_rows<Q5_K>(g, nb, a45, M, op + n0, os, ln);
        else packed_rows<Q6_K>(g, nb, a6, M, op + n0, os, ln);
      }
    });
    return;
  }
  if (gemm) {  // threads split groups of GEMM_COLS columns of one part
    std::vector<std::pair<const Part*, int64_t>> groups;
    for (const Part& p : parts)
      for (int64_t n0 = p.lo; n0 < p.hi; n0 += GEMM_COLS) groups.emplace_back(&p, n0);
    at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
      Group512 g;
      for (int64_t i = begin; i < end; ++i) {
        const auto [p, n0] = groups[i];
        unpack_group(*p, n0, static_cast<int>(std::min<int64_t>(GEMM_COLS, p->hi - n0)), nb, g);
        const Acts& a = p->kind == Q6_K ? a6 : a45;
        if (p->kind == Q6_K) gemm_rows<true>(g, a, M, op + n0, os);
        else gemm_rows<false>(g, a, M, op + n0, os);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    const Spread sp;
    std::vector<uint8_t> buf;
    for (int64_t n = begin; n < end; ++n) {
      const Part& p = part_of(parts, n);
      const Acts& a = p.kind == Q6_K ? a6 : a45;
      const uint8_t* w = p.row(n, nb, buf);
      if (!p.packed && n + PREFETCH_ROWS < std::min(end, p.hi)) {
        const uint8_t* ahead = w + PREFETCH_ROWS * p.ws;
        for (int64_t at = 0; at < nb * block_bytes(p.kind); at += 64) __builtin_prefetch(ahead + at, 0, 3);
      }
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) tile<4>(isa, p.kind, w, a, r, op + r * os + n, os, sp);
      for (; r < M; ++r) tile<1>(isa, p.kind, w, a, r, op + r * os + n, os, sp);
    }
  });
}

}  // namespace

// x @ W.T for W the parts raws[i] (kinds[i], int64 [P]) stacked along the output rows, in
// one call: the exact kernel (q8 false) or q8_K activations on path isa (-1: the best
// here). KQuantWeight's products, and the fused decode step's (decode_step.cpp).
torch::Tensor kquant_mm_parts(torch::Tensor x, std::vector<torch::Tensor> raws,
                              torch::Tensor kinds, bool q8, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && kinds.scalar_type() == torch::kInt64 && kinds.is_contiguous() &&
              kinds.numel() == static_cast<int64_t>(raws.size()) && !raws.empty(),
              "kquant_mm_parts: kinds int64 [parts]");
  int64_t N, nb;
  const auto parts = parts_of(raws, kinds.data_ptr<int64_t>(), N, nb);
  auto out = torch::empty({x.size(0), N}, x.options());
  check_io(x, out, N, nb * QK);
  if (q8) q8_parts(x, parts, N, nb, out, isa);
  else exact_parts(x, parts, N, nb, out);
  return out;
}

// A dispatcher op too, for the fused decode step in the cpu_ops extension:
// c10::Dispatcher::singleton().findSchemaOrThrow("pie_ctx_kquants::kquant_mm_parts", "").
TORCH_LIBRARY(pie_ctx_kquants, m) {
  m.def("kquant_mm_parts(Tensor x, Tensor[] raws, Tensor kinds, bool q8, int isa) -> Tensor",
        &kquant_mm_parts);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kquant_mm_parts", &kquant_mm_parts,
        "x @ W.T for W in K-quant super-blocks (its parts), exact or on q8_K activations");
  m.def("kquant_rows", &kquant_rows, "rows of a K-quant weight, dequantized to float32");
  m.def("kquant_pack", &kquant_pack, "a K-quant weight's bytes in the packed layout");
  m.def("kquant_unpack", &kquant_unpack, "a packed K-quant weight's bytes in the file's layout");
  m.def("q8k_quantize", &q8k_quantize, "x rounded to q8_K: (q, d, bsums)");
  m.def("kquant_isas", &kquant_isas, "the q8_K product's code paths built here");
}
