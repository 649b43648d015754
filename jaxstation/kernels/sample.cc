#include <functional>

#include "cpu_kernels.h"

namespace {

// Sampling one token per row: temperature, the top-k, top-p and min-p cut-offs, and an inverse-CDF draw with one
// uniform per row. Each row reads only its own logits and parameters and runs one fixed sequence of operations, so
// its token depends on nothing else in the call; the float sums are in double, in fixed lane orders that are the same
// with AVX-512 and AVX2.
//
// After temperature (x = logit / T, float32) a row keeps exactly the tokens with x >= cut, where cut is the largest
// of: the k-th largest x (top-k); the x at the last position, in descending order, whose mass before it is below
// top_p of the row's total (top-p: the shortest prefix that reaches top_p, ties at the cut kept); and the smallest
// float >= max + log(min_p) (min-p: p >= min_p * p_max). Masses are exp(x - max) in double. The cut-offs are found
// without a sort: a histogram of the order-preserving int32 keys of x over a key interval (at most 2048 buckets of a
// power-of-two number of keys), walked from the top until the count or the mass reaches the goal, then the one bucket
// that holds the cut is sorted (when small) or split again. The first interval is the values within kHead of the
// max, which holds the cut-offs of any but the flattest distributions; the rest of the row is searched only when it
// does not. The draw walks the kept tokens in vocabulary order: the mass of each block of kBlock tokens, then the
// first token whose running mass exceeds u times the kept total.

constexpr int kBucketBits = 11;   // at most 2^11 buckets a histogram
constexpr int64_t kSortMax = 256; // a bucket of at most this many members is sorted, a larger one split again
constexpr float kHead = 16.0f;    // the first interval: values within this of the row's max
constexpr int64_t kBlock = 256;   // the draw's block of the vocabulary (a multiple of 8)
constexpr int64_t kSparse = 64;   // a block with at most this many kept tokens computes only theirs
constexpr double kExpFloor = -708.0;  // exp(t) for t below this counts as 0 (and t = -inf, NaN)

// Order-preserving int32 keys of float32 (-NaN lowest, then -inf ... -0, +0 ... +inf, +NaN), and back.
inline int32_t Key(float f) {
  int32_t v;
  std::memcpy(&v, &f, 4);
  return v ^ ((v >> 31) & 0x7FFFFFFF);
}
inline float Value(int32_t k) {
  const int32_t v = k ^ ((k >> 31) & 0x7FFFFFFF);
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline __m256i Keys(__m256 x) {
  const __m256i v = _mm256_castps_si256(x);
  return _mm256_xor_si256(v, _mm256_and_si256(_mm256_srai_epi32(v, 31), _mm256_set1_epi32(0x7FFFFFFF)));
}
// Bit l set where lo <= key l <= hi.
inline uint32_t Within(__m256i key, int32_t lo, int32_t hi) {
  const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), key);
  const __m256i above = _mm256_cmpgt_epi32(key, _mm256_set1_epi32(hi));
  return 0xFFu & ~static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_or_si256(below, above))));
}
// Bit l set where x l >= cut.
inline uint32_t AtLeast(__m256 x, float cut) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(cut), _CMP_GE_OQ)));
}

// exp(t) for t <= 0 in double: t = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor series to r^13 (truncation below
// 1e-17), times 2^n. The scalar and the vector forms are the same operations, so they give the same bits.
constexpr double kLog2e = 1.4426950408889634, kLn2Hi = 0.6931471805599453, kLn2Lo = 2.3190468138462996e-17;
constexpr double kShift = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer held in the low bits
constexpr double kTaylor[14] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                                1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600,
                                1.0 / 6227020800};

