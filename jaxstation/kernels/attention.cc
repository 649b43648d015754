// Decode attention of each query row over its own arena lane's positions, each row's result depending on nothing but
// its own lane; a prefill chunk's rows share their key and value loads (DecodeAttentionImpl below).

#include "cpu_kernels.h"

namespace {

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

// A lane's positions lie kv_heads * head_dim floats apart, one head's slice of each a few cache lines: the walks
// over keys and values ask for the slice kAhead positions on (into L2), so that many lines are in flight at once.
constexpr int64_t kAhead = 64;
inline void Prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, _MM_HINT_T1);
}

// One head's key or value at one slot, as stored in the arena (float32, bfloat16 as uint16_t, or int8 with its
// float32 scale); Load(c) widens its vector c to float32 exactly as the arena's read does (LayerKV.read: bfloat16
// exactly, int8 to float32 then one float32 multiply by the scale), so every later operation is the float32 walk's.
template <typename T>
struct Row;
template <>
struct Row<float> {
  const float* p;
  Row(const float* at, const float*, int64_t) : p(at) {}
  Vec Load(int64_t c) const { return LoadX(p + c * kLanes); }
};
template <>
struct Row<uint16_t> {
  const uint16_t* p;
  Row(const uint16_t* at, const float*, int64_t) : p(at) {}
  Vec Load(int64_t c) const { return LoadBf16(p + c * kLanes); }
};
template <>
struct Row<int8_t> {
  const int8_t* p;
  Vec scale;
  Row(const int8_t* at, const float* scales, int64_t s) : p(at), scale(Set1(scales[s])) {}
  Vec Load(int64_t c) const { return Mul(LoadW(p + c * kLanes), scale); }
};

// A lane's keys or values for one head, walked from a row's first position: position i of the walk lies at slot
// first + i, taken modulo `wrap` slots (a windowed layer's ring; a full buffer never wraps), slots `stride` elements
// apart from `base` (slot 0), their int8 scales `scale_stride` floats apart from `scales` (unused otherwise). Where a
// slot lies never changes the operations on it.
template <typename T>
struct Slots {
  const T* base;
  const float* scales;
  int64_t stride, scale_stride, first, wrap;
  int64_t Slot(int64_t i) const {
    const int64_t slot = first + i;
    return slot < wrap ? slot : slot - wrap;
  }
  const T* At(int64_t i) const { return base + Slot(i) * stride; }
  Row<T> operator[](int64_t i) const { return Row<T>(At(i), scales, Slot(i) * scale_stride); }
};

// The attention's scores for a group of query heads: scores[g * ld + i] = scale * q_g . k_i over n positions, each dot
// in the matmul kernel's order (two accumulators over alternate vectors, then Finish's sum): kLanes positions at a
// time, their horizontal sums folded together (FoldLanes: Finish's bits, so a score's bits do not depend on where a
// walk starts). NV vectors a head; the heads go side by side with their queries in registers, so each key vector is
// read once for all of them. q: [group, NV * kLanes]; k: the walk's keys (Slots); scores: [group, ld].
template <int NV, typename T>
inline void Dot(const Vec* q, const Row<T>& k, Vec& even, Vec& odd) {
  even = Zero(), odd = Zero();
  for (int c = 0; c < NV; c += 2) {
    even = Fma(q[c], k.Load(c), even);
    if (c + 1 < NV) odd = Fma(q[c + 1], k.Load(c + 1), odd);
  }
}

