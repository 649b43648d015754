// Row-invariant matmul for XLA's CPU backend: y[m, n] = scale[n] * dot(x[m, :], w[n, :]).
//
// Weights are stored out-major, w [N, K]: float32; int8 with one float32 scale per output channel; or a GGUF file's
// own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), each row of w its channel's blocks along K. Int8 and block
// weights are widened in registers, so a step reads their bytes, not the four per weight that XLA's CPU dot reads
// after it materializes converted weights. A block weight is rebuilt exactly as the gguf package's dequantization
// computes it (the same float32 multiplies and adds), so the output is the float32 path's on the dequantized weights,
// bit for bit.
//
// Every output element is computed by one fixed sequence of operations: two vector accumulators (16 float32 lanes with
// AVX-512, else 8), one over the even and one over the odd vector-wide column groups of K, fused multiply-adds in K
// order, then one fixed horizontal sum.
// How many rows a call has, which rows share a register tile and which thread takes a channel range never change that
// sequence, so a row's result does not depend on the other rows in the call: batch invariance by construction, at
// any wave width. Requires K % 32 == 0 (K % 256 for the K-quants) and N % 4 == 0 (the Python side checks and
// otherwise uses XLA's dot).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One vector of float32 lanes: 16 with AVX-512, else 8 (AVX2 + FMA).
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec LoadX(const float* p) { return _mm512_loadu_ps(p); }
inline Vec LoadW(const float* p) { return _mm512_loadu_ps(p); }
inline Vec LoadW(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline __m256 Half(Vec s) {  // lanes i + (i + 8)
  return _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
}
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Set1(float a) { return _mm512_set1_ps(a); }
inline void Store(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Round(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec Pow2(Vec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// ((p[c] >> shift) & mask) << up for the kLanes bytes p[0..15], as int32 lanes.
inline __m512i Bits(const uint8_t* p, int shift, int mask, int up) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_sll_epi32(_mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(mask)),
                          _mm_cvtsi32_si128(up));
}
inline Vec Int(__m512i a, __m512i b, int bias) {  // float((a | b) - bias)
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(a, b), _mm512_set1_epi32(bias)));
}
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec LoadX(const float* p) { return _mm256_loadu_ps(p); }
inline Vec LoadW(const float* p) { return _mm256_loadu_ps(p); }
inline Vec LoadW(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 Half(Vec s) { return s; }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Set1(float a) { return _mm256_set1_ps(a); }
inline void Store(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec Round(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec Pow2(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// ((p[c] >> shift) & mask) << up for the kLanes bytes p[0..7], as int32 lanes.
inline __m256i Bits(const uint8_t* p, int shift, int mask, int up) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_sll_epi32(_mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask)),
                          _mm_cvtsi32_si128(up));
}
inline Vec Int(__m256i a, __m256i b, int bias) {  // float((a | b) - bias)
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(a, b), _mm256_set1_epi32(bias)));
}
#endif

// e^x for x <= 0 (a score minus the row's maximum): Cody-Waite reduction and a degree-6 polynomial, ~2 ulp; x below
// -87 gives e^-87 (1.6e-38), as good as zero beside the maximum's 1.
inline Vec ExpNonPositive(Vec x) {
  x = Max(x, Set1(-87.0f));
  const Vec n = Round(Mul(x, Set1(1.44269504088896341f)));
  Vec r = Fma(n, Set1(-0.693359375f), x);
  r = Fma(n, Set1(2.12194440e-4f), r);
  Vec p = Set1(1.0f / 720);
  p = Fma(p, r, Set1(1.0f / 120));
  p = Fma(p, r, Set1(1.0f / 24));
  p = Fma(p, r, Set1(1.0f / 6));
  p = Fma(p, r, Set1(0.5f));
  p = Fma(p, r, Set1(1.0f));
  p = Fma(p, r, Set1(1.0f));
  return Mul(p, Pow2(n));
}
constexpr int64_t kStep = 2 * kLanes;  // K columns per iteration: one vector into each accumulator

// The one horizontal sum every output uses.
inline float Finish(Vec even, Vec odd) {
  const __m256 s = Half(Add(even, odd));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // lanes i + (i + 4)
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                         // + lanes 2, 3
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));                                     // + lane 1
  return _mm_cvtss_f32(h);
}

// Finish for kLanes vectors at once: lane p of the result is the sum of v[kSlot[p]]'s lanes by Finish's own tree (lane
// i + lane i + kLanes / 2, then i + 4, i + 2, i + 1), so each sum has Finish's bits. v is overwritten.
#if defined(__AVX512F__)
inline Vec FoldLanes(Vec* v) {
  for (int j = 0; j < 8; ++j)
    v[j] = Add(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44), _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    v[j] = Add(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x88), _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)
    v[j] = Add(_mm512_shuffle_ps(v[2 * j], v[2 * j + 1], 0x44), _mm512_shuffle_ps(v[2 * j], v[2 * j + 1], 0xEE));
  return Add(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}
#else
inline Vec FoldLanes(Vec* v) {
  for (int j = 0; j < 4; ++j)
    v[j] = Add(_mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x20),
               _mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x31));
  for (int j = 0; j < 2; ++j)
    v[j] = Add(_mm256_shuffle_ps(v[2 * j], v[2 * j + 1], 0x44), _mm256_shuffle_ps(v[2 * j], v[2 * j + 1], 0xEE));
  return Add(_mm256_shuffle_ps(v[0], v[1], 0x88), _mm256_shuffle_ps(v[0], v[1], 0xDD));
}
#endif

// kSlot[p]: the input of FoldLanes whose sum lands in lane p (found by folding one-hot vectors).
struct FoldSlots {
  int slot[kLanes];
  FoldSlots() {
    Vec v[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      float one[kLanes] = {};
      one[0] = static_cast<float>(j);
      v[j] = LoadX(one);
    }
    float lane[kLanes];
    Store(lane, FoldLanes(v));
    for (int p = 0; p < kLanes; ++p) slot[p] = static_cast<int>(lane[p]);
  }
};
const FoldSlots kSlot;

// ---- weight formats: a channel's weights for 32 consecutive columns (one group), as float32 vectors ----
// Plain<W> reads float32 or int8 [N, K] in place. A block format's Decode reads a group's scales once per tile and
// channel (its Group), and Weight rebuilds kLanes of its columns in registers, for every row of the tile.
constexpr int64_t kGroup = 32;

template <typename W>
struct Plain {
  using Elem = W;
  using Group = const W*;
  static Group Decode(const W* row, int64_t k) { return row + k; }
  static Vec Weight(Group g, int64_t i) { return LoadW(g + i); }
};

inline float HalfToFloat(const uint8_t* p) { return _cvtsh_ss(static_cast<uint16_t>(p[0] | (p[1] << 8))); }

// Q4_0 (d, 16 bytes of nibbles; w = d * (q - 8)) and Q4_1 (d, m, 16 bytes of nibbles; w = d * q + m), all
// float16 scales: one block is one group. Column c's nibble is the low one of byte c, or the high one of byte c - 16.
// With AVX-512 a block's 16 possible weights fill one vector, each computed by that same multiply (and add), and a
// column's weight is one permute by its nibble; with AVX2 the nibbles are widened straight into vectors.
template <bool kMin>
struct Q4 {
  using Elem = uint8_t;
  static constexpr int64_t kBlock = 32, kBytes = kMin ? 20 : 18;
#if defined(__AVX512F__)
  struct Group {
    __m512i q;  // byte c as int32 lane c
    Vec table;  // lane q: the weight of nibble q
  };
  static Group Decode(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + k / kBlock * kBytes;
    const Vec d = Set1(HalfToFloat(b));
    const Vec q = _mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kMin ? 0 : 8)));
    const Vec w = Mul(d, q);
    return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kBytes - 16))),
            kMin ? Add(w, Set1(HalfToFloat(b + 2))) : w};
  }
  static Vec Weight(const Group& g, int64_t i) {  // the permute reads each lane's low 4 bits
    return _mm512_permutexvar_ps(i < 16 ? g.q : _mm512_srli_epi32(g.q, 4), g.table);
  }
#else
  struct Group {
    const uint8_t* q;  // 16 bytes
    Vec d, m;
  };
  static Group Decode(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + k / kBlock * kBytes;
    return {b + kBytes - 16, Set1(HalfToFloat(b)), Set1(kMin ? HalfToFloat(b + 2) : 0.0f)};
  }
  static Vec Weight(const Group& g, int64_t i) {
    const auto q = Bits(g.q + i % 16, i < 16 ? 0 : 4, 0x0F, 0);
    const Vec w = Mul(g.d, Int(q, q, kMin ? 0 : 8));
    return kMin ? Add(w, g.m) : w;
  }