inline double ExpScalar(double t) {
  if (!(t >= kExpFloor)) return 0.0;
  const double z = std::fma(t, kLog2e, kShift);
  const double n = z - kShift;
  double r = std::fma(-n, kLn2Hi, t);
  r = std::fma(-n, kLn2Lo, r);
  double p = kTaylor[13];
  for (int i = 12; i >= 0; --i) p = std::fma(p, r, kTaylor[i]);
  int64_t bits;
  std::memcpy(&bits, &z, 8);
  bits = static_cast<int64_t>(static_cast<uint64_t>(bits + 1023) << 52);
  double scale;
  std::memcpy(&scale, &bits, 8);
  return p * scale;
}

// Eight doubles: one AVX-512 vector, or two AVX2 ones.
#if defined(__AVX512F__)
struct D8 {
  __m512d v;
};
inline D8 Splat(double a) { return {_mm512_set1_pd(a)}; }
inline D8 Widen(__m256 x) { return {_mm512_cvtps_pd(x)}; }
inline D8 Add(D8 a, D8 b) { return {_mm512_add_pd(a.v, b.v)}; }
inline D8 Sub(D8 a, D8 b) { return {_mm512_sub_pd(a.v, b.v)}; }
inline D8 Mul(D8 a, D8 b) { return {_mm512_mul_pd(a.v, b.v)}; }
inline D8 Fma(D8 a, D8 b, D8 c) { return {_mm512_fmadd_pd(a.v, b.v, c.v)}; }
inline D8 KeepGe(D8 e, D8 a, D8 b) { return {_mm512_maskz_mov_pd(_mm512_cmp_pd_mask(a.v, b.v, _CMP_GE_OQ), e.v)}; }
inline D8 TwoTo(D8 z) {  // 2^n from z = n + kShift
  const __m512i bits = _mm512_add_epi64(_mm512_castpd_si512(z.v), _mm512_set1_epi64(1023));
  return {_mm512_castsi512_pd(_mm512_slli_epi64(bits, 52))};
}
inline void Store(double* p, D8 a) { _mm512_storeu_pd(p, a.v); }
#else
struct D8 {
  __m256d lo, hi;
};
inline D8 Splat(double a) { return {_mm256_set1_pd(a), _mm256_set1_pd(a)}; }
inline D8 Widen(__m256 x) {
  return {_mm256_cvtps_pd(_mm256_castps256_ps128(x)), _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))};
}
inline D8 Add(D8 a, D8 b) { return {_mm256_add_pd(a.lo, b.lo), _mm256_add_pd(a.hi, b.hi)}; }
inline D8 Sub(D8 a, D8 b) { return {_mm256_sub_pd(a.lo, b.lo), _mm256_sub_pd(a.hi, b.hi)}; }
inline D8 Mul(D8 a, D8 b) { return {_mm256_mul_pd(a.lo, b.lo), _mm256_mul_pd(a.hi, b.hi)}; }
inline D8 Fma(D8 a, D8 b, D8 c) { return {_mm256_fmadd_pd(a.lo, b.lo, c.lo), _mm256_fmadd_pd(a.hi, b.hi, c.hi)}; }
inline D8 KeepGe(D8 e, D8 a, D8 b) {
  return {_mm256_and_pd(e.lo, _mm256_cmp_pd(a.lo, b.lo, _CMP_GE_OQ)),
          _mm256_and_pd(e.hi, _mm256_cmp_pd(a.hi, b.hi, _CMP_GE_OQ))};
}
inline D8 TwoTo(D8 z) {
  const __m256i one = _mm256_set1_epi64x(1023);
  const __m256i lo = _mm256_add_epi64(_mm256_castpd_si256(z.lo), one);
  const __m256i hi = _mm256_add_epi64(_mm256_castpd_si256(z.hi), one);
  return {_mm256_castsi256_pd(_mm256_slli_epi64(lo, 52)), _mm256_castsi256_pd(_mm256_slli_epi64(hi, 52))};
}
inline void Store(double* p, D8 a) { _mm256_storeu_pd(p, a.lo), _mm256_storeu_pd(p + 4, a.hi); }
#endif

