// Hand-written kernels for bf16 passes of few rows on a CPU with AVX512-BF16 (cpu/kernels.py builds them on first use
// and registers them as torch ops): a linear layer (rows_mm; rows_mm_f32 writing fp32 sums; rows_mm_int8 over int8
// codes, widened to bf16 in registers), attention for few queries (attend), the draws over fp32 logits: greedy
// decoding's argmax, sampling's softmax draw; the draft tree's top-k; and the target's draws from its LM head's int8
// codes, only the rows that can win computed exactly (lm_head_argmax).
//
// A decode step, a tree verify, a draft level and a lookup chain multiply 1 to ~16 rows by every weight. Without AMX,
// Inductor's GEMM templates widen bf16 to fp32 and turn compute-bound past a few rows, and oneDNN does not overlap its
// compute with streaming cold weights (docs/cpu.md). vdpbf16ps multiplies bf16 pairs natively, 32 products an
// instruction. The weight is stored [out/16, in/2, 16] int32: a 64-byte load is 16 outputs' next 2 inputs, read once
// and fed to every row's accumulator, so the weight streams from memory once for up to 16 rows and no sum crosses
// lanes. attend scores the query rows of a KV head against its keys with the same instruction, 16 keys at a time, the
// softmax in fp32, then the values two slots an instruction (the probabilities as bf16 pairs); the rows sharing a KV
// head share each load. In both, a row's sums run in the same order whatever rows share its pass (rows_mm: a verify's
// linears give the one-row step's values).
//
// With AMX (amx_tile, amx_bf16; built with -DEAGLET_AMX) the rows_mm ops run on tiles instead: the packed layout is
// the B tile's (int8 codes are widened into one first), and one tile multiply sums 16 input pairs for up to 16 rows,
// so a verify's rows stop costing compute (and attend's, from amx_attend_rows query rows a KV head); past 16 rows up to
// four groups of 16 share each B tile load, so the weight still streams once for up to 64 rows. Passes of fewer
// than amx_min_rows rows stay on vdpbf16ps; so a row's sums are the same in every pass on either side of that bound,
// but the two paths add them in different orders.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <mutex>
#include <vector>

static inline void store16(at::BFloat16* y, __m512 a) { _mm256_storeu_si256((__m256i*)y, (__m256i)_mm512_cvtneps_pbh(a)); }
static inline void store16(float* y, __m512 a) { _mm512_storeu_ps(y, a); }

// A weight vector: 16 outputs' next 2 inputs as bf16 pairs. int32_t: stored so (64 bytes); int16_t: as int8 pairs (32
// bytes), widened here (exact: |code| <= 127 fits bf16's 8 bits) and scaled per output after the sums.
static inline __m512bh weights(const int32_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
static inline __m512bh weights(const int16_t* w) {
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w + 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// R rows (<= 16) times NB blocks of 16 outputs: NB * R accumulators in registers, NB weight loads per input pair.
// scale: per output (int8 weights), or null.
template <int R, int NB, typename W, typename Y>
static inline void tile(const W* __restrict w, int64_t block, const int32_t* __restrict x, int64_t xs, int64_t pairs,
                        Y* __restrict y, int64_t ys, const float* __restrict scale) {
  __m512 acc[NB][R];
#pragma GCC unroll 16
  for (int b = 0; b < NB; b++)
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[b][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p++) {
    __m512bh wv[NB];
#pragma GCC unroll 16
    for (int b = 0; b < NB; b++) {
      _mm_prefetch((const char*)(w + b * block + p * 16 + 256), _MM_HINT_T0);  // 1 KB ahead: the next block is in cache when its turn comes
      wv[b] = weights(w + b * block + p * 16);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      __m512i xv = _mm512_set1_epi32(x[r * xs + p]);  // row r's inputs 2p, 2p+1 in every lane
#pragma GCC unroll 16
      for (int b = 0; b < NB; b++) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], (__m512bh)xv, wv[b]);
    }
  }
#pragma GCC unroll 16
  for (int b = 0; b < NB; b++) {
    __m512 s = scale ? _mm512_loadu_ps(scale + b * 16) : _mm512_set1_ps(1.0f);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) store16(y + r * ys + b * 16, scale ? _mm512_mul_ps(acc[b][r], s) : acc[b][r]);
  }
}

// Blocks [b0, b1) NB at a time, the rest in halves: NB * R independent accumulators hide vdpbf16ps' latency when rows
// are few.
template <int R, int NB, typename W, typename Y>
static void span(const W* w, int64_t b0, int64_t b1, int64_t pairs, const int32_t* x, Y* y, int64_t ys, const float* scale) {
  int64_t b = b0;
  for (; b + NB <= b1; b += NB)
    tile<R, NB>(w + b * pairs * 16, pairs * 16, x, pairs, pairs, y + b * 16, ys, scale ? scale + b * 16 : nullptr);
  if constexpr (NB > 1)
    if (b < b1) span<R, NB / 2>(w, b, b1, pairs, x, y, ys, scale);
}

template <int R, typename W, typename Y>
static void rows(const W* w, int64_t blocks, int64_t pairs, const int32_t* x, Y* y, int64_t ys, const float* scale) {
  constexpr int NB = R <= 2 ? 8 : R <= 4 ? 4 : R <= 12 ? 2 : 1;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { span<R, NB>(w, b0, b1, pairs, x, y, ys, scale); });
}

#ifdef EAGLET_AMX
// AMX (a CPU with amx_bf16): kernels.pack's layout is the B tile's own, 16 input pairs by 16 outputs' pairs in 1 KB,
// so a tile loads straight from the packed weight. One tile multiply sums 16 pairs for up to 16 rows where vdpbf16ps
// sums one pair for one row: many rows stop costing compute. A row's sums run in the same order whatever rows share
// the pass (from amx_min_rows rows: fewer take vdpbf16ps above).
#include <sys/syscall.h>
#include <unistd.h>
static bool amx_on = false;
static int64_t amx_min_rows = 1, amx_attend_rows = 1;
struct TileConfig { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static void amx_config(int R) {  // tiles 0-3: C (R rows of 16 fp32), 4: A (R rows of 32 bf16), 5-7: B
  TileConfig c = {};
  c.palette = 1;
  for (int t = 0; t < 8; t++) c.rows[t] = t < 5 ? R : 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}
template <typename Y>
static inline void amx_rows_out(const float* buf, int R, Y* y, int64_t ys, const float* scale) {
  __m512 s = scale ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.0f);
  for (int r = 0; r < R; r++) store16(y + r * ys, scale ? _mm512_mul_ps(_mm512_loadu_ps(buf + r * 16), s) : _mm512_loadu_ps(buf + r * 16));
}
// GCC's tile intrinsics take the tile's number as a literal, and are asm that tells the compiler of no memory it
// touches: the barrier keeps the stores into wide before the tile load, the reads of buf after the tile store.
#define MEMORY_BARRIER asm volatile("" ::: "memory");
#define AMX_STORE(t) _tile_stored(t, buf, 64); MEMORY_BARRIER amx_rows_out(buf, R, y + t * 16, ys, scale ? scale + t * 16 : nullptr);
// Block b's B tile for input pairs [p, p + 16): the packed weight itself (bf16 pairs), or int8 codes widened to bf16
// pairs in wide (exact, as weights() does) and loaded from there.
#define AMX_LOAD_B(t, b) \
  if constexpr (std::is_same_v<W, int32_t>) { _tile_loadd(t, w + (b) * block + p * 16, 64); } \
  else { for (int l = 0; l < 16; l++) _mm512_store_si512(wide + l * 16, (__m512i)weights(w + (b) * block + (p + l) * 16)); \
         MEMORY_BARRIER _tile_loadd(t, wide, 64); MEMORY_BARRIER }
