// gefen_titan.optim.cpu_step: Gefen's CPU step and GefenMuon's momentum quantize, bit for bit gefen-x 0.5.0's.
//
// gefen-x runs its step on CPU tensors as a chain of torch ops (``Gefen._step_automatic``: the vmean update,
// weight decay, the stepsize, ``_automatic_momentum_update``; the factored step's momentum,
// ``_automatic_momentum_update_merged``; GefenMuon: ``_prepare_muon_momentum``). This file
// computes the same values in one pass per block row. Every rounding is the one torch makes on this CPU:
//
// * ``lerp`` with a scalar weight is ``w*(end-self)+self`` for w < 0.5, else ``end-(1-w)*(end-self)``, and
//   ``add_(x, alpha=a)`` is ``x*a+self``: one fused multiply-add each where torch's kernels fuse them (its
//   AVX2 and AVX-512 builds, vector loop and scalar tail alike), two roundings where they do not (its DEFAULT
//   build on x86); ``fused`` says which, probed from torch at load (probe.py). Nothing else may fuse: the
//   file is built with -ffp-contract=off and every FMA is written out.
// * ``torch.mean(g*g, dim=1)`` is ``sum / period`` where the sum follows torch's cascade over vectors of
//   ``sum_width`` floats (``sum_width_f64`` doubles), with four interleaved partial sums, levels of 16+
//   items, then the tail and the lanes in order (SumKernel.cpp). The widths are not the CPU's vector width
//   (torch 2.13 sums in 8-float order under its AVX-512 kernels too): probe.py finds them by asking torch.
//
// Two builds of this file (build.py): with AVX2, FMA and F16C (``GT_SIMD``: the vector loops below), and a
// portable one with no intrinsics (hosts without AVX2, ARM), whose scalar loops make the same roundings.
// * ``x.div_(scalar)`` is a true division; ``max(dim)`` keeps the first NaN of the row.
// * The nearest codeword: gefen-x's rule (searchsorted, ties to the lower index) is monotone in x, so the
//   code is the number of the codebook's thresholds at or below x, compared as order-preserving uint32 keys.
//   A 65536-entry table indexed by the key's top 16 bits gives the code at the bucket's start, the code above
//   its one threshold and that threshold's low 16 bits; a bucket with two or more thresholds is flagged
//   (hi < lo) and counted by binary search. The thresholds come from gefen-x's rule itself (codebook.py).
//
// Rows are independent, so ``at::parallel_for`` over rows (torch's intra-op threads) gives the same bits at
// any thread count. The entry points take one plain struct each (ctypes) and return 0, or -1 with a message.