inline D8 Exp(D8 t) {
  const D8 z = Fma(t, Splat(kLog2e), Splat(kShift));
  const D8 n = Sub(z, Splat(kShift));
  D8 r = Fma(Sub(Splat(0.0), n), Splat(kLn2Hi), t);
  r = Fma(Sub(Splat(0.0), n), Splat(kLn2Lo), r);
  D8 p = Splat(kTaylor[13]);
  for (int i = 12; i >= 0; --i) p = Fma(p, r, Splat(kTaylor[i]));
  return KeepGe(Mul(p, TwoTo(z)), t, Splat(kExpFloor));
}

// The one horizontal sum of eight lane sums.
inline double Lanes(const double* a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// A row after temperature: x [n] (n a multiple of kBlock, padded with -NaN, which no interval, cut or mass counts),
// and its max.
struct Row {
  const float* x;
  int64_t n;
  float max;
  double m;  // max, in double
  double Mass(float v) const { return ExpScalar(static_cast<double>(v) - m); }
};

// What a cut-off looks for, in descending order of x: top-k the position k - 1; top-p the last position whose mass
// before it is below `mass`.
struct Goal {
  bool by_mass;
  int64_t k;
  double mass;
};
struct Above {  // what lies above the keys still to search
  int64_t count = 0;
  double mass = 0.0;
};
inline bool Reaches(const Goal& g, const Above& above, int64_t count, double mass) {
  return g.by_mass ? above.mass + mass >= g.mass : above.count + count >= g.k;
}

// Counts (and, by_mass, masses) of the row's values with keys in [lo, hi], by bucket (key - lo) >> shift, in index
// order. With `total`, also the mass of the whole row, in lanes i mod 8.
void Fill(const Row& r, int32_t lo, int32_t hi, int shift, bool by_mass, int64_t* count, double* mass,
          double* total) {
  D8 lanes = Splat(0.0);
  alignas(64) double e[8];
  alignas(32) int32_t key[8];
  const D8 m = Splat(r.m);
  for (int64_t i = 0; i < r.n; i += 8) {
    const __m256 x = _mm256_loadu_ps(r.x + i);
    const __m256i k = Keys(x);
    uint32_t in = Within(k, lo, hi);
    if (total) {
      const D8 ex = Exp(Sub(Widen(x), m));
      lanes = Add(lanes, ex);
      if (in) Store(e, ex);
    } else if (in && by_mass) {
      Store(e, Exp(Sub(Widen(x), m)));
    }
    if (!in) continue;
    _mm256_store_si256(reinterpret_cast<__m256i*>(key), k);
    for (; in; in &= in - 1) {
      const int l = __builtin_ctz(in);
      const uint32_t b = (static_cast<uint32_t>(key[l]) - static_cast<uint32_t>(lo)) >> shift;
      ++count[b];
      if (by_mass) mass[b] += e[l];
    }
  }
  if (total) {
    alignas(64) double sums[8];
    Store(sums, lanes);
    *total = Lanes(sums);
  }
}

// The cut among the members of one bucket (keys in [lo, hi]), sorted: top-k's position, or top-p's last position
// whose mass before it is below the goal (the first member's always is).
float SortedCut(const Row& r, const Goal& g, int32_t lo, int32_t hi, const Above& above) {
  std::vector<int32_t> keys;
  for (int64_t i = 0; i < r.n; i += 8) {
    const __m256i k = Keys(_mm256_loadu_ps(r.x + i));
    for (uint32_t in = Within(k, lo, hi); in; in &= in - 1) keys.push_back(Key(r.x[i + __builtin_ctz(in)]));
  }
  std::sort(keys.begin(), keys.end(), std::greater<int32_t>());
  if (!g.by_mass) return Value(keys[std::min<int64_t>(g.k - 1 - above.count, keys.size() - 1)]);
  double before = above.mass;
  int32_t cut = keys[0];
  for (const int32_t k : keys) {
    if (!(before < g.mass)) break;
    cut = k;
    before += r.Mass(Value(k));
  }
  return Value(cut);
}

// Searches keys [lo, hi] downward for the goal's cut, `above` holding what lies above hi; advances `above` past
// the interval when the cut is not in it. With `must` (the cut is known to lie here), rounding that leaves the goal
// unreached ends at the lowest member. With `total`, the pass also sums the whole row's mass, and the goal's mass is
// `fraction` of it.
bool Search(const Row& r, Goal& g, int32_t lo, int32_t hi, Above& above, bool must, float* cut,
            double fraction = 0.0, bool total = false) {
  const uint32_t span = static_cast<uint32_t>(hi) - static_cast<uint32_t>(lo);
  const int width = span ? 32 - __builtin_clz(span) : 0;
  const int shift = std::max(0, width - kBucketBits);
  const int64_t buckets = (span >> shift) + 1;
  std::vector<int64_t> count(buckets, 0);
  std::vector<double> mass(g.by_mass ? buckets : 0, 0.0);
  double sum = 0.0;
  Fill(r, lo, hi, shift, g.by_mass, count.data(), mass.data(), total ? &sum : nullptr);
  if (total) g.mass = fraction * sum;
  int64_t found = -1, last = -1;
  Above at_last;
  for (int64_t b = buckets - 1; b >= 0; --b) {
    if (!count[b]) continue;
    const double m = g.by_mass ? mass[b] : 0.0;
    if (Reaches(g, above, count[b], m)) {
      found = b;
      break;
    }
    last = b, at_last = above;
    above.count += count[b], above.mass += m;
  }
  if (found < 0) {
    if (!must || last < 0) return false;
    found = last, above = at_last;
  }
  const int32_t klo = static_cast<int32_t>(static_cast<uint32_t>(lo) + (static_cast<uint32_t>(found) << shift));
  const int32_t khi = static_cast<int32_t>(std::min<int64_t>(int64_t{klo} + (int64_t{1} << shift) - 1, hi));
  if (klo == khi) {
    *cut = Value(klo);
  } else if (count[found] <= kSortMax) {
    *cut = SortedCut(r, g, klo, khi, above);
  } else {
    Search(r, g, klo, khi, above, true, cut);
  }
  return true;
}

// A cut-off's value, or `floor` where it lies below floor (the other cut-offs keep nothing below it). The head
// [max - kHead, max] above the floor is searched first, then the rest above the floor. A top-p goal's mass is
// `fraction` of the row's total, which the head's pass sums.
float Cut(const Row& r, Goal g, float floor, double fraction = 0.0) {
  const int32_t hi = Key(r.max), bottom = Key(floor);
  const int32_t lo = std::max(Key(r.max - kHead), bottom);
  Above above;
  float cut;
  if (Search(r, g, lo, hi, above, false, &cut, fraction, g.by_mass)) return cut;
  if (lo > bottom && Search(r, g, bottom, lo - 1, above, false, &cut)) return cut;
  return floor;
}

// The smallest float f with f >= max + log(min_p) in double.
float MinPCut(double m, float min_p) {
  const double bound = m + std::log(static_cast<double>(min_p));
  float f = static_cast<float>(bound);
  if (static_cast<double>(f) < bound) f = std::nextafter(f, INFINITY);
  return f;
}

// The mass of the kept tokens (x >= cut) of one block [i, i + kBlock), in lanes i mod 8: only the kept tokens' where
// they are few, all of them (a dropped one adds +0) where they are many; the same bits either way.
double BlockMass(const Row& r, int64_t i, float cut) {
  uint32_t kept[kBlock / 8];
  int64_t n = 0;
  for (int64_t j = 0; j < kBlock / 8; ++j) {
    kept[j] = AtLeast(_mm256_loadu_ps(r.x + i + 8 * j), cut);
    n += __builtin_popcount(kept[j]);
  }
  if (!n) return 0.0;
  alignas(64) double lanes[8] = {};
  if (n <= kSparse) {
    for (int64_t j = 0; j < kBlock / 8; ++j)
      for (uint32_t in = kept[j]; in; in &= in - 1) {
        const int l = __builtin_ctz(in);
        lanes[l] += r.Mass(r.x[i + 8 * j + l]);
      }
    return Lanes(lanes);
  }
  D8 sum = Splat(0.0);
  const D8 m = Splat(r.m), c = Splat(static_cast<double>(cut));
  for (int64_t j = 0; j < kBlock; j += 8) {
    const D8 x = Widen(_mm256_loadu_ps(r.x + i + j));
    sum = Add(sum, KeepGe(Exp(Sub(x, m)), x, c));
  }
  Store(lanes, sum);
  return Lanes(lanes);
}

// The token whose kept mass, walked in vocabulary order, first exceeds u times the kept total. `blocks`: scratch for
// n / kBlock block masses.
int32_t Draw(const Row& r, float cut, double u, double* blocks) {
  const int64_t n_blocks = r.n / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < n_blocks; ++b) total += blocks[b] = BlockMass(r, b * kBlock, cut);
  const double target = u * total;
  double before = 0.0;
  int64_t chosen = -1;
  double at_chosen = 0.0;
  for (int64_t b = 0; b < n_blocks; ++b) {
    if (blocks[b] <= 0.0) continue;
    chosen = b, at_chosen = before;
    if (before + blocks[b] > target) break;
    before += blocks[b];
  }
  if (chosen < 0) return -1;
  int32_t last = -1;
  double running = at_chosen;
  for (int64_t i = chosen * kBlock; i < (chosen + 1) * kBlock; ++i) {
    if (!(r.x[i] >= cut)) continue;
    const double e = r.Mass(r.x[i]);
    if (e <= 0.0) continue;
    last = static_cast<int32_t>(i);
    running += e;
    if (running > target) break;
  }
  return last;
}