// NB blocks' next 16 pairs, 1 KB (bf16) or 512 bytes (int8) ahead of the tile loads at pair p; in the last step, the
// first 16 of the next NB blocks' (the next call's), whose starts would otherwise come cold to a tile load.
template <int NB, typename W>
static inline void amx_prefetch(const W* w, int64_t block, int64_t p, int64_t pairs) {
  for (int b = 0; b < NB; b++) {
    const W* ahead = p + 16 < pairs ? w + b * block + (p + 16) * 16 : w + (NB + b) * block;
    for (int l = 0; l < (int)sizeof(W) * 4; l++) _mm_prefetch((const char*)ahead + l * 64, _MM_HINT_T0);
  }
}
// NB (<= 4) blocks of 16 outputs for R rows: w at the first block, x's rows xs elements apart, scale per output or null.
template <int NB, typename W, typename Y>
static void amx_blocks(const W* w, int64_t pairs, const at::BFloat16* x, int64_t xs, int R, Y* y, int64_t ys, const float* scale) {
  alignas(64) float buf[256];
  alignas(64) int32_t wide[256];
  const int64_t block = pairs * 16;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t p = 0; p < pairs; p += 16) {
    amx_prefetch<NB>(w, block, p, pairs);
    _tile_loadd(4, x + 2 * p, xs * 2);
    AMX_LOAD_B(5, 0) _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) { AMX_LOAD_B(6, 1) _tile_dpbf16ps(1, 4, 6); }
    if constexpr (NB > 2) { AMX_LOAD_B(7, 2) _tile_dpbf16ps(2, 4, 7); }
    if constexpr (NB > 3) { AMX_LOAD_B(5, 3) _tile_dpbf16ps(3, 4, 5); }
  }
  AMX_STORE(0)
  if constexpr (NB > 1) { AMX_STORE(1) }
  if constexpr (NB > 2) { AMX_STORE(2) }
  if constexpr (NB > 3) { AMX_STORE(3) }
}
// Past 16 rows: G (2-4) groups of 16 rows, from a zero-padded copy, share each B tile load, so the weight streams
// from memory once for up to 64 rows where a pass a group would read it G times; NB blocks, G * NB <= 4 C tiles (C
// tile g * NB + b: group g, block b). A row's sums run in amx_blocks' order. last: the last group's real rows.
#define AMX_STORE_AT(t, g, b) _tile_stored(t, buf, 64); MEMORY_BARRIER \
  amx_rows_out(buf, g == G - 1 ? last : 16, y + g * 16 * ys + b * 16, ys, scale ? scale + b * 16 : nullptr);
template <int G, int NB, typename W, typename Y>
static void amx_groups(const W* w, int64_t pairs, const at::BFloat16* x, int64_t xs, int last, Y* y, int64_t ys, const float* scale) {
  static_assert(G >= 2 && G <= 4 && G * NB <= 4);
  alignas(64) float buf[256];
  alignas(64) int32_t wide[256];
  const int64_t block = pairs * 16;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (G * NB > 2) _tile_zero(2);
  if constexpr (G * NB > 3) _tile_zero(3);
  for (int64_t p = 0; p < pairs; p += 16) {
    amx_prefetch<NB>(w, block, p, pairs);
    _tile_loadd(4, x + 2 * p, xs * 2);
    if constexpr (G == 2) {
      _tile_loadd(7, x + 16 * xs + 2 * p, xs * 2);
      if constexpr (NB == 1) { AMX_LOAD_B(5, 0) _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 7, 5); }
      else { AMX_LOAD_B(5, 0) _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(2, 7, 5);
             AMX_LOAD_B(6, 1) _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(3, 7, 6); }
    } else {
      _tile_loadd(6, x + 16 * xs + 2 * p, xs * 2);
      _tile_loadd(7, x + 32 * xs + 2 * p, xs * 2);
      AMX_LOAD_B(5, 0) _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 6, 5); _tile_dpbf16ps(2, 7, 5);
      if constexpr (G == 4) { _tile_loadd(4, x + 48 * xs + 2 * p, xs * 2); _tile_dpbf16ps(3, 4, 5); }
    }
  }
  if constexpr (NB == 1) {
    AMX_STORE_AT(0, 0, 0) AMX_STORE_AT(1, 1, 0)
    if constexpr (G > 2) { AMX_STORE_AT(2, 2, 0) }
    if constexpr (G > 3) { AMX_STORE_AT(3, 3, 0) }
  } else { AMX_STORE_AT(0, 0, 0) AMX_STORE_AT(1, 0, 1) AMX_STORE_AT(2, 1, 0) AMX_STORE_AT(3, 1, 1) }
}
// Every block for M rows: the blocks split evenly over the threads (whole groups of 4 left one thread 5 of a 576-wide
// output's 9: 5-11% slower), 4 at a time for up to 16 rows; past that, 64 rows at a time in amx_groups, each block's
// weights read from memory once and again from cache for the next 64.
template <typename W, typename Y>
static void amx_rows(const W* w, int64_t blocks, int64_t pairs, const at::BFloat16* x, int64_t M, Y* y, int64_t N, const float* scale) {
  at::Tensor padded;
  if (M > 16 && M % 16) {
    padded = at::zeros({(M + 15) / 16 * 16, pairs * 2}, at::kBFloat16);
    std::memcpy(padded.data_ptr(), x, M * pairs * 2 * sizeof(at::BFloat16));
    x = padded.data_ptr<at::BFloat16>();
  }
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    amx_config(M < 16 ? (int)M : 16);
    for (int64_t g = b0; g < b1;) {
      // blocks a call: 4 for one group of rows, 2 for two groups, 1 for more
      int nb = (int)std::min<int64_t>(M <= 16 ? 4 : M <= 32 ? 2 : 1, b1 - g);
      const W* wg = w + g * pairs * 16;
      const float* sg = scale ? scale + g * 16 : nullptr;
      for (int64_t m = 0; m < M; m += 64) {
        int64_t left = std::min<int64_t>(64, M - m);
        int groups = (int)((left + 15) / 16), last = (int)(left - (groups - 1) * 16);
        const at::BFloat16* xm = x + m * pairs * 2;
        Y* ym = y + m * N + g * 16;
        if (groups == 1) {  // up to 16 rows, or the rows past a multiple of 64
          switch (nb) {
            case 4: amx_blocks<4>(wg, pairs, xm, pairs * 2, last, ym, N, sg); break;
            case 3: amx_blocks<3>(wg, pairs, xm, pairs * 2, last, ym, N, sg); break;
            case 2: amx_blocks<2>(wg, pairs, xm, pairs * 2, last, ym, N, sg); break;
            case 1: amx_blocks<1>(wg, pairs, xm, pairs * 2, last, ym, N, sg); break;
          }
        } else if (groups == 2 && nb == 2) amx_groups<2, 2>(wg, pairs, xm, pairs * 2, last, ym, N, sg);
        else if (groups == 2) amx_groups<2, 1>(wg, pairs, xm, pairs * 2, last, ym, N, sg);
        else if (groups == 3) amx_groups<3, 1>(wg, pairs, xm, pairs * 2, last, ym, N, sg);
        else amx_groups<4, 1>(wg, pairs, xm, pairs * 2, last, ym, N, sg);
      }
      g += nb;
    }
    _tile_release();
  });
}
static bool amx_granted = false;
bool amx_set(bool on, int64_t min_rows, int64_t attend_rows) {  // Linux hands out the tile state on request: ARCH_REQ_XCOMP_PERM, XTILEDATA
  if (on && !amx_granted) amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  amx_min_rows = min_rows, amx_attend_rows = attend_rows;
  return amx_on = on && amx_granted;
}
#else
bool amx_set(bool on, int64_t min_rows, int64_t attend_rows) { return false; }
#endif

// Y: the output's type, bf16 or (the LM head's logits, not rounded to bf16's 8 bits) fp32; W: the weight's (above).
template <typename W, typename Y>
at::Tensor rows_mm_to(const at::Tensor& input, const at::Tensor& w, at::ScalarType out, const float* scale) {
  auto x = input.contiguous();
  int64_t K = x.size(-1), M = K ? x.numel() / K : 0, blocks = w.size(0), pairs = w.size(1), N = blocks * 16;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options().dtype(out));
  auto xp = (const int32_t*)x.data_ptr();
  auto wp = (const W*)w.data_ptr();
  auto yp = y.data_ptr<Y>();
#ifdef EAGLET_AMX
  if (amx_on && pairs % 16 == 0 && M >= amx_min_rows) {
    amx_rows<W, Y>(wp, blocks, pairs, (const at::BFloat16*)x.data_ptr(), M, yp, N, scale);
    return y;
  }
#endif
  for (int64_t m = 0; m < M; m += 16) {  // more rows: 16 at a time, the weight read again for each
    auto xm = xp + m * pairs;
    auto ym = yp + m * N;
    switch (std::min<int64_t>(16, M - m)) {
#define ROWS(n) case n: rows<n, W, Y>(wp, blocks, pairs, xm, ym, N, scale); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
      ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
    }
  }
  return y;
}

