// GGUF block weights laid out once, at load, as the integer products read them (int_matmul.cc, Packed and PackedK):
// each tile of kIntCh channels holds its channels' scales side by side and their codes in the dwords one vpdpbusd
// takes. The same bytes as the file's, moved, so memory does not grow; the same integers, so a row's bits are the
// stored layout's. A plain C++ pass over the file's bytes, tiles split over the machine's cores: an 8B model's
// 4.5 GB take a second or two, where the load would otherwise wait on it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int kCh = 16;  // int_matmul.cc's kIntCh
#else
constexpr int kCh = 8;
#endif

struct Format {
  const char* name;  // the stored format; the repacked one is name + "R"
  int block, bytes;  // columns and bytes a block
};
constexpr Format kFormats[] = {{"Q8_0", 32, 34}, {"Q4_0", 32, 18}, {"Q4_1", 32, 20}, {"Q5_0", 32, 22},
                               {"Q5_1", 32, 24}, {"Q4_K", 256, 144}, {"Q5_K", 256, 176}, {"Q6_K", 256, 210}};

// The kCh channels' blocks b of a tile: channel c's at src + c * row_len + b * bytes.
struct Tile {
  const uint8_t* src;
  int64_t row_len;
  int bytes;
  const uint8_t* Block(int c, int64_t b) const { return src + c * row_len + b * bytes; }
};

// Each channel's `n` bytes at offset `at` of block b, channel after channel.
uint8_t* SideBySide(const Tile& t, int64_t b, int at, int n, uint8_t* out) {
  for (int c = 0; c < kCh; ++c) std::memcpy(out + c * n, t.Block(c, b) + at, n);
  return out + kCh * n;
}

// 32 codes a channel (kCh channels' codes at codes + 32 c) as 4 dwords of nibbles, dword i channel c: bytes 4i..4i+3
// of the channel's 16 nibble bytes, byte k = code k | code 16 + k << 4.
uint8_t* Nibbles(const uint8_t* codes, uint8_t* out) {
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < kCh; ++c)
      for (int t = 0; t < 4; ++t) {
        const uint8_t* code = codes + 32 * c;
        *out++ = (code[4 * i + t] & 15) | (code[16 + 4 * i + t] & 15) << 4;
      }
  return out;
}

// Each channel's fifth-bit word (bit k: code k's) as code vector j's 4 bits a channel, two channels a byte (the
// lower-numbered in the low nibble), vector after vector.
uint8_t* FifthBits(const uint32_t* words, uint8_t* out) {
  for (int j = 0; j < 8; ++j)
    for (int c = 0; c < kCh; c += 2) *out++ = (words[c] >> 4 * j & 15) | (words[c + 1] >> 4 * j & 15) << 4;
  return out;
}

// A 32-column format's group g: its float16 fields side by side, the codes as dwords, then (Q5_0, Q5_1) fifth bits.
void PackSmall(const Tile& t, int64_t groups, int head, int high, uint8_t* out) {
  const int dwords = (t.bytes - head - high) / 4;
  for (int64_t g = 0; g < groups; ++g) {
    for (int f = 0; f < head; f += 2) out = SideBySide(t, g, f, 2, out);
    for (int i = 0; i < dwords; ++i) out = SideBySide(t, g, head + high + 4 * i, 4, out);
    if (high) {
      uint32_t words[kCh];
      for (int c = 0; c < kCh; ++c) std::memcpy(&words[c], t.Block(c, g) + head, 4);
      out = FifthBits(words, out);
    }
  }
}