struct Params {
  float temperature, top_p, min_p;
  int32_t top_k;
  uint32_t bits[2];
};

// x = logits / temperature into the scratch row (padded with -NaN to n_pad), and its max (NaN skipped).
float Scale(const float* logits, int64_t n, float temperature, float* x, int64_t n_pad) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  const __m256 t = _mm256_set1_ps(temperature);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(logits + i), t);
    _mm256_storeu_ps(x + i, v);
    top = _mm256_max_ps(v, top);  // a NaN v gives top
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float max = -INFINITY;
  for (float v : lanes) max = std::max(max, v);
  for (; i < n; ++i) {
    x[i] = logits[i] / temperature;
    if (x[i] > max) max = x[i];
  }
  const float nan = Value(INT32_MIN);
  for (; i < n_pad; ++i) x[i] = nan;
  return max + 0.0f;  // a zero max as +0, whose key is above -0's
}

// One sampled row's token; *kept_from is its cut (it keeps x >= cut).
int32_t SampleRow(const float* logits, int64_t n, const Params& p, float* kept_from) {
  const int64_t n_pad = (n + kBlock - 1) / kBlock * kBlock;
  thread_local std::vector<float> scratch;
  thread_local std::vector<double> blocks;
  if (static_cast<int64_t>(scratch.size()) < n_pad) scratch.resize(n_pad), blocks.resize(n_pad / kBlock);
  const float max = Scale(logits, n, p.temperature, scratch.data(), n_pad);
  const Row r{scratch.data(), n_pad, max, static_cast<double>(max)};
  const auto first_max = [&] { return static_cast<int32_t>((std::find(r.x, r.x + n, max) - r.x) % n); };
  *kept_from = max;
  if (!(max > -INFINITY) || max == INFINITY) return first_max();  // nothing to weigh
  float cut = p.min_p > 0.0f ? MinPCut(r.m, p.min_p) : -INFINITY;
  if (p.top_k > 0 && p.top_k < n) cut = std::max(cut, Cut(r, Goal{false, p.top_k, 0.0}, cut));
  if (p.top_p < 1.0f) cut = std::max(cut, Cut(r, Goal{true, 0, 0.0}, cut, p.top_p));
  *kept_from = cut;
  const uint64_t u53 = (uint64_t{p.bits[0]} << 21) | (p.bits[1] >> 11);
  const int32_t token = Draw(r, cut, static_cast<double>(u53) * 0x1p-53, blocks.data());
  return token >= 0 ? token : first_max();
}