static void check_rows(const at::Tensor& x, const at::Tensor& w, at::ScalarType wtype, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == wtype && w.dim() == 3 && w.size(2) == 16
              && x.size(-1) == 2 * w.size(1) && w.is_contiguous(), what);
}

at::Tensor rows_mm(const at::Tensor& x, const at::Tensor& w) {
  check_rows(x, w, at::kInt, "eaglet::rows_mm: bf16 rows, kernels.pack's weight");
  return rows_mm_to<int32_t, at::BFloat16>(x, w, at::kBFloat16, nullptr);
}
at::Tensor rows_mm_f32(const at::Tensor& x, const at::Tensor& w) {
  check_rows(x, w, at::kInt, "eaglet::rows_mm_f32: bf16 rows, kernels.pack's weight");
  return rows_mm_to<int32_t, float>(x, w, at::kFloat, nullptr);
}
at::Tensor rows_mm_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  check_rows(x, w, at::kShort, "eaglet::rows_mm_int8: bf16 rows, kernels.pack_int8's weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == w.size(0) * 16,
              "eaglet::rows_mm_int8: fp32 scales, one per output");
  return rows_mm_to<int16_t, at::BFloat16>(x, w, at::kBFloat16, scales.data_ptr<float>());
}

// The first index of each row's largest value (fp32 [..., N] -> int64 [...]), as torch.argmax: 16 lanes keep their
// first maximum and its index, then the lowest index among the lanes holding the row's maximum. ATen's and Inductor's
// argmax compare one element at a time. NaN is never picked.
at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() >= 1 && logits.size(-1) > 0, "eaglet::argmax: fp32 rows");
  auto x = logits.contiguous();
  int64_t N = x.size(-1), M = x.numel() / N;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto y = at::empty(sizes, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* yp = y.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      const float* r = xp + m * N;
      __m512 best = _mm512_set1_ps(-INFINITY);
      __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      int64_t i = 0;
      for (; i + 16 <= N; i += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
        __m512 v = _mm512_loadu_ps(r + i);
        __mmask16 more = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, more, v);
        at = _mm512_mask_mov_epi32(at, more, idx);
      }
      float top = _mm512_reduce_max_ps(best);
      int64_t arg = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ), at);
      for (; i < N; i++)
        if (r[i] > top) top = r[i], arg = i;
      yp[m] = arg;
    }
  });
  return y;
}

// ---------------------------------------------------------------- the LM head's draw, screened
// A target's draw reads one thing of its logits: the argmax (greedy), or the argmax of logits / T plus a Gumbel per
// token (tree_cycle's sampled verify). lm_head_argmax finds that token from the LM head's int8 codes, half its bf16
// rows' bytes, with a bound on each row's error, and then computes exactly, as rows_mm_f32 does for one row, only the
// rows whose upper bound reaches the best lower bound. The token is the argmax of those exact logits (ties: the lower
// index), never an estimate's.
//
// The codes' sums are integers. Each input row x is split into two 8-bit levels, x ~ x^ = s1 q1 + s2 q2, stored as
// q1 + 128 and q2 + 128 (vpdpbusd and AMX's tdpbusd multiply unsigned bytes by signed ones), and a row i of codes c
// (weights ~ sw_i c) gives the estimate e_i = sw_i (s1 D1 + s2 D2), D = A - 128 C_i from the int32 sums A and C_i the
// sum of its codes. Against the exact fp32 logit:
//   |x.w_i - e_i| <= ||x||_1 max|w_i - sw_i c_i| + max|x - x^| sw_i ||c_i||_1 + (the fp32 sum's rounding,
//                    at most K 2^-24 sum|x w_i| <= K 2^-24 ||x||_1 max|w_i|)
// = ||x||_1 kx_i + max|x - x^| kq_i (kx, kq per token: kernels.screen_codes, which leaves in kx 16 more roundings of
// 2^-24 of ||x||_1 max|w_i| for the arithmetic here; ||x||_1 here is the larger of it and s1 ||q1||_1 + s2 ||q2||_1,
// which bounds every term of e_i). Greedy, the estimates are fp32, 16 tokens a vector, where the D are exact in fp32
// (127^2 K < 2^24); with noise (fp64 Gumbels), fp64.
static constexpr double SCREEN_ROUND_UP = 1.0 + 1.0 / (1 << 20);
static constexpr float SCREEN_SLACK = 1e-6f;

struct Screen {  // per input row: its two levels' scales, the bound's ||x||_1 and max|x - x^|; the bytes q + 128, rows K apart
  std::vector<double> s1, s2, l1, ex;
  std::vector<uint8_t> u1, u2;
};

static Screen screen_rows(const at::BFloat16* x, int64_t M, int64_t K) {
  Screen s{std::vector<double>(M), std::vector<double>(M), std::vector<double>(M), std::vector<double>(M),
           std::vector<uint8_t>(M * K), std::vector<uint8_t>(M * K)};
  for (int64_t m = 0; m < M; m++) {
    const at::BFloat16* r = x + m * K;
    double top = 0, l1 = 0, rtop = 0, ex = 0, lq = 0;
    for (int64_t k = 0; k < K; k++) top = std::max(top, std::fabs((double)(float)r[k])), l1 += std::fabs((double)(float)r[k]);
    double s1 = top > 0 ? top / 127 : 1;
    for (int64_t k = 0; k < K; k++) {
      double v = (float)r[k];
      rtop = std::max(rtop, std::fabs(v - s1 * std::nearbyint(v / s1)));
    }
    double s2 = rtop > 0 ? rtop / 127 : 1;
    for (int64_t k = 0; k < K; k++) {
      double v = (float)r[k], q1 = std::nearbyint(v / s1), rest = v - s1 * q1;
      double q2 = std::min(127.0, std::max(-127.0, std::nearbyint(rest / s2)));
      s.u1[m * K + k] = (uint8_t)(q1 + 128), s.u2[m * K + k] = (uint8_t)(q2 + 128);
      ex = std::max(ex, std::fabs(rest - s2 * q2));
      lq += s1 * std::fabs(q1) + s2 * std::fabs(q2);
    }
    s.s1[m] = s1, s.s2[m] = s2, s.l1[m] = std::max(l1, lq) * SCREEN_ROUND_UP, s.ex[m] = ex * SCREEN_ROUND_UP;
  }
  return s;
}

// Block b's int32 sums of R rows' bytes (u, rows K apart) by its codes (w: [K/4, 16] words of 4 codes), vpdpbusd.
template <int R>
static void vnni_sums(const int32_t* w, int64_t K, const uint8_t* u1, const uint8_t* u2, int32_t* a1, int32_t* a2) {
  __m512i c1[R], c2[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) c1[r] = c2[r] = _mm512_setzero_si512();
  for (int64_t p = 0; p < K / 4; p++) {
    __m512i wv = _mm512_loadu_si512(w + p * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      c1[r] = _mm512_dpbusd_epi32(c1[r], _mm512_set1_epi32(*(const int32_t*)(u1 + r * K + 4 * p)), wv);
      c2[r] = _mm512_dpbusd_epi32(c2[r], _mm512_set1_epi32(*(const int32_t*)(u2 + r * K + 4 * p)), wv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) _mm512_storeu_si512(a1 + r * 16, c1[r]), _mm512_storeu_si512(a2 + r * 16, c2[r]);
}

// Two blocks' sums (the second's codes K/4 * 16 words on, its sums in a1, a2 + 256).
static void block_sums(const int32_t* w, int64_t K, const uint8_t* u1, const uint8_t* u2, int R, int32_t* a1, int32_t* a2,
                       bool tiles) {
#ifdef EAGLET_AMX
  if (tiles) {  // tiles 0-3: the two blocks' two levels' sums (R rows of 16 int32), 4, 5: the levels' bytes, 6, 7: the
    // blocks' codes, as packed: four independent sums hide a tile multiply's latency
    const int32_t* w2 = w + K / 4 * 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 64) {
      for (int l = 0; l < 16; l++) {  // each block's codes 2 KB on (at its end, the next block's): a tile load waits
        _mm_prefetch((const char*)(w + k / 4 * 16) + 2048 + l * 64, _MM_HINT_T0);  // for all 16 of its lines
        _mm_prefetch((const char*)(w2 + k / 4 * 16) + 2048 + l * 64, _MM_HINT_T0);
      }
      _tile_loadd(4, u1 + k, K);
      _tile_loadd(5, u2 + k, K);
      _tile_loadd(6, w + k / 4 * 16, 64);
      _tile_loadd(7, w2 + k / 4 * 16, 64);
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 5, 6);
      _tile_dpbusd(2, 4, 7);
      _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, a1, 64);
    _tile_stored(1, a2, 64);
    _tile_stored(2, a1 + 256, 64);
    _tile_stored(3, a2 + 256, 64);
    MEMORY_BARRIER
    return;
  }
#endif
  for (int half = 0; half < 2; half++, w += K / 4 * 16, a1 += 256, a2 += 256) {
    for (int m = 0; m < R; m += 8) {
      switch (std::min(8, R - m)) {
#define SUMS(n) case n: vnni_sums<n>(w, K, u1 + m * K, u2 + m * K, a1 + m * 16, a2 + m * 16); break;
        SUMS(1) SUMS(2) SUMS(3) SUMS(4) SUMS(5) SUMS(6) SUMS(7) SUMS(8)
#undef SUMS
      }
    }
  }
}

