// What the CPU kernels share (one .cc file per kernel family, all built into one library by
// jaxstation/kernels/cpu_kernel.py): one vector of float32 lanes and its operations (16 lanes with AVX-512, else 8
// with AVX2 + FMA), the one horizontal sum every output uses, float16 scales, and the loop that spreads a kernel's
// items over the caller and as many helper threads as XLA's intra-op pool has besides it. Everything here is internal
// to each kernel file (an unnamed namespace), except the library's one worker pool (pool.cc).
//
// The worker pool (off by default: JAXSTATION_KERNEL_SPIN_US=0): a decode step makes a few hundred kernel calls, most
// of them on small matrices, where handing a call's items to XLA's pool (its queue, and a futex wake-up where its
// thread sleeps) can cost a share of the call on a busy machine (docs/cpu.md, "The kernels' own workers"). The
// library's own workers spin for a bounded time after each job (JAXSTATION_KERNEL_SPIN_US, set by cpu_kernel.py through
// jaxstation_kernel_spin), so the next call of the step finds them awake; past that time they sleep on a condition
// variable, and an idle station burns no CPU. The spin yields the core every few microseconds, so another thread
// waiting for it gets it. A call that finds the pool running another caller's job (XLA may run two kernels at once,
// several engines may share a process) hands its items to XLA's pool instead, as every call does with the spin set to
// 0. Which thread runs an item never changes its bits.

#ifndef JAXSTATION_CPU_KERNELS_H
#define JAXSTATION_CPU_KERNELS_H

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

namespace jaxstation {

// Runs job(arg) on the caller and on up to `helpers` of the library's workers at once, and returns once every run of
// it has returned; the job claims its own items, so it does not matter how many helpers join it. Returns false,
// having run nothing, where the pool is off or running another caller's job.
bool RunOnWorkers(int64_t helpers, void (*job)(void*), void* arg);

// The channels of a repacked tile (pack.cc): 16 with AVX-512, 8 with AVX2.
int TileChannels();

// Lane `lane` of a repacked tile (at `tile`, rows of `row_len` bytes) of format fmt + "R" ("Q4_K", ...), written to
// `out` as its row's blocks are stored (pack.cc). Returns false for an unknown format or lane.
bool UnpackRow(const uint8_t* tile, int64_t row_len, int lane, const char* fmt, uint8_t* out);

}  // namespace jaxstation

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
inline Vec LoadBf16(const uint16_t* p) {  // bfloat16 bits into float32's upper half: exact
  const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
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
inline Vec LoadBf16(const uint16_t* p) {  // bfloat16 bits into float32's upper half: exact
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
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


// The one horizontal sum every output uses.
inline float Finish(Vec even, Vec odd) {
  const __m256 s = Half(Add(even, odd));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // lanes i + (i + 4)
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                         // + lanes 2, 3
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));                                     // + lane 1
  return _mm_cvtss_f32(h);
}

inline float HalfToFloat(const uint8_t* p) { return _cvtsh_ss(static_cast<uint16_t>(p[0] | (p[1] << 8))); }

// Runs task(i) for i in [0, n) on the caller and the library's workers, or the intra-op pool where those are off or
// busy. Work is claimed from a shared counter, so the caller never waits on a task that has not started: it only waits
// for items other threads are running.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const F& task) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) task(i);
    return;
  }
  struct Job {
    const F* task;
    int64_t n;
    std::atomic<int64_t> next{0};
  } job{&task, n};
  const auto run = [](void* p) {
    Job& j = *static_cast<Job*>(p);
    for (int64_t i; (i = j.next.fetch_add(1, std::memory_order_relaxed)) < j.n;) (*j.task)(i);
  };
  if (jaxstation::RunOnWorkers(helpers, run, &job)) return;
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

}  // namespace

#endif  // JAXSTATION_CPU_KERNELS_H