ffi::Error SampleImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                      ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> min_p,
                      ffi::Buffer<ffi::U32> bits, ffi::ResultBuffer<ffi::S32> tokens,
                      ffi::ResultBuffer<ffi::F32> cuts) {
  const auto d = logits.dimensions();
  if (d.size() != 2 || d[1] < 1)
    return ffi::Error::InvalidArgument("sample: logits [M, N]");
  const int64_t rows = d[0], n = d[1];
  if (temperature.element_count() != size_t(rows) || top_k.element_count() != size_t(rows) ||
      top_p.element_count() != size_t(rows) || min_p.element_count() != size_t(rows) ||
      bits.element_count() != size_t(2 * rows) || tokens->element_count() != size_t(rows) ||
      cuts->element_count() != size_t(rows))
    return ffi::Error::InvalidArgument("sample: temperature, top_k, top_p, min_p, tokens, cuts [M], bits [M, 2]");
  std::vector<int64_t> sampled;
  for (int64_t r = 0; r < rows; ++r)
    if (temperature.typed_data()[r] > 0.0f) sampled.push_back(r);
    else tokens->typed_data()[r] = 0, cuts->typed_data()[r] = 0.0f;
  ParallelFor(pool, static_cast<int64_t>(sampled.size()), [&](int64_t j) {
    const int64_t r = sampled[j];
    const Params p{temperature.typed_data()[r], top_p.typed_data()[r], min_p.typed_data()[r],
                   top_k.typed_data()[r], {bits.typed_data()[2 * r], bits.typed_data()[2 * r + 1]}};
    tokens->typed_data()[r] = SampleRow(logits.typed_data() + r * n, n, p, cuts->typed_data() + r);
  });
  return ffi::Error::Success();
}