using Kept = std::vector<std::pair<int64_t, double>>;  // (token, its upper bound)

// One row's 16 tokens from i: their estimates and bounds; lane (per vector lane, fp32: 16, fp64: 2 x 8) keeps the best
// lower bound it has seen, a bound that only rises, so what it drops the row's final one drops too; kept gets the
// tokens whose upper bound reaches it.
static inline void screen16_f32(const int32_t* a1, const int32_t* a2, int64_t i, const float* st, int64_t V, const Screen& s,
                                int64_t row, __m512* lane, Kept& kept) {
  __m512i c128 = _mm512_slli_epi32(_mm512_cvtps_epi32(_mm512_loadu_ps(st + V + i)), 7);
  __m512 d1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(a1), c128));
  __m512 d2 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(a2), c128));
  __m512 e = _mm512_mul_ps(_mm512_loadu_ps(st + i), _mm512_fmadd_ps(_mm512_set1_ps(s.s1[row]), d1, _mm512_mul_ps(_mm512_set1_ps(s.s2[row]), d2)));
  __m512 bound = _mm512_fmadd_ps(_mm512_set1_ps(s.l1[row]), _mm512_loadu_ps(st + 2 * V + i),
                                 _mm512_fmadd_ps(_mm512_set1_ps(s.ex[row]), _mm512_loadu_ps(st + 3 * V + i), _mm512_set1_ps(SCREEN_SLACK)));
  __m512 hi = _mm512_add_ps(e, bound);
  *lane = _mm512_max_ps(*lane, _mm512_sub_ps(e, bound));
  __mmask16 k = _mm512_cmp_ps_mask(hi, *lane, _CMP_GE_OQ);
  if (!k) return;
  alignas(64) float up[16];
  _mm512_store_ps(up, hi);
  for (; k; k &= k - 1) kept.emplace_back(i + __builtin_ctz(k), up[__builtin_ctz(k)]);
}

// After each pair of blocks a row's lanes all take the best lower bound any of them has seen: a token is then kept only
// if it reaches the row's best so far, not merely its lane's, which rises slowly (every kept token costs a push and its
// share of the sort).
static inline void spread(__m512& lane) { lane = _mm512_set1_ps(_mm512_reduce_max_ps(lane)); }
static inline void spread(__m512d* lane) { lane[0] = lane[1] = _mm512_set1_pd(std::max(_mm512_reduce_max_pd(lane[0]), _mm512_reduce_max_pd(lane[1]))); }

static inline void screen16_f64(const int32_t* a1, const int32_t* a2, int64_t i, const float* st, int64_t V, const Screen& s,
                                int64_t row, const double* g, double inv_t, __m512d* lane, Kept& kept) {
  for (int h = 0; h < 16; h += 8) {
    __m512d c = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(st + V + i + h)), _mm512_set1_pd(128));
    __m512d d1 = _mm512_sub_pd(_mm512_cvtepi32_pd(_mm256_load_si256((const __m256i*)(a1 + h))), c);
    __m512d d2 = _mm512_sub_pd(_mm512_cvtepi32_pd(_mm256_load_si256((const __m256i*)(a2 + h))), c);
    __m512d e = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(st + i + h)),
                              _mm512_fmadd_pd(_mm512_set1_pd(s.s1[row]), d1, _mm512_mul_pd(_mm512_set1_pd(s.s2[row]), d2)));
    __m512d bound = _mm512_fmadd_pd(_mm512_set1_pd(s.l1[row]), _mm512_cvtps_pd(_mm256_loadu_ps(st + 2 * V + i + h)),
                                    _mm512_fmadd_pd(_mm512_set1_pd(s.ex[row]), _mm512_cvtps_pd(_mm256_loadu_ps(st + 3 * V + i + h)),
                                                    _mm512_set1_pd(SCREEN_SLACK)));
    __m512d it = _mm512_set1_pd(inv_t), gi = g ? _mm512_loadu_pd(g + i + h) : _mm512_setzero_pd();
    __m512d hi = _mm512_fmadd_pd(_mm512_add_pd(e, bound), it, gi);
    lane[h / 8] = _mm512_max_pd(lane[h / 8], _mm512_fmadd_pd(_mm512_sub_pd(e, bound), it, gi));
    __mmask8 k = _mm512_cmp_pd_mask(hi, lane[h / 8], _CMP_GE_OQ);
    if (!k) continue;
    alignas(64) double up[8];
    _mm512_store_pd(up, hi);
    for (; k; k &= k - 1) kept.emplace_back(i + h + __builtin_ctz(k), up[__builtin_ctz(k)]);
  }
}

// x bf16 [..., K]; codes int32 [V/16, K/4, 16] (kernels.screen_codes); w: the same rows as kernels.pack's bf16; stats
// fp32 [4, V]: sw, C, kx, kq (screen_codes); noise: fp64 [..., V] Gumbels, a row for each input row, or empty (greedy);
// noise_rows: int64 [...], the noise row each input row draws with (a tree's rows share their depth's), or empty (the
// row's own); inv_t 1/T. -> int64 [...]: argmax_i (exact_i * inv_t + noise_i), exact_i what rows_mm_f32 computes for
// the row alone.
at::Tensor lm_head_argmax(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& w, const at::Tensor& stats,
                          const at::Tensor& noise_, const at::Tensor& noise_rows_, double inv_t) {
  auto x = input.contiguous();
  int64_t K = x.size(-1), M = x.numel() / K, blocks = codes.size(0), V = blocks * 16, pairs = K / 2;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && codes.scalar_type() == at::kInt && codes.dim() == 3 && codes.size(1) * 4 == K
              && codes.size(2) == 16 && w.scalar_type() == at::kInt && w.size(0) == blocks && w.size(1) == pairs
              && stats.scalar_type() == at::kFloat && stats.numel() == 4 * V && stats.is_contiguous() && K % 4 == 0,
              "eaglet::lm_head_argmax: bf16 rows, screen_codes' codes and stats, kernels.pack's weight");
  auto noise = noise_.numel() ? noise_.contiguous() : noise_;
  auto noise_rows = noise_rows_.contiguous();
  int64_t D = noise.numel() / V;
  TORCH_CHECK(!noise.numel() || (noise.scalar_type() == at::kDouble && noise.numel() == D * V
                                 && (noise_rows.numel() ? noise_rows.scalar_type() == at::kLong && noise_rows.numel() == M : D == M)),
              "eaglet::lm_head_argmax: fp64 noise, rows of V: one for each input row, or those noise_rows picks");
  std::vector<const double*> g_row(M, nullptr);  // each input row's noise, or none (greedy)
  for (int64_t m = 0; m < M && noise.numel(); m++) {
    int64_t r = noise_rows.numel() ? noise_rows.data_ptr<int64_t>()[m] : m;
    TORCH_CHECK(0 <= r && r < D, "eaglet::lm_head_argmax: a noise row out of range");
    g_row[m] = noise.data_ptr<double>() + r * V;
  }
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto y = at::empty(sizes, x.options().dtype(at::kLong));
  if (!M) return y;
  const auto xb = (const at::BFloat16*)x.data_ptr();
  const int32_t* cw = codes.data_ptr<int32_t>();
  const float* st = stats.data_ptr<float>();
  const bool g = noise.numel() > 0;
  const bool f32 = !g && 127 * 127 * K < (1 << 24);
  Screen s = screen_rows(xb, M, K);
  std::vector<double> floor(M, -INFINITY);  // each row's best lower bound
  std::vector<Kept> kept(M);
  std::mutex merge;
  bool tiles = false;
