#include "cpu_kernels.h"

namespace {

// Sums the first n rows of t ([n + 1, width]: one spare row) by pairwise halves, a zero row appended to an odd count:
// the order `jaxstation/kernels/rowwise.py`'s row_sum spells out over an axis before the last. The sum lands in row 0.
void HalveRows(float* t, int64_t n, int64_t width) {
  while (n > 1) {
    if (n % 2) std::fill(t + n * width, t + (n + 1) * width, 0.0f), ++n;
    const int64_t half = n / 2;
    for (int64_t i = 0; i < half * width; ++i) t[i] = t[i] + t[i + half * width];
    n = half;
  }
}

// One fused projection's LoRA delta for each row, from the adapter in the row's own slot: h = sum_i x[i] a[slot, i, :]
// over the input, then part j's columns sum_r h[j R + r] b_j[slot, r, :], each product rounded to float32 and each sum
// by pairwise halves (XLA, running `model/lora.py`'s ops, contracts a product and the add it feeds into one FMA where
// it fuses them, so its bits differ in the last place). A row reads only its own slot and its own x, so its bits are
// the same whatever rows share the call. x [M, Q, D], a [S, D, P R], slots [M] int32, b_j [S, R, O_j] ->
// delta [M, Q, sum_j O_j].
ffi::Error LoraDeltaImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> a,
                         ffi::Buffer<ffi::S32> slots, ffi::RemainingArgs bs, ffi::ResultBuffer<ffi::F32> delta) {
  const auto xd = x.dimensions(), ad = a.dimensions(), dd = delta->dimensions();
  const int64_t parts = static_cast<int64_t>(bs.size());
  if (xd.size() != 3 || ad.size() != 3 || ad[1] != xd[2] || parts < 1 || ad[2] % parts ||
      slots.element_count() != size_t(xd[0]) || dd.size() != 3 || dd[0] != xd[0] || dd[1] != xd[1])
    return ffi::Error::InvalidArgument("lora_delta: x [M, Q, D], a [S, D, P R], slots [M], P b [S, R, O_j]");
  const int64_t stacked = ad[0], d = xd[2], pr = ad[2], rank = pr / parts, q = xd[1], out = dd[2];
  std::vector<const float*> b(parts);
  std::vector<int64_t> widths(parts);
  int64_t total = 0;
  for (int64_t j = 0; j < parts; ++j) {
    auto part = bs.get<ffi::Buffer<ffi::F32>>(j);
    if (!part.has_value()) return part.error();
    const auto bd = part->dimensions();
    if (bd.size() != 3 || bd[0] != stacked || bd[1] != rank) return ffi::Error::InvalidArgument("lora_delta: b_j");
    b[j] = part->typed_data(), widths[j] = bd[2], total += bd[2];
  }
  if (total != out) return ffi::Error::InvalidArgument("lora_delta: the parts' columns must add up to delta's");
  const int32_t* sp = slots.typed_data();
  for (int64_t m = 0; m < xd[0]; ++m)
    if (sp[m] < 0 || sp[m] >= stacked) return ffi::Error::InvalidArgument("lora_delta: a slot outside the stacks");
  const int64_t widest = *std::max_element(widths.begin(), widths.end());
  ParallelFor(pool, xd[0] * q, [&](int64_t row) {
    const int64_t slot = sp[row / q];
    const float* xr = x.typed_data() + row * d;
    const float* ar = a.typed_data() + slot * d * pr;
    thread_local std::vector<float> h, t;  // every entry read is written first: no clearing a call
    h.resize((d + 1) * pr), t.resize((rank + 1) * widest);
    for (int64_t i = 0; i < d; ++i)
      for (int64_t c = 0; c < pr; ++c) h[i * pr + c] = xr[i] * ar[i * pr + c];
    HalveRows(h.data(), d, pr);
    float* yr = delta->typed_data() + row * out;
    for (int64_t j = 0; j < parts; ++j) {
      const int64_t w = widths[j];
      const float* br = b[j] + slot * rank * w;
      for (int64_t r = 0; r < rank; ++r)
        for (int64_t o = 0; o < w; ++o) t[r * w + o] = h[j * rank + r] * br[r * w + o];
      HalveRows(t.data(), rank, w);
      std::copy(t.begin(), t.begin() + w, yr);
      yr += w;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraDelta, LoraDeltaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());
