// Integer dot products over GGUF blocks (weights "gguf"): x [M, K] times a GGUF file's blocks w [N, K / block *
// block bytes] -> y [M, N].
//
// Each row of x is rounded to 8 bits per 32 columns (as llama.cpp's Q8_0), from that row alone: d = amax / 127, q =
// x * (127 / amax) rounded to nearest even. (llama.cpp rounds to 256-column Q8_K blocks for the K-quants; on Gemma 3
// 270M's Q4_K and Q6_K matrices that alone cost more perplexity than the 1% the integer path may lose.) A weight block
// is read as unsigned byte codes (signed for Q8_0 without VNNI), w = d_w * s * (code - bias) (+ m for the formats with
// a minimum), s an integer scale per 32 or 16 columns (the K-quants). For each output and each 32 columns, the products
// of codes and q are summed exactly in int32, with the bias folded in as -bias * the columns' sum of q and the K-quant
// scales joining d_w as floats (exact: a float16 times at most 8 bits): one integer `sum` per 32 columns (Q6_K: per 16,
// each with its own scale). Then, in K order, one fixed float epilogue of fused multiply-adds (one rounding each):
// acc = fma(scale * d_x, float(sum), acc), scale being d_w times the 32 columns' integer scale (Q4_K, Q5_K) or d_w;
// Q6_K's acc = fma(fma(high, float(second sum), low * float(first sum)), d_x, acc); and for the formats with a minimum
// acc = fma(m * minimum code, d_x * sum of q, acc). The output is acc. No step depends on the rows, the tile, the
// thread or the instruction set (vpdpbusd, maddubs and AMX's tdpbsud give the same int32 sums), so a row's bits never
// depend on the rows beside it, and every build gives the same bits.
//
// Layout: a vector holds kIntCh channels, lane c channel c. A tile's channels are decoded once per call, each 32
// columns into 8 vectors (vector j: columns 4j..4j+3 of every channel, as 4 bytes a lane), so that vpdpbusd against the
// row's 4 bytes j, broadcast, adds every channel's 4 products into its own lane.

#include "cpu_kernels.h"

#include <chrono>
#include <string>

#include "amx_tiles.h"