#ifdef EAGLET_AMX
  tiles = amx_on && K % 64 == 0;  // from one row: a decode step measured faster so than on vpdpbusd (docs/cpu.md)
#endif
  TORCH_CHECK(blocks % 2 == 0, "eaglet::lm_head_argmax: a vocabulary of whole 32s");
  at::parallel_for(0, blocks / 2, 1, [&](int64_t p0, int64_t p1) {  // pairs of blocks
    std::vector<__m512> lanes(M, _mm512_set1_ps(-INFINITY));
    std::vector<__m512d> lanes2(2 * M, _mm512_set1_pd(-INFINITY));
    std::vector<Kept> mine(M);
    alignas(64) int32_t a1[512], a2[512];
#ifdef EAGLET_AMX
    int configured = 0;
#endif
    for (int64_t b = 2 * p0; b < 2 * p1; b += 2) {
      for (int64_t m = 0; m < M; m += 16) {
        int R = (int)std::min<int64_t>(16, M - m);
#ifdef EAGLET_AMX
        if (tiles && configured != R) {
          TileConfig c = {};
          c.palette = 1;
          for (int t = 0; t < 8; t++) c.rows[t] = t < 6 ? R : 16, c.colsb[t] = 64;
          _tile_loadconfig(&c);
          configured = R;
        }
#endif
        block_sums(cw + b * (K / 4) * 16, K, s.u1.data() + m * K, s.u2.data() + m * K, R, a1, a2, tiles);
        for (int half = 0; half < 2; half++)
          for (int r = 0; r < R; r++) {
            int64_t i = (b + half) * 16;
            int32_t *s1 = a1 + half * 256 + r * 16, *s2 = a2 + half * 256 + r * 16;
            if (f32)
              screen16_f32(s1, s2, i, st, V, s, m + r, &lanes[m + r], mine[m + r]);
            else
              screen16_f64(s1, s2, i, st, V, s, m + r, g_row[m + r], inv_t, &lanes2[2 * (m + r)], mine[m + r]);
          }
        for (int r = 0; r < R; r++)
          if (f32) spread(lanes[m + r]); else spread(&lanes2[2 * (m + r)]);
      }
    }
#ifdef EAGLET_AMX
    if (configured) _tile_release();
#endif
    std::lock_guard<std::mutex> hold(merge);
    for (int64_t m = 0; m < M; m++) {
      double best = f32 ? _mm512_reduce_max_ps(lanes[m]) : std::max(_mm512_reduce_max_pd(lanes2[2 * m]), _mm512_reduce_max_pd(lanes2[2 * m + 1]));
      floor[m] = std::max(floor[m], best);
      kept[m].insert(kept[m].end(), mine[m].begin(), mine[m].end());
    }
  });
  const int32_t* wp = (const int32_t*)w.data_ptr();
  int64_t* yp = y.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    alignas(64) float exact[16];
    for (int64_t m = m0; m < m1; m++) {
      const int32_t* xm = (const int32_t*)(xb + m * K);
      int64_t arg = -1, held = -1;
      double top = -INFINITY;
      std::sort(kept[m].begin(), kept[m].end());  // by token: ties go to the lower one, and a block is summed once
      for (auto [i, hi] : kept[m]) {
        if (hi < floor[m]) continue;
        if (i / 16 != held)  // the block's 16 logits as rows_mm_f32 sums them for one row (tile<1, NB>, any NB)
          held = i / 16, tile<1, 1, int32_t, float>(wp + held * pairs * 16, pairs * 16, xm, pairs, pairs, exact, 16, nullptr);
        double score = g ? (double)exact[i % 16] * inv_t + g_row[m][i] : (double)exact[i % 16];
        if (score > top || arg < 0) top = score, arg = i;
      }
      yp[m] = arg;
    }
  });
  return y;
}

// e^x for x <= 0 (softmax after its max is taken; -inf gives 0): Cephes' expf, a degree-6 polynomial after 2^n is split off.
static inline __m512 exp_ps(__m512 x) {
  __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);  // e^x below fp32's normals: 0, as masked keys
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, x), x, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

// The first min(16, n) lanes (none for n <= 0): a row's last partial vector.
static inline __mmask16 lanes16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n > 0 ? (__mmask16)((1u << n) - 1) : 0; }

// The k largest values of each fp32 row (k <= 16), in descending order, the lower index first among equals -> (values,
// int64 indices), as torch.topk. One pass: 16 values at a time against the k-th best so far, and the few that beat it
// inserted in order. aten's topk copies each row into (value, index) pairs and partially sorts them, a draft level's
// cost again for its few rows of the draft vocabulary.
static inline void topk_insert(float* v, int64_t* id, int64_t k, int64_t n, float c, int64_t i) {  // n of k held
  int64_t j = std::min(n, k - 1);
  for (; j > 0 && v[j - 1] < c; j--) v[j] = v[j - 1], id[j] = id[j - 1];
  v[j] = c, id[j] = i;
}

std::tuple<at::Tensor, at::Tensor> topk(const at::Tensor& x_, int64_t k) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() >= 1 && k >= 1 && k <= 16 && k <= x_.size(-1),
              "eaglet::topk: fp32 rows, 1 <= k <= min(16, row length)");
  auto x = x_.contiguous();
  int64_t N = x.size(-1), M = x.numel() / N;
  auto sizes = x.sizes().vec();
  sizes.back() = k;
  auto values = at::empty(sizes, x.options());
  auto indices = at::empty(sizes, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      const float* r = xp + m * N;
      float* v = vp + m * k;
      int64_t* id = ip + m * k;
      for (int64_t i = 0; i < k; i++) topk_insert(v, id, k, i, r[i], i);
      for (int64_t i = k; i < N; i += 16) {
        __mmask16 live = lanes16(N - i);
        __m512 chunk = _mm512_maskz_loadu_ps(live, r + i);
        unsigned above = _mm512_mask_cmp_ps_mask(live, chunk, _mm512_set1_ps(v[k - 1]), _CMP_GT_OQ);
        for (; above; above &= above - 1) {
          int64_t at = i + __builtin_ctz(above);
          if (r[at] > v[k - 1]) topk_insert(v, id, k, k, r[at], at);  // an earlier lane may have raised the bar
        }
      }
    }
  });
  return {values, indices};
}

// One draw per row of softmax(logits * inv_t) (fp32 [..., N]; u [...]: a float64 uniform in [0, 1) a row -> int64 [...]),
// sampling.sample's inverse CDF: the first index whose running sum passes u times the row's total. The exponentials
// stay in a buffer (a 49152-token row: 192 KB) with a sum per 16, so the walk adds 16 at a time up to the right block.
// torch's softmax, float64 cumsum and searchsorted cost more than the rest of a verify's draw (docs/cpu.md).
at::Tensor sample(const at::Tensor& logits, const at::Tensor& u, double inv_t) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && u.scalar_type() == at::kDouble && logits.dim() >= 1 && logits.size(-1) > 0
              && u.numel() * logits.size(-1) == logits.numel(), "eaglet::sample: fp32 rows, a float64 uniform a row");
  auto x = logits.contiguous();
  auto uc = u.contiguous();
  int64_t N = x.size(-1), M = x.numel() / N, NB = (N + 15) / 16;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto y = at::empty(sizes, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* yp = y.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    static thread_local std::vector<float> e, part;
    e.resize(NB * 16), part.resize(NB);
    for (int64_t m = m0; m < m1; m++) {
      const float* r = xp + m * N;
      __m512 best = _mm512_set1_ps(-INFINITY);
      for (int64_t b = 0; b < NB; b++) {
        __mmask16 live = lanes16(N - 16 * b);
        best = _mm512_max_ps(best, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, r + 16 * b));
      }
      __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best)), scale = _mm512_set1_ps((float)inv_t);
      double total = 0;
      for (int64_t b = 0; b < NB; b++) {
        __mmask16 live = lanes16(N - 16 * b);
        __m512 v = _mm512_mask_loadu_ps(top, live, r + 16 * b);
        __m512 ev = _mm512_maskz_mov_ps(live, exp_ps(_mm512_mul_ps(_mm512_sub_ps(v, top), scale)));
        _mm512_storeu_ps(e.data() + 16 * b, ev);
        total += part[b] = _mm512_reduce_add_ps(ev);
      }
      double target = up[m] * total, acc = 0;
      int64_t b = 0, with_mass = 0;
      for (; b < NB && acc + part[b] <= target; b++) {
        acc += part[b];
        with_mass = part[b] > 0 ? b : with_mass;
      }
      // The block whose sum passes the target; should rounding carry the target past every sum, the last with mass.
      // Within it the last token with mass so far, until one passes (its elements added one by one may not).
      int64_t arg = 0;
      for (int64_t i = 16 * (b < NB ? b : with_mass), end = i + 16; i < end; i++)
        if (e[i] > 0 && (arg = i, (acc += e[i]) > target && b < NB)) break;
      yp[m] = arg;
    }
  });
  return y;
}