template <int NV, typename T>
void Scores(const float* q, int64_t group, const Slots<T>& k, int64_t n, int64_t ld, float scale, float* scores) {
  constexpr int64_t kHeads = std::max(1, 16 / NV);
  for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const int64_t heads = std::min(kHeads, group - g0);
    Vec qv[kHeads][NV];
    for (int64_t g = 0; g < heads; ++g)
      for (int c = 0; c < NV; ++c) qv[g][c] = LoadX(q + (g0 + g) * NV * kLanes + c * kLanes);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      if (g0 == 0)
        for (int64_t p = 0; p < kLanes && i + kAhead + p < n; ++p)
          Prefetch(k.At(i + kAhead + p), NV * kLanes * sizeof(T));
      Vec s[kHeads][kLanes];
      for (int64_t p = 0; p < kLanes; ++p)  // position i + p into the input that lands in lane p
        for (int64_t g = 0; g < heads; ++g) {
          Vec even, odd;
          Dot<NV, T>(qv[g], k[i + p], even, odd);
          s[g][kSlot.slot[p]] = Add(even, odd);
        }
      for (int64_t g = 0; g < heads; ++g) Store(scores + (g0 + g) * ld + i, Mul(FoldLanes(s[g]), Set1(scale)));
    }
    for (; i < n; ++i)
      for (int64_t g = 0; g < heads; ++g) {
        Vec even, odd;
        Dot<NV, T>(qv[g], k[i], even, odd);
        scores[(g0 + g) * ld + i] = Finish(even, odd) * scale;
      }
  }
}

// Scores for any number of vectors a head (up to 32), one head at a time.
template <typename T>
void ScoresAny(const float* q, int64_t group, int64_t nv, const Slots<T>& k, int64_t n, int64_t ld, float scale,
               float* scores) {
  const auto dot = [&](const float* qr, const Row<T>& kr) {
    Vec even = Zero(), odd = Zero();
    for (int64_t c = 0; c < nv; c += 2) {
      even = Fma(LoadX(qr + c * kLanes), kr.Load(c), even);
      if (c + 1 < nv) odd = Fma(LoadX(qr + (c + 1) * kLanes), kr.Load(c + 1), odd);
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
      Store(scores + g * ld + i, Mul(FoldLanes(s), Set1(scale)));
    }
    for (; i < n; ++i) {
      const auto [even, odd] = dot(qg, k[i]);
      scores[g * ld + i] = Finish(even, odd) * scale;
    }
  }
}

template <typename T>
void ScoresFor(int64_t nv, const float* q, int64_t group, const Slots<T>& k, int64_t n, int64_t ld, float scale,
               float* scores) {
  switch (nv) {
    case 1: return Scores<1>(q, group, k, n, ld, scale, scores);
    case 2: return Scores<2>(q, group, k, n, ld, scale, scores);
    case 3: return Scores<3>(q, group, k, n, ld, scale, scores);
    case 4: return Scores<4>(q, group, k, n, ld, scale, scores);
    case 8: return Scores<8>(q, group, k, n, ld, scale, scores);
    case 16: return Scores<16>(q, group, k, n, ld, scale, scores);
    default: return ScoresAny(q, group, nv, k, n, ld, scale, scores);
  }
}

// A group's scores [group, n] into softmax weights in place, their denominators into denom[group]: each row's maximum,
// e^(score - maximum) kLanes at a time (the tail through a padded vector, so every score takes the same exp), each
// denominator summed in position order.
inline void Softmax(float* scores, int64_t group, int64_t n, float* denom) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    Vec mv = Set1(sg[0]);
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) mv = Max(mv, LoadX(sg + j));
    float lanes_max[kLanes];
    Store(lanes_max, mv);
    float m = *std::max_element(lanes_max, lanes_max + kLanes);
    for (; j < n; ++j) m = std::max(m, sg[j]);
    mv = Set1(m);
    for (j = 0; j + kLanes <= n; j += kLanes) Store(sg + j, ExpNonPositive(Sub(LoadX(sg + j), mv)));
    if (j < n) {
      float tail[kLanes];
      for (int64_t t = 0; t < kLanes; ++t) tail[t] = j + t < n ? sg[j + t] - m : 0.0f;
      Store(tail, ExpNonPositive(LoadX(tail)));
      for (int64_t t = 0; j + t < n; ++t) sg[j + t] = tail[t];
    }
  }
  for (int64_t g = 0; g < group; ++g) denom[g] = 0.0f;
  for (int64_t j = 0; j < n; ++j)  // the group's chains side by side
    for (int64_t g = 0; g < group; ++g) denom[g] += scores[g * n + j];
}