#endif
};
using Q4_0 = Q4<false>;
using Q4_1 = Q4<true>;

// Q5_0 (d, qh[4], 16 bytes of nibbles; w = d * (q - 16)) and Q5_1 (d, m, qh[4], nibbles; w = d * q + m): Q4's
// nibbles plus a fifth bit, column c's bit c of the little-endian word qh. With AVX-512 a block's 32 possible weights
// fill two vectors and a column's weight is one two-table permute by its 5-bit value; with AVX2 the bits are widened
// straight into vectors.
template <bool kMin>
struct Q5 {
  using Elem = uint8_t;
  static constexpr int64_t kBlock = 32, kBytes = kMin ? 24 : 22, kHigh = kMin ? 4 : 2;
  static constexpr int kBias = kMin ? 0 : 16;
  static uint32_t HighBits(const uint8_t* b) {
    uint32_t qh;
    std::memcpy(&qh, b + kHigh, 4);
    return qh;
  }
#if defined(__AVX512F__)
  struct Group {
    __m512i q[2];  // columns 0-15 and 16-31: each column's 5-bit value as an int32 lane
    Vec low, high;  // lane v: the weight of value v, and of value v + 16
  };
  static Group Decode(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + k / kBlock * kBytes;
    const uint32_t qh = HighBits(b);  // bit c: column c's fifth bit, set into its lane through a mask
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kHigh + 4)));
    const __m512i five = _mm512_set1_epi32(0x10);
    const __m512i low4 = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), high4 = _mm512_srli_epi32(bytes, 4);
    const __m512i q0 = _mm512_mask_or_epi32(low4, static_cast<__mmask16>(qh), low4, five);
    const __m512i q1 = _mm512_mask_or_epi32(high4, static_cast<__mmask16>(qh >> 16), high4, five);
    const Vec iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const Vec d = Set1(HalfToFloat(b));
    Vec low = Mul(d, Sub(iota, Set1(kBias)));
    Vec high = Mul(d, Sub(iota, Set1(kBias - 16)));
    if (kMin) {
      const Vec m = Set1(HalfToFloat(b + 2));
      low = Add(low, m), high = Add(high, m);
    }
    return {{q0, q1}, low, high};
  }
  static Vec Weight(const Group& g, int64_t i) { return _mm512_permutex2var_ps(g.low, g.q[i / 16], g.high); }
#else
  struct Group {
    const uint8_t* q;  // 16 bytes
    uint32_t qh;
    Vec d, m;
  };
  static Group Decode(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + k / kBlock * kBytes;
    return {b + kHigh + 4, HighBits(b), Set1(HalfToFloat(b)), Set1(kMin ? HalfToFloat(b + 2) : 0.0f)};
  }
  static Vec Weight(const Group& g, int64_t i) {
    const auto low = Bits(g.q + i % 16, i < 16 ? 0 : 4, 0x0F, 0);
    const __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(i)));
    const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(g.qh)), at),
                                         _mm256_set1_epi32(1));
    const Vec w = Mul(g.d, Int(low, _mm256_slli_epi32(bit, 4), kBias));
    return kMin ? Add(w, g.m) : w;
  }
#endif
};
using Q5_0 = Q5<false>;
using Q5_1 = Q5<true>;

struct Q8_0 {  // d (f16), 32 int8; w = d * q
  using Elem = uint8_t;
  static constexpr int64_t kBlock = 32, kBytes = 34;
  struct Group {
    const int8_t* q;
    Vec d;
  };
  static Group Decode(const uint8_t* row, int64_t k) {
    const uint8_t* b = row + k / kBlock * kBytes;
    return {reinterpret_cast<const int8_t*>(b + 2), Set1(HalfToFloat(b))};
  }
  static Vec Weight(const Group& g, int64_t i) { return Mul(g.d, LoadW(g.q + i)); }
};

// The K-quants: 256 columns a block in 8 groups of 32, each column a low field in `ql` and (Q5_K, Q6_K) a high one in
// `qh`: q = ((ql >> low_shift) & low_mask) | (((qh >> high_shift) & high_mask) << 4) - bias, w = d[half] * q + m.
struct KGroup {
  const uint8_t* ql;
  const uint8_t* qh;
  int low_shift, high_shift;
  Vec d[2];  // the scale of columns 0-15 and of 16-31 (they differ in Q6_K only)
  Vec m;     // Q4_K and Q5_K: -dmin * min
};

template <typename Format>
struct KQuant {
  using Elem = uint8_t;
  using Group = KGroup;
  static constexpr int64_t kBlock = 256, kBytes = Format::kBytes;
  static KGroup Decode(const uint8_t* row, int64_t k) {
    KGroup g;
    Format::Fill(row + k / kBlock * kBytes, k % kBlock / kGroup, g);
    return g;
  }
  static Vec Weight(const KGroup& g, int64_t i) {
    const auto low = Bits(g.ql + i, g.low_shift, 0x0F, 0);
    const auto high = Format::kHighMask ? Bits(g.qh + i, g.high_shift, Format::kHighMask, 4) : low;
    const Vec w = Mul(g.d[i / 16], Int(low, high, Format::kBias));
    return Format::kOffset ? Add(w, g.m) : w;
  }
};