// 52 random bits an element (int64 [*seed, *shape], sampling.uniform's k), a table for each seed: element i of seed s's
// table is SplitMix64's output for the state mix(s) + (i + 1) * golden, its top 52 bits. A counter-based generator:
// every element computed apart from the others, 8 a vector, where Inductor's randint runs Philox once per element,
// over a sampled cycle's Gumbels: a row of the vocabulary a depth. The seed, 62 bits a table, comes from torch's
// generator (kernels.random_bits), so torch.manual_seed still fixes every draw.
static inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
at::Tensor random_bits(const at::Tensor& seed, at::IntArrayRef shape) {
  TORCH_CHECK(seed.scalar_type() == at::kLong, "eaglet::random_bits: int64 seeds");
  auto seeds = seed.contiguous();
  auto sizes = seeds.sizes().vec();
  sizes.insert(sizes.end(), shape.begin(), shape.end());
  auto y = at::empty(sizes, seeds.options());
  int64_t S = seeds.numel(), n = S ? y.numel() / S : 0;
  const int64_t* sp = seeds.data_ptr<int64_t>();
  uint64_t* yp = (uint64_t*)y.data_ptr<int64_t>();
  constexpr uint64_t golden = 0x9E3779B97F4A7C15ull;
  at::parallel_for(0, S * n, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {  // table t's elements [j0, j1)
      int64_t t = i / n, j0 = i - t * n, j1 = std::min(i1 - t * n, n);
      uint64_t base = splitmix64((uint64_t)sp[t]) + golden, *out = yp + t * n;
      for (int64_t j = j0; j < j1; j++) out[j] = splitmix64(base + (uint64_t)j * golden) >> 12;
      i += j1 - j0;
    }
  });
  return y;
}

// Sixteen vectors -> one whose lane i is the sum of a[i]'s lanes: a transpose-and-add tree, 45 instructions where
// sixteen horizontal sums take about 130. Every lane sums in the same order.
static inline __m512 sum16(const __m512* a) {
  __m512 s[8], u[4];
  for (int i = 0; i < 8; i++)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Mask slots s.. (stride apart) as bits, the first min(16, n - s) of them; the rest 0.
static inline __mmask16 mask16(const bool* m, int64_t s, int64_t n, int64_t stride) {
  if (stride == 1 && n - s >= 16) {
    __m128i bits = _mm_loadu_si128((const __m128i*)(m + s));
    return _mm_test_epi8_mask(bits, bits);
  }
  __mmask16 live = 0;
  for (int j = 0; j < 16 && s + j < n; j++) live |= (__mmask16)((unsigned)m[(s + j) * stride] << j);
  return live;
}

// A layer's keys and values were last read a whole pass ago, so they come from memory, a few KB a KV head, too short a
// run for the hardware's prefetchers to reach ahead of the loads: the loops ask for the rows PREFETCH_SLOTS slots on.
static constexpr int64_t PREFETCH_SLOTS = 48;
static inline void prefetch_row(const at::BFloat16* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0);
}

struct Attend {  // one eaglet::attend call: q [B, H, T, D]; k, v [B, Hkv, S, D]; their tree rows kt, vt [B, Hkv, Tt, D]
  const int32_t* q;
  at::BFloat16* y;  // stored [B, T, H, D], the layout the output projection reads: no transpose copy after the call
  const bool* mask;
  int64_t ms[4], H, T, D, Hkv, n[2], row_k[2], row_v[2];
  const at::BFloat16 *k[2], *v[2];  // at batch 0, KV head 0
  int64_t kb[2], kh[2], vb[2], vh[2];  // batch and head strides
  float scale;
};

static inline at::BFloat16* out_row(const Attend& a, int64_t r) {  // query row r = (b, h, t) of [B, H, T] in y's [B, T, H]
  int64_t b = r / (a.H * a.T), h = r / a.T % a.H, t = r % a.T;
  return a.y + ((b * a.T + t) * a.H + h) * a.D;
}

// R query rows r0.. of one KV head (consecutive rows share it) against its keys: the cache's S, then the tree's Tt;
// softmax in fp32. Each block of 16 keys and each pair of values is loaded once for the R rows; a row's sums run in
// the same order whatever rows share its pass, as rows_mm's. score: R rows of S + Tt + 32 floats; pairs: R of half.
template <int C, int R>  // C = head_dim / 32
static void attend_rows(const Attend& a, int64_t r0, float* score, int32_t* pairs) {
  int64_t total = a.n[0] + a.n[1], stride = total + 32, pstride = total / 2 + 32;
  int64_t b = r0 / (a.H * a.T), kvh = r0 / a.T % a.H / (a.H / a.Hkv);
  __m512bh qv[R][C];
  const bool* m[R];
  for (int i = 0; i < R; i++) {
    int64_t r = r0 + i, h = r / a.T % a.H, t = r % a.T;
    for (int c = 0; c < C; c++) qv[i][c] = (__m512bh)_mm512_loadu_si512(a.q + r * a.D / 2 + c * 16);
    m[i] = a.mask + b * a.ms[0] + h * a.ms[1] + t * a.ms[2];
  }
  __m512 top[R];
  for (int i = 0; i < R; i++) top[i] = _mm512_set1_ps(-INFINITY);
  for (int part = 0; part < 2; part++) {
    int64_t n = a.n[part], off = part ? a.n[0] : 0, row = a.row_k[part];
    const at::BFloat16* kp = a.k[part] + b * a.kb[part] + kvh * a.kh[part];
    for (int64_t s0 = 0; s0 < n; s0 += 16) {
      int64_t w = std::min<int64_t>(16, n - s0);
      for (int64_t j = s0 + PREFETCH_SLOTS; j < std::min(n, s0 + 16 + PREFETCH_SLOTS); j++) prefetch_row(kp + j * row, a.D * 2);
      for (int i = 0; i < R; i++) {
        __m512 acc[16];
        if (w == 16) {  // unrolled: the accumulators stay in registers
#pragma GCC unroll 16
          for (int j = 0; j < 16; j++) {
            __m512 x = _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int c = 0; c < C; c++)
              x = _mm512_dpbf16_ps(x, qv[i][c], (__m512bh)_mm512_loadu_si512(kp + (s0 + j) * row + c * 32));
            acc[j] = x;
          }
        } else {
          for (int j = 0; j < 16; j++) {
            acc[j] = _mm512_setzero_ps();
            if (j >= w) continue;
            for (int c = 0; c < C; c++)
              acc[j] = _mm512_dpbf16_ps(acc[j], qv[i][c], (__m512bh)_mm512_loadu_si512(kp + (s0 + j) * row + c * 32));
          }
        }
        __m512 x = _mm512_mask_blend_ps(mask16(m[i], off + s0, off + n, a.ms[3]), _mm512_set1_ps(-INFINITY), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(a.scale)));
        _mm512_storeu_ps(score + i * stride + off + s0, x);  // past n: -inf, then the tree's scores or spare room
        top[i] = _mm512_max_ps(top[i], x);
      }
    }
  }
  float inv[R];
  for (int i = 0; i < R; i++) {
    float* sc = score + i * stride;
    float mx = _mm512_reduce_max_ps(top[i]);
    if (mx == -INFINITY) mx = 0;  // a row that may read nothing: zeros, not NaN
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s = 0; s < total; s += 16) {
      __mmask16 live = lanes16(total - s);
      __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + s), _mm512_set1_ps(mx))));
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(sc + s, e);
    }
    inv[i] = 1.0f / std::max(_mm512_reduce_add_ps(sum), 1e-30f);
    // Probabilities as bf16 pairs (slot s with s + 1 of the same part; an odd last slot pairs with zero), the
    // values' matmul in bf16 as a bf16 GEMM would take it.
    for (int part = 0, at = 0; part < 2; part++) {
      int64_t n = a.n[part], off = part ? a.n[0] : 0;
      for (int64_t s = 0; s < n; s += 2, at++)
        pairs[i * pstride + at] = _mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(
            _mm_set_ps(0.0f, 0.0f, s + 1 < n ? sc[off + s + 1] : 0.0f, sc[off + s])));
    }
  }
  static const at::BFloat16 zeros[256] = {};
  __m512 out[R][2 * C];
  for (int i = 0; i < R; i++)
    for (int c = 0; c < 2 * C; c++) out[i][c] = _mm512_setzero_ps();
  for (int part = 0, at = 0; part < 2; part++) {
    int64_t n = a.n[part], row = a.row_v[part];
    const at::BFloat16* vp = a.v[part] + b * a.vb[part] + kvh * a.vh[part];
    for (int64_t s = 0; s < n; s += 2, at++) {
      bool any = false;
      for (int i = 0; i < R; i++) any |= pairs[i * pstride + at] != 0;
      if (!any) continue;  // masked for every row: the values are not read
      for (int64_t j = s + PREFETCH_SLOTS; j < std::min(n, s + 2 + PREFETCH_SLOTS); j++) prefetch_row(vp + j * row, a.D * 2);
      const at::BFloat16* v0 = vp + s * row;
      const at::BFloat16* v1 = s + 1 < n ? v0 + row : zeros;
      for (int c = 0; c < C; c++) {
        __m512i x0 = _mm512_loadu_si512(v0 + c * 32), x1 = _mm512_loadu_si512(v1 + c * 32);
        __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
        for (int i = 0; i < R; i++) {
          __m512bh p = (__m512bh)_mm512_set1_epi32(pairs[i * pstride + at]);
          out[i][2 * c] = _mm512_dpbf16_ps(out[i][2 * c], lo, p);
          out[i][2 * c + 1] = _mm512_dpbf16_ps(out[i][2 * c + 1], hi, p);
        }
      }
    }
  }
  // out[i][2c] holds dims 32c + 8L + 0..3 at lanes 4L + 0..3 (L: 128-bit lane), out[i][2c+1] dims 32c + 8L + 4..7.
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int i = 0; i < R; i++) {
    __m512 norm = _mm512_set1_ps(inv[i]);
    at::BFloat16* yp = out_row(a, r0 + i);
    for (int c = 0; c < C; c++) {
      __m512 lo = _mm512_mul_ps(_mm512_permutex2var_ps(out[i][2 * c], first, out[i][2 * c + 1]), norm);
      __m512 hi = _mm512_mul_ps(_mm512_permutex2var_ps(out[i][2 * c], second, out[i][2 * c + 1]), norm);
      _mm256_storeu_si256((__m256i*)(yp + c * 32), (__m256i)_mm512_cvtneps_pbh(lo));
      _mm256_storeu_si256((__m256i*)(yp + c * 32 + 16), (__m256i)_mm512_cvtneps_pbh(hi));
    }
  }
}