namespace {

#if defined(__AVX512F__)
using IVec = __m512i;
constexpr int kIntCh = 16;
constexpr int kIntRows = 8;  // rows a tile, at most: their sums, the weights and the scales fit in 32 registers
inline IVec ILoad(const void* p) { return _mm512_loadu_si512(p); }
inline void IStore(void* p, IVec v) { _mm512_storeu_si512(p, v); }
inline IVec IAdd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec ISet1(int32_t a) { return _mm512_set1_epi32(a); }
inline Vec ToFloat(IVec a) { return _mm512_cvtepi32_ps(a); }
inline IVec FlipSigns(IVec a) { return _mm512_xor_si512(a, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline IVec LowNibbles(IVec a) { return _mm512_and_si512(a, _mm512_set1_epi8(0x0F)); }
inline IVec HighNibbles(IVec a) { return _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi8(0x0F)); }
inline IVec IAnd(IVec a, IVec b) { return _mm512_and_si512(a, b); }
inline IVec IOr(IVec a, IVec b) { return _mm512_or_si512(a, b); }
inline IVec IShiftRight(IVec a, int n) { return _mm512_srli_epi32(a, n); }
inline IVec IShiftLeft(IVec a, int n) { return _mm512_slli_epi32(a, n); }
inline IVec UnsignedBytes(const uint8_t* p) {  // kIntCh bytes as int32
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline IVec SignedBytes(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// w with bits 2k and 2k + 1 of every byte of `bits` set in as its bits 4 and 5 (its own are 0): the bits shifted in
// 16-bit lanes (what crosses a byte lands outside bits 4 and 5), then one ternary op, w | (shifted & 0x30)
template <int k>
inline IVec OrHighBits(IVec w, IVec bits) {
  const IVec at = k < 2 ? _mm512_slli_epi16(bits, 4 - 2 * k) : k == 2 ? bits : _mm512_srli_epi16(bits, 2);
  return _mm512_ternarylogic_epi32(w, at, _mm512_set1_epi8(0x30), 0xF8);
}
inline Vec Halves(const uint8_t* p) {  // kIntCh float16 as float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
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
constexpr int kIntRows = 4;  // rows a tile, at most (16 registers)
inline IVec ILoad(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline void IStore(void* p, IVec v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
inline IVec IAdd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec ISet1(int32_t a) { return _mm256_set1_epi32(a); }
inline Vec ToFloat(IVec a) { return _mm256_cvtepi32_ps(a); }
inline IVec FlipSigns(IVec a) { return _mm256_xor_si256(a, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline IVec LowNibbles(IVec a) { return _mm256_and_si256(a, _mm256_set1_epi8(0x0F)); }
inline IVec HighNibbles(IVec a) { return _mm256_and_si256(_mm256_srli_epi16(a, 4), _mm256_set1_epi8(0x0F)); }
inline IVec IAnd(IVec a, IVec b) { return _mm256_and_si256(a, b); }
inline IVec IOr(IVec a, IVec b) { return _mm256_or_si256(a, b); }
inline IVec IShiftRight(IVec a, int n) { return _mm256_srli_epi32(a, n); }
inline IVec IShiftLeft(IVec a, int n) { return _mm256_slli_epi32(a, n); }
inline IVec UnsignedBytes(const uint8_t* p) {  // kIntCh bytes as int32
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline IVec SignedBytes(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// w with bits 2k and 2k + 1 of every byte of `bits` set in as its bits 4 and 5 (its own are 0), as the AVX-512 one
template <int k>
inline IVec OrHighBits(IVec w, IVec bits) {
  const IVec at = k < 2 ? _mm256_slli_epi16(bits, 4 - 2 * k) : k == 2 ? bits : _mm256_srli_epi16(bits, 2);
  return _mm256_or_si256(w, _mm256_and_si256(at, _mm256_set1_epi8(0x30)));
}
inline Vec Halves(const uint8_t* p) {  // kIntCh float16 as float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
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
// Bytes ahead of the block being decoded that the decoder asks for: the rows of a matrix lie one after the other, so
// the next channels' blocks are in flight while this one decodes. kIntAheadL2: a repacked tile of several rows' (see
// PrefetchAhead).
constexpr int64_t kIntAhead = 4096, kIntAheadL2 = 65536;

// The rows of x rounded to 8 bits per 32 columns: q [M, K], d [M, K / 32] (each 32 columns' scale), biased
// [M, K / 16] (each 16 columns' sum of q times -bias, the codes' offset: where their integer sums start) and dsums
// [M, K / 32] (each 32 columns' d times their sum of q).
struct IntActs {
  int64_t K = 0;
  std::vector<int8_t> q;
  std::vector<float> d, dsums;
  std::vector<int32_t> biased;
};

void QuantizeRows(const float* x, int64_t M, int64_t K, int bias, IntActs& a) {
  a.K = K;
  a.q.resize(M * K), a.d.resize(M * K / 32), a.dsums.resize(M * K / 32), a.biased.resize(M * K / 16);
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
    int32_t sum = 0;
    for (int h = 0; h < 2; ++h) {
      int32_t half = 0;
      for (int64_t i = 16 * h; i < 16 * h + 16; ++i) half += q[i] = static_cast<int8_t>(rounded[i]);
      a.biased[2 * b + h] = -bias * half, sum += half;
    }
    a.dsums[b] = a.d[b] * static_cast<float>(sum);
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
// Codes w with their fifth bits: 0x10 added in byte k where bit k of the kIntCh * 4 bits at p is set
#if defined(__AVX512F__)
inline IVec WithFifths(IVec w, const uint8_t* p) {
  uint64_t bits;
  std::memcpy(&bits, p, 8);
  return _mm512_mask_add_epi8(w, bits, w, _mm512_set1_epi8(0x10));
}
#else
inline IVec WithFifths(IVec w, const uint8_t* p) { return _mm256_or_si256(w, FifthBits(p)); }
#endif

// The 32-column formats: one block a group. kBias: the code's offset; kMin: a float minimum per block.
template <int kBytesT, int kBiasT, bool kMinT>
struct IntSmall {
  static constexpr int64_t kBlock = 32, kBytes = kBytesT;
  static constexpr int kBias = kBiasT;
  static constexpr bool kMin = kMinT, kScaled = false, kOneScale = false, kTwoScales = false, kSigned = false;
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

// The K-quants: 256 columns in 8 groups of 32, each with an integer scale (kOneScale: Q4_K, Q5_K) or two (Q6_K: one
// per 16 columns) in `scales`.
template <int kBytesT, int kBiasT, bool kMinT, bool kOneScaleT>
struct IntK {
  static constexpr int64_t kBlock = 256, kBytes = kBytesT;
  static constexpr int kBias = kBiasT;
  static constexpr bool kMin = kMinT, kScaled = true, kOneScale = kOneScaleT, kTwoScales = !kOneScaleT;
  static constexpr bool kSigned = false;
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

struct IntQ4_K : IntK<144, 0, true, true> {  // d, dmin, scales[12], qs[128]: group j, nibble j % 2 of bytes 32 * (j / 2) on
  static void Decode(const uint8_t* b, int64_t blk, IntChannel& c) {
    KScales(b, blk, c);
    for (int j = 0; j < 8; ++j)
      Store32(c.Codes(blk * 8 + j), Field(Load32(b + 16 + 32 * (j / 2)), 4 * (j % 2), 0x0F));
  }
};
struct IntQ5_K : IntK<176, 0, true, true> {  // d, dmin, scales[12], qh[32] (bit j: group j's fifth bit), qs[128]
  static void Decode(const uint8_t* b, int64_t blk, IntChannel& c) {
    KScales(b, blk, c);
    const __m256i qh = Load32(b + 16);
    for (int j = 0; j < 8; ++j) {
      const __m256i low = Field(Load32(b + 48 + 32 * (j / 2)), 4 * (j % 2), 0x0F);
      Store32(c.Codes(blk * 8 + j), _mm256_or_si256(low, _mm256_slli_epi16(Field(qh, j, 1), 4)));
    }
  }
};
struct IntQ6_K : IntK<210, 32, false, false> {  // ql[128], qh[64], int8 scales[16] (one per 16 columns), d
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

// A group's float factors, formed once for a tile's R rows: scale, d_w times the 32 columns' integer scale where they
// have one (Q4_K, Q5_K), else d_w; Q6_K's low and high, d_w times the integer scale of columns 0-15 and of 16-31; and
// minimum, the minimum's coefficient m (times the group's minimum code mins for the K-quants). Every product is exact
// in float32: a float16 times at most 8 bits.
struct Factors {
  Vec scale, low, high, minimum;
};

template <typename F>
inline Factors GroupFactors(Vec dw, Vec mw, IVec low, IVec high, IVec mins) {
  Factors f{};  // low and high stay 0 but for Q6_K
  f.scale = F::kOneScale ? Mul(dw, ToFloat(low)) : dw;
  if constexpr (F::kTwoScales) f.low = Mul(dw, ToFloat(low)), f.high = Mul(dw, ToFloat(high));
  f.minimum = F::kMin && F::kScaled ? Mul(mw, ToFloat(mins)) : mw;
  return f;
}

// A row's epilogue of one group into acc, from its integer sums of columns 0-15 and 16-31 (each from -bias * the
// columns' sum of q) and its d and dsum: Q6_K's low * float(first) + high * float(second), one fused multiply-add, then
// that times d into acc; the others' scale * d times float(first + second) into acc; then the minimum's term.
template <typename F>
inline Vec Epilogue(IVec first, IVec second, const Factors& f, float d, float dsum, Vec acc) {
  if constexpr (F::kTwoScales) {
    acc = Fma(Fma(f.high, ToFloat(second), Mul(f.low, ToFloat(first))), Set1(d), acc);
  } else {
    acc = Fma(Mul(f.scale, Set1(d)), ToFloat(IAdd(first, second)), acc);
  }
  if constexpr (F::kMin) acc = Fma(f.minimum, Set1(dsum), acc);
  return acc;
}

// One group of 32 columns for R rows at once: the 8 code vectors w and the group's factors: each row's integer sums,
// then its epilogue into acc.
template <typename F, int R>
inline void IntGroup(const IntActs& a, int64_t m0, int64_t group, const IVec* w, const Factors& f, Vec* acc) {
  const int64_t groups = a.K / 32;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {  // unrolled: each row's acc stays in a register
    const int64_t at = (m0 + r) * groups + group;  // the row's 32 columns
    const int8_t* q = a.q.data() + at * 32;
    IVec half[2];
    for (int h = 0; h < 2; ++h) {
      half[h] = F::kBias ? ISet1(a.biased[2 * at + h]) : ISet1(0);
      for (int j = 4 * h; j < 4 * h + 4; ++j) {
        int32_t x4;
        std::memcpy(&x4, q + 4 * j, 4);
        half[h] = F::kSigned ? DotS(half[h], w[j], ISet1(x4)) : DotU(half[h], w[j], ISet1(x4));
      }
    }
    acc[r] = Epilogue<F>(half[0], half[1], f, a.d[at], a.dsums[at], acc[r]);
  }
}

// tile(rows, m) over rows [m, M) in tiles of kIntRows rows, then a tile each of the halves of kIntRows that the rest
// holds (rows: a std::integral_constant, so each tile's row count is a compile-time constant).
template <typename T>
inline void ForRowTiles(int64_t m, int64_t M, const T& tile) {
  for (; m + kIntRows <= M; m += kIntRows) tile(std::integral_constant<int, kIntRows>{}, m);
  if constexpr (kIntRows > 4) {
    if (M - m >= 4) tile(std::integral_constant<int, 4>{}, m), m += 4;
  }
  if (M - m >= 2) tile(std::integral_constant<int, 2>{}, m), m += 2;
  if (M - m >= 1) tile(std::integral_constant<int, 1>{}, m);
}

template <int R>
void StoreTile(const Vec* acc, int64_t m0, float* y, int64_t N, int64_t n0, int64_t valid) {
  for (int r = 0; r < R; ++r) {
    float out[kIntCh];
    Store(out, acc[r]);
    std::copy_n(out, valid, y + (m0 + r) * N + n0);
  }
}

// visit(group, w, factors) for each 32 columns of a decoded tile, in K order: w its 8 code vectors.
template <typename F, typename V>
inline void ForCodesGroups(const IntCodes& c, int64_t K, const V& visit) {
  constexpr int G = F::kBlock / 32;
  for (int64_t group = 0; group < K / 32; ++group) {
    const int64_t blk = group / G;
    IVec w[8];
    for (int j = 0; j < 8; ++j) w[j] = ILoad(c.codes.data() + (group * 8 + j) * kIntCh * 4);
    visit(group, w, GroupFactors<F>(LoadW(c.d.data() + blk * kIntCh), LoadW(c.m.data() + blk * kIntCh),
                                    ILoad(c.scales.data() + 2 * group * kIntCh),
                                    ILoad(c.scales.data() + (2 * group + 1) * kIntCh),
                                    ILoad(c.mins.data() + group * kIntCh)));
  }
}

// R rows x kIntCh channels over the whole K: each 32 columns' integer sums, then their epilogue, in K order (out of
// line, as PackedTile).
template <typename F, int R>
__attribute__((noinline)) void IntTile(const IntActs& a, int64_t m0, const IntCodes& c, float* y, int64_t N, int64_t n0,
                                       int64_t valid) {
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Zero();
  ForCodesGroups<F>(c, a.K, [&](int64_t group, const IVec* w, const Factors& f) {
    IntGroup<F, R>(a, m0, group, w, f, acc);
  });
  StoreTile<R>(acc, m0, y, N, n0, valid);
}

// Rows in tiles of kAmxRows on AMX (amx_tiles.h), where the build has it and this process may use it (AmxOff()): per
// range of channels, AmxRows loads the tile configuration; per kIntCh channels, Filler() takes each group's code
// vectors and factors once, and Run() gives every whole tile of kAmxRows rows its outputs and returns the first row
// left to the vector tiles. A group's integer sums (TDPBSUD: q signed, the codes unsigned, as vpdpbusd) are exact,
// and each row's epilogue is IntGroup's, so a row's bits are the vector kernel's.
constexpr int kAmxRows = 16;
#if defined(JAXSTATION_AMX)
// nullptr where the tiles serve: Linux granted them and one TDPBSUD gave the sums of its definition; else why not
const char* AmxProbe() {
  if (const char* why = amx::Grant()) return why;
  alignas(64) int8_t q[kAmxRows][32];
  alignas(64) uint8_t codes[8][64];
  alignas(64) int32_t sums[kAmxRows][16];
  uint32_t state = 12345;
  const auto next = [&state] { return static_cast<uint8_t>((state = state * 1664525u + 1013904223u) >> 24); };
  for (auto& row : q)
    for (int8_t& v : row) v = static_cast<int8_t>(next());
  for (auto& row : codes)
    for (uint8_t& v : row) v = next();
  amx::LoadConfig(amx::Config().Tile(0, kAmxRows, 64).Tile(1, kAmxRows, 32).Tile(2, 8, 64));
  amx::TileZero<0>();
  amx::TileLoad<1>(q, 32);
  amx::TileLoad<2>(codes, 64);
  amx::TileDot<0, 1, 2>();
  amx::TileStore<0>(sums, 64);
  amx::Release();
  for (int m = 0; m < kAmxRows; ++m)
    for (int n = 0; n < 16; ++n) {
      int32_t sum = 0;
      for (int k = 0; k < 32; ++k) sum += q[m][k] * static_cast<int32_t>(codes[k / 4][4 * n + k % 4]);
      if (sum != sums[m][n]) return "a TDPBSUD's sums differ from its definition's";
    }
  return nullptr;
}

const char* AmxOff() {
  static const char* const why = AmxProbe();
  return why;
}

template <typename F>
struct AmxRows {
  static_assert(!F::kSigned && kIntCh * 4 == 64, "the tiles read unsigned codes, 16 channels a 64-byte row");
  const IntActs& a;
  const int64_t tiles;  // whole tiles of kAmxRows rows
  const bool on;
  std::vector<uint8_t> codes;  // [K / 32][8][kIntCh * 4]: a group's code vectors, the rows of its B tile
  std::vector<Factors> factors;  // [K / 32]

  AmxRows(const IntActs& a_, int64_t M) : a(a_), tiles(M / kAmxRows), on(tiles > 0 && !AmxOff()) {
    if (!on) return;
    codes.resize(a.K / 32 * 8 * kIntCh * 4), factors.resize(a.K / 32);
    // tiles 0, 1, 2: sums, q, codes (Q6_K: of columns 0-15; 3, 4, 5 those of 16-31)
    amx::Config config;
    if constexpr (F::kTwoScales) {
      config.Tile(0, kAmxRows, 64).Tile(1, kAmxRows, 16).Tile(2, 4, 64);
      config.Tile(3, kAmxRows, 64).Tile(4, kAmxRows, 16).Tile(5, 4, 64);
    } else {
      config.Tile(0, kAmxRows, 64).Tile(1, kAmxRows, 32).Tile(2, 8, 64);
    }
    amx::LoadConfig(config);
  }
  ~AmxRows() {
    if (on) amx::Release();
  }
  AmxRows(const AmxRows&) = delete;
  AmxRows& operator=(const AmxRows&) = delete;

  auto Filler() {
    return [this](int64_t group, const IVec* w, const Factors& f) {
      for (int j = 0; j < 8; ++j) IStore(codes.data() + (group * 8 + j) * kIntCh * 4, w[j]);
      factors[group] = f;
    };
  }

  int64_t Run(float* y, int64_t N, int64_t n0, int64_t valid) const {
    if (!on) return 0;
    for (int64_t t = 0; t < tiles; ++t) Tile(t * kAmxRows, y, N, n0, valid);
    return tiles * kAmxRows;
  }

  // a group's integer sums for rows m0.. from their q: sums [kAmxRows][kIntCh] (Q6_K: then those of columns 16-31)
  void Sums(int64_t m0, int64_t group, int32_t (*sums)[kIntCh]) const {
    const int8_t* q = a.q.data() + m0 * a.K + group * 32;
    const uint8_t* w = codes.data() + group * 8 * kIntCh * 4;
    amx::TileZero<0>();
    amx::TileLoad<1>(q, a.K);
    amx::TileLoad<2>(w, kIntCh * 4);
    amx::TileDot<0, 1, 2>();
    amx::TileStore<0>(sums, kIntCh * 4);
    if constexpr (F::kTwoScales) {
      amx::TileZero<3>();
      amx::TileLoad<4>(q + 16, a.K);
      amx::TileLoad<5>(w + 4 * kIntCh * 4, kIntCh * 4);
      amx::TileDot<3, 4, 5>();
      amx::TileStore<3>(sums + kAmxRows, kIntCh * 4);
    }
  }

  void Tile(int64_t m0, float* y, int64_t N, int64_t n0, int64_t valid) const {
    const int64_t groups = a.K / 32;
    Vec acc[kAmxRows];
    for (Vec& v : acc) v = Zero();
    alignas(64) int32_t sums[2 * kAmxRows][kIntCh];
    for (int64_t group = 0; group < groups; ++group) {
      Sums(m0, group, sums);
      const Factors& f = factors[group];
#pragma GCC unroll 16
      for (int r = 0; r < kAmxRows; ++r) {
        const int64_t at = (m0 + r) * groups + group;
        IVec first = ILoad(sums[r]), second;
        if constexpr (F::kTwoScales) {
          first = IAdd(first, ISet1(a.biased[2 * at]));
          second = IAdd(ILoad(sums[kAmxRows + r]), ISet1(a.biased[2 * at + 1]));
        } else {
          second = ISet1(F::kBias ? a.biased[2 * at] + a.biased[2 * at + 1] : 0);
        }
        acc[r] = Epilogue<F>(first, second, f, a.d[at], a.dsums[at], acc[r]);
      }
    }
    StoreTile<kAmxRows>(acc, m0, y, N, n0, valid);
  }
};
#else
const char* AmxOff() {
  return "this build has no AMX-INT8 (the CPU has none, or JAXSTATION_KERNEL_ISA named a build without it)";
}

template <typename F>
struct AmxRows {  // no tiles: every row is the vector kernel's
  static constexpr bool on = false;
  AmxRows(const IntActs&, int64_t) {}
  auto Filler() {
    return [](int64_t, const IVec*, const Factors&) {};
  }
  int64_t Run(float*, int64_t, int64_t, int64_t) const { return 0; }
};
#endif

// Channels [n_begin, n_end), kIntCh at a time decoded once into codes, then every row tile over them.
template <typename F>
void IntChannels(const IntActs& a, const uint8_t* w, int64_t row_len, float* y, int64_t M, int64_t N,
                 int64_t n_begin, int64_t n_end) {
  IntCodes c;
  c.Resize(a.K, F::kBlock);
  AmxRows<F> amx(a, M);
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
    if (amx.on) ForCodesGroups<F>(c, a.K, amx.Filler());
    const int64_t rest = amx.Run(y, N, n, valid);
    ForRowTiles(rest, M, [&](auto rows, int64_t m) { IntTile<F, decltype(rows)::value>(a, m, c, y, N, n, valid); });
  }
}

// Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 repacked at load (packing.pack_blocks, formats "Q8_0R", "Q4_0R", ...): the
// kIntCh rows of w from channel t kIntCh on hold that tile; for each 32 columns in K order, the tile's float16 fields
// side by side (d, then Q4_1 and Q5_1's m), then the code bytes as dwords, dword i lane c holding channel c's bytes
// 4i..4i+3: Q8_0's 8 dwords are IntCodes' 8 vectors (int8 as stored); the others' 4 hold codes 4i..4i+3 in their low
// nibbles and 16 + 4i.. in their high ones; then Q5_0 and Q5_1's fifth bits, kIntCh * 4 bits for each of the 8 code
// vectors, bit k for its byte k. A call reads them as they lie, with nothing to decode per channel or reorder (at one
// row the decoding is most of the plain layout's cost); the integer sums and the epilogue are IntTile's, so a row's
// bits are the plain layout's.
// A repacked tile's 32 codes a channel from 4 dwords of nibbles (codes 4i.. low, 16 + 4i.. high) into the 8 code
// vectors, with kFifth their fifth bits after them (one bit a byte of each code vector).
template <bool kFifth>
inline void LoadNibbleCodes(const uint8_t* codes, IVec* w) {
  for (int i = 0; i < 4; ++i) {
    const IVec v = ILoad(codes + i * kIntCh * 4);
    w[i] = LowNibbles(v), w[i + 4] = HighNibbles(v);
  }
  if constexpr (kFifth)
    for (int j = 0; j < 8; ++j) w[j] = WithFifths(w[j], codes + 16 * kIntCh + j * kIntCh / 2);
}

// Asks for the `bytes` lying ahead of p (a matrix's tiles lie one after the other): for one row, kIntAhead on into L1,
// as fast as memory reads; for a tile of R > 1 rows, whose arithmetic takes longer than reading its weights,
// kIntAheadL2 on into L2, so that memory reads run that far ahead of the arithmetic instead of in turn with it (into L1
// at kIntAhead, an 8-row tile of an 8B model's streamed matrices spent about as long waiting as computing).
template <int R>
inline void PrefetchAhead(const uint8_t* p, int64_t bytes) {
  const char* at = reinterpret_cast<const char*>(p) + (R == 1 ? kIntAhead : kIntAheadL2);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(at + o, R == 1 ? _MM_HINT_T0 : _MM_HINT_T1);
}

template <typename F>
struct Packed {
  static constexpr int kFields = F::kMin ? 2 : 1;  // float16 fields a channel: d (and m)
  static constexpr bool kFifth = F::kBytes == 22 || F::kBytes == 24;  // Q5_0, Q5_1
  static constexpr int64_t kGroup = kIntCh * F::kBytes;  // bytes of a tile's 32 columns
  static void Load(const uint8_t* g, IVec* w, Vec& dw, Vec& mw) {
    dw = Halves(g), mw = F::kMin ? Halves(g + 2 * kIntCh) : Zero();
    const uint8_t* codes = g + 2 * kFields * kIntCh;
    if constexpr (F::kBytes == 34) {  // Q8_0: IntQ8_0's unsigned codes q + 128 with VNNI
      for (int j = 0; j < 8; ++j) {
        w[j] = ILoad(codes + j * kIntCh * 4);
        if constexpr (kVnni) w[j] = FlipSigns(w[j]);
      }
    } else {
      LoadNibbleCodes<kFifth>(codes, w);
    }
  }
};

// The K-quants repacked at load ("Q4_KR", "Q5_KR", "Q6_KR"; packing.pack_blocks), the same bytes: per tile and
// 256 columns, Q4_K and Q5_K hold the tile's float16 d, then dmin, side by side; then for each group j of 32 columns a
// byte a channel, its 6-bit scale and its minimum's low 2 bits (sc | (mn & 3) << 6); then for groups j and j + 4 a
// byte a channel, their minimums' high 4 bits (low nibble: group j); then each group's codes as the 32-column formats
// hold them (4 dwords of nibbles), Q5_K's followed by their fifth bits as Q5_0R's. Q6_K holds d, then for each group
// its int8 scales of columns 0-15 and 16-31, a byte a channel each, its codes' low 4 bits as nibbles, and their high 2
// bits: two vectors' worth of bytes, byte k of vector h holding the high bits of byte k of code vectors 4h..4h+3, 2
// bits each. Integer scales, minimums and codes are IntQ4_K's, IntQ5_K's and IntQ6_K's, so a row's bits are the plain
// layout's.
template <typename F>
struct PackedK {
  static constexpr bool kQ6 = F::kBytes == 210, kFifth = F::kBytes == 176;
  static constexpr int64_t kHead = (kQ6 ? 2 : 16) * kIntCh;  // bytes before a block's first group
  static constexpr int64_t kGroup = (kQ6 ? 26 : kFifth ? 20 : 16) * kIntCh;  // bytes of one group
  static void Load(const uint8_t* block, int j, IVec* w, IVec& low, IVec& high, IVec& mins) {
    const uint8_t* g = block + kHead + j * kGroup;
    const uint8_t* codes = g + (kQ6 ? 2 * kIntCh : 0);
    LoadNibbleCodes<kFifth>(codes, w);
    if constexpr (kQ6) {
      low = SignedBytes(g), high = SignedBytes(g + kIntCh), mins = ISet1(0);
      for (int h = 0; h < 2; ++h) {
        const IVec bits = ILoad(codes + 16 * kIntCh + h * kIntCh * 4);
        w[4 * h] = OrHighBits<0>(w[4 * h], bits);
        w[4 * h + 1] = OrHighBits<1>(w[4 * h + 1], bits);
        w[4 * h + 2] = OrHighBits<2>(w[4 * h + 2], bits);
        w[4 * h + 3] = OrHighBits<3>(w[4 * h + 3], bits);
      }
    } else {
      const IVec a = UnsignedBytes(block + 4 * kIntCh + j * kIntCh);
      const IVec b = UnsignedBytes(block + 12 * kIntCh + (j % 4) * kIntCh);
      low = high = IAnd(a, ISet1(63));
      mins = IOr(IShiftRight(a, 6), IShiftLeft(IAnd(IShiftRight(b, 4 * (j / 4)), ISet1(15)), 2));
    }
  }
};

// visit(group, w, factors) for each 32 columns of a repacked tile, in K order, its bytes asked for ahead as a tile of R
// rows reads them.
template <typename F, int R, typename V>
inline void ForPackedGroups(const uint8_t* tile, int64_t K, const V& visit) {
  IVec w[8];
  if constexpr (F::kScaled) {
    for (int64_t blk = 0; blk < K / 256; ++blk) {
      const uint8_t* block = tile + blk * kIntCh * F::kBytes;
      PrefetchAhead<R>(block, kIntCh * F::kBytes);
      const Vec dw = Halves(block), mw = F::kMin ? Sub(Zero(), Halves(block + 2 * kIntCh)) : Zero();
      for (int j = 0; j < 8; ++j) {
        IVec low, high, mins;
        PackedK<F>::Load(block, j, w, low, high, mins);
        visit(blk * 8 + j, w, GroupFactors<F>(dw, mw, low, high, mins));
      }
    }
  } else {
    for (int64_t group = 0; group < K / 32; ++group) {
      const uint8_t* g = tile + group * Packed<F>::kGroup;
      PrefetchAhead<R>(g, Packed<F>::kGroup);
      Vec dw, mw;
      Packed<F>::Load(g, w, dw, mw);
      visit(group, w, GroupFactors<F>(dw, mw, ISet1(0), ISet1(0), ISet1(0)));
    }
  }
}

// A tile of R rows (out of line: inlined into PackedChannels, its 8-row tile measured slower)
template <typename F, int R>
__attribute__((noinline)) void PackedTile(const IntActs& a, int64_t m0, const uint8_t* tile, float* y, int64_t N,
                                          int64_t n0) {
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Zero();
  ForPackedGroups<F, R>(tile, a.K, [&](int64_t group, const IVec* w, const Factors& f) {
    IntGroup<F, R>(a, m0, group, w, f, acc);
  });
  StoreTile<R>(acc, m0, y, N, n0, kIntCh);
}

template <typename F>
void PackedChannels(const IntActs& a, const uint8_t* w, int64_t row_len, float* y, int64_t M, int64_t N,
                    int64_t n_begin, int64_t n_end) {
  AmxRows<F> amx(a, M);
  for (int64_t n = n_begin; n < n_end; n += kIntCh) {
    const uint8_t* tile = w + n * row_len;
    if (amx.on) ForPackedGroups<F, kAmxRows>(tile, a.K, amx.Filler());
    const int64_t rest = amx.Run(y, N, n, kIntCh);
    ForRowTiles(rest, M, [&](auto rows, int64_t m) { PackedTile<F, decltype(rows)::value>(a, m, tile, y, N, n); });
  }
}

// x [M, K] times block weights w [N, K / block * bytes] (uint8; kPacked: Q8_0 repacked) -> y [M, N] by integer dot
// products.
template <typename F, bool kPacked = false>
ffi::Error IntMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] % F::kBlock || wd[1] != xd[1] / F::kBlock * F::kBytes ||
      wd[0] % (kPacked ? kIntCh : 4))
    return ffi::Error::InvalidArgument("int_matmul: x [M, K], w [N, K / block * block bytes], N % 4 == 0 (repacked: "
                                       "N % the kernel's channels a tile)");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  IntActs a;
  QuantizeRows(x.typed_data(), M, K, F::kBias, a);
  // channel ranges of a multiple of kIntCh, about 4 per thread, at least 2 * kIntCh channels each
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = std::max<int64_t>(2 * kIntCh, (N / (4 * threads) + kIntCh - 1) / kIntCh * kIntCh);
  ParallelFor(pool, (N + per - 1) / per, [&](int64_t i) {
    const int64_t begin = i * per, end = std::min(N, (i + 1) * per);
    if constexpr (kPacked) {
      PackedChannels<F>(a, w.typed_data(), wd[1], y->typed_data(), M, N, begin, end);
    } else {
      IntChannels<F>(a, w.typed_data(), wd[1], y->typed_data(), M, N, begin, end);
    }
  });
  return ffi::Error::Success();
}

template <typename F>
ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  return IntMatmul<F, true>(pool, x, w, y);
}

}  // namespace

// The integer dot's peak on this machine, for benchmarks: `threads` threads each run `iters` rounds of 8 independent
// DotU (the kernels' integer dot: one vpdpbusd, or maddubs + madd) on registers only; returns the seconds they took.
// Each DotU is 4 * kIntCh multiply-adds.
extern "C" double jaxstation_int_dot_peak(int threads, int64_t iters) {
  const auto run = [iters] {
    IVec acc[8], u = ISet1(0x01010101);
    for (int i = 0; i < 8; ++i) acc[i] = ISet1(i);
    for (int64_t n = 0; n < iters; ++n) {
      for (int i = 0; i < 8; ++i) acc[i] = DotU(acc[i], u, u);
      asm volatile("" : "+v"(u));  // an operand that changes as far as the compiler knows: no folding
    }
    IVec sum = acc[0];
    for (int i = 1; i < 8; ++i) sum = IAdd(sum, acc[i]);
    alignas(64) int32_t out[kIntCh];
    IStore(out, sum);
    asm volatile("" : : "r"(out[0]));
  };
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(run);
  run();
  for (std::thread& t : pool) t.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The integer dot products' instruction set: avx512-vnni, avx-vnni or avx2.
extern "C" const char* jaxstation_int_dot_isa() { return kIntIsa; }

// Whether products of kAmxRows rows or more run on AMX tiles: "amx", "amx-emulated", or "off: " and why not.
extern "C" const char* jaxstation_int_amx() {
#if defined(JAXSTATION_AMX)
  static const std::string state = AmxOff() ? std::string("off: ") + AmxOff() : amx::kName;
#else
  static const std::string state = std::string("off: ") + AmxOff();
#endif
  return state.c_str();
}

// Channels a tile of the integer products (a repacked matrix's tile): 16 with AVX-512, 8 with AVX2.
extern "C" int jaxstation_int_channels() { return kIntCh; }

// Per repacked format, the integer matmul: IntMatmulQ8_0R, IntMatmulQ4_0R, ...
#define JAXSTATION_PACKED_FORMAT(F)                                                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(IntMatmul##F##R, PackedMatmul<Int##F>,                                      \
                                ffi::Ffi::Bind()                                                            \
                                    .Ctx<ffi::ThreadPool>()                                                 \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                           \
                                    .Arg<ffi::Buffer<ffi::U8>>()                                            \
                                    .Ret<ffi::Buffer<ffi::F32>>());

JAXSTATION_PACKED_FORMAT(Q8_0)
JAXSTATION_PACKED_FORMAT(Q4_0)
JAXSTATION_PACKED_FORMAT(Q4_1)
JAXSTATION_PACKED_FORMAT(Q5_0)
JAXSTATION_PACKED_FORMAT(Q5_1)
JAXSTATION_PACKED_FORMAT(Q4_K)
JAXSTATION_PACKED_FORMAT(Q5_K)
JAXSTATION_PACKED_FORMAT(Q6_K)
// Per block format, the integer matmul: IntMatmulQ4_0, IntMatmulQ4_1, ...
#define JAXSTATION_INT_FORMAT(F)                                                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(IntMatmul##F, IntMatmul<Int##F>,                                           \
                                ffi::Ffi::Bind()                                                            \
                                    .Ctx<ffi::ThreadPool>()                                                 \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                           \
                                    .Arg<ffi::Buffer<ffi::U8>>()                                            \
                                    .Ret<ffi::Buffer<ffi::F32>>());

JAXSTATION_INT_FORMAT(Q4_0)
JAXSTATION_INT_FORMAT(Q4_1)
JAXSTATION_INT_FORMAT(Q5_0)
JAXSTATION_INT_FORMAT(Q5_1)
JAXSTATION_INT_FORMAT(Q8_0)
JAXSTATION_INT_FORMAT(Q4_K)
JAXSTATION_INT_FORMAT(Q5_K)
JAXSTATION_INT_FORMAT(Q6_K)