// Q4_K and Q5_K: d, dmin (f16), 12 bytes of 6-bit scales and mins for 8 groups; w = (d * sc) * q - dmin * min.
inline void ScaleMin(const uint8_t* b, int64_t j, KGroup& g) {
  const uint8_t* s = b + 4;
  const int sc = j < 4 ? s[j] & 0x3F : (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
  const int mn = j < 4 ? s[j + 4] & 0x3F : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  g.d[0] = g.d[1] = Set1(HalfToFloat(b) * static_cast<float>(sc));
  g.m = Set1(-(HalfToFloat(b + 2) * static_cast<float>(mn)));
}

struct Q4_KFormat {  // 256 columns: d, dmin, scales[12], qs[128] (group j: nibble j % 2 of bytes 32 * (j / 2) on)
  static constexpr int64_t kBytes = 144;
  static constexpr int kHighMask = 0, kBias = 0;  // (a | a) == a: no high field
  static constexpr bool kOffset = true;
  static void Fill(const uint8_t* b, int64_t j, KGroup& g) {
    ScaleMin(b, j, g);
    g.ql = b + 16 + 32 * (j / 2);
    g.low_shift = 4 * (j % 2);
  }
};

struct Q5_KFormat {  // 256 columns: d, dmin, scales[12], qh[32] (bit j: group j's fifth bit), qs[128] as Q4_K
  static constexpr int64_t kBytes = 176;
  static constexpr int kHighMask = 1, kBias = 0;
  static constexpr bool kOffset = true;
  static void Fill(const uint8_t* b, int64_t j, KGroup& g) {
    ScaleMin(b, j, g);
    g.ql = b + 48 + 32 * (j / 2);
    g.low_shift = 4 * (j % 2);
    g.qh = b + 16;
    g.high_shift = static_cast<int>(j);
  }
};

// 256 columns: ql[128], qh[64], int8 scales[16] (one per 16 columns), d (f16); w = (d * sc) * (q - 32)
struct Q6_KFormat {
  static constexpr int64_t kBytes = 210;
  static constexpr int kHighMask = 3, kBias = 32;
  static constexpr bool kOffset = false;
  static void Fill(const uint8_t* b, int64_t j, KGroup& g) {
    const int64_t half = j / 4, quarter = j % 4;
    g.ql = b + 64 * half + 32 * (quarter % 2);
    g.low_shift = static_cast<int>(4 * (quarter / 2));
    g.qh = b + 128 + 32 * half;
    g.high_shift = static_cast<int>(2 * quarter);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = HalfToFloat(b + 208);
    g.d[0] = Set1(d * static_cast<float>(scales[2 * j]));
    g.d[1] = Set1(d * static_cast<float>(scales[2 * j + 1]));
  }
};

#if defined(__AVX512F__)
// Q4_K and Q5_K with AVX-512: a group's 16 (Q5_K: 32) possible weights fill one vector (two), each computed by
// KQuant's multiply and add, and a column's weight is one permute by its 4-bit (5-bit) value.
template <typename Format>
struct KTable {
  using Elem = uint8_t;
  static constexpr int64_t kBlock = 256, kBytes = Format::kBytes;
  struct Group {
    __m512i q[2];  // columns 0-15 and 16-31: each column's value as an int32 lane
    Vec low, high;  // lane v: the weight of value v, and of value v + 16
  };
  static Group Decode(const uint8_t* row, int64_t k) {
    KGroup g;
    Format::Fill(row + k / kBlock * kBytes, k % kBlock / kGroup, g);
    Group t;
    for (int h = 0; h < 2; ++h) {
      const __m512i low = Bits(g.ql + 16 * h, g.low_shift, 0x0F, 0);
      t.q[h] = Format::kHighMask ? _mm512_or_si512(low, Bits(g.qh + 16 * h, g.high_shift, 1, 4)) : low;
    }
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    t.low = Add(Mul(g.d[0], _mm512_cvtepi32_ps(iota)), g.m);
    t.high = Format::kHighMask ? Add(Mul(g.d[0], _mm512_cvtepi32_ps(_mm512_add_epi32(iota, _mm512_set1_epi32(16)))), g.m)
                               : t.low;
    return t;
  }
  static Vec Weight(const Group& g, int64_t i) {
    return Format::kHighMask ? _mm512_permutex2var_ps(g.low, g.q[i / 16], g.high)
                             : _mm512_permutexvar_ps(g.q[i / 16], g.low);
  }
};
using Q4_K = KTable<Q4_KFormat>;
using Q5_K = KTable<Q5_KFormat>;
#else
using Q4_K = KQuant<Q4_KFormat>;
using Q5_K = KQuant<Q5_KFormat>;
#endif
using Q6_K = KQuant<Q6_KFormat>;

// R rows x C channels, the whole K: R * C * 2 accumulators in registers. `w` is channel n0's weights, each channel
// `row_len` F::Elem after the one before.
template <int R, int C, typename F>
inline void Tile(const float* x, const typename F::Elem* w, int64_t row_len, const float* scale, float* y, int64_t K,
                 int64_t N, int64_t m0, int64_t n0) {
  Vec acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = Zero();
  for (int64_t k = 0; k < K; k += kGroup) {
    typename F::Group g[C];
    for (int c = 0; c < C; ++c) g[c] = F::Decode(w + c * row_len, k);
    for (int64_t i = 0; i < kGroup; i += kStep) {
      Vec w0[C], w1[C];
      for (int c = 0; c < C; ++c) {
        w0[c] = F::Weight(g[c], i);
        w1[c] = F::Weight(g[c], i + kLanes);
      }
      for (int r = 0; r < R; ++r) {
        const Vec x0 = LoadX(x + (m0 + r) * K + k + i);
        const Vec x1 = LoadX(x + (m0 + r) * K + k + i + kLanes);
        for (int c = 0; c < C; ++c) {
          acc[r][c][0] = Fma(x0, w0[c], acc[r][c][0]);
          acc[r][c][1] = Fma(x1, w1[c], acc[r][c][1]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float s = Finish(acc[r][c][0], acc[r][c][1]);
      y[(m0 + r) * N + n0 + c] = scale ? s * scale[n0 + c] : s;
    }
}

// Up to 4 rows (one row tile) a call reads each weight once, straight from memory: before each four channels, the four
// after the next four are asked for, into L1.
template <typename E>
inline void PrefetchRows(const E* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// Channels [n_begin, n_end) of every row (`w` is channel n_begin's weights). From 16 rows on, in blocks of
// kChannelBlock channels that stay in L2 while every row tile (6 rows) passes over them. Fewer rows take each channel
// pair through every row tile (4 rows down to 1) in turn: its weights come from memory once, then from L1, and before
// each four channels the four after the next four are asked for (a lone row reads a 262,144-row Q8_0 head a quarter
// faster in pairs than in fours). Each tile rebuilds the weights it reads, so this suits a few rows.
constexpr int64_t kChannelBlock = 64;

template <int C, typename F>
inline void RowTiles(const float* x, const typename F::Elem* w, int64_t row_len, const float* scale, float* y,
                     int64_t M, int64_t K, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) Tile<4, C, F>(x, w, row_len, scale, y, K, N, m, n);
  switch (M - m) {
    case 3: Tile<3, C, F>(x, w, row_len, scale, y, K, N, m, n); break;
    case 2: Tile<2, C, F>(x, w, row_len, scale, y, K, N, m, n); break;
    case 1: Tile<1, C, F>(x, w, row_len, scale, y, K, N, m, n); break;
  }
}

template <typename F>
void Channels(const float* x, const typename F::Elem* w, int64_t row_len, const float* scale, float* y, int64_t M,
              int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  const auto at = [&](int64_t n) { return w + (n - n_begin) * row_len; };
  if (M < 16) {
    const int64_t tile_bytes = 4 * row_len * sizeof(typename F::Elem);  // four channels
    for (int64_t n = n_begin; n < n_end; n += 2) {
      if (n % 4 == 0 && n + 12 <= n_end) PrefetchRows(at(n + 8), tile_bytes);
      RowTiles<2, F>(x, at(n), row_len, scale, y, M, K, N, n);
    }
    return;
  }
  for (int64_t b = n_begin; b < n_end; b += kChannelBlock) {
    const int64_t b_end = std::min(n_end, b + kChannelBlock);
    int64_t m = 0;
    for (; m + 6 <= M; m += 6)  // six rows a tile, fewer weight loads per multiply-add
      for (int64_t n = b; n < b_end; n += 2) Tile<6, 2, F>(x, at(n), row_len, scale, y, K, N, m, n);
    for (int64_t n = b; n < b_end; n += 2) RowTiles<2, F>(x + m * K, at(n), row_len, scale, y + m * N, M - m, K, N, n);
  }
}

// Channels for many rows: a block of channels is rebuilt once into float32 (at most kRebuiltFloats, in L2), then the
// float32 tiles run over it. Rebuilding stores the vectors Weight gives, and the tiles do the same multiply-adds in
// the same order, so every output keeps Channels' bits; a weight is rebuilt once per call, not once per row tile.
constexpr int64_t kRebuiltFloats = 1 << 17;

template <typename F>
void RebuiltChannels(const float* x, const typename F::Elem* w, int64_t row_len, const float* scale, float* y,
                     int64_t M, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t per = std::clamp<int64_t>(kRebuiltFloats / K / 4 * 4, 4, kChannelBlock);  // a multiple of 4
  thread_local std::vector<float> rebuilt;
  rebuilt.resize(per * K);
  float* f = rebuilt.data();
  for (int64_t b = n_begin; b < n_end; b += per) {
    const int64_t b_end = std::min(n_end, b + per);
    for (int64_t n = b; n < b_end; ++n) {
      if (n + 3 <= n_end) PrefetchRows(w + (n + 2 - n_begin) * row_len, row_len * sizeof(typename F::Elem));
      for (int64_t k = 0; k < K; k += kGroup) {
        const typename F::Group g = F::Decode(w + (n - n_begin) * row_len, k);
        for (int64_t i = 0; i < kGroup; i += kLanes) Store(f + (n - b) * K + k + i, F::Weight(g, i));
      }
    }
    Channels<Plain<float>>(x, f, K, scale, y, M, K, N, b, b_end);
  }
}

// Runs task(i) for i in [0, n) on the caller and the intra-op pool. Work is claimed from a shared counter, so the
// caller never waits on a task that has not started: it only waits for items other threads are running.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const F& task) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) task(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, &task] {
    for (int64_t i; (i = state->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      task(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  // A helper that starts after every item is claimed touches only `state`, which it co-owns.
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

template <typename F>
ffi::Error Run(ffi::ThreadPool pool, const float* x, const typename F::Elem* w, int64_t row_len, const float* scale,
               float* y, int64_t M, int64_t K, int64_t N) {
  // Channel ranges of a multiple of 4, about 4 per thread, at least 32 channels each.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = std::max<int64_t>(32, (N / (4 * threads) + 3) / 4 * 4);
  const int64_t items = (N + per - 1) / per;
  // float32 weights need no rebuilding; the others are rebuilt once per call from 16 rows on (below, a channel pair is
  // read from memory once and from L1 by its other row tiles)
  const bool rebuild = M >= 16 && !std::is_same_v<F, Plain<float>>;
  ParallelFor(pool, items, [&](int64_t i) {
    const int64_t n0 = i * per, n1 = std::min(N, (i + 1) * per);
    if (rebuild)
      RebuiltChannels<F>(x, w + n0 * row_len, row_len, scale, y, M, K, N, n0, n1);
    else
      Channels<F>(x, w + n0 * row_len, row_len, scale, y, M, K, N, n0, n1);
  });
  return ffi::Error::Success();
}

ffi::Error MatmulS8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || scale.element_count() != size_t(wd[0]) ||
      xd[1] % kGroup || wd[0] % 4)
    return ffi::Error::InvalidArgument("rowwise_matmul_s8: x [M, K], w [N, K], scale [N], K % 32 == 0, N % 4 == 0");
  return Run<Plain<int8_t>>(pool, x.typed_data(), w.typed_data(), xd[1], scale.typed_data(), y->typed_data(), xd[0],
                            xd[1], wd[0]);
}

ffi::Error MatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || xd[1] % kGroup || wd[0] % 4)
    return ffi::Error::InvalidArgument("rowwise_matmul_f32: x [M, K], w [N, K], K % 32 == 0, N % 4 == 0");
  return Run<Plain<float>>(pool, x.typed_data(), w.typed_data(), xd[1], nullptr, y->typed_data(), xd[0], xd[1],
                           wd[0]);
}

// x [M, K] times block weights w [N, K / kBlock * kBytes] (uint8) -> y [M, N].
template <typename F>
ffi::Error MatmulBlocks(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] % F::kBlock || wd[1] != xd[1] / F::kBlock * F::kBytes || wd[0] % 4)
    return ffi::Error::InvalidArgument("rowwise_matmul (blocks): x [M, K], w [N, K / block * block bytes], N % 4 == 0");
  return Run<F>(pool, x.typed_data(), w.typed_data(), wd[1], nullptr, y->typed_data(), xd[0], xd[1],
                             wd[0]);
}

// Rows `ids` of block weights w [N, K / kBlock * kBytes], rebuilt as float32 (the same weights the matmul uses):
// an embedding table looked up in its stored form. y [M, K].
template <typename F>
ffi::Error BlockRows(ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), yd = y->dimensions();
  if (wd.size() != 2 || yd.size() != 2 || size_t(yd[0]) != ids.element_count() || yd[1] % F::kBlock ||
      wd[1] != yd[1] / F::kBlock * F::kBytes)
    return ffi::Error::InvalidArgument("block_rows: w [N, K / block * block bytes], ids [M], y [M, K]");
  const int64_t n = wd[0], row_len = wd[1], K = yd[1];
  const int32_t* id = ids.typed_data();
  float* out = y->typed_data();
  for (int64_t m = 0; m < yd[0]; ++m) {
    if (id[m] < 0 || id[m] >= n) return ffi::Error::InvalidArgument("block_rows: id out of range");
    const uint8_t* row = w.typed_data() + id[m] * row_len;
    for (int64_t k = 0; k < K; k += kGroup) {
      const typename F::Group g = F::Decode(row, k);
      for (int64_t i = 0; i < kGroup; i += kLanes) Store(out + m * K + k + i, F::Weight(g, i));
    }
  }
  return ffi::Error::Success();
}

// ---- Integer dot products over GGUF blocks (weights "gguf") ----
// Each row of x is rounded to 8 bits per 32 columns (as llama.cpp's Q8_0), from that row alone: d = amax / 127, q =
// x * (127 / amax) rounded to nearest even. (llama.cpp rounds to 256-column Q8_K blocks for the K-quants; on Gemma 3
// 270M's Q4_K and Q6_K matrices that alone cost more perplexity than the 1% the integer path may lose.) A weight block
// is read as unsigned byte codes (signed for Q8_0 without VNNI), w = d_w * s * (code - bias) (+ m for the formats with
// a minimum), s an integer scale per 32 or 16 columns (the K-quants). For each output and each 32 columns, the products
// of codes and q are summed exactly in int32, with the bias folded in as -bias * the columns' sum of q and the K-quant
// scales multiplied in as integers: one integer `sum` per 32 columns. Then, in K order, one fixed float epilogue:
// acc = acc + (d_w * d_x) * float(sum), and for the formats with a minimum acc = acc + (m * d_x) * float(minimum code *
// sum of q). The output is acc. No step depends on the rows, the tile, the thread or the instruction set (vpdpbusd and
// maddubs give the same int32 sums), so a row's bits never depend on the rows beside it, and every build gives the same
// bits.
//
// Layout: a vector holds kIntCh channels, lane c channel c. A tile's channels are decoded once per call, each 32
// columns into 8 vectors (vector j: columns 4j..4j+3 of every channel, as 4 bytes a lane), so that vpdpbusd against the
// row's 4 bytes j, broadcast, adds every channel's 4 products into its own lane.
#if defined(__AVX512F__)
using IVec = __m512i;
constexpr int kIntCh = 16;
inline IVec ILoad(const void* p) { return _mm512_loadu_si512(p); }
inline void IStore(void* p, IVec v) { _mm512_storeu_si512(p, v); }
inline IVec IAdd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec ISet1(int32_t a) { return _mm512_set1_epi32(a); }
inline IVec IMul(IVec a, IVec b) { return _mm512_mullo_epi32(a, b); }
inline Vec ToFloat(IVec a) { return _mm512_cvtepi32_ps(a); }
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
constexpr const char* kIntIsa = "avx512-vnni";
inline IVec DotU(IVec acc, IVec u, IVec s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
constexpr const char* kIntIsa = "avx512";
// pairs of u8 x s8 products in int16 (codes below 64 and |q| <= 127 cannot saturate), then pairs of those in int32
inline IVec DotU(IVec acc, IVec u, IVec s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
#endif
// Q8_0's signed codes without VNNI: |w| times q with w's sign (|w| <= 128, so no pair saturates)
inline IVec DotS(IVec acc, IVec w, IVec s) {
  return DotU(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(w), _mm512_setzero_si512(), s));
}
// 16 channels' 8 dwords (channel c's at in + 32 c) as 8 vectors, vector j lane c: channel c's dword j. Three rounds
// of two-source permutes: 2 channels x 8 dwords a vector, then 4 x 4, 8 x 2, 16 x 1.
inline void Interleave(const uint8_t* in, IVec* out) {
  struct Index {
    IVec v[3][2];
    Index() {
      alignas(64) int32_t idx[16];
      for (int h = 0; h < 2; ++h) {
        for (int l = 0; l < 16; ++l) idx[l] = (l / 4 / 2) * 16 + (l / 4 % 2) * 8 + 4 * h + l % 4;
        v[0][h] = _mm512_load_si512(idx);
        for (int l = 0; l < 16; ++l) idx[l] = (l / 2 / 4) * 16 + (l / 2 % 4) * 4 + 2 * h + l % 2;
        v[1][h] = _mm512_load_si512(idx);
        for (int l = 0; l < 16; ++l) idx[l] = (l / 8) * 16 + (l % 8) * 2 + h;
        v[2][h] = _mm512_load_si512(idx);
      }
    }
  };
  static const Index index;
  IVec a[8], b[8];
  for (int i = 0; i < 8; ++i) a[i] = ILoad(in + 64 * i);
  for (int p = 0; p < 4; ++p)  // b[2p + h]: channels 4p.., dwords 4h..
    for (int h = 0; h < 2; ++h) b[2 * p + h] = _mm512_permutex2var_epi32(a[2 * p], index.v[0][h], a[2 * p + 1]);
  for (int q = 0; q < 2; ++q)  // a[4q + 2h + h2]: channels 8q.., dwords 4h + 2h2..
    for (int h = 0; h < 2; ++h)
      for (int h2 = 0; h2 < 2; ++h2)
        a[4 * q + 2 * h + h2] = _mm512_permutex2var_epi32(b[4 * q + h], index.v[1][h2], b[4 * q + 2 + h]);
  for (int j = 0; j < 8; ++j) out[j] = _mm512_permutex2var_epi32(a[j / 2], index.v[2][j % 2], a[4 + j / 2]);
}
#else
using IVec = __m256i;
constexpr int kIntCh = 8;
inline IVec ILoad(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline void IStore(void* p, IVec v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
inline IVec IAdd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec ISet1(int32_t a) { return _mm256_set1_epi32(a); }
inline IVec IMul(IVec a, IVec b) { return _mm256_mullo_epi32(a, b); }
inline Vec ToFloat(IVec a) { return _mm256_cvtepi32_ps(a); }
#if defined(__AVXVNNI__)
constexpr bool kVnni = true;
constexpr const char* kIntIsa = "avx-vnni";
inline IVec DotU(IVec acc, IVec u, IVec s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
constexpr const char* kIntIsa = "avx2";
inline IVec DotU(IVec acc, IVec u, IVec s) {  // as the AVX-512 one
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif
inline IVec DotS(IVec acc, IVec w, IVec s) { return DotU(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w)); }
// 8 channels' 8 dwords (channel c's at in + 32 c) as 8 vectors, vector j lane c: channel c's dword j.
inline void Interleave(const uint8_t* in, IVec* out) {
  IVec r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = ILoad(in + 32 * i);
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4)
    for (int k = 0; k < 2; ++k)
      r[i + k] = _mm256_unpacklo_epi64(t[i + k], t[i + 2 + k]), r[i + 2 + k] = _mm256_unpackhi_epi64(t[i + k], t[i + 2 + k]);
  // r[0..3]: channels 0-3, dwords (0, 4), (2, 6), (1, 5), (3, 7); r[4..7] the same for channels 4-7
  const int order[4] = {0, 2, 1, 3};
  for (int k = 0; k < 4; ++k) {
    out[order[k]] = _mm256_permute2x128_si256(r[k], r[4 + k], 0x20);
    out[order[k] + 4] = _mm256_permute2x128_si256(r[k], r[4 + k], 0x31);
  }
}
#endif
constexpr int kIntRows = 4;  // rows a tile, at most
// Bytes ahead of the block being decoded that the decoder asks for: the rows of a matrix lie one after the other, so
// the next channels' blocks are in flight while this one decodes.
constexpr int64_t kIntAhead = 4096;

// The rows of x rounded to 8 bits per 32 columns: q [M, K], d [M, K / 32] (each 32 columns' scale) and halves
// [M, K / 16] (each 16 columns' sum of q).
struct IntActs {
  int64_t K = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> halves;
  int32_t Sum(int64_t at) const { return halves[2 * at] + halves[2 * at + 1]; }
};

void QuantizeRows(const float* x, int64_t M, int64_t K, IntActs& a) {
  a.K = K;
  a.q.resize(M * K), a.d.resize(M * K / 32), a.halves.resize(M * K / 16);
  float rounded[32];
  for (int64_t b = 0; b < M * K / 32; ++b) {
    const float* xb = x + b * 32;
    Vec amax = Zero();
    for (int64_t i = 0; i < 32; i += kLanes) amax = Max(amax, Max(LoadX(xb + i), Sub(Zero(), LoadX(xb + i))));
    float lanes[kLanes];
    Store(lanes, amax);
    const float m = *std::max_element(lanes, lanes + kLanes);
    const Vec id = Set1(m > 0 ? 127.0f / m : 0.0f);
    a.d[b] = m / 127.0f;
    for (int64_t i = 0; i < 32; i += kLanes) Store(rounded + i, Round(Mul(LoadX(xb + i), id)));
    int8_t* q = a.q.data() + b * 32;
    for (int h = 0; h < 2; ++h) {
      int32_t sum = 0;
      for (int64_t i = 16 * h; i < 16 * h + 16; ++i) sum += q[i] = static_cast<int8_t>(rounded[i]);
      a.halves[2 * b + h] = sum;
    }
  }
}

// A tile's kIntCh channels as integer codes: codes [K / 32][8][kIntCh][4] (see Layout above); d, m [blocks][kIntCh];
// scales [K / 32][2][kIntCh] (the K-quants' integer scale of columns 0-15 and 16-31 of each 32); mins [K / 32][kIntCh]
// (Q4_K and Q5_K's integer minimum of each 32 columns). `raw` holds a group's codes channel by channel until
// Interleave reorders them.
struct IntCodes {
  std::vector<uint8_t> codes, raw;
  std::vector<int32_t> scales, mins;
  std::vector<float> d, m;
  void Resize(int64_t K, int64_t block) {
    codes.resize(K * kIntCh), raw.resize(K * kIntCh), scales.resize(K / 16 * kIntCh), mins.resize(K / 32 * kIntCh);
    d.resize(K / block * kIntCh), m.resize(K / block * kIntCh);
  }
};

// Channel h of an IntCodes, as a block decoder writes it.
struct IntChannel {
  IntCodes& s;
  int h;
  uint8_t* Codes(int64_t group) { return s.raw.data() + (group * kIntCh + h) * 32; }
  void Scales(int64_t group, int32_t low, int32_t high) {
    s.scales[(2 * group) * kIntCh + h] = low, s.scales[(2 * group + 1) * kIntCh + h] = high;
  }
  void Min(int64_t group, int32_t min) { s.mins[group * kIntCh + h] = min; }
  float& D(int64_t blk) { return s.d[blk * kIntCh + h]; }
  float& M(int64_t blk) { return s.m[blk * kIntCh + h]; }
};

inline __m256i Load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void Store32(uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline __m256i Field(__m256i v, int shift, int mask) {  // (byte >> shift) & mask in every byte
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}
// 16 bytes of nibbles as 32 codes: the low nibbles, then the high ones
inline __m256i Nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
// 0x10 in byte c where bit c of the little-endian word at p is set
inline __m256i FifthBits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// The 32-column formats: one block a group. kBias: the code's offset; kMin: a float minimum per block.
template <int kBytesT, int kBiasT, bool kMinT>
struct IntSmall {
  static constexpr int64_t kBlock = 32, kBytes = kBytesT;
  static constexpr int kBias = kBiasT;
  static constexpr bool kMin = kMinT, kScaled = false, kSigned = false;
};

struct IntQ4_0 : IntSmall<18, 8, false> {  // d, 16 bytes of nibbles
  static void Decode(const uint8_t* b, int64_t blk, IntChannel& c) {
    c.D(blk) = HalfToFloat(b);
    Store32(c.Codes(blk), Nibbles(b + 2));
  }
};
struct IntQ4_1 : IntSmall<20, 0, true> {  // d, m, 16 bytes of nibbles
  static void Decode(const uint8_t* b, int64_t blk, IntChannel& c) {
    c.D(blk) = HalfToFloat(b), c.M(blk) = HalfToFloat(b + 2);
    Store32(c.Codes(blk), Nibbles(b + 4));
  }
};
struct IntQ5_0 : IntSmall<22, 16, false> {  // d, qh[4], 16 bytes of nibbles
  static void Decode(const uint8_t* b, int64_t blk, IntChannel& c) {
    c.D(blk) = HalfToFloat(b);
    Store32(c.Codes(blk), _mm256_or_si256(Nibbles(b + 6), FifthBits(b + 2)));
  }
};
struct IntQ5_1 : IntSmall<24, 0, true> {  // d, m, qh[4], 16 bytes of nibbles
  static void Decode(const uint8_t* b, int64_t blk, IntChannel& c) {
    c.D(blk) = HalfToFloat(b), c.M(blk) = HalfToFloat(b + 2);
    Store32(c.Codes(blk), _mm256_or_si256(Nibbles(b + 8), FifthBits(b + 4)));
  }
};
struct IntQ8_0 : IntSmall<34, kVnni ? 128 : 0, false> {  // d, 32 int8: with VNNI as unsigned codes q + 128
  static constexpr bool kSigned = !kVnni;
  static void Decode(const uint8_t* b, int64_t blk, IntChannel& c) {
    c.D(blk) = HalfToFloat(b);
    const __m256i q = Load32(b + 2);
    Store32(c.Codes(blk), kVnni ? _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80))) : q);
  }
};

// The K-quants: 256 columns in 8 groups of 32, each with an integer scale (Q6_K: one per 16 columns) in `scales`.
template <int kBytesT, int kBiasT, bool kMinT>
struct IntK {
  static constexpr int64_t kBlock = 256, kBytes = kBytesT;
  static constexpr int kBias = kBiasT;
  static constexpr bool kMin = kMinT, kScaled = true, kSigned = false;
};

// Q4_K and Q5_K's 6-bit scales and mins of group j (d * sc * q - dmin * mn): the minimum's coefficient is -dmin.
inline void KScales(const uint8_t* b, int64_t blk, IntChannel& c) {
  const uint8_t* s = b + 4;
  c.D(blk) = HalfToFloat(b), c.M(blk) = -HalfToFloat(b + 2);
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 0x3F : (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    const int mn = j < 4 ? s[j + 4] & 0x3F : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    c.Scales(blk * 8 + j, sc, sc);
    c.Min(blk * 8 + j, mn);
  }
}

struct IntQ4_K : IntK<144, 0, true> {  // d, dmin, scales[12], qs[128]: group j, nibble j % 2 of bytes 32 * (j / 2) on
  static void Decode(const uint8_t* b, int64_t blk, IntChannel& c) {
    KScales(b, blk, c);
    for (int j = 0; j < 8; ++j)
      Store32(c.Codes(blk * 8 + j), Field(Load32(b + 16 + 32 * (j / 2)), 4 * (j % 2), 0x0F));
  }
};
struct IntQ5_K : IntK<176, 0, true> {  // d, dmin, scales[12], qh[32] (bit j: group j's fifth bit), qs[128]
  static void Decode(const uint8_t* b, int64_t blk, IntChannel& c) {
    KScales(b, blk, c);
    const __m256i qh = Load32(b + 16);
    for (int j = 0; j < 8; ++j) {
      const __m256i low = Field(Load32(b + 48 + 32 * (j / 2)), 4 * (j % 2), 0x0F);
      Store32(c.Codes(blk * 8 + j), _mm256_or_si256(low, _mm256_slli_epi16(Field(qh, j, 1), 4)));
    }
  }
};
struct IntQ6_K : IntK<210, 32, false> {  // ql[128], qh[64], int8 scales[16] (one per 16 columns), d
  static void Decode(const uint8_t* b, int64_t blk, IntChannel& c) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    c.D(blk) = HalfToFloat(b + 208);
    for (int j = 0; j < 8; ++j) {
      const int64_t half = j / 4, quarter = j % 4;
      const __m256i low = Field(Load32(b + 64 * half + 32 * (quarter % 2)), static_cast<int>(4 * (quarter / 2)), 0x0F);
      const __m256i high = Field(Load32(b + 128 + 32 * half), static_cast<int>(2 * quarter), 3);
      Store32(c.Codes(blk * 8 + j), _mm256_or_si256(low, _mm256_slli_epi16(high, 4)));
      c.Scales(blk * 8 + j, scales[2 * j], scales[2 * j + 1]);
    }
  }
};

// R rows x kIntCh channels over the whole K: each 32 columns' integer sums, then their epilogue, in K order.
template <typename F, int R>
void IntTile(const IntActs& a, int64_t m0, const IntCodes& c, float* y, int64_t N, int64_t n0, int64_t valid) {
  constexpr int G = F::kBlock / 32;
  const int64_t K = a.K;
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Zero();
  for (int64_t group = 0; group < K / 32; ++group) {
    const int64_t blk = group / G;
    const Vec dw = LoadW(c.d.data() + blk * kIntCh), mw = LoadW(c.m.data() + blk * kIntCh);
    IVec w[8];
    for (int j = 0; j < 8; ++j) w[j] = ILoad(c.codes.data() + (group * 8 + j) * kIntCh * 4);
    const IVec low = ILoad(c.scales.data() + 2 * group * kIntCh), high = ILoad(c.scales.data() + (2 * group + 1) * kIntCh);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * K / 32 + group;  // the row's 32 columns
      const int8_t* q = a.q.data() + at * 32;
      IVec half[2];
      for (int h = 0; h < 2; ++h) {
        half[h] = ISet1(-F::kBias * a.halves[2 * at + h]);
        for (int j = 4 * h; j < 4 * h + 4; ++j) {
          int32_t x4;
          std::memcpy(&x4, q + 4 * j, 4);
          half[h] = F::kSigned ? DotS(half[h], w[j], ISet1(x4)) : DotU(half[h], w[j], ISet1(x4));
        }
      }
      const IVec sum = F::kScaled ? IAdd(IMul(half[0], low), IMul(half[1], high)) : IAdd(half[0], half[1]);
      const Vec dx = Set1(a.d[at]);
      acc[r] = Add(acc[r], Mul(Mul(dw, dx), ToFloat(sum)));
      if constexpr (F::kMin) {  // the minimum codes (Q4_1, Q5_1: 1) times the row's sum of q
        const Vec ms = F::kScaled ? ToFloat(IMul(ILoad(c.mins.data() + group * kIntCh), ISet1(a.Sum(at))))
                                  : Set1(static_cast<float>(a.Sum(at)));
        acc[r] = Add(acc[r], Mul(Mul(mw, dx), ms));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[kIntCh];
    Store(out, acc[r]);
    std::copy_n(out, valid, y + (m0 + r) * N + n0);
  }
}

// Channels [n_begin, n_end), kIntCh at a time decoded once into codes, then every row tile over them.
template <typename F>
void IntChannels(const IntActs& a, const uint8_t* w, int64_t row_len, float* y, int64_t M, int64_t N,
                 int64_t n_begin, int64_t n_end) {
  IntCodes c;
  c.Resize(a.K, F::kBlock);
  for (int64_t n = n_begin; n < n_end; n += kIntCh) {
    const int64_t valid = std::min<int64_t>(kIntCh, n_end - n);
    if (valid < kIntCh) {  // a short last tile: the missing channels are zeros
      std::fill(c.raw.begin(), c.raw.end(), 0), std::fill(c.d.begin(), c.d.end(), 0.0f);
      std::fill(c.m.begin(), c.m.end(), 0.0f), std::fill(c.scales.begin(), c.scales.end(), 0);
      std::fill(c.mins.begin(), c.mins.end(), 0);
    }
    for (int h = 0; h < valid; ++h) {
      const uint8_t* row = w + (n + h) * row_len;
      IntChannel channel{c, h};
      for (int64_t b = 0; b < a.K / F::kBlock; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(row + b * F::kBytes) + kIntAhead, _MM_HINT_T0);
        F::Decode(row + b * F::kBytes, b, channel);
      }
    }
    for (int64_t group = 0; group < a.K / 32; ++group) {
      IVec v[8];
      Interleave(c.raw.data() + group * kIntCh * 32, v);
      for (int j = 0; j < 8; ++j) IStore(c.codes.data() + (group * 8 + j) * kIntCh * 4, v[j]);
    }
    int64_t m = 0;
    for (; m + kIntRows <= M; m += kIntRows) IntTile<F, kIntRows>(a, m, c, y, N, n, valid);
    switch (M - m) {
      case 3: IntTile<F, 3>(a, m, c, y, N, n, valid); break;
      case 2: IntTile<F, 2>(a, m, c, y, N, n, valid); break;
      case 1: IntTile<F, 1>(a, m, c, y, N, n, valid); break;
    }
  }
}

// x [M, K] times block weights w [N, K / block * bytes] (uint8) -> y [M, N] by integer dot products.
template <typename F>
ffi::Error IntMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] % F::kBlock || wd[1] != xd[1] / F::kBlock * F::kBytes || wd[0] % 4)
    return ffi::Error::InvalidArgument("int_matmul: x [M, K], w [N, K / block * block bytes], N % 4 == 0");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  IntActs a;
  QuantizeRows(x.typed_data(), M, K, a);
  // channel ranges of a multiple of kIntCh, about 4 per thread, at least 2 * kIntCh channels each
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = std::max<int64_t>(2 * kIntCh, (N / (4 * threads) + kIntCh - 1) / kIntCh * kIntCh);
  ParallelFor(pool, (N + per - 1) / per, [&](int64_t i) {
    IntChannels<F>(a, w.typed_data(), wd[1], y->typed_data(), M, N, i * per, std::min(N, (i + 1) * per));
  });
  return ffi::Error::Success();
}