#ifdef EAGLET_AMX
// 16 vectors of 16 int32 -> their transpose (r[i] lane j becomes r[j] lane i): 4x4 blocks within 128-bit lanes, then
// the lanes.
static inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]), u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]), u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; c++) {  // u[4g + c] lane L: rows 4g..4g+3 at column 4L + c
    __m512i p = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), q = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    __m512i p2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), q2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(p, p2, 0x88), r[4 + c] = _mm512_shuffle_i32x4(p, p2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(q, q2, 0x88), r[12 + c] = _mm512_shuffle_i32x4(q, q2, 0xDD);
  }
}

// R (<= 16) query rows r0.. of one KV head on tiles: the keys (cache, then tree) transposed into B tiles 16 at a time,
// scores = Q K^T into a C tile, the softmax in fp32 as attend_rows', then P V with the values' rows paired into B
// tiles. The vector kernel spends a dot product per query and key; here a tile multiply covers 16 of each.
// fresh: the keys and values are not yet in kbuf and vbuf (the previous call was another KV head's).
template <int C>  // C = head_dim / 32 (1, 2 or 4)
static void attend_tiles(const Attend& a, int64_t r0, int R, bool fresh) {
  static thread_local std::vector<int32_t> kbuf, vbuf;
  static thread_local std::vector<float> score;
  static thread_local std::vector<at::BFloat16> probs;
  constexpr int D = 32 * C, NT = D / 16;
  int64_t total = a.n[0] + a.n[1], blocks = (total + 15) / 16, tpad = (total + 31) / 32 * 32;
  int64_t b = r0 / (a.H * a.T), kvh = r0 / a.T % a.H / (a.H / a.Hkv);
  kbuf.resize(blocks * C * 256), vbuf.resize(tpad / 32 * NT * 256), score.resize(16 * tpad), probs.resize(16 * tpad);
  auto key = [&](int64_t s, bool values) -> const at::BFloat16* {  // key or value row s of the cache and tree rows
    int part = s >= a.n[0];
    int64_t j = s - (part ? a.n[0] : 0);
    return values ? a.v[part] + b * a.vb[part] + kvh * a.vh[part] + j * a.row_v[part]
                  : a.k[part] + b * a.kb[part] + kvh * a.kh[part] + j * a.row_k[part];
  };
  for (int64_t kb = 0; kb < blocks * fresh; kb++)  // B tiles of K^T: row p = input pair p of 16 keys
    for (int c = 0; c < C; c++) {
      __m512i r[16];
      for (int64_t j = kb * 16 + PREFETCH_SLOTS; c == 0 && j < std::min(total, kb * 16 + 16 + PREFETCH_SLOTS); j++) prefetch_row(key(j, false), D * 2);
      for (int j = 0; j < 16; j++)
        r[j] = kb * 16 + j < total ? _mm512_loadu_si512(key(kb * 16 + j, false) + c * 32) : _mm512_setzero_si512();
      transpose16(r);
      for (int p = 0; p < 16; p++) _mm512_storeu_si512(kbuf.data() + (kb * C + c) * 256 + p * 16, r[p]);
    }
  for (int64_t s = 0; s < tpad * fresh; s += 2) {  // B tiles of V: row m = values s, s + 1 paired, 16 dims a tile
    for (int64_t j = s + PREFETCH_SLOTS; j < std::min(total, s + 2 + PREFETCH_SLOTS); j++) prefetch_row(key(j, true), D * 2);
    for (int n = 0; n < NT; n++) {
      __m256i x0 = s < total ? _mm256_loadu_si256((const __m256i*)(key(s, true) + n * 16)) : _mm256_setzero_si256();
      __m256i x1 = s + 1 < total ? _mm256_loadu_si256((const __m256i*)(key(s + 1, true) + n * 16)) : _mm256_setzero_si256();
      __m256i lo = _mm256_unpacklo_epi16(x0, x1), hi = _mm256_unpackhi_epi16(x0, x1);
      int32_t* row = vbuf.data() + ((s / 32) * NT + n) * 256 + (s % 32) / 2 * 16;
      _mm256_storeu_si256((__m256i*)row, _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256((__m256i*)(row + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
  }
  amx_config(R);
  const int32_t* q = a.q + r0 * D / 2;
  _tile_loadd(1, q, D * 2);
  if constexpr (C > 1) _tile_loadd(2, q + 16, D * 2);
  if constexpr (C > 2) { _tile_loadd(3, q + 32, D * 2); _tile_loadd(4, q + 48, D * 2); }
  for (int64_t kb = 0; kb < blocks; kb++) {
    _tile_zero(0);
    const int32_t* kt = kbuf.data() + kb * C * 256;
    _tile_loadd(5, kt, 64); _tile_dpbf16ps(0, 1, 5);
    if constexpr (C > 1) { _tile_loadd(6, kt + 256, 64); _tile_dpbf16ps(0, 2, 6); }
    if constexpr (C > 2) { _tile_loadd(7, kt + 512, 64); _tile_dpbf16ps(0, 3, 7); _tile_loadd(5, kt + 768, 64); _tile_dpbf16ps(0, 4, 5); }
    _tile_stored(0, score.data() + kb * 16, tpad * 4);
  }
  MEMORY_BARRIER
  float inv[16];
  for (int i = 0; i < R; i++) {
    int64_t r = r0 + i, h = r / a.T % a.H, t = r % a.T;
    const bool* m = a.mask + b * a.ms[0] + h * a.ms[1] + t * a.ms[2];
    float* sc = score.data() + i * tpad;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < total; s += 16) {
      __m512 x = _mm512_mask_blend_ps(mask16(m, s, total, a.ms[3]), _mm512_set1_ps(-INFINITY), _mm512_mul_ps(_mm512_loadu_ps(sc + s), _mm512_set1_ps(a.scale)));
      _mm512_storeu_ps(sc + s, x);
      top = _mm512_max_ps(top, x);
    }
    float mx = _mm512_reduce_max_ps(top);
    if (mx == -INFINITY) mx = 0;  // a row that may read nothing: zeros, not NaN
    __m512 sum = _mm512_setzero_ps();
    at::BFloat16* pr = probs.data() + i * tpad;
    for (int64_t s = 0; s < tpad; s += 16) {
      __mmask16 live = lanes16(total - s);
      __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + s), _mm512_set1_ps(mx))));
      sum = _mm512_add_ps(sum, e);
      store16(pr + s, e);
    }
    inv[i] = 1.0f / std::max(_mm512_reduce_add_ps(sum), 1e-30f);
  }
  MEMORY_BARRIER
  alignas(64) float buf[256];
  for (int n0 = 0; n0 < NT; n0 += 4) {  // 4 C tiles of 16 dims at a time
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kc = 0; kc < tpad / 32; kc++) {
      _tile_loadd(4, probs.data() + kc * 32, tpad * 2);
      const int32_t* vt = vbuf.data() + (kc * NT + n0) * 256;
      _tile_loadd(5, vt, 64); _tile_dpbf16ps(0, 4, 5);
      if constexpr (NT > 1) { _tile_loadd(6, vt + 256, 64); _tile_dpbf16ps(1, 4, 6); }
      if constexpr (NT > 2) { _tile_loadd(7, vt + 512, 64); _tile_dpbf16ps(2, 4, 7); _tile_loadd(5, vt + 768, 64); _tile_dpbf16ps(3, 4, 5); }
    }
    for (int n = 0; n < std::min(4, NT - n0); n++) {
      switch (n) {
        case 0: _tile_stored(0, buf, 64); break;
        case 1: _tile_stored(1, buf, 64); break;
        case 2: _tile_stored(2, buf, 64); break;
        case 3: _tile_stored(3, buf, 64); break;
      }
      MEMORY_BARRIER
      for (int i = 0; i < R; i++)
        store16(out_row(a, r0 + i) + (n0 + n) * 16, _mm512_mul_ps(_mm512_loadu_ps(buf + i * 16), _mm512_set1_ps(inv[i])));
    }
  }
}
#endif