#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(GT_PORTABLE)
#define GT_SIMD 1
#include <immintrin.h>
#else
#define GT_SIMD 0
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace {

enum DType : int32_t { F32 = 0, BF16 = 1, F16 = 2, F64 = 3 };

struct Codebook {
  const float* values;        // codebook[i] rounded to the tensors' dtype, as float (exact for every dtype)
  const uint32_t* table;      // 65536 entries by key >> 16: lo | hi << 8 | low16(threshold) << 16;
                              // hi < lo: a bucket of several thresholds, low16 = its row of ``fine``
  const uint32_t* fine;       // 256 entries per flagged bucket by (key >> 8) & 0xFF: lo | hi << 8 | low8 << 16;
                              // hi < lo again: count the thresholds
  const uint32_t* thresholds; // sorted keys: code(x) = #{t : t <= key(x)}
  int32_t n_thresholds;
  int32_t nan_code;           // NaN keys are in the tables too (their buckets hold this code)
};

// ------------------------------------------------------------------ scalars
inline uint32_t f2u(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float u2f(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// Order-preserving key of a float (NaN excluded): negative floats reversed below the positive ones.
inline uint32_t key_of(float x) {
  const uint32_t u = f2u(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline int32_t count_at_or_below(const Codebook& cb, uint32_t key) {
  return int32_t(std::upper_bound(cb.thresholds, cb.thresholds + cb.n_thresholds, key) - cb.thresholds);
}

inline int32_t code_of(const Codebook& cb, float x) {
  if (x != x) return cb.nan_code;
  const uint32_t k = key_of(x);
  uint32_t e = cb.table[k >> 16];
  if (((e >> 8) & 0xFFu) >= (e & 0xFFu)) return int32_t((k & 0xFFFFu) >= (e >> 16) ? (e >> 8) & 0xFFu : e & 0xFFu);
  e = cb.fine[(e >> 16) * 256 + ((k >> 8) & 0xFFu)];
  if (((e >> 8) & 0xFFu) >= (e & 0xFFu)) return int32_t((k & 0xFFu) >= (e >> 16) ? (e >> 8) & 0xFFu : e & 0xFFu);
  return count_at_or_below(cb, k);
}

// c10::BFloat16 and c10::Half conversions (round to nearest even).
inline float bf16_to_f(uint16_t h) { return u2f(uint32_t(h) << 16); }
inline uint16_t f_to_bf16(float x) {
  if (x != x) return 0x7FC0;
  const uint32_t u = f2u(x);
  return uint16_t((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
}
#if GT_SIMD
inline float f16_to_f(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f_to_f16(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
#else
// c10::Half's own conversions (c10/util/Half.h, fp16_ieee_to_fp32_value / fp16_ieee_from_fp32_value): exact,
// round to nearest even. They rest on float roundings, which -ffp-contract=off keeps as written.
inline float f16_to_f(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = u2f((two_w >> 4) + (uint32_t(0xE0) << 23)) * 0x1.0p-112f;
  const float denormalized = u2f((two_w >> 17) | (uint32_t(126) << 23)) - 0.5f;
  const uint32_t result = sign | (two_w < (uint32_t(1) << 27) ? f2u(denormalized) : f2u(normalized));
  return u2f(result);
}
inline uint16_t f_to_f16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f2u(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = u2f((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f2u(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
#endif

// Storage types: raw element, compute type (torch's opmath), load, round-and-store.
template <int D> struct St;
template <> struct St<F32> {
  using raw = float; using C = float;
  static C load(const raw* p, int64_t i) { return p[i]; }
  static raw pack(C x) { return x; }
};
template <> struct St<BF16> {
  using raw = uint16_t; using C = float;
  static C load(const raw* p, int64_t i) { return bf16_to_f(p[i]); }
  static raw pack(C x) { return f_to_bf16(x); }
};
template <> struct St<F16> {
  using raw = uint16_t; using C = float;
  static C load(const raw* p, int64_t i) { return f16_to_f(p[i]); }
  static raw pack(C x) { return f_to_f16(x); }
};
template <> struct St<F64> {
  using raw = double; using C = double;
  static C load(const raw* p, int64_t i) { return p[i]; }
  static raw pack(C x) { return x; }
};
template <int D> inline typename St<D>::C round_to(typename St<D>::C x) { return x; }
template <> inline float round_to<BF16>(float x) { return bf16_to_f(f_to_bf16(x)); }
template <> inline float round_to<F16>(float x) { return f16_to_f(f_to_f16(x)); }

// ``x * y + z`` as torch's kernels compute it here: one rounding (fused) or two.
template <typename C> inline C madd(C x, C y, C z, bool fused) { return fused ? std::fma(x, y, z) : x * y + z; }

// torch's lerp(self, end, w) with a scalar weight (aten/src/ATen/native/Lerp.h).
template <typename C> inline C lerp1(C self, C end, C w, C one_minus_w, bool small, bool fused) {
  const C diff = end - self;
  return small ? madd(w, diff, self, fused) : madd(-one_minus_w, diff, end, fused);
}

// ----------------------------------------------------- torch's cascade sum (SumKernel.cpp, inner reduction)
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return int64_t(63 - __builtin_clzll(uint64_t(x) - 1)) + 1;
}

// ``Item`` is one lane (A) or W lanes (std::array<A, W>).
template <typename A, int W> struct Lanes {
  std::array<A, W> v;
  Lanes() { v.fill(A(0)); }
  Lanes& operator+=(const Lanes& o) { for (int l = 0; l < W; ++l) v[l] += o.v[l]; return *this; }
};

// multi_row_sum<acc, nrows=4>: item(i, k) is the k-th of the 4 interleaved items of step i.
template <typename Item, typename LoadItem>
std::array<Item, 4> multi_row_sum(const LoadItem& item, int64_t size) {
  constexpr int64_t num_levels = 4;
  const int64_t level_power = std::max(int64_t(4), ceil_log2(size) / num_levels);
  const int64_t level_step = int64_t(1) << level_power;
  const int64_t level_mask = level_step - 1;
  Item acc[num_levels][4];
  for (auto& lv : acc) for (auto& a : lv) a = Item();
  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] += item(i * 4 + k);
    for (int64_t j = 1; j < num_levels; ++j) {
      for (int k = 0; k < 4; ++k) { acc[j][k] += acc[j - 1][k]; acc[j - 1][k] = Item(); }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] += item(i * 4 + k);
  for (int64_t j = 1; j < num_levels; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  return {acc[0][0], acc[0][1], acc[0][2], acc[0][3]};
}

template <typename Item, typename LoadItem>
Item row_sum(const LoadItem& item, int64_t size) {
  const int64_t size_ilp = size / 4;
  auto partial = multi_row_sum<Item>(item, size_ilp);
  for (int64_t i = size_ilp * 4; i < size; ++i) partial[0] += item(i);
  for (int k = 1; k < 4; ++k) partial[0] += partial[k];
  return partial[0];
}

// The sum of ``value(i)`` for i < n in torch's order, as torch's sum kernel over a contiguous row of
// acc-type values with W lanes per vector (then ``0 + sum``: the output starts at zero).
template <typename A, int W, typename Value>
A torch_row_sum(const Value& value, int64_t n) {
  if (n >= W) {
    const int64_t vec_size = n / W;
    auto item = [&](int64_t i) {
      Lanes<A, W> x;
      for (int l = 0; l < W; ++l) x.v[l] = value(i * W + l);
      return x;
    };
    const Lanes<A, W> acc = row_sum<Lanes<A, W>>(item, vec_size);
    A final_acc = 0;
    for (int64_t k = vec_size * W; k < n; ++k) final_acc += value(k);
    for (int l = 0; l < W; ++l) final_acc += acc.v[l];
    return A(0) + final_acc;
  }
  struct One {
    A v = 0;
    One& operator+=(const One& o) { v += o.v; return *this; }
  };
  auto item = [&](int64_t i) { One x; x.v = value(i); return x; };
  return A(0) + row_sum<One>(item, n).v;
}

template <typename A, typename Value>
A torch_row_sum_w(const Value& value, int64_t n, int width) {
  switch (width) {
    case 2: return torch_row_sum<A, 2>(value, n);
    case 4: return torch_row_sum<A, 4>(value, n);
    case 8: return torch_row_sum<A, 8>(value, n);
    case 16: return torch_row_sum<A, 16>(value, n);
    case 32: return torch_row_sum<A, 32>(value, n);
    default: throw std::runtime_error("unsupported sum width");
  }
}

#if GT_SIMD
// ------------------------------------------------------------------ AVX2 helpers (8 floats)
struct V8 {
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load(const uint16_t* p, bool bf16) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))
                : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // round to nearest even, NaN -> 0x7FC0 (as c10::BFloat16)
  static __m128i to_bf16(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, lsb), _mm256_set1_epi32(0x7FFF)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  // The codes of 8 floats (NaN included: the tables hold its code). The rare lanes in buckets of
  // several thresholds take the fine table, and the rarer ones in its flagged rows the scalar count.
  static __m256i codes_of(__m256 x, const Codebook& cb) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i key = _mm256_xor_si256(u, _mm256_or_si256(_mm256_srai_epi32(u, 31),
                                                             _mm256_set1_epi32(int32_t(0x80000000u))));
    const __m256i ff = _mm256_set1_epi32(0xFF);
    const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(cb.table), _mm256_srli_epi32(key, 16), 4);
    const __m256i lo = _mm256_and_si256(e, ff);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(e, 8), ff);
    const __m256i thr = _mm256_srli_epi32(e, 16);
    __m256i code = _mm256_blendv_epi8(hi, lo, _mm256_cmpgt_epi32(thr, _mm256_and_si256(key, _mm256_set1_epi32(0xFFFF))));
    const __m256i flagged = _mm256_cmpgt_epi32(lo, hi);
    if (!_mm256_testz_si256(flagged, flagged)) code = fine_codes(x, key, thr, flagged, code, cb);
    return code;
  }
  static __m256i fine_codes(__m256 x, __m256i key, __m256i row, __m256i flagged, __m256i code, const Codebook& cb) {
    const __m256i ff = _mm256_set1_epi32(0xFF);
    const __m256i idx = _mm256_or_si256(_mm256_slli_epi32(row, 8), _mm256_and_si256(_mm256_srli_epi32(key, 8), ff));
    const __m256i e = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(cb.fine), idx,
                                                  flagged, 4);
    const __m256i lo = _mm256_and_si256(e, ff);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(e, 8), ff);
    const __m256i fine = _mm256_blendv_epi8(hi, lo, _mm256_cmpgt_epi32(_mm256_srli_epi32(e, 16), _mm256_and_si256(key, ff)));
    code = _mm256_blendv_epi8(code, fine, flagged);
    const int again = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_and_si256(flagged, _mm256_cmpgt_epi32(lo, hi))));
    if (again) {
      alignas(32) float xs[8];
      alignas(32) int32_t cs[8];
      _mm256_store_ps(xs, x);
      _mm256_store_si256(reinterpret_cast<__m256i*>(cs), code);
      for (int l = 0; l < 8; ++l)
        if (again & (1 << l)) cs[l] = code_of(cb, xs[l]);
      code = _mm256_load_si256(reinterpret_cast<const __m256i*>(cs));
    }
    return code;
  }
};

inline __m256i load_codes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline void store_codes8(uint8_t* p, __m256i c) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
}

template <int D> inline __m256 load8(const typename St<D>::raw* p);
template <> inline __m256 load8<F32>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 load8<BF16>(const uint16_t* p) { return V8::load(p, true); }
template <> inline __m256 load8<F16>(const uint16_t* p) { return V8::load(p, false); }

template <int D> inline void store8(typename St<D>::raw* p, __m256 x);
template <> inline void store8<F32>(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
template <> inline void store8<BF16>(uint16_t* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), V8::to_bf16(x));
}
template <> inline void store8<F16>(uint16_t* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
template <int D> inline __m256 round8(__m256 x) {
  if constexpr (D == F32) return x;
  typename St<D>::raw tmp[8];
  store8<D>(tmp, x);
  return load8<D>(tmp);
}

// The row sum of squares of a float-computed gradient row (fp32, bf16: squares rounded to bf16, fp16: in
// float) in torch's order, with vectors of W = 8 * R floats held as R AVX2 registers.
inline __m256 round_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, lsb), _mm256_set1_epi32(0x7FFF));
  r = _mm256_and_si256(r, _mm256_set1_epi32(int32_t(0xFFFF0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan));
}