// Q4_K and Q5_K's 6-bit scale and minimum of group j (int_matmul.cc's KScales).
void KScale(const uint8_t* block, int j, int& sc, int& mn) {
  const uint8_t* s = block + 4;
  sc = j < 4 ? s[j] & 0x3F : (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
  mn = j < 4 ? s[j + 4] & 0x3F : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
}

// The 32 codes (0..63) of group j of a K-quant block of kBytes bytes.
template <int kBytes>
void KCodes(const uint8_t* block, int j, uint8_t* code) {
  if constexpr (kBytes == 210) {  // Q6_K: ql[128], qh[64]
    const int half = j / 4, quarter = j % 4;
    const uint8_t* ql = block + 64 * half + 32 * (quarter % 2);
    const uint8_t* qh = block + 128 + 32 * half;
    for (int k = 0; k < 32; ++k) code[k] = (ql[k] >> 4 * (quarter / 2) & 15) | (qh[k] >> 2 * quarter & 3) << 4;
  } else {  // Q4_K: qs at 16; Q5_K: qh[32] at 16, qs at 48
    const uint8_t* qs = block + (kBytes == 176 ? 48 : 16) + 32 * (j / 2);
    for (int k = 0; k < 32; ++k) code[k] = qs[k] >> 4 * (j % 2) & 15;
    if constexpr (kBytes == 176)
      for (int k = 0; k < 32; ++k) code[k] |= (block[16 + k] >> j & 1) << 4;
  }
}

// A K-quant's 256-column blocks: Q4_K and Q5_K d, dmin, each group's scale and minimum's low bits, the minimums' high
// bits, then each group's nibbles (Q5_K: and fifth bits); Q6_K d, then each group's two scales, nibbles and high bits.
template <int kBytes>
void PackK(const Tile& t, int64_t blocks, uint8_t* out) {
  constexpr bool q6 = kBytes == 210, q5 = kBytes == 176;
  uint8_t codes[kCh * 32];
  for (int64_t b = 0; b < blocks; ++b) {
    if (q6) {
      out = SideBySide(t, b, 208, 2, out);
    } else {
      out = SideBySide(t, b, 0, 2, out);
      out = SideBySide(t, b, 2, 2, out);
      int sc[kCh][8], mn[kCh][8];
      for (int c = 0; c < kCh; ++c)
        for (int j = 0; j < 8; ++j) KScale(t.Block(c, b), j, sc[c][j], mn[c][j]);
      for (int j = 0; j < 8; ++j)
        for (int c = 0; c < kCh; ++c) *out++ = static_cast<uint8_t>(sc[c][j] | (mn[c][j] & 3) << 6);
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < kCh; ++c) *out++ = static_cast<uint8_t>(mn[c][j] >> 2 | (mn[c][j + 4] >> 2) << 4);
    }
    for (int j = 0; j < 8; ++j) {
      for (int c = 0; c < kCh; ++c) KCodes<kBytes>(t.Block(c, b), j, codes + 32 * c);
      if (q6) {
        for (int h = 0; h < 2; ++h) out = SideBySide(t, b, 192 + 2 * j + h, 1, out);
      }
      out = Nibbles(codes, out);
      if (q5) {
        uint32_t words[kCh] = {};
        for (int c = 0; c < kCh; ++c)
          for (int k = 0; k < 32; ++k) words[c] |= static_cast<uint32_t>(codes[32 * c + k] >> 4) << k;
        out = FifthBits(words, out);
      }
      if (q6) {  // byte (h, c, t): bits 2k..2k+1 the high bits of code 16 h + 4 k + t
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < kCh; ++c)
            for (int tt = 0; tt < 4; ++tt) {
              uint8_t bits = 0;
              for (int k = 0; k < 4; ++k) bits |= (codes[32 * c + 16 * h + 4 * k + tt] >> 4 & 3) << 2 * k;
              *out++ = bits;
            }
      }
    }
  }
}

// Lane `lane`'s 32 codes of a nibble group (4 dwords of kCh lanes' 4 bytes, Nibbles' layout) into code[32].
void LaneNibbles(const uint8_t* group, int lane, uint8_t* code) {
  for (int i = 0; i < 4; ++i)
    for (int t = 0; t < 4; ++t) {
      const uint8_t byte = group[i * 4 * kCh + 4 * lane + t];
      code[4 * i + t] = byte & 15, code[16 + 4 * i + t] = byte >> 4;
    }
}

// Lane `lane`'s fifth-bit word (bit k: code k's) out of FifthBits' layout.
uint32_t LaneFifthBits(const uint8_t* bits, int lane) {
  uint32_t word = 0;
  for (int j = 0; j < 8; ++j) word |= static_cast<uint32_t>(bits[j * kCh / 2 + lane / 2] >> 4 * (lane % 2) & 15) << 4 * j;
  return word;
}

// The inverse of PackSmall for one lane: its row's blocks as stored.
void UnpackSmall(const uint8_t* tile, int lane, int64_t groups, int bytes, int head, int high, uint8_t* out) {
  const int dwords = (bytes - head - high) / 4;
  for (int64_t g = 0; g < groups; ++g, out += bytes) {
    const uint8_t* in = tile + g * kCh * bytes;
    for (int f = 0; f < head; f += 2) std::memcpy(out + f, in + f * kCh + 2 * lane, 2);
    for (int i = 0; i < dwords; ++i) std::memcpy(out + head + high + 4 * i, in + (head + 4 * i) * kCh + 4 * lane, 4);
    if (high) {
      const uint32_t word = LaneFifthBits(in + (head + 4 * dwords) * kCh, lane);
      std::memcpy(out + head, &word, 4);
    }
  }
}

