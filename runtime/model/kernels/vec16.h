// The vectors pie-ctx's CPU kernels share (cpu_ops.cpp, sampling.cpp, block_mm.cpp): 16
// floats as GCC vector extensions (one AVX-512 register, two AVX2 ones), so one source
// compiles to whatever the CPU has, and the one vectorised exp they all use.
//
// The files are compiled under different contraction rules (block_mm.cpp with
// -ffp-contract=fast, sampling.cpp with it off, cpu_ops.cpp's paged kernel with GCC's
// default and its elementwise ops under a pragma that turns it off). What is defined here
// therefore never leaves a rounding to the including file's rule: fmadd is one fused
// rounding by intrinsic, and each exp_core names its rounding. Its digest is part of each
// including module's build folder (runtime/model/kernels/__init__.py, SOURCES).

#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

constexpr int W = 16;  // floats per vector

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 splat(float x) { return v16{} + x; }

// a * b + c, rounded once where the CPU has an FMA
inline v16 fmadd(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  __m256 x[2], y[2], z[2];
  std::memcpy(x, &a, sizeof a);
  std::memcpy(y, &b, sizeof b);
  std::memcpy(z, &c, sizeof c);
  z[0] = _mm256_fmadd_ps(x[0], y[0], z[0]);
  z[1] = _mm256_fmadd_ps(x[1], y[1], z[1]);
  std::memcpy(&c, z, sizeof c);
  return c;
#elif defined(__FP_FAST_FMAF)  // (Arm: the compiler makes vector fmas of these)
  v16 r;
  for (int i = 0; i < W; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#else  // no FMA instruction: nothing to fuse
  return a * b + c;
#endif
}

// exp(x) for x in [-87, 88] (callers clamp: each says what happens outside), ~1.2e-7
// relative: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor series to r^6, 2^n in
// the exponent; exp(0) is exactly 1. One body, two roundings (MUL_ADD(a, b, c) is
// a * b + c):
// * exp_core_fused: every multiply-add one fused rounding (fmadd; what GCC's contraction
//   made of this code in the paged kernel's softmax). Nothing in it is left to contract,
//   so it rounds alike under any rule, and it is defined under the including file's own
//   options so that it inlines there;
// * exp_core_exact: every product and sum rounded on its own (silu_mul and sampling, the
//   eager ops' rule), defined under a pragma that turns contraction off, so that a copy
//   compiled on its own rounds as its inlined copies do (its callers run under that rule).
// (A template over the two would not do: its instances get the options of the place the
// template is defined, and GCC does not inline a function whose options differ from its
// caller's.)
#define PIE_EXP_CORE(MUL_ADD)                                                      \
  const v16 magic = splat(12582912.f); /* 1.5 * 2^23: adding it rounds to an integer */ \
  const v16 n = MUL_ADD(x, splat(1.44269504088896341f), magic) - magic;            \
  const v16 r = MUL_ADD(-n, splat(0.693147180559945309f), x);                      \
  v16 p = splat(1.f / 720.f);                                                      \
  p = MUL_ADD(p, r, splat(1.f / 120.f));                                           \
  p = MUL_ADD(p, r, splat(1.f / 24.f));                                            \
  p = MUL_ADD(p, r, splat(1.f / 6.f));                                             \
  p = MUL_ADD(p, r, splat(0.5f));                                                  \
  p = MUL_ADD(p, r, splat(1.f));                                                   \
  p = MUL_ADD(p, r, splat(1.f));                                                   \
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;                   \
  return p * (v16)e;

inline v16 exp_core_fused(v16 x) { PIE_EXP_CORE(fmadd) }

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
inline v16 mul_then_add(v16 a, v16 b, v16 c) { return a * b + c; }
inline v16 exp_core_exact(v16 x) { PIE_EXP_CORE(mul_then_add) }
#pragma GCC pop_options

#undef PIE_EXP_CORE

}  // namespace