template <int R> struct VItem {
  __m256 v[R];
  VItem() { for (int k = 0; k < R; ++k) v[k] = _mm256_setzero_ps(); }
  VItem& operator+=(const VItem& o) {
    for (int k = 0; k < R; ++k) v[k] = _mm256_add_ps(v[k], o.v[k]);
    return *this;
  }
};

#endif  // GT_SIMD

template <int D> inline float sq1(const typename St<D>::raw* g, int64_t i) {
  const float x = St<D>::load(g, i);
  return D == BF16 ? round_to<BF16>(x * x) : x * x;
}

#if GT_SIMD
template <int D, int R>
float sumsq_row_simd(const typename St<D>::raw* g, int64_t n) {
  constexpr int W = 8 * R;
  if (n < W) return torch_row_sum<float, W>([&](int64_t i) { return sq1<D>(g, i); }, n);
  const int64_t vec_size = n / W;
  auto item = [&](int64_t i) {
    VItem<R> x;
    for (int k = 0; k < R; ++k) {
      const __m256 y = load8<D>(g + i * W + 8 * k);
      x.v[k] = D == BF16 ? round_bf16_8(_mm256_mul_ps(y, y)) : _mm256_mul_ps(y, y);
    }
    return x;
  };
  const VItem<R> acc = row_sum<VItem<R>>(item, vec_size);
  float final_acc = 0;
  for (int64_t k = vec_size * W; k < n; ++k) final_acc += sq1<D>(g, k);
  alignas(32) float lanes[W];
  for (int k = 0; k < R; ++k) _mm256_store_ps(lanes + 8 * k, acc.v[k]);
  for (int l = 0; l < W; ++l) final_acc += lanes[l];
  return 0.0f + final_acc;
}
#endif

