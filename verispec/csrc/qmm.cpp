// The kernel of verispec/fast/qmm.py (its docstring says what it computes and why); built by verispec/fast/ops.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t GROUP = 32, BLOCK = 16, MB = 8;

// The activations as the blocks read them: x8 [M, K] int8, and per row and group of 32 its scale dx, the sum
// S of its x8 and dx * S (the 4-bit epilogue's factor, computed once per row and group, not per block).
struct Act {
  int8_t* x8;
  float* dx;
  int32_t* s;
  float* dxs;
};

// 16 activations as float32: float32 as is, bfloat16 widened exactly
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512 load16(const at::BFloat16* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

// 16 outputs stored as float32, or rounded to bfloat16 to nearest even as c10::BFloat16 rounds (NaN: 0x7FC0)
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void store16(at::BFloat16* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// x [M, K] -> Act. x8 = round-half-even(x * (127 / amax)) clamped to +-127 (the CPU's default rounding).
template <typename In>
__attribute__((target("avx512f,avx512bw")))
void quantize(const In* x, int64_t M, int64_t K, const Act& act) {
  const int64_t G = K / GROUP;
  const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const In* xs = x + m * K + g * GROUP;
      const __m512 v0 = load16(xs), v1 = load16(xs + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i q0 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
      const __m512i q1 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
      int8_t* out = act.x8 + m * K + g * GROUP;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(q1));
      const float dx = amax / 127.f;
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      act.dx[m * G + g] = dx;
      act.s[m * G + g] = sum;
      act.dxs[m * G + g] = dx * (float)sum;
    }
  }
}

// How far ahead (bytes) the kernels' rows ask for the weight stream. A projection's weights are a few hundred KB, read
// once per pass, straight from memory; the hardware prefetcher alone ramps up too late on such short streams
// (a forward's qmm calls ran well below the copy bandwidth at one row). 2 KB is 8 4-bit groups or 4 8-bit
// ones: enough lines in flight to cover the memory latency at that bandwidth; docs/fast-native.md has the sweep.
constexpr int64_t PREFETCH = 2048;

// The float part of one group for row i (a: its exact integer sum I over the group, 16 channels).
template <bool I4>
__attribute__((target("avx512f,avx512bw,f16c"), always_inline)) inline
__m512 epilogue(__m512 acc, __m512i a, __m512 dv, __m512 cv, const Act& act, int64_t at) {
  if (I4) {  // sum_k (d q + c) dx x8 = d dx I + c dx S
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dv, _mm512_set1_ps(act.dx[at])), acc);
    return _mm512_fmadd_ps(cv, _mm512_set1_ps(act.dxs[at]), acc);
  }
  // sum_k (q + 128) x8 - 128 S = I, exact; the channel's scale comes at the end
  a = _mm512_sub_epi32(a, _mm512_set1_epi32(128 * act.s[at]));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(act.dx[at]), acc);
}

// R rows (R fixed, so the accumulators live in registers) of one block of 16 output channels. I4: 4-bit
// weights with float16 d and c per channel and group (SC [NB, G, 2, 16]); else 8-bit weights stored as
// q + 128 with a float32 scale per channel (SC [NB, 16]). A row's integer sum runs as two chains of 4
// instructions (integer addition is exact, so the split changes no bit) to hide the instruction's latency.
template <int R, bool I4, typename Out>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
void rows(int64_t nb, int64_t m0, int64_t K, int64_t N, const uint8_t* W, const void* SC, const Act& act,
          Out* Y) {
  const int64_t G = K / GROUP;
  constexpr int64_t LINES = I4 ? 4 : 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t at = nb * G + g;
    const uint8_t* wg = W + at * LINES * 64;
    // Zen 4's own prefetcher keeps up with the stream at a few rows (asking as well only costs there); at 8
    // rows the products slow the loads enough that it falls behind (docs/fast-native.md)
    if constexpr (R >= 8)
      for (int l = 0; l < LINES; ++l) _mm_prefetch(reinterpret_cast<const char*>(wg + PREFETCH + 64 * l), _MM_HINT_T0);
    __m512i wv[8];
    __m512 dv = _mm512_setzero_ps(), cv = _mm512_setzero_ps();
    if (I4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(wg + 64 * j);
        wv[2 * j] = _mm512_and_si512(v, low);
        wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      const uint16_t* sc = static_cast<const uint16_t*>(SC) + at * 2 * BLOCK;
      dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      cv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + BLOCK)));
    } else {
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512(wg + 64 * j);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int64_t m = m0 + i;
      const int32_t* xq = reinterpret_cast<const int32_t*>(act.x8 + m * K + g * GROUP);
      __m512i a0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], _mm512_set1_epi32(xq[0]));  // {1to16}
      __m512i a1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[1], _mm512_set1_epi32(xq[1]));
