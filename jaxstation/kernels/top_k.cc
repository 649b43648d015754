#include "cpu_kernels.h"

namespace {

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

// Each row's maximum and the first index that holds it, as jnp.max and sampling.first_argmax give them: a row with a
// NaN has the maximum NaN and the index N - 1; +0 and -0 are equal. Exact in any order, so one pass of vector maxima
// (and a NaN test), then a search from the start for the first value equal to it. x [M, N] -> max [M], index [M].
void RowMaxRow(const float* x, int64_t n, float* max, int32_t* index) {
  Vec m = Set1(-INFINITY);
  uint32_t unordered = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = LoadX(x + i);
#if defined(__AVX512F__)
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
#else
    unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
#endif
    m = Max(m, v);
  }
  bool nan = unordered != 0;
  float lanes[kLanes];
  Store(lanes, m);
  float best = *std::max_element(lanes, lanes + kLanes);
  for (; i < n; ++i) nan |= std::isnan(x[i]), best = std::max(best, x[i]);
  if (nan) {
    *max = NAN, *index = static_cast<int32_t>(n - 1);
    return;
  }
  int64_t at = 0;
  while (x[at] != best) ++at;
  *max = best, *index = static_cast<int32_t>(at);
}

ffi::Error RowMaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> max,
                      ffi::ResultBuffer<ffi::S32> index) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || max->element_count() != size_t(xd[0]) || index->element_count() != size_t(xd[0]) || xd[1] < 1)
    return ffi::Error::InvalidArgument("row_max: x [M, N] with N >= 1, max and index [M]");
  const int64_t n = xd[1];
  ParallelFor(pool, xd[0], [&](int64_t r) {
    RowMaxRow(x.typed_data() + r * n, n, max->typed_data() + r, index->typed_data() + r);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowMax, RowMaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TopK, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