// The row sum of squares of a float-computed gradient row (fp32, bf16: squares rounded to bf16, fp16: in
// float) in torch's order at ``width`` lanes: vectorized as 1 or 2 AVX2 registers at widths 8 and 16, else
// (and in the portable build) the plain rendering of torch's algorithm, which the tests hold equal.
template <int D>
float sumsq_row(const typename St<D>::raw* g, int64_t n, int width, bool vectorized = true) {
#if GT_SIMD
  if (vectorized && width == 8) return sumsq_row_simd<D, 1>(g, n);
  if (vectorized && width == 16) return sumsq_row_simd<D, 2>(g, n);
#endif
  (void)vectorized;
  return torch_row_sum_w<float>([&](int64_t i) { return sq1<D>(g, i); }, n, width);
}

// ================================================================== Gefen's step
// Two calls per parameter, because torch.sqrt on CPU is MKL's vsSqrt (not always correctly rounded), which
// only torch itself reproduces: ``gt_gefen_moments`` (the vmean update, the momentum update and requantize),
// then ``torch.sqrt(vmean)`` in Python, then ``gt_gefen_apply`` (the stepsize from it, weight decay, the apply).
// The factored second moment's step (its own stepsize, in torch) calls ``gt_gefen_momentum``: the momentum
// update alone, returning the dense requantized momentum.
// max |x| over a row as torch's max(dim) takes it: the row's first NaN wins (Gefen's and GefenMuon's magnitude).
template <typename C> struct RowAbsMax {
  C mx = 0, first_nan = 0;
  bool nan_seen = false;
  void add(C au) {
    if (au != au) {
      if (!nan_seen) { nan_seen = true; first_nan = au; }
    } else {
      mx = std::max(mx, au);
    }
  }
#if GT_SIMD
  void add_lanes(__m256 vmx) {  // the vector loop's maxima (NaN lanes are found by the caller)
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmx);
    for (float x : lanes) mx = std::max(mx, C(x));
  }