#pragma GCC unroll 3
      for (int j = 2; j < 8; j += 2) {
        a0 = _mm512_dpbusd_epi32(a0, wv[j], _mm512_set1_epi32(xq[j]));
        a1 = _mm512_dpbusd_epi32(a1, wv[j + 1], _mm512_set1_epi32(xq[j + 1]));
      }
      acc[i] = epilogue<I4>(acc[i], _mm512_add_epi32(a0, a1), dv, cv, act, m * G + g);
    }
  }
  const __m512 scale = I4 ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(static_cast<const float*>(SC) + nb * BLOCK);
  for (int i = 0; i < R; ++i)
    store16(Y + (m0 + i) * N + nb * BLOCK, I4 ? acc[i] : _mm512_mul_ps(acc[i], scale));
}

// ---- AVX2 + FMA + F16C (no VNNI, e.g. Zen 3): the same arithmetic on 256-bit vectors ----
// Same packing, same rounding of the activations, the same exact integer sums I and S, and the same float
// operations in the same order per output, so both kernels give the same bits. The integer sums come from
// `vpmaddubsw` (unsigned x signed bytes, adjacent pairs summed into int16, saturating) and `vpmaddwd`
// (int16 pairs into int32); no pair may saturate: 4-bit weights (0..15) x x8 (|x8| <= 127) keep all 16
// products of a channel's int16 lane within 16 * 15 * 127 = 30480 over a whole group, so one `vpmaddwd`
// per group; 8-bit weights take llama.cpp's sign trick (|q| x sign(q) x8, a pair at most 2 * 127 * 127 =
// 32258), one `vpmaddwd` per line. A block of 16 channels runs as two halves of 8, each half's 32-byte
// slice of the 64-byte lines.
constexpr int64_t MB2 = 4;

__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(const at::BFloat16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

__attribute__((target("avx2,fma"), always_inline)) inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
__attribute__((target("avx2,fma"), always_inline)) inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // r holds 0..0xFFFF per lane: the unsigned-saturating pack keeps it; the permute puts lanes 0..7 in order
  const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(p16));
}

__attribute__((target("avx2,fma"), always_inline)) inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

__attribute__((target("avx2,fma"), always_inline)) inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

template <typename In>
__attribute__((target("avx2,fma")))
void quantize2(const In* x, int64_t M, int64_t K, const Act& act) {
  const int64_t G = K / GROUP;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const In* xs = x + m * K + g * GROUP;
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = load8(xs + 8 * j);
      const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                     _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
      const float amax = hmax8(a);
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4];
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_max_epi32(lo, _mm256_min_epi32(hi, _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv))));
      // int32 -> int8 (no saturation: |q| <= 127); the packs interleave 128-bit lanes, the permute undoes it
      const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(act.x8 + m * K + g * GROUP), _mm256_permutevar8x32_epi32(b, order));
      const float dx = amax / 127.f;
      const int32_t sum = hsum8(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      act.dx[m * G + g] = dx;
      act.s[m * G + g] = sum;
      act.dxs[m * G + g] = dx * (float)sum;
    }
  }
}

// An empty asm that takes v in a register: the compiler cannot move v's computation past it. Without it GCC
// issues all of a group's products first and sums them later, and the live products spill to the stack.
__attribute__((always_inline)) inline void pin(__m256i& v) { asm("" : "+x"(v)); }