// A lane's positions lie kv_heads * head_dim floats apart, one head's slice of each a few cache lines: the walks
// over keys and values ask for the slice kAhead positions on (into L2), so that many lines are in flight at once.
constexpr int64_t kAhead = 64;
inline void Prefetch(const float* p, int64_t floats) {
  for (int64_t f = 0; f < floats; f += 16) _mm_prefetch(reinterpret_cast<const char*>(p + f), _MM_HINT_T1);
}

// A lane's keys or values for one head, walked from a row's first position: position i of the walk lies at slot
// first + i, taken modulo `wrap` slots (a windowed layer's ring; a full buffer never wraps), slots `stride` floats
// apart from `base` (slot 0). Where a slot lies never changes the operations on it.
struct Slots {
  const float* base;
  int64_t stride, first, wrap;
  const float* operator[](int64_t i) const {
    const int64_t slot = first + i;
    return base + (slot < wrap ? slot : slot - wrap) * stride;
  }
};

// The attention's scores for a group of query heads: scores[g][i] = scale * q_g . k_i over n positions, each dot in
// the matmul kernel's order (two accumulators over alternate vectors, then Finish's sum): kLanes positions at a time,
// their horizontal sums folded together (FoldLanes: Finish's bits). NV vectors a head; the heads go side by side with
// their queries in registers, so each key vector is read once for all of them. q: [group, NV * kLanes]; k: position
// the walk's keys (Slots); scores: [group, n].
template <int NV>
inline void Dot(const Vec* q, const float* k, Vec& even, Vec& odd) {
  even = Zero(), odd = Zero();
  for (int c = 0; c < NV; c += 2) {
    even = Fma(q[c], LoadX(k + c * kLanes), even);
    if (c + 1 < NV) odd = Fma(q[c + 1], LoadX(k + (c + 1) * kLanes), odd);
  }
}