// The inverse of PackK for one lane: its row's 256-column blocks as stored.
void UnpackK(const uint8_t* tile, int lane, int64_t blocks, int bytes, uint8_t* out) {
  const bool q6 = bytes == 210, q5 = bytes == 176;
  uint8_t code[32];
  for (int64_t b = 0; b < blocks; ++b, out += bytes) {
    const uint8_t* in = tile + b * kCh * bytes;
    std::memset(out, 0, bytes);
    int sc[8], mn[8];
    if (q6) {
      std::memcpy(out + 208, in + 2 * lane, 2);
    } else {
      std::memcpy(out, in + 2 * lane, 2);
      std::memcpy(out + 2, in + 2 * kCh + 2 * lane, 2);
      for (int j = 0; j < 8; ++j) {
        const uint8_t a = in[(4 + j) * kCh + lane], high = in[(12 + j % 4) * kCh + lane];
        sc[j] = a & 63, mn[j] = a >> 6 | (high >> 4 * (j / 4) & 15) << 2;
      }
      for (int j = 0; j < 4; ++j) {  // KScale's 12 bytes
        out[4 + j] = static_cast<uint8_t>(sc[j] | (sc[j + 4] >> 4) << 6);
        out[8 + j] = static_cast<uint8_t>(mn[j] | (mn[j + 4] >> 4) << 6);
        out[12 + j] = static_cast<uint8_t>((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4);
      }
    }
    const int64_t head = (q6 ? 2 : 16) * kCh, group = (q6 ? 26 : q5 ? 20 : 16) * kCh;
    for (int j = 0; j < 8; ++j) {
      const uint8_t* g = in + head + j * group;
      if (q6) {
        out[192 + 2 * j] = g[lane], out[193 + 2 * j] = g[kCh + lane];
        g += 2 * kCh;
      }
      LaneNibbles(g, lane, code);
      if (q5) {
        const uint32_t word = LaneFifthBits(g + 16 * kCh, lane);
        for (int k = 0; k < 32; ++k) code[k] |= (word >> k & 1) << 4;
      }
      if (q6) {
        for (int h = 0; h < 2; ++h)
          for (int t = 0; t < 4; ++t) {
            const uint8_t bits = g[16 * kCh + (h * kCh + lane) * 4 + t];
            for (int k = 0; k < 4; ++k) code[16 * h + 4 * k + t] |= (bits >> 2 * k & 3) << 4;
          }
        const int half = j / 4, quarter = j % 4;
        for (int k = 0; k < 32; ++k) {
          out[64 * half + 32 * (quarter % 2) + k] |= (code[k] & 15) << 4 * (quarter / 2);
          out[128 + 32 * half + k] |= (code[k] >> 4) << 2 * quarter;
        }
      } else {
        uint8_t* qs = out + (q5 ? 48 : 16);
        for (int k = 0; k < 32; ++k) {
          qs[32 * (j / 2) + k] |= (code[k] & 15) << 4 * (j % 2);
          if (q5) out[16 + k] |= (code[k] >> 4) << j;
        }
      }
    }
  }
}

const Format* FindFormat(const char* fmt) {
  for (const Format& f : kFormats)
    if (std::string(fmt) == f.name) return &f;
  return nullptr;
}

int Head(const Format& f) { return std::string(f.name) == "Q4_1" || std::string(f.name) == "Q5_1" ? 4 : 2; }
int High(const Format& f) { return std::string(f.name) == "Q5_0" || std::string(f.name) == "Q5_1" ? 4 : 0; }

}  // namespace

namespace jaxstation {

int TileChannels() { return kCh; }

bool UnpackRow(const uint8_t* tile, int64_t row_len, int lane, const char* fmt, uint8_t* out) {
  const Format* f = FindFormat(fmt);
  if (f == nullptr || row_len % f->bytes || lane < 0 || lane >= kCh) return false;
  if (f->block == 256) {
    UnpackK(tile, lane, row_len / f->bytes, f->bytes, out);
  } else {
    UnpackSmall(tile, lane, row_len / f->bytes, f->bytes, Head(*f), High(*f), out);
  }
  return true;
}

}  // namespace jaxstation

// Block weights src [n, row_len] stored in format `fmt` ("Q4_K", ...) into dst (as many bytes) laid out as fmt + "R"
// reads them, with `threads` threads. Returns 0, or -1 for an unknown format or a shape it cannot lay out (n not a
// multiple of the tile's channels, row_len not whole blocks).
extern "C" int jaxstation_pack_blocks(const uint8_t* src, uint8_t* dst, int64_t n, int64_t row_len, const char* fmt,
                                      int threads) {
  const Format* format = FindFormat(fmt);
  if (format == nullptr || n % kCh || row_len % format->bytes) return -1;
  const int64_t tiles = n / kCh, blocks = row_len / format->bytes, tile_bytes = kCh * row_len;
  const int head = Head(*format), high = High(*format);
  auto pack = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Tile t{src + i * tile_bytes, row_len, format->bytes};
      if (format->bytes == 144) {
        PackK<144>(t, blocks, dst + i * tile_bytes);
      } else if (format->bytes == 176) {
        PackK<176>(t, blocks, dst + i * tile_bytes);
      } else if (format->bytes == 210) {
        PackK<210>(t, blocks, dst + i * tile_bytes);
      } else {
        PackSmall(t, blocks, head, high, dst + i * tile_bytes);
      }
    }
  };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, tiles));
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(pack, tiles * w / workers, tiles * (w + 1) / workers);
  pack(0, tiles / workers);
  for (std::thread& th : pool) th.join();
  return 0;
}
