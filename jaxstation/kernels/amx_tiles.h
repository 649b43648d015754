// AMX tiles for the integer products (int_matmul.cc), and whether this process may use them.
//
// A tile is up to 16 rows of up to 64 bytes; the tile configuration (one per thread) sets each tile's rows and bytes
// a row. TileDot<c, a, b> is TDPBSUD: c[m] dword n += the sum over dwords k of a's row m (4 signed bytes) times b's
// row k dword n (4 unsigned bytes), each of the 4 byte products exact, so c holds exact int32 sums, as vpdpbusd's.
//
// Built for a CPU with AMX (-march=native defines __AMX_INT8__), the tiles are the hardware's; Linux hands a process
// the tiles' state only on request (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), and a process whose request
// is refused (a kernel before 5.16, a VM that lists the flag but does not grant it) keeps the vector kernel. Built
// with JAXSTATION_AMX_EMULATED, each tile instruction is a plain loop over thread-local tiles with the instruction's
// definition: the AMX code path then runs, and is tested, on a CPU without AMX.

#ifndef JAXSTATION_AMX_TILES_H_
#define JAXSTATION_AMX_TILES_H_

#include <cstdint>
#include <cstring>

#if defined(__AVX512VNNI__) && (defined(JAXSTATION_AMX_EMULATED) || (defined(__AMX_TILE__) && defined(__AMX_INT8__)))
#define JAXSTATION_AMX 1
#if !defined(JAXSTATION_AMX_EMULATED)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace amx {

// The 64-byte tile configuration (palette 1): bytes a row and rows of each of the 8 tiles.
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  Config& Tile(int t, int rows_, int bytes) {
    rows[t] = static_cast<uint8_t>(rows_), colsb[t] = static_cast<uint16_t>(bytes);
    return *this;
  }
};
static_assert(sizeof(Config) == 64, "the tile configuration is 64 bytes");

#if defined(JAXSTATION_AMX_EMULATED)
constexpr const char* kName = "amx-emulated";
struct Tiles {
  uint8_t data[8][16][64];
  Config config;
};
inline Tiles& tiles() {
  thread_local Tiles t;
  return t;
}
inline void LoadConfig(const Config& c) { tiles().config = c; }
inline void Release() {}
template <int t>
inline void TileZero() {
  std::memset(tiles().data[t], 0, sizeof(tiles().data[t]));
}
template <int t>
inline void TileLoad(const void* base, int64_t stride) {
  const Config& c = tiles().config;
  for (int r = 0; r < c.rows[t]; ++r)
    std::memcpy(tiles().data[t][r], static_cast<const uint8_t*>(base) + r * stride, c.colsb[t]);
}
template <int t>
inline void TileStore(void* base, int64_t stride) {
  const Config& c = tiles().config;
  for (int r = 0; r < c.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles().data[t][r], c.colsb[t]);
}
template <int c, int a, int b>
inline void TileDot() {
  Tiles& s = tiles();
  for (int m = 0; m < s.config.rows[c]; ++m)
    for (int n = 0; n < s.config.colsb[c] / 4; ++n) {
      int32_t sum;
      std::memcpy(&sum, s.data[c][m] + 4 * n, 4);
      for (int k = 0; k < s.config.colsb[a] / 4; ++k)
        for (int i = 0; i < 4; ++i)
          sum += static_cast<int8_t>(s.data[a][m][4 * k + i]) * static_cast<int32_t>(s.data[b][k][4 * n + i]);
      std::memcpy(s.data[c][m] + 4 * n, &sum, 4);
    }
}
inline const char* Grant() { return nullptr; }
#else
constexpr const char* kName = "amx";
inline void LoadConfig(const Config& c) { _tile_loadconfig(&c); }
inline void Release() { _tile_release(); }
// GCC's tile intrinsics are macros that paste the tile's number into the instruction: one specialization per tile
template <int t>
void TileZero();
template <int t>
void TileLoad(const void* base, int64_t stride);
template <int t>
void TileStore(void* base, int64_t stride);
template <int c, int a, int b>
void TileDot();
#define JAXSTATION_TILE(T)                                                                          \
  template <>                                                                                       \
  inline void TileZero<T>() {                                                                       \
    _tile_zero(T);                                                                                  \
  }                                                                                                 \
  template <>                                                                                       \
  inline void TileLoad<T>(const void* base, int64_t stride) {                                       \
    _tile_loadd(T, base, stride);                                                                   \
  }                                                                                                 \
  template <>                                                                                       \
  inline void TileStore<T>(void* base, int64_t stride) {                                            \
    _tile_stored(T, base, stride);                                                                  \
  }
JAXSTATION_TILE(0)
JAXSTATION_TILE(1)
JAXSTATION_TILE(2)
JAXSTATION_TILE(3)
JAXSTATION_TILE(4)
JAXSTATION_TILE(5)
#undef JAXSTATION_TILE
template <>
inline void TileDot<0, 1, 2>() {
  _tile_dpbsud(0, 1, 2);
}
template <>
inline void TileDot<3, 4, 5>() {
  _tile_dpbsud(3, 4, 5);
}
// nullptr where Linux grants this process the tiles' state, else why not
inline const char* Grant() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0 ? nullptr : "Linux refused the tiles' state "
                                                                             "(arch_prctl ARCH_REQ_XCOMP_PERM)";
}
#endif

}  // namespace amx
#endif
#endif  // JAXSTATION_AMX_TILES_H_
