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

#include "cpu_kernels.h"

namespace {

constexpr int64_t kStep = 2 * kLanes;  // K columns per iteration: one vector into each accumulator

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
// an embedding table looked up in its stored form, or (kPacked) in the integer products' repacked tiles, whose lane
// pack.cc lays back out as stored first. y [M, K].
template <typename F, bool kPacked>
ffi::Error Rows(ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> y, const char* name) {
  const auto wd = w.dimensions(), yd = y->dimensions();
  if (wd.size() != 2 || yd.size() != 2 || size_t(yd[0]) != ids.element_count() || yd[1] % F::kBlock ||
      wd[1] != yd[1] / F::kBlock * F::kBytes || (kPacked && wd[0] % jaxstation::TileChannels()))
    return ffi::Error::InvalidArgument("block_rows: w [N, K / block * block bytes], ids [M], y [M, K]");
  const int64_t n = wd[0], row_len = wd[1], K = yd[1], c = jaxstation::TileChannels();
  const int32_t* id = ids.typed_data();
  float* out = y->typed_data();
  std::vector<uint8_t> unpacked(kPacked ? row_len : 0);
  for (int64_t m = 0; m < yd[0]; ++m) {
    if (id[m] < 0 || id[m] >= n) return ffi::Error::InvalidArgument("block_rows: id out of range");
    const uint8_t* row = w.typed_data() + id[m] * row_len;
    if constexpr (kPacked) {
      jaxstation::UnpackRow(w.typed_data() + id[m] / c * c * row_len, row_len, id[m] % c, name, unpacked.data());
      row = unpacked.data();
    }
    for (int64_t k = 0; k < K; k += kGroup) {
      const typename F::Group g = F::Decode(row, k);
      for (int64_t i = 0; i < kGroup; i += kLanes) Store(out + m * K + k + i, F::Weight(g, i));
    }
  }
  return ffi::Error::Success();
}

template <typename F>
ffi::Error BlockRows(ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> y) {
  return Rows<F, false>(w, ids, y, nullptr);
}

}  // namespace

// The variant built: 16 float32 lanes per vector with AVX-512, 8 with AVX2.
extern "C" int jaxstation_vector_lanes() { return static_cast<int>(kLanes); }

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

// Per block format, the float32-exact matmul and the row lookup: RowwiseMatmulQ4_1, BlockRowsQ4_1, ...
#define JAXSTATION_BLOCK_FORMAT(F)                                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RowwiseMatmul##F, MatmulBlocks<F>,                                         \
                                ffi::Ffi::Bind()                                                            \
                                    .Ctx<ffi::ThreadPool>()                                                 \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                           \
                                    .Arg<ffi::Buffer<ffi::U8>>()                                            \
                                    .Ret<ffi::Buffer<ffi::F32>>());                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockRows##F, BlockRows<F>,                                                \
                                ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::S32>>().Ret< \
                                    ffi::Buffer<ffi::F32>>());

// Per block format, the row lookup from its repacked tiles: BlockRowsQ4_0R, ...
#define JAXSTATION_PACKED_ROWS(F)                                                                           \
  static ffi::Error BlockRowsPacked##F(ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> ids,                 \
                                       ffi::ResultBuffer<ffi::F32> y) {                                     \
    return Rows<F, true>(w, ids, y, #F);                                                               \
  }                                                                                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockRows##F##R, BlockRowsPacked##F,                                       \
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
JAXSTATION_PACKED_ROWS(Q4_0)
JAXSTATION_PACKED_ROWS(Q4_1)
JAXSTATION_PACKED_ROWS(Q5_0)
JAXSTATION_PACKED_ROWS(Q5_1)
JAXSTATION_PACKED_ROWS(Q8_0)
JAXSTATION_PACKED_ROWS(Q4_K)
JAXSTATION_PACKED_ROWS(Q5_K)
JAXSTATION_PACKED_ROWS(Q6_K)