#endif
  float value() const { return nan_seen ? float(first_nan) : float(mx); }
};

// Gefen's and GefenMuon's momentum pass over a row, 8 lanes at a time: u = lerp(codebook[code] * mag, g,
// 1 - beta) as torch's vector lerp (on the branch the weight picks; fused or not, as torch here), stored to
// ``dst``; the lanes' max |u| go into ``row``, then the row's first NaN, looked up in ``dst`` in order
// (torch's max(dim)). Returns how many elements it did (whole vectors; 0 in the portable build). The scalar
// tail stays each caller's: Gefen computes it in float (opmath), GefenMuon rounds every op to the dtype, as
// their torch ops do. Not for fp64 (no float lanes).
template <int D>
int64_t momentum_lerp8(const Codebook& cb, const uint8_t* codes, const typename St<D>::raw* g, float* dst,
                       int64_t n, float mag, float w, float omw, bool small, bool fused, RowAbsMax<float>& row) {
  static_assert(D != F64, "the vector pass holds float lanes");
  int64_t i = 0;
#if GT_SIMD
  const __m256 vmag = _mm256_set1_ps(mag), vw = _mm256_set1_ps(w), vomw = _mm256_set1_ps(-omw);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmx = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
  auto pass = [&](auto fused_tag) {
    constexpr bool FUSED = decltype(fused_tag)::value;
    auto madd8 = [](__m256 x, __m256 y, __m256 z) {
      if constexpr (FUSED) return _mm256_fmadd_ps(x, y, z);
      else return _mm256_add_ps(_mm256_mul_ps(x, y), z);
    };
    for (; i + 8 <= n; i += 8) {
      const __m256 cur = _mm256_mul_ps(_mm256_i32gather_ps(cb.values, load_codes8(codes + i), 4), vmag);
      const __m256 gv = load8<D>(g + i);
      const __m256 diff = _mm256_sub_ps(gv, cur);
      const __m256 u = small ? madd8(vw, diff, cur) : madd8(vomw, diff, gv);
      _mm256_storeu_ps(dst + i, u);
      const __m256 au = _mm256_and_ps(u, absmask);
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(au, au, _CMP_UNORD_Q));
      vmx = _mm256_max_ps(vmx, au);  // NaN lanes: the row's first NaN is looked up below
    }
  };
  if (fused) pass(std::true_type()); else pass(std::false_type());
  row.add_lanes(vmx);
  if (_mm256_movemask_ps(vnan))  // max(dim) keeps the first NaN of the row (its |.|)
    for (int64_t j = 0; j < i && !row.nan_seen; ++j)
      if (dst[j] != dst[j]) row.add(std::fabs(dst[j]));
#else
  (void)cb; (void)codes; (void)g; (void)dst; (void)n; (void)mag; (void)w; (void)omw; (void)small; (void)fused;
  (void)row;
#endif
  return i;
}

struct GefenArgs {
  void* p;                 // parameter shard, [blocks * period], dtype
  const void* g;           // gradient, same layout and dtype
  uint8_t* codes;          // [blocks, period]
  float* magnitude;        // [blocks]
  float* vmean;            // [blocks]
  const float* sqrt_vmean; // [blocks]: torch.sqrt(vmean) after the update (apply only)
  int64_t blocks, period;
  int32_t dtype;
  int32_t sum_width;       // torch's sum order for float rows: its lanes (probe.py)
  int32_t sum_width_f64;   // and for double rows
  int32_t fused;           // torch's lerp and add_(alpha) are one FMA here (probe.py)
  Codebook cb;
  // lerp weight 1 - beta1: as the compute type, its 1 - w, and which branch torch takes
  float w_f, omw_f; double w_d, omw_d; int32_t w_small;
  float beta2_f, alpha_f;         // vmean.mul_(beta2).add_(mean, alpha=1 - beta2)
  double alpha_d;                 // the add's alpha when the mean is double (fp64 gradients)
  float sqrt_bc2_f, eps_f, inv_bc1_f;  // h = sqrt(vmean) / sqrt(bc2) + eps; stepsize = 1/h * (1/bc1)
  float lr_f, wdf_f; double lr_d, wdf_d; int32_t has_wd;  // p *= 1 - lr*wd (if wd > 0); p -= update * lr
  void* out;               // gt_gefen_momentum only: the dense momentum, [blocks * period], float (fp64: double)
};