// Threefry-2x32 with 20 rounds on (x0, x1) under the key (k0, k1), as JAX's CPU lowering computes it.
void Threefry(uint32_t k0, uint32_t k1, uint32_t& x0, uint32_t& x1) {
  static constexpr int kRotations[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  x0 += ks[0], x1 += ks[1];
  for (uint32_t i = 0; i < 5; ++i) {
    for (const int r : kRotations[i % 2]) x0 += x1, x1 = (x1 << r) | (x1 >> (32 - r)), x1 ^= x0;
    x0 += ks[(i + 1) % 3], x1 += ks[(i + 2) % 3] + i + 1;
  }
}

// Each row's 64 random bits, those of `jax.random.bits(jax.random.fold_in(jax.random.PRNGKey(seed), counter), (2,),
// jnp.uint32)` (`engine/sampling.row_bits`, JAX's partitionable Threefry): the key (0, seed) folded with (0, counter)
// gives the key the two bit words are hashed under, each the xor of the hash of (0, i). One call, where XLA's lowering
// (a loop of hash rounds) was an eighth of a tiny model's step compile. seed [M] uint32, counter [M] int32 ->
// bits [M, 2] uint32.
ffi::Error RowBitsImpl(ffi::Buffer<ffi::U32> seed, ffi::Buffer<ffi::S32> counter, ffi::ResultBuffer<ffi::U32> bits) {
  const size_t rows = seed.element_count();
  if (counter.element_count() != rows || bits->element_count() != 2 * rows)
    return ffi::Error::InvalidArgument("row_bits: seed, counter [M], bits [M, 2]");
  for (size_t r = 0; r < rows; ++r) {
    uint32_t k0 = 0, k1 = static_cast<uint32_t>(counter.typed_data()[r]);
    Threefry(0, seed.typed_data()[r], k0, k1);
    for (uint32_t i = 0; i < 2; ++i) {
      uint32_t hi = 0, lo = i;
      Threefry(k0, k1, hi, lo);
      bits->typed_data()[2 * r + i] = hi ^ lo;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowBits, RowBitsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Sample, SampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