// R rows of one block of 16 output channels, as two halves of 8 (a half: the 32-byte slice h of each 64-byte
// line; see rows above for the arguments). Both halves run in the same pass over the groups, so each
// activation broadcast serves two products and a weight line is read once. AVX2 has 16 vector registers: the
// integer sums run over one loaded line at a time for all R rows (a group's expanded lines held while summing
// each row spilled the sums and stalled each group on a store), each partial sum pinned in a register; at 4
// rows the float accumulators go to the stack, read and written once per group on the load/store ports
// while the vector ports do the products (docs/fast-native.md has the measurement). Integer sums are exact in any
// order, and the float part is rows' operations in rows' order per output, so this changes no bit.
template <int R, bool I4, typename Out>
__attribute__((target("avx2,fma,f16c")))
void rows2(int64_t nb, int64_t m0, int64_t K, int64_t N, const uint8_t* W, const void* SC, const Act& act, Out* Y) {
  const int64_t G = K / GROUP;
  constexpr int64_t LINES = I4 ? 4 : 8;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t at = nb * G + g;
    const uint8_t* wg = W + at * LINES * 64;
    // the lines of the group PREFETCH bytes ahead (the next blocks' groups follow this one's in memory; a
    // prefetch past the end of the weight is dropped by the CPU, it does not fault)
    for (int l = 0; l < LINES; ++l) _mm_prefetch(reinterpret_cast<const char*>(wg + PREFETCH + 64 * l), _MM_HINT_T0);
    const int32_t* xq[R];
    for (int i = 0; i < R; ++i) xq[i] = reinterpret_cast<const int32_t*>(act.x8 + (m0 + i) * K + g * GROUP);
    __m256i a[R][2];
    if (I4) {  // 64-byte vector j holds lines 2j (low nibbles) and 2j + 1 (high); a row's int16 sums over the group
      __m256i s[R][2];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * j));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * j + 32));
        const __m256i w00 = _mm256_and_si256(v0, low), w01 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
        const __m256i w10 = _mm256_and_si256(v1, low), w11 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const __m256i b0 = _mm256_set1_epi32(xq[i][2 * j]), b1 = _mm256_set1_epi32(xq[i][2 * j + 1]);
          const __m256i t0 = _mm256_add_epi16(_mm256_maddubs_epi16(w00, b0), _mm256_maddubs_epi16(w01, b1));
          const __m256i t1 = _mm256_add_epi16(_mm256_maddubs_epi16(w10, b0), _mm256_maddubs_epi16(w11, b1));
          s[i][0] = j == 0 ? t0 : _mm256_add_epi16(s[i][0], t0);
          s[i][1] = j == 0 ? t1 : _mm256_add_epi16(s[i][1], t1);
          pin(s[i][0]);
          pin(s[i][1]);
        }
      }
      for (int i = 0; i < R; ++i)
        for (int h = 0; h < 2; ++h) a[i][h] = _mm256_madd_epi16(s[i][h], ones);
    } else {  // q + 128 -> q (signed), and |q| for the unsigned operand
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * j)), flip);
        const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * j + 32)), flip);
        const __m256i mag0 = _mm256_abs_epi8(w0), mag1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const __m256i b = _mm256_set1_epi32(xq[i][j]);
          const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(mag0, _mm256_sign_epi8(b, w0)), ones);
          const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(mag1, _mm256_sign_epi8(b, w1)), ones);
          a[i][0] = j == 0 ? p0 : _mm256_add_epi32(a[i][0], p0);
          a[i][1] = j == 0 ? p1 : _mm256_add_epi32(a[i][1], p1);
          pin(a[i][0]);
          pin(a[i][1]);
        }
      }
    }
    if (I4) {
      const uint16_t* sc = static_cast<const uint16_t*>(SC) + at * 2 * BLOCK;
      __m256 dv[2], cv[2];
      for (int h = 0; h < 2; ++h) {
        dv[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * h)));
        cv[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + BLOCK + 8 * h)));
      }
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const int64_t t = (m0 + i) * G + g;
        const __m256 dx = _mm256_set1_ps(act.dx[t]), dxs = _mm256_set1_ps(act.dxs[t]);
        for (int h = 0; h < 2; ++h) {
          acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[i][h]), _mm256_mul_ps(dv[h], dx), acc[i][h]);
          acc[i][h] = _mm256_fmadd_ps(cv[h], dxs, acc[i][h]);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const __m256 dx = _mm256_set1_ps(act.dx[(m0 + i) * G + g]);
        for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[i][h]), dx, acc[i][h]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 scale = I4 ? _mm256_set1_ps(1.f) : _mm256_loadu_ps(static_cast<const float*>(SC) + nb * BLOCK + 8 * h);
    for (int i = 0; i < R; ++i)
      store8(Y + (m0 + i) * N + nb * BLOCK + 8 * h, I4 ? acc[i][h] : _mm256_mul_ps(acc[i][h], scale));
  }
}