template <int NV>
void Scores(const float* q, int64_t group, const Slots& k, int64_t n, float scale, float* scores) {
  constexpr int64_t kHeads = std::max(1, 16 / NV);
  for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const int64_t heads = std::min(kHeads, group - g0);
    Vec qv[kHeads][NV];
    for (int64_t g = 0; g < heads; ++g)
      for (int c = 0; c < NV; ++c) qv[g][c] = LoadX(q + (g0 + g) * NV * kLanes + c * kLanes);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      if (g0 == 0)
        for (int64_t p = 0; p < kLanes && i + kAhead + p < n; ++p) Prefetch(k[i + kAhead + p], NV * kLanes);
      Vec s[kHeads][kLanes];
      for (int64_t p = 0; p < kLanes; ++p)  // position i + p into the input that lands in lane p
        for (int64_t g = 0; g < heads; ++g) {
          Vec even, odd;
          Dot<NV>(qv[g], k[i + p], even, odd);
          s[g][kSlot.slot[p]] = Add(even, odd);
        }
      for (int64_t g = 0; g < heads; ++g) Store(scores + (g0 + g) * n + i, Mul(FoldLanes(s[g]), Set1(scale)));
    }
    for (; i < n; ++i)
      for (int64_t g = 0; g < heads; ++g) {
        Vec even, odd;
        Dot<NV>(qv[g], k[i], even, odd);
        scores[(g0 + g) * n + i] = Finish(even, odd) * scale;
      }
  }
}