// MOMENTUM_ONLY (``gt_gefen_momentum``, the factored second moment's step: ``_automatic_momentum_update_merged``):
// no vmean; the row's updated momentum is worked in ``out`` and overwritten there by the requantized one,
// codebook[code] * magnitude (torch: the dtype's codeword promoted by the fp32 magnitude, one rounding).
template <int D, bool MOMENTUM_ONLY = false>
void gefen_moments(const GefenArgs& a, int64_t r0, int64_t r1, std::vector<typename St<D>::C>& scratch) {
  using S = St<D>;
  using C = typename S::C;
  using raw = typename S::raw;
  const int64_t n = a.period;
  const raw* g_all = static_cast<const raw*>(a.g);
  const bool small = a.w_small != 0, fused = a.fused != 0;
  const C w = D == F64 ? C(a.w_d) : C(a.w_f);
  const C omw = D == F64 ? C(a.omw_d) : C(a.omw_f);
  if (!MOMENTUM_ONLY) scratch.resize(size_t(n));
  for (int64_t r = r0; r < r1; ++r) {
    const raw* g = g_all + r * n;
    uint8_t* codes = a.codes + r * n;
    const float mag_old = a.magnitude[r];
    C* upd = MOMENTUM_ONLY ? static_cast<C*>(a.out) + r * n : scratch.data();
    if constexpr (!MOMENTUM_ONLY) {
      // ---- vmean: torch.mean(g * g, dim=1) (fp16 squares in float), then mul_(beta2).add_(mean, alpha)
      float v = a.vmean[r] * a.beta2_f;
      if constexpr (D == F64) {
        const double mean = torch_row_sum_w<double>([&](int64_t i) { return g[i] * g[i]; }, n, a.sum_width_f64)
                            / double(n);
        v = float(madd(mean, a.alpha_d, double(v), fused));
      } else {
        float mean = sumsq_row<D>(g, n, a.sum_width) / float(n);
        if constexpr (D == BF16) mean = round_to<BF16>(mean);
        v = madd(mean, a.alpha_f, v, fused);
      }
      a.vmean[r] = v;
    }
    // ---- pass 1: updated_m = lerp(codebook[code] * magnitude, g, 1 - beta1); its max |.| (first NaN kept)
    int64_t i = 0;
    RowAbsMax<C> row;
    if constexpr (D != F64) i = momentum_lerp8<D>(a.cb, codes, g, upd, n, mag_old, w, omw, small, fused, row);
    for (; i < n; ++i) {
      const C cur = C(a.cb.values[codes[i]]) * C(mag_old);
      const C u = lerp1<C>(cur, S::load(g, i), w, omw, small, fused);
      upd[i] = u;
      row.add(std::fabs(u));
    }
    const float mag = row.value();
    a.magnitude[r] = mag;
    // ---- pass 2: requantize updated_m / magnitude (0 where magnitude is not > 0); MOMENTUM_ONLY: and
    // codebook[code] * magnitude into ``out``
    const bool live = mag > 0.0f;
    i = 0;
#if GT_SIMD
    if constexpr (D != F64) {
      const __m256 vmag = _mm256_set1_ps(mag);
      for (; i + 8 <= n; i += 8) {
        const __m256 x = live ? _mm256_div_ps(_mm256_loadu_ps(upd + i), vmag) : _mm256_setzero_ps();
        const __m256i code = V8::codes_of(x, a.cb);
        store_codes8(codes + i, code);
        if constexpr (MOMENTUM_ONLY)
          _mm256_storeu_ps(upd + i, _mm256_mul_ps(_mm256_i32gather_ps(a.cb.values, code, 4), vmag));
      }
    }
#endif
    for (; i < n; ++i) {
      const C x = live ? upd[i] / C(mag) : C(0);
      const int32_t code = code_of(a.cb, float(x));
      codes[i] = uint8_t(code);
      if constexpr (MOMENTUM_ONLY) upd[i] = C(a.cb.values[code]) * C(mag);
    }
  }
}

template <int D>
void gefen_apply(const GefenArgs& a, int64_t r0, int64_t r1) {
  using S = St<D>;
  using C = typename S::C;
  using raw = typename S::raw;
  const int64_t n = a.period;
  const C lr = D == F64 ? C(a.lr_d) : C(a.lr_f);
  const C wdf = D == F64 ? C(a.wdf_d) : C(a.wdf_f);
  for (int64_t r = r0; r < r1; ++r) {
    raw* p = static_cast<raw*>(a.p) + r * n;
    const uint8_t* codes = a.codes + r * n;
    const float mag = a.magnitude[r];
    // stepsize = reciprocal(sqrt(vmean) / sqrt(bc2) + eps) * (1/bc1): true division, one rounding each
    const float stepsize = (1.0f / (a.sqrt_vmean[r] / a.sqrt_bc2_f + a.eps_f)) * a.inv_bc1_f;
    // p = (p * (1 - lr*wd)) - codebook[code] * magnitude * stepsize * lr
    int64_t i = 0;
#if GT_SIMD
    if constexpr (D != F64) {
      const __m256 vmag = _mm256_set1_ps(mag), vst = _mm256_set1_ps(stepsize), vlr = _mm256_set1_ps(a.lr_f);
      const __m256 vwd = _mm256_set1_ps(a.wdf_f);
      for (; i + 8 <= n; i += 8) {
        __m256 u = _mm256_mul_ps(_mm256_i32gather_ps(a.cb.values, load_codes8(codes + i), 4), vmag);
        u = _mm256_mul_ps(_mm256_mul_ps(u, vst), vlr);
        __m256 pv = load8<D>(p + i);
        if (a.has_wd) pv = round8<D>(_mm256_mul_ps(pv, vwd));
        store8<D>(p + i, _mm256_sub_ps(pv, u));
      }
    }
#endif
    for (; i < n; ++i) {
      C u = C(a.cb.values[codes[i]]) * C(mag);
      u = (u * C(stepsize)) * lr;
      C pv = S::load(p, i);
      if (a.has_wd) pv = round_to<D>(pv * wdf);
      p[i] = S::pack(pv - u);
    }
  }
}