// acc_g += sum_i p[g * ld + i] v_i over n positions for a group of query heads, each head's chain of multiply-adds in
// position order (a walk split into consecutive parts gives the same bits as one). NV vectors a head; the heads go side
// by side, as many at a time as keep their accumulators in registers, so each value vector is read once for all of
// them and their chains overlap. v: the walk's values (Slots); acc: [group, NV * kLanes].
template <int NV, int H, typename T>
void WeightedHeads(const float* p, int64_t ld, int64_t n, const Slots<T>& v, float* acc, bool prefetch) {
  Vec a[H][NV];
  for (int g = 0; g < H; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = LoadX(acc + (g * NV + c) * kLanes);
  for (int64_t i = 0; i < n; ++i) {
    if (prefetch && i % kLanes == 0)
      for (int64_t b = i + kAhead; b < std::min(n, i + kAhead + kLanes); ++b)
        Prefetch(v.At(b), NV * kLanes * sizeof(T));
    const Row<T> vi = v[i];
    Vec x[NV];
    for (int c = 0; c < NV; ++c) x[c] = vi.Load(c);
    for (int g = 0; g < H; ++g) {
      const Vec w = Set1(p[g * ld + i]);
      for (int c = 0; c < NV; ++c) a[g][c] = Fma(w, x[c], a[g][c]);
    }
  }
  for (int g = 0; g < H; ++g)
    for (int c = 0; c < NV; ++c) Store(acc + (g * NV + c) * kLanes, a[g][c]);
}

// WeightedHeads for `heads` (1 to 8) heads, their number a constant so that the accumulators stay in registers.
template <int NV, typename T, int H = 1>
void WeightedHeadsFor(int64_t heads, const float* p, int64_t ld, int64_t n, const Slots<T>& v, float* acc,
                      bool prefetch) {
  if constexpr (H < 8 && H < std::max(1, 24 / NV))
    if (heads > H) return WeightedHeadsFor<NV, T, H + 1>(heads, p, ld, n, v, acc, prefetch);
  WeightedHeads<NV, H, T>(p, ld, n, v, acc, prefetch);
}

template <int NV, typename T>
void WeightedSum(const float* p, int64_t ld, int64_t n, int64_t group, const Slots<T>& v, float* acc) {
  constexpr int64_t kHeads = std::max(1, 24 / NV);
  for (int64_t g0 = 0; g0 < group; g0 += kHeads)
    WeightedHeadsFor<NV, T>(std::min(kHeads, group - g0), p + g0 * ld, ld, n, v, acc + g0 * NV * kLanes, g0 == 0);
}

// WeightedSum for any number of vectors a head (up to 32), one head at a time.
template <typename T>
void WeightedSumAny(const float* p, int64_t ld, int64_t n, int64_t group, int64_t nv, const Slots<T>& v, float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    Vec a[32];
    for (int64_t c = 0; c < nv; ++c) a[c] = LoadX(acc + g * nv * kLanes + c * kLanes);
    for (int64_t i = 0; i < n; ++i) {
      const Vec w = Set1(p[g * ld + i]);
      const Row<T> vi = v[i];
      for (int64_t c = 0; c < nv; ++c) a[c] = Fma(w, vi.Load(c), a[c]);
    }
    for (int64_t c = 0; c < nv; ++c) Store(acc + g * nv * kLanes + c * kLanes, a[c]);
  }
}

template <typename T>
void WeightedSumFor(int64_t nv, const float* p, int64_t ld, int64_t n, int64_t group, const Slots<T>& v, float* acc) {
  switch (nv) {
    case 1: return WeightedSum<1>(p, ld, n, group, v, acc);
    case 2: return WeightedSum<2>(p, ld, n, group, v, acc);
    case 3: return WeightedSum<3>(p, ld, n, group, v, acc);
    case 4: return WeightedSum<4>(p, ld, n, group, v, acc);
    case 8: return WeightedSum<8>(p, ld, n, group, v, acc);
    case 16: return WeightedSum<16>(p, ld, n, group, v, acc);
    default: return WeightedSumAny(p, ld, n, group, nv, v, acc);
  }
}