// Scores for any number of vectors a head (up to 32), one head at a time.
inline void ScoresAny(const float* q, int64_t group, int64_t nv, const Slots& k, int64_t n, float scale,
                      float* scores) {
  const auto dot = [&](const float* qr, const float* kr) {
    Vec even = Zero(), odd = Zero();
    for (int64_t c = 0; c < nv; c += 2) {
      even = Fma(LoadX(qr + c * kLanes), LoadX(kr + c * kLanes), even);
      if (c + 1 < nv) odd = Fma(LoadX(qr + (c + 1) * kLanes), LoadX(kr + (c + 1) * kLanes), odd);
    }
    return std::pair<Vec, Vec>(even, odd);
  };
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * nv * kLanes;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      Vec s[kLanes];
      for (int64_t p = 0; p < kLanes; ++p) {
        const auto [even, odd] = dot(qg, k[i + p]);
        s[kSlot.slot[p]] = Add(even, odd);
      }
      Store(scores + g * n + i, Mul(FoldLanes(s), Set1(scale)));
    }
    for (; i < n; ++i) {
      const auto [even, odd] = dot(qg, k[i]);
      scores[g * n + i] = Finish(even, odd) * scale;
    }
  }
}

// The attention's output for a group of query heads: out_g = sum_i p_gi v_i / denom_g over n positions, each head's
// sum in position order. NV vectors a head; the heads go side by side, as many at a time as keep their accumulators in
// registers, so each value vector is read once for all of them and their chains of multiply-adds overlap. p: [group,
// n] weights; v: the walk's values (Slots); out: [group, NV * kLanes].
template <int NV>
void WeightedSum(const float* p, int64_t n, int64_t group, const Slots& v, const float* denom,
                 float* out) {
  constexpr int64_t kHeads = std::max(1, 24 / NV);
  for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const int64_t heads = std::min(kHeads, group - g0);
    Vec acc[kHeads][NV];
    for (int64_t g = 0; g < kHeads; ++g)
      for (int c = 0; c < NV; ++c) acc[g][c] = Zero();
    for (int64_t i = 0; i < n; ++i) {
      if (g0 == 0 && i % kLanes == 0)
        for (int64_t a = i + kAhead; a < std::min(n, i + kAhead + kLanes); ++a) Prefetch(v[a], NV * kLanes);
      const float* vi = v[i];
      Vec x[NV];
      for (int c = 0; c < NV; ++c) x[c] = LoadX(vi + c * kLanes);
      for (int64_t g = 0; g < kHeads; ++g) {
        if (g >= heads) break;
        const Vec w = Set1(p[(g0 + g) * n + i]);
        for (int c = 0; c < NV; ++c) acc[g][c] = Fma(w, x[c], acc[g][c]);
      }
    }
    for (int64_t g = 0; g < heads; ++g) {
      const Vec inv = Set1(1.0f / denom[g0 + g]);
      for (int c = 0; c < NV; ++c) Store(out + (g0 + g) * NV * kLanes + c * kLanes, Mul(acc[g][c], inv));
    }
  }
}