// ================================================================== GefenMuon's momentum
// gefen-x's ``_prepare_muon_momentum`` on CPU: every op rounds to the tensors' dtype T, as torch does
// in place on T tensors.
struct MuonArgs {
  void* out;             // dense momentum for Newton-Schulz, [blocks * period], dtype
  const void* g;         // gradient shard, same layout and dtype
  uint8_t* codes;        // [blocks, period]
  float* magnitude;      // [blocks]
  int64_t blocks, period;
  int32_t dtype;
  int32_t fused;         // torch's lerp and add_(alpha) are one FMA here (probe.py)
  Codebook cb;
  float w_f, omw_f; double w_d, omw_d; int32_t w_small;  // lerp_(g, 1 - momentum)
  float tiny_f;          // the magnitude's clamp(min=finfo(T).tiny), as float
  int32_t nesterov;      // m.mul_(momentum).add_(g, alpha=1 - momentum)
  float mom_f, alpha_f; double mom_d, alpha_d;
};

template <int D>
void muon_rows(const MuonArgs& a, int64_t r0, int64_t r1) {
  using S = St<D>;
  using C = typename S::C;
  using raw = typename S::raw;
  const int64_t n = a.period;
  const bool small = a.w_small != 0, fused = a.fused != 0;
  const C w = D == F64 ? C(a.w_d) : C(a.w_f);
  const C omw = D == F64 ? C(a.omw_d) : C(a.omw_f);
  const C mom = D == F64 ? C(a.mom_d) : C(a.mom_f);
  const C alpha = D == F64 ? C(a.alpha_d) : C(a.alpha_f);
  for (int64_t r = r0; r < r1; ++r) {
    const raw* g = static_cast<const raw*>(a.g) + r * n;
    raw* m = static_cast<raw*>(a.out) + r * n;
    uint8_t* codes = a.codes + r * n;
    const float mag_old = a.magnitude[r];
    // dequantize * magnitude, lerp towards g; max |m| (first NaN kept)
    int64_t i = 0;
    RowAbsMax<C> row;
    if constexpr (D == F32) i = momentum_lerp8<D>(a.cb, codes, g, m, n, mag_old, w, omw, small, fused, row);
    for (; i < n; ++i) {
      const C cur = round_to<D>(C(a.cb.values[codes[i]]) * C(mag_old));
      const C u = round_to<D>(lerp1<C>(cur, S::load(g, i), w, omw, small, fused));
      m[i] = S::pack(u);
      row.add(std::fabs(u));
    }
    const float mag = row.value();
    a.magnitude[r] = mag;
    // m / clamp(magnitude, tiny) (0 where magnitude <= 0), requantize, codebook[code] * magnitude
    const float denom = mag != mag ? mag : std::max(mag, a.tiny_f);
    const bool zero = mag <= 0.0f;
    i = 0;
#if GT_SIMD
    if constexpr (D == F32) {
      const __m256 vden = _mm256_set1_ps(denom), vmag = _mm256_set1_ps(mag);
      const __m256 vmom = _mm256_set1_ps(mom), valpha = _mm256_set1_ps(alpha);
      for (; i + 8 <= n; i += 8) {
        const __m256 x = zero ? _mm256_setzero_ps() : _mm256_div_ps(_mm256_loadu_ps(m + i), vden);
        const __m256i code = V8::codes_of(x, a.cb);
        store_codes8(codes + i, code);
        __m256 q = _mm256_mul_ps(_mm256_i32gather_ps(a.cb.values, code, 4), vmag);
        if (a.nesterov) {
          const __m256 gv = _mm256_loadu_ps(g + i), qm = _mm256_mul_ps(q, vmom);
          q = fused ? _mm256_fmadd_ps(gv, valpha, qm) : _mm256_add_ps(_mm256_mul_ps(gv, valpha), qm);
        }
        _mm256_storeu_ps(m + i, q);
      }
    }
#endif
    for (; i < n; ++i) {
      const C x = zero ? C(0) : round_to<D>(S::load(m, i) / C(denom));
      const int32_t code = code_of(a.cb, float(x));
      codes[i] = uint8_t(code);
      C q = round_to<D>(C(a.cb.values[code]) * C(mag));
      if (a.nesterov) q = round_to<D>(madd(S::load(g, i), alpha, round_to<D>(q * mom), fused));
      m[i] = S::pack(q);
    }
  }
}