// The positions a tiled task walks at a time: one block of a head's keys (then values) stays in cache while each of the
// task's rows takes the part of it that lies in its own range (32 KB, an L1's worth, at head_dim 256; 64 positions
// ran slower at Gemma 3's shapes).
constexpr int64_t kBlock = 32;
constexpr int64_t kScores = int64_t{1} << 22;  // floats (16 MB) of scores a tiled task keeps at most

// One layer's attention call: q [rows, heads, hd]; k, v [layers, lanes, seq, kv_heads, hd] of T, with int8 their
// scales k_scale, v_scale [layers, lanes, seq, kv_heads]; out [rows, heads, hd].
template <typename T>
struct Attention {
  const float* q;
  const T *k, *v;
  const float *k_scale, *v_scale;
  float* out;
  const int32_t *lane, *pos;
  int64_t heads, hd, kvh, group, nv, n_lanes, seq, layer, window, ring, scratch_pos;
  float scale;

  // A row at the lane's last position (the scratch slot idle rows write, which no request uses) reads only itself.
  bool Scratch(int64_t r) const { return pos[r] == scratch_pos; }
  int64_t Lo(int64_t r) const {  // the first position row r attends to; the last is pos[r]
    return Scratch(r) ? pos[r] : window > 0 ? std::max<int64_t>(0, pos[r] - window + 1) : 0;
  }
  // Row r's lane's keys or values (kv, their scales sc) for head h, walked from position a.
  Slots<T> Walk(const T* kv, const float* sc, int64_t r, int64_t h, int64_t a) const {
    const int64_t slot0 = (layer * n_lanes + lane[r]) * seq;  // the lane's slot 0
    const bool scratch = Scratch(r);
    const float* scales = std::is_same_v<T, int8_t> ? sc + slot0 * kvh + h : sc;  // only int8 reads them
    return Slots<T>{kv + slot0 * kvh * hd + h * hd, scales, kvh * hd, kvh,
                    scratch ? seq - 1 : ring ? a % ring : a, ring && !scratch ? ring : seq};
  }

  // Rows r0 .. r0 + len - 1 (one lane at consecutive positions when len > 1) and kv head h: each row's scores, softmax
  // and weighted sum are the one-row walk's, in its order, the walks taken a block of positions at a time (one block
  // for a lone row) so that the rows share each block's loads.
  void Run(int64_t r0, int64_t len, int64_t h) const {
    std::vector<int64_t> at(len + 1, 0);  // row j's scores at at[j]: [group, its n]
    for (int64_t j = 0; j < len; ++j) at[j + 1] = at[j] + group * (pos[r0 + j] - Lo(r0 + j) + 1);
    std::vector<float> scores(at[len]), denom(len * group);
    // A lone row is one block where one pass of each walk takes the group's heads side by side; else the walks go
    // kBlock positions at a time, each block read once from memory while every head takes it (a lone row asking for
    // its next block meanwhile).
    const bool whole = len == 1 && 16 / nv >= group;  // Scores' heads a pass
    const int64_t first = Lo(r0), last = pos[r0 + len - 1], block = whole ? last - first + 1 : kBlock;
    // walk(keys or values, their scales, part): part(row, j, index of position a in the row's walk, a, count)
    const auto walk = [&](const T* kv, const float* sc, auto&& part) {
      for (int64_t s = first; s <= last; s += block) {
        if (len == 1)
          for (int64_t p = s + block; p < std::min(s + 2 * block, last + 1); ++p)
            Prefetch(Walk(kv, sc, r0, h, p).At(0), hd * sizeof(T));
        for (int64_t j = 0; j < len; ++j) {
          const int64_t r = r0 + j, lo = Lo(r), a = std::max(s, lo), b = std::min<int64_t>(s + block, pos[r] + 1);
          if (a < b) part(r, j, a - lo, a, b - a);
        }
      }
    };
    const auto n = [&](int64_t j) { return (at[j + 1] - at[j]) / group; };  // row j's positions
    const auto head = [&](int64_t r) { return (r * heads + h * group) * hd; };  // the group's heads in q and out
    walk(k, k_scale, [&](int64_t r, int64_t j, int64_t i, int64_t a, int64_t m) {
      ScoresFor(nv, q + head(r), group, Walk(k, k_scale, r, h, a), m, n(j), scale, scores.data() + at[j] + i);
    });
    for (int64_t j = 0; j < len; ++j) {
      Softmax(scores.data() + at[j], group, n(j), denom.data() + j * group);
      std::fill_n(out + head(r0 + j), group * hd, 0.0f);
    }
    walk(v, v_scale, [&](int64_t r, int64_t j, int64_t i, int64_t a, int64_t m) {
      WeightedSumFor(nv, scores.data() + at[j] + i, n(j), m, group, Walk(v, v_scale, r, h, a), out + head(r));
    });
    for (int64_t j = 0; j < len; ++j)
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + head(r0 + j) + g * hd;
        const Vec inv = Set1(1.0f / denom[j * group + g]);
        for (int64_t c = 0; c < nv; ++c) Store(o + c * kLanes, Mul(LoadX(o + c * kLanes), inv));
      }
  }
};