// WeightedSum for any number of vectors a head (up to 32), one head at a time.
inline void WeightedSumAny(const float* p, int64_t n, int64_t group, int64_t nv, const Slots& v,
                           const float* denom, float* out) {
  for (int64_t g = 0; g < group; ++g) {
    Vec acc[32];
    for (int64_t c = 0; c < nv; ++c) acc[c] = Zero();
    for (int64_t i = 0; i < n; ++i) {
      const Vec w = Set1(p[g * n + i]);
      for (int64_t c = 0; c < nv; ++c) acc[c] = Fma(w, LoadX(v[i] + c * kLanes), acc[c]);
    }
    const Vec inv = Set1(1.0f / denom[g]);
    for (int64_t c = 0; c < nv; ++c) Store(out + g * nv * kLanes + c * kLanes, Mul(acc[c], inv));
  }
}

// Decode attention of one query row per arena lane over that lane's own positions: for row r and kv head h, the
// group's query heads attend to k/v[layer, lanes[r], lo..positions[r], h] with lo = positions[r] - window + 1 (or 0),
// softmax over exactly those positions (scores by the same two-accumulator dot as the matmul, exp by one polynomial,
// sums and the weighted sum of v in position order). Each (row, kv head) is one task with one fixed order of
// operations, so a row's result depends on nothing but its own lane. The key walk (Scores) takes kLanes positions at a
// time, their horizontal sums folded together, and both it and the value walk (WeightedSum) take the group's heads
// side by side; none of that changes any operation's order. q [rows, heads, hd]; k, v [layers, lanes, seq, kv_heads, hd].
// With ring > 0 the layer keeps a ring: position p at slot p mod ring, and the scratch position (idle rows') at slot
// seq - 1 = ring; a row's positions then wrap around the ring at most once, walked in position order all the same.
ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lanes,
                               ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out, int64_t window,
                               float scale, int64_t ring, int64_t scratch_pos) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || v.element_count() != k.element_count() || qd[2] != kd[4] ||
      qd[1] % kd[3])
    return ffi::Error::InvalidArgument("decode_attention: q [rows, heads, hd], k and v [layers, lanes, seq, kvh, hd]");
  const int64_t rows = qd[0], heads = qd[1], hd = qd[2], n_layers = kd[0], n_lanes = kd[1], seq = kd[2];
  const int64_t kvh = kd[3], group = heads / kvh, nv = hd / kLanes;  // nv: vectors per head
  if (hd % kLanes || hd > 256 || group > 8)
    return ffi::Error::InvalidArgument("decode_attention: head_dim a multiple of 16 up to 256, group <= 8");
  if (ring ? seq != ring + 1 || window > ring : scratch_pos != seq - 1)
    return ffi::Error::InvalidArgument("decode_attention: a ring of seq - 1 slots holds the window; else scratch_pos "
                                       "is seq - 1");
  const int64_t l = layer.typed_data()[0];
  const int32_t* lane = lanes.typed_data();
  const int32_t* pos = positions.typed_data();
  if (l < 0 || l >= n_layers) return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  for (int64_t r = 0; r < rows; ++r)
    if (lane[r] < 0 || lane[r] >= n_lanes || pos[r] < 0 || pos[r] > scratch_pos)
      return ffi::Error::InvalidArgument("decode_attention: lane or position out of range");
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  float* op = out->typed_data();
  ParallelFor(pool, rows * kvh, [&](int64_t item) {
    const int64_t r = item / kvh, h = item % kvh;
    // a row at the lane's last position (the scratch slot idle rows write, which no request uses) reads only itself
    const int64_t hi = pos[r], scratch = hi == scratch_pos;
    const int64_t lo = scratch ? hi : window > 0 ? std::max<int64_t>(0, hi - window + 1) : 0, n = hi - lo + 1;
    const int64_t stride = kvh * hd;  // floats between consecutive slots
    const int64_t base = (l * n_lanes + lane[r]) * seq * stride + h * hd;  // the lane's slot 0, head h
    const int64_t first = scratch ? seq - 1 : ring ? lo % ring : lo, wrap = ring && !scratch ? ring : seq;
    const float* qh = qp + (r * heads + h * group) * hd;  // the group's query heads
    std::vector<float> scores(group * n);
    const Slots kr{kp + base, stride, first, wrap};
    float* sc = scores.data();
    switch (nv) {
      case 1: Scores<1>(qh, group, kr, n, scale, sc); break;
      case 2: Scores<2>(qh, group, kr, n, scale, sc); break;
      case 3: Scores<3>(qh, group, kr, n, scale, sc); break;
      case 4: Scores<4>(qh, group, kr, n, scale, sc); break;
      case 8: Scores<8>(qh, group, kr, n, scale, sc); break;
      case 16: Scores<16>(qh, group, kr, n, scale, sc); break;
      default: ScoresAny(qh, group, nv, kr, n, scale, sc);
    }
    float denom[8] = {};
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores.data() + g * n;
      Vec mv = Set1(sg[0]);
      int64_t j = 0;
      for (; j + kLanes <= n; j += kLanes) mv = Max(mv, LoadX(sg + j));
      float lanes_max[kLanes];
      Store(lanes_max, mv);
      float m = *std::max_element(lanes_max, lanes_max + kLanes);
      for (; j < n; ++j) m = std::max(m, sg[j]);
      mv = Set1(m);
      for (j = 0; j + kLanes <= n; j += kLanes) Store(sg + j, ExpNonPositive(Sub(LoadX(sg + j), mv)));
      if (j < n) {  // the tail through a padded vector, so every score takes the same exp
        float tail[kLanes];
        for (int64_t t = 0; t < kLanes; ++t) tail[t] = j + t < n ? sg[j + t] - m : 0.0f;
        Store(tail, ExpNonPositive(LoadX(tail)));
        for (int64_t t = 0; j + t < n; ++t) sg[j + t] = tail[t];
      }
    }
    for (int64_t j = 0; j < n; ++j)  // each sum in position order, the group's chains side by side
      for (int64_t g = 0; g < group; ++g) denom[g] += scores[g * n + j];
    const Slots vr{vp + base, stride, first, wrap};
    float* o = op + (r * heads + h * group) * hd;
    switch (nv) {
      case 1: WeightedSum<1>(scores.data(), n, group, vr, denom, o); break;
      case 2: WeightedSum<2>(scores.data(), n, group, vr, denom, o); break;
      case 3: WeightedSum<3>(scores.data(), n, group, vr, denom, o); break;
      case 4: WeightedSum<4>(scores.data(), n, group, vr, denom, o); break;
      case 8: WeightedSum<8>(scores.data(), n, group, vr, denom, o); break;
      case 16: WeightedSum<16>(scores.data(), n, group, vr, denom, o); break;
      default: WeightedSumAny(scores.data(), n, group, nv, vr, denom, o);
    }
  });
  return ffi::Error::Success();
}

