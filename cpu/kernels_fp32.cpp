// A linear layer over few fp32 rows on a CPU with AVX2 and FMA (cpu/kernels.py builds it on first use, apart from
// kernels.cpp, which needs AVX-512: this file is compiled for AVX2 alone, so nothing in it can reach an instruction an
// AVX2 CPU lacks).
//
// A decode step, a tree verify and a draft level multiply 1 to ~16 rows by every weight. torch's fp32 linear on an
// AVX2 CPU streams a one-row product well below the memory's bandwidth and turns compute-bound past a few rows at a
// fraction of the FMA units' rate (docs/cpu.md), so a 16-row verify cost several decode steps. Here the weight is
// stored [out/16, in, 16]: input k's 16 outputs are one 64-byte line, two 8-lane vectors, streamed from memory once
// and fed to every row's accumulators; many rows cost FMAs, of which two AVX2 cores have enough for about 6 rows
// before the FMAs, not the weights' bandwidth, are the bound. Each output's sum runs over k in order in one accumulator,
// whatever rows share the pass: a verify's rows get the one-row step's values, bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

constexpr int MAX_ROWS = 6;  // rows a pass takes: 2 x 6 accumulators in AVX2's 16 vector registers, beside 2 weights and an input

// R rows by NB consecutive 16-output blocks (two 8-lane halves each): NB * 2 * R accumulators. w: the first block's
// packed weight, K inputs; blocks K * 16 floats apart. A step loads 2 NB weight vectors and R inputs for 2 NB R FMAs.
template <int R, int NB>
static inline void tile(const float* __restrict w, int64_t K, const float* __restrict x, float* __restrict y, int64_t N) {
  constexpr int H = 2;
  __m256 acc[NB][H][R];
#pragma GCC unroll 16
  for (int b = 0; b < NB; b++)
#pragma GCC unroll 2
    for (int h = 0; h < H; h++)
#pragma GCC unroll 16
      for (int r = 0; r < R; r++) acc[b][h][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
#pragma GCC unroll 16
    for (int b = 0; b < NB; b++) {
      const float* wk = w + b * K * 16 + k * 16;
      _mm_prefetch((const char*)(wk + 256), _MM_HINT_T0);  // 1 KB ahead in this block's stream
#pragma GCC unroll 2
      for (int h = 0; h < H; h++) {
        __m256 wv = _mm256_loadu_ps(wk + h * 8);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[b][h][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * K + k), wv, acc[b][h][r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int b = 0; b < NB; b++)
#pragma GCC unroll 2
    for (int h = 0; h < H; h++)
#pragma GCC unroll 16
      for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * N + b * 16 + h * 8, acc[b][h][r]);
}

// Blocks [b0, b1) for R rows: fewer rows take more blocks at once, enough independent sums to hide the FMA's latency.
template <int R>
static void span(const float* w, int64_t b0, int64_t b1, int64_t K, const float* x, float* y, int64_t N) {
  constexpr int NB = R == 1 ? 4 : R <= 3 ? 2 : 1;
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) tile<R, NB>(w + b * K * 16, K, x, y + b * 16, N);
  for (; b < b1; b++) tile<R, 1>(w + b * K * 16, K, x, y + b * 16, N);  // what is left when NB > 1
}

at::Tensor rows_mm_fp32(const at::Tensor& input, const at::Tensor& w) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 3 && w.size(2) == 16
              && input.size(-1) == w.size(1) && w.is_contiguous(), "eaglet::rows_mm_fp32: fp32 rows, kernels.pack_fp32's weight");
  auto x = input.contiguous();
  int64_t K = x.size(-1), M = K ? x.numel() / K : 0, blocks = w.size(0), N = blocks * 16;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Threads split the blocks. More than MAX_ROWS rows come MAX_ROWS at a time over two blocks before the next two
  // (at most 2 x 96 KB of weights: they stay in L2), so each weight comes from memory once whatever the rows.
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    int64_t group = M <= MAX_ROWS ? b1 - b0 : 2;
    for (int64_t g = b0; g < b1; g += group)
      for (int64_t m = 0; m < M; m += MAX_ROWS) {
        const float* xm = xp + m * K;
        float* ym = yp + m * N;
        switch (std::min<int64_t>(MAX_ROWS, M - m)) {
#define ROWS(n) case n: span<n>(wp, g, std::min(g + group, b1), K, xm, ym, N); break;
          ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#undef ROWS
        }
      }
  });
  return y;
}

// A fragment: kernels.cpp defines the eaglet namespace's other ops where the CPU has AVX-512, and either may load alone.
TORCH_LIBRARY_FRAGMENT(eaglet, m) { m.def("rows_mm_fp32(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(eaglet, CPU, m) { m.impl("rows_mm_fp32", &rows_mm_fp32); }