// Decode attention of one query row per arena lane over that lane's own positions: for row r and kv head h, the
// group's query heads attend to k/v[layer, lanes[r], lo..positions[r], h] with lo = positions[r] - window + 1 (or 0),
// softmax over exactly those positions (scores by the same two-accumulator dot as the matmul, exp by one polynomial,
// sums and the weighted sum of v in position order). Each row has one fixed order of operations, so its result
// depends on nothing but its own lane. The key walk (Scores) takes kLanes positions at a time, their horizontal sums
// folded together, and both it and the value walk (WeightedSum) take the group's heads side by side; none of that
// changes any operation's order. q [rows, heads, hd]; k, v [layers, lanes, seq, kv_heads, hd] float32, bfloat16 or
// int8, each vector widened to float32 as it is loaded (Row), so a row's bits are those over the float32 read.
// With ring > 0 the layer keeps a ring: position p at slot p mod ring, and the scratch position (idle rows') at slot
// seq - 1 = ring; a row's positions then wrap around the ring at most once, walked in position order all the same.
// Consecutive rows on one lane at consecutive positions (a prefill chunk's) are a run: up to `tile` of its rows share
// one task per kv head (Attention::Run), each key and value read once for all of them; tile 1 is a task per row.
// Attend: the checks and the task split of one call, over keys and values of type T.
template <typename T>
ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v,
               ffi::Buffer<ffi::F32>& k_scale, ffi::Buffer<ffi::F32>& v_scale, ffi::Buffer<ffi::S32>& layer,
               ffi::Buffer<ffi::S32>& lanes, ffi::Buffer<ffi::S32>& positions, ffi::ResultBuffer<ffi::F32>& out,
               int64_t window, float scale, int64_t ring, int64_t scratch_pos, int64_t tile) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || v.element_count() != k.element_count() ||
      v.element_type() != k.element_type() || qd[2] != kd[4] || qd[1] % kd[3])
    return ffi::Error::InvalidArgument("decode_attention: q [rows, heads, hd], k and v [layers, lanes, seq, kvh, hd]");
  const int64_t rows = qd[0], heads = qd[1], hd = qd[2], n_layers = kd[0], n_lanes = kd[1], seq = kd[2];
  const int64_t kvh = kd[3], group = heads / kvh;
  if (std::is_same_v<T, int8_t> && (k_scale.element_count() != k.element_count() / hd ||
                                    v_scale.element_count() != k_scale.element_count()))
    return ffi::Error::InvalidArgument("decode_attention: int8 k and v need scales [layers, lanes, seq, kvh]");
  if (hd % kLanes || hd > 256 || group > 8)
    return ffi::Error::InvalidArgument("decode_attention: head_dim a multiple of 16 up to 256, group <= 8");
  if (ring ? seq != ring + 1 || window > ring : scratch_pos != seq - 1)
    return ffi::Error::InvalidArgument("decode_attention: a ring of seq - 1 slots holds the window; else scratch_pos "
                                       "is seq - 1");
  if (tile < 1) return ffi::Error::InvalidArgument("decode_attention: tile >= 1");
  const int64_t l = layer.typed_data()[0];
  const int32_t* lane = lanes.typed_data();
  const int32_t* pos = positions.typed_data();
  if (l < 0 || l >= n_layers) return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  for (int64_t r = 0; r < rows; ++r)
    if (lane[r] < 0 || lane[r] >= n_lanes || pos[r] < 0 || pos[r] > scratch_pos)
      return ffi::Error::InvalidArgument("decode_attention: lane or position out of range");
  const Attention<T> at{q.typed_data(), static_cast<const T*>(k.untyped_data()),
                        static_cast<const T*>(v.untyped_data()), k_scale.typed_data(), v_scale.typed_data(),
                        out->typed_data(), lane, pos, heads, hd, kvh, group, hd / kLanes, n_lanes, seq, l, window,
                        ring, scratch_pos, scale};
  // Each run split into near-equal tasks of at most `tile` rows whose scores take at most kScores floats, and into at
  // least two tasks a thread where it has the rows; the tasks claimed longest first (rows times the last row's
  // positions) so that the pool ends together.
  const int64_t min_tasks = (2 * (pool.num_threads() + 1) + kvh - 1) / kvh;
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (first row, rows)
  for (int64_t r = 0; r < rows;) {
    int64_t e = r + 1;
    while (e < rows && lane[e] == lane[r] && pos[e] == pos[e - 1] + 1 && pos[e] != scratch_pos) ++e;
    const int64_t len = e - r, scores = len * group * (pos[e - 1] + 1);  // the run's scores, at most
    const int64_t parts = std::max({(len + tile - 1) / tile, std::min(len, min_tasks),
                                    std::min(len, (scores + kScores - 1) / kScores)});
    for (int64_t p = 0; p < parts; ++p)
      tasks.emplace_back(r + len * p / parts, len * (p + 1) / parts - len * p / parts);
    r = e;
  }
  const auto cost = [&](const std::pair<int64_t, int64_t>& t) { return t.second * (pos[t.first + t.second - 1] + 1); };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& a, const auto& b) { return cost(a) > cost(b); });
  ParallelFor(pool, static_cast<int64_t>(tasks.size()) * kvh, [&](int64_t item) {
    const auto [r0, len] = tasks[item / kvh];
    at.Run(r0, len, item % kvh);
  });
  return ffi::Error::Success();
}

// k and v float32, bfloat16 or int8 (k_scale, v_scale [layers, lanes, seq, kvh] float32 for int8, else unread).
ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lanes,
                               ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out, int64_t window,
                               float scale, int64_t ring, int64_t scratch_pos, int64_t tile) {
  switch (k.element_type()) {
    case ffi::DataType::F32:
      return Attend<float>(pool, q, k, v, k_scale, v_scale, layer, lanes, positions, out, window, scale, ring,
                        scratch_pos, tile);
    case ffi::DataType::BF16:
      return Attend<uint16_t>(pool, q, k, v, k_scale, v_scale, layer, lanes, positions, out, window, scale, ring,
                           scratch_pos, tile);
    case ffi::DataType::S8:
      return Attend<int8_t>(pool, q, k, v, k_scale, v_scale, layer, lanes, positions, out, window, scale, ring,
                         scratch_pos, tile);
    default:
      return ffi::Error::InvalidArgument("decode_attention: k and v float32, bfloat16 or int8");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("ring")
                                  .Attr<int64_t>("scratch_pos")
                                  .Attr<int64_t>("tile"));