template <int C>
static void attend_all(const Attend& a, int64_t B) {
  // The rows of one KV head are consecutive (G heads x T queries); they go in chunks of up to RMAX rows sharing their
  // loads, chunks of a group differing by at most a row, with enough chunks to keep every thread busy.
  constexpr int RMAX = C <= 2 ? 4 : (C == 4 ? 2 : 1);
  int64_t per = a.H / a.Hkv * a.T, groups = B * a.Hkv, rows = RMAX;
  while (rows > 1 && groups * ((per + rows - 1) / rows) < 4 * at::get_num_threads()) rows--;
  int64_t chunks = (per + rows - 1) / rows;
#ifdef EAGLET_AMX
  if (amx_on && C <= 4 && per >= amx_attend_rows) {  // tiles of up to 16 rows of a KV head, split evenly
    int64_t tiles = (per + 15) / 16;
    at::parallel_for(0, groups * tiles, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; c++) {
        int64_t g = c / tiles, k = c % tiles, lo = k * per / tiles, hi = (k + 1) * per / tiles;
        attend_tiles<C <= 4 ? C : 4>(a, g * per + lo, (int)(hi - lo), c == c0 || k == 0);
      }
      _tile_release();
    });
    return;
  }
#endif
  at::parallel_for(0, groups * chunks, 1, [&](int64_t c0, int64_t c1) {
    int64_t total = a.n[0] + a.n[1];
    std::vector<float> score(RMAX * (total + 32));
    std::vector<int32_t> pairs(RMAX * (total / 2 + 32));
    for (int64_t c = c0; c < c1; c++) {
      int64_t g = c / chunks, k = c % chunks, lo = k * per / chunks, hi = (k + 1) * per / chunks, r0 = g * per + lo;
      switch (hi - lo) {
        case 1: attend_rows<C, 1>(a, r0, score.data(), pairs.data()); break;
        case 2: attend_rows<C, RMAX >= 2 ? 2 : 1>(a, r0, score.data(), pairs.data()); break;
        case 3: attend_rows<C, RMAX >= 3 ? 3 : 1>(a, r0, score.data(), pairs.data()); break;
        default: attend_rows<C, RMAX>(a, r0, score.data(), pairs.data()); break;
      }
    }
  });
}

at::Tensor attend(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                  const at::Tensor& kt, const at::Tensor& vt, double scale) {
  auto q = q_.contiguous();
  int64_t D = q.size(3);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && (D == 32 || D == 64 || D == 128 || D == 256)
              && k.stride(3) == 1 && v.stride(3) == 1 && kt.stride(3) == 1 && vt.stride(3) == 1 && mask.dim() == 4
              && mask.size(3) == k.size(2) + kt.size(2) && mask.scalar_type() == at::kBool,
              "eaglet::attend: bf16 q, k, v, head_dim 32/64/128/256; mask [B, H, T, S + Tt]");
  auto y = at::empty_strided(q.sizes(), {q.size(1) * q.size(2) * D, D, q.size(1) * D, 1}, q.options());  // [B, T, H, D]
  Attend a;
  a.q = (const int32_t*)q.data_ptr();
  a.y = y.data_ptr<at::BFloat16>();
  a.mask = mask.data_ptr<bool>();
  for (int i = 0; i < 4; i++) a.ms[i] = mask.stride(i);
  a.H = q.size(1), a.T = q.size(2), a.D = D, a.Hkv = k.size(1), a.scale = (float)scale;
  const at::Tensor* keys[2] = {&k, &kt};
  const at::Tensor* values[2] = {&v, &vt};
  for (int p = 0; p < 2; p++) {
    a.n[p] = keys[p]->size(2);
    a.k[p] = (const at::BFloat16*)keys[p]->data_ptr(), a.kb[p] = keys[p]->stride(0), a.kh[p] = keys[p]->stride(1), a.row_k[p] = keys[p]->stride(2);
    a.v[p] = (const at::BFloat16*)values[p]->data_ptr(), a.vb[p] = values[p]->stride(0), a.vh[p] = values[p]->stride(1), a.row_v[p] = values[p]->stride(2);
  }
  switch (D / 32) {
    case 1: attend_all<1>(a, q.size(0)); break;
    case 2: attend_all<2>(a, q.size(0)); break;
    case 4: attend_all<4>(a, q.size(0)); break;
    case 8: attend_all<8>(a, q.size(0)); break;
  }
  return y;
}

TORCH_LIBRARY(eaglet, m) {
  m.def("rows_mm(Tensor x, Tensor w) -> Tensor");
  m.def("rows_mm_f32(Tensor x, Tensor w) -> Tensor");
  m.def("rows_mm_int8(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("amx_set(bool on, int min_rows, int attend_rows) -> bool", &amx_set);
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("lm_head_argmax(Tensor x, Tensor codes, Tensor w, Tensor stats, Tensor noise, Tensor noise_rows, float inv_t) -> Tensor");
  m.def("topk(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("sample(Tensor logits, Tensor u, float inv_t) -> Tensor");
  m.def("random_bits(Tensor seed, int[] shape) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor k_tree, Tensor v_tree, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(eaglet, CPU, m) {
  m.impl("rows_mm", &rows_mm);
  m.impl("rows_mm_f32", &rows_mm_f32);
  m.impl("rows_mm_int8", &rows_mm_int8);
  m.impl("argmax", &argmax);
  m.impl("lm_head_argmax", &lm_head_argmax);
  m.impl("topk", &topk);
  m.impl("sample", &sample);
  m.impl("random_bits", &random_bits);
  m.impl("attend", &attend);
}