// the two instruction sets' row kernels as types, for block(): at most MAX rows a call
struct Avx512 {
  static constexpr int MAX = MB;
  template <int R, bool I4, typename Out>
  static void run(int64_t nb, int64_t m0, int64_t K, int64_t N, const uint8_t* W, const void* SC, const Act& act,
                  Out* Y) { rows<R, I4, Out>(nb, m0, K, N, W, SC, act, Y); }
};
struct Avx2 {
  static constexpr int MAX = MB2;
  template <int R, bool I4, typename Out>
  static void run(int64_t nb, int64_t m0, int64_t K, int64_t N, const uint8_t* W, const void* SC, const Act& act,
                  Out* Y) { rows2<R, I4, Out>(nb, m0, K, N, W, SC, act, Y); }
};

// the last r < MAX rows of a block in one call of the kernel made for r rows
template <typename Isa, int R, bool I4, typename Out>
void rest(int64_t r, int64_t nb, int64_t m0, int64_t K, int64_t N, const uint8_t* W, const void* SC, const Act& act,
          Out* Y) {
  if constexpr (R > 0) {
    if (r == R) Isa::template run<R, I4, Out>(nb, m0, K, N, W, SC, act, Y);
    else rest<Isa, R - 1, I4, Out>(r, nb, m0, K, N, W, SC, act, Y);
  }
}

// one block of 16 output channels for all M rows: MAX rows at a time, then the rest
template <typename Isa, bool I4, typename Out>
void block(int64_t nb, int64_t M, int64_t K, int64_t N, const uint8_t* W, const void* SC, const Act& act, Out* Y) {
  int64_t m0 = 0;
  for (; m0 + Isa::MAX <= M; m0 += Isa::MAX) Isa::template run<Isa::MAX, I4, Out>(nb, m0, K, N, W, SC, act, Y);
  rest<Isa, Isa::MAX - 1, I4, Out>(M - m0, nb, m0, K, N, W, SC, act, Y);
}

// x [M, K] (any float dtype) -> [M, N] in x's dtype. 4-bit: w [N / 16, K / 32, 256] uint8, sc [N / 16, K / 32,
// 2, 16] float16 (d, c); 8-bit: w [N / 16, K / 32, 512] uint8, sc [N / 16, 16] float32
at::Tensor qmm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sc) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "qmm: x [M, K], w [N/16, K/32, bytes]");
  const int64_t M = x.size(0), K = x.size(1), NB = w.size(0), N = NB * BLOCK, G = K / GROUP;
  const bool int4 = w.size(2) == 4 * 64;
  TORCH_CHECK(K % GROUP == 0 && w.size(1) == G && (int4 || w.size(2) == 8 * 64), "qmm: weight shape does not match x");
  TORCH_CHECK(sc.is_contiguous() && (int4 ? sc.scalar_type() == at::kHalf && sc.numel() == NB * G * 2 * BLOCK
                                          : sc.scalar_type() == at::kFloat && sc.numel() == NB * BLOCK),
              "qmm: scales do not match the weight");
  // float32 and bfloat16 activations are read and written as they are; others go through float32
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor xc = bf16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  // the activations' 8-bit groups in a per-thread scratch buffer, not tensors: at one row their three
  // allocations cost more than the quantization itself
  thread_local std::vector<int32_t> scratch;
  const int64_t words = (M * K + 3) / 4;
  scratch.resize(words + 3 * M * G);
  int32_t* base = scratch.data();
  const Act act{reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + words), base + words + M * G,
                reinterpret_cast<float*>(base + words + 2 * M * G)};
  // chosen once per process: the same bits either way (see the AVX2 section)
  static const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  if (bf16) vnni ? quantize(xc.data_ptr<at::BFloat16>(), M, K, act) : quantize2(xc.data_ptr<at::BFloat16>(), M, K, act);
  else vnni ? quantize(xc.data_ptr<float>(), M, K, act) : quantize2(xc.data_ptr<float>(), M, K, act);
  at::Tensor y = at::empty({M, N}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* W = w.data_ptr<uint8_t>();
  const void* SC = sc.data_ptr();
  auto run = [&](auto* Y) {
    at::parallel_for(0, NB, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb) {
        if (vnni) int4 ? block<Avx512, true>(nb, M, K, N, W, SC, act, Y) : block<Avx512, false>(nb, M, K, N, W, SC, act, Y);
        else int4 ? block<Avx2, true>(nb, M, K, N, W, SC, act, Y) : block<Avx2, false>(nb, M, K, N, W, SC, act, Y);
      }
    });
  };
  if (bf16) run(y.data_ptr<at::BFloat16>());
  else run(y.data_ptr<float>());
  return bf16 || x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(verispec, m) {
  m.def("qmm(Tensor x, Tensor w, Tensor sc) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("qmm", &qmm);
}