// Calls ``f(std::integral_constant<int, D>())`` for the entry's dtype code: one instantiation per dtype.
template <typename F>
void by_dtype(int32_t dtype, const F& f) {
  switch (dtype) {
    case F32: f(std::integral_constant<int, F32>()); break;
    case BF16: f(std::integral_constant<int, BF16>()); break;
    case F16: f(std::integral_constant<int, F16>()); break;
    case F64: f(std::integral_constant<int, F64>()); break;
    default: throw std::runtime_error("unsupported dtype");
  }
}

template <typename Args, typename Rows>
int run_rows(const Args& a, char* err, int errlen, const Rows& rows) {
  try {
    // About 16K elements per task: whole rows, so the result is the same at any thread count.
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, a.period));
    at::parallel_for(0, a.blocks, grain, [&](int64_t r0, int64_t r1) { rows(r0, r1); });
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, size_t(errlen), "%s", e.what());
  } catch (...) {
    std::snprintf(err, size_t(errlen), "unknown C++ exception");
  }
  return -1;
}

}  // namespace

extern "C" {

// The layout of the argument structs: the Python side refuses a library whose version differs.
int gt_abi_version() { return 3; }

// Which build this is: 1 with the AVX2 vector loops, 0 portable (plain C++).
int gt_simd() { return GT_SIMD; }

int gt_gefen_moments(const GefenArgs* a, char* err, int errlen) {
  return run_rows(*a, err, errlen, [&](int64_t r0, int64_t r1) {
    by_dtype(a->dtype, [&](auto d) {
      constexpr int D = decltype(d)::value;
      std::vector<typename St<D>::C> s;  // the row's updated momentum, in the compute type
      gefen_moments<D>(*a, r0, r1, s);
    });
  });
}

// The factored second moment's momentum update alone (no vmean): codes and magnitudes in place, the dense
// requantized momentum into ``a->out``. Only the momentum's fields of ``a`` are read.
int gt_gefen_momentum(const GefenArgs* a, char* err, int errlen) {
  return run_rows(*a, err, errlen, [&](int64_t r0, int64_t r1) {
    by_dtype(a->dtype, [&](auto d) {
      constexpr int D = decltype(d)::value;
      std::vector<typename St<D>::C> unused;
      gefen_moments<D, true>(*a, r0, r1, unused);
    });
  });
}

int gt_gefen_apply(const GefenArgs* a, char* err, int errlen) {
  return run_rows(*a, err, errlen, [&](int64_t r0, int64_t r1) {
    by_dtype(a->dtype, [&](auto d) { gefen_apply<decltype(d)::value>(*a, r0, r1); });
  });
}

// One row's sum of squares as the step takes it (``vectorized``) or by the plain rendering of torch's
// algorithm, at a given width, as a double (exact for float sums): probe.py compares torch's own reductions
// with these renderings to find torch's order, and the tests hold the vectorized sums to the plain ones.
// Returns -1 for an unsupported dtype or width.
int gt_row_sumsq(const void* g, int64_t n, int32_t dtype, int32_t width, int32_t vectorized, double* out) {
  try {
    switch (dtype) {
      case F32: *out = sumsq_row<F32>(static_cast<const float*>(g), n, width, vectorized); return 0;
      case BF16: *out = sumsq_row<BF16>(static_cast<const uint16_t*>(g), n, width, vectorized); return 0;
      case F16: *out = sumsq_row<F16>(static_cast<const uint16_t*>(g), n, width, vectorized); return 0;
      case F64: {
        const double* x = static_cast<const double*>(g);
        *out = torch_row_sum_w<double>([&](int64_t i) { return x[i] * x[i]; }, n, width);
        return 0;
      }
      default: return -1;
    }
  } catch (...) {
    return -1;
  }
}

int gt_muon_momentum(const MuonArgs* a, char* err, int errlen) {
  return run_rows(*a, err, errlen, [&](int64_t r0, int64_t r1) {
    by_dtype(a->dtype, [&](auto d) { muon_rows<decltype(d)::value>(*a, r0, r1); });
  });
}

}  // extern "C"