// RMSNorm of each row: y = w * (x * 1 / sqrt(sum(x * x) / D + eps)), the sum by pairwise halves with a zero appended
// to an odd length, the order `jaxstation/kernels/rowwise.py`'s row_sum spells out for XLA. One row's result reads
// nothing but that row. x [M, D], w [D] -> y [M, D].
ffi::Error RmsNormImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y, float eps) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || w.element_count() != size_t(xd[1]))
    return ffi::Error::InvalidArgument("rms_norm: x [M, D], w [D]");
  const int64_t rows = xd[0], d = xd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  std::vector<float> sq(d + 1);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * d;
    for (int64_t i = 0; i < d; ++i) sq[i] = xr[i] * xr[i];
    for (int64_t n = d; n > 1;) {
      if (n % 2) sq[n++] = 0.0f;
      const int64_t half = n / 2;
      for (int64_t i = 0; i < half; ++i) sq[i] = sq[i] + sq[i + half];
      n = half;
    }
    const float inv = 1.0f / std::sqrt(sq[0] / static_cast<float>(d) + eps);
    float* yr = yp + r * d;
    for (int64_t i = 0; i < d; ++i) yr[i] = wp[i] * (xr[i] * inv);
  }
  return ffi::Error::Success();
}

// The k largest values of each row and their indices, in the order of jax.lax.top_k: descending in float32's total
// order (+NaN highest, -NaN lowest, +0 above -0), equal values by ascending index. One pass a row: kLanes values at
// a time are compared, as order-preserving int32 keys, with the k-th best so far; the rare one above it is inserted
// (a later equal value ranks below, so never enters). x [M, N] -> values, ids [M, k], k <= N.
inline int32_t OrderKey(float f) {
  int32_t v;
  std::memcpy(&v, &f, 4);
  return v ^ ((v >> 31) & 0x7FFFFFFF);
}

void TopKRow(const float* x, int64_t n, int64_t k, float* values, int32_t* ids) {
  std::vector<int32_t> keys(k);
  int64_t count = 0;
  const auto insert = [&](int64_t i) {
    const int32_t key = OrderKey(x[i]);
    int64_t at = count < k ? count++ : k - 1;
    for (; at > 0 && keys[at - 1] < key; --at) keys[at] = keys[at - 1], ids[at] = ids[at - 1];
    keys[at] = key, ids[at] = static_cast<int32_t>(i);
  };
  int64_t i = 0;
  for (; i < n && count < k; ++i) insert(i);
  const int32_t* bits = reinterpret_cast<const int32_t*>(x);
  for (; i + kLanes <= n; i += kLanes) {
#if defined(__AVX512F__)
    const __m512i v = _mm512_loadu_si512(bits + i);
    const __m512i key = _mm512_xor_si512(v, _mm512_and_si512(_mm512_srai_epi32(v, 31), _mm512_set1_epi32(0x7FFFFFFF)));
    uint32_t above = _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(keys[k - 1]));
#else
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + i));
    const __m256i key = _mm256_xor_si256(v, _mm256_and_si256(_mm256_srai_epi32(v, 31), _mm256_set1_epi32(0x7FFFFFFF)));
    uint32_t above = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, _mm256_set1_epi32(keys[k - 1]))));
#endif
    for (; above; above &= above - 1) {
      const int64_t j = i + __builtin_ctz(above);
      if (OrderKey(x[j]) > keys[k - 1]) insert(j);  // the bar may have risen within this vector
    }
  }
  for (; i < n; ++i)
    if (OrderKey(x[i]) > keys[k - 1]) insert(i);
  for (int64_t j = 0; j < k; ++j) values[j] = x[ids[j]];
}

ffi::Error TopKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> values,
                    ffi::ResultBuffer<ffi::S32> ids) {
  const auto xd = x.dimensions(), vd = values->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || vd[0] != xd[0] || vd[1] < 1 || vd[1] > xd[1])
    return ffi::Error::InvalidArgument("top_k: x [M, N], values and ids [M, k], 1 <= k <= N");
  const int64_t n = xd[1], k = vd[1];
  ParallelFor(pool, xd[0], [&](int64_t r) {
    TopKRow(x.typed_data() + r * n, n, k, values->typed_data() + r * k, ids->typed_data() + r * k);
  });
  return ffi::Error::Success();
}

}  // namespace

// The variant built: 16 float32 lanes per vector with AVX-512, 8 with AVX2.
extern "C" int jaxstation_vector_lanes() { return static_cast<int>(kLanes); }

// The integer dot products' instruction set: avx512-vnni, avx-vnni or avx2.
extern "C" const char* jaxstation_int_dot_isa() { return kIntIsa; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("ring")
                                  .Attr<int64_t>("scratch_pos"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowwiseMatmulS8, MatmulS8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowwiseMatmulF32, MatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TopK, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

// Per block format, the float32-exact matmul, the integer one and the row lookup: RowwiseMatmulQ4_1, IntMatmulQ4_1,
// BlockRowsQ4_1, ...
#define JAXSTATION_BLOCK_FORMAT(F)                                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RowwiseMatmul##F, MatmulBlocks<F>,                                         \
                                ffi::Ffi::Bind()                                                            \
                                    .Ctx<ffi::ThreadPool>()                                                 \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                           \
                                    .Arg<ffi::Buffer<ffi::U8>>()                                            \
                                    .Ret<ffi::Buffer<ffi::F32>>());                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(IntMatmul##F, IntMatmul<Int##F>,                                           \
                                ffi::Ffi::Bind()                                                            \
                                    .Ctx<ffi::ThreadPool>()                                                 \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                           \
                                    .Arg<ffi::Buffer<ffi::U8>>()                                            \
                                    .Ret<ffi::Buffer<ffi::F32>>());                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockRows##F, BlockRows<F>,                                                \
                                ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::S32>>().Ret< \
                                    ffi::Buffer<ffi::F32>>());

JAXSTATION_BLOCK_FORMAT(Q4_0)
JAXSTATION_BLOCK_FORMAT(Q4_1)
JAXSTATION_BLOCK_FORMAT(Q5_0)
JAXSTATION_BLOCK_FORMAT(Q5_1)
JAXSTATION_BLOCK_FORMAT(Q8_0)
JAXSTATION_BLOCK_FORMAT(Q4_K)
JAXSTATION_BLOCK_FORMAT(Q5_K)
JAXSTATION_BLOCK_FORMAT(Q6_K)
