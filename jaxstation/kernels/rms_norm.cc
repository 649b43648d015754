#include "cpu_kernels.h"

namespace {

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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));
