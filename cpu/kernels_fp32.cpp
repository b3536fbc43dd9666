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

#include <atomic>
#include <cmath>

constexpr int MAX_ROWS = 6;  // rows a pass takes: 2 x 6 accumulators in AVX2's 16 vector registers, beside 2 weights and an input

// Where a pass's weights come from: w(b, k, h) is block b's 8 weights of input k, half h, as fp32.
// Plain: kernels.pack_fp32's [out/16, in, 16] floats.
struct Plain {
  const float* w;
  int64_t K;
  const float* at(int64_t b, int64_t k) const { return w + (b * K + k) * 16; }
  void prefetch(int64_t b, int64_t k) const { _mm_prefetch((const char*)(at(b, k) + 256), _MM_HINT_T0); }  // 1 KB ahead
  __m256 operator()(int64_t b, int64_t k, int h) const { return _mm256_loadu_ps(at(b, k) + h * 8); }
};

// Codes: kernels.pack_codes' int8 codes [out/16, in, 16] and, for each 32 inputs, a scale and an offset a output
// [out/16, in/32, 2, 16]: weight = scale * code + offset, the fp32 value a llama.cpp Q8_0 or Q4_1 block dequantises
// to, bit for bit (scale * code is exact: an fp16 scale's 11 bits by a code's 8; one rounding, the add's, as
// dequantising rounds). A quarter of the plain layout's bytes, and the same sums after it.
struct Codes {
  const int8_t* q;
  const float* dm;
  int64_t K;
  const int8_t* at(int64_t b, int64_t k) const { return q + (b * K + k) * 16; }
  void prefetch(int64_t b, int64_t k) const { _mm_prefetch((const char*)(at(b, k) + 1024), _MM_HINT_T0); }
  __m256 operator()(int64_t b, int64_t k, int h) const {
    const float* s = dm + ((b * (K / 32) + k / 32) * 2) * 16 + h * 8;
    __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(at(b, k) + h * 8))));
    return _mm256_fmadd_ps(_mm256_loadu_ps(s), code, _mm256_loadu_ps(s + 16));
  }
};

// R rows by NB consecutive 16-output blocks from b0 (two 8-lane halves each): NB * 2 * R accumulators. A step loads
// 2 NB weight vectors and R inputs for 2 NB R FMAs.
template <int R, int NB, class W>
static inline void tile(const W& w, int64_t b0, int64_t K, const float* __restrict x, float* __restrict y, int64_t N) {
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
      w.prefetch(b0 + b, k);
#pragma GCC unroll 2
      for (int h = 0; h < H; h++) {
        __m256 wv = w(b0 + b, k, h);
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
      for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * N + (b0 + b) * 16 + h * 8, acc[b][h][r]);
}

// Blocks [b0, b1) for R rows: fewer rows take more blocks at once, enough independent sums to hide the FMA's latency.
template <int R, class W>
static void span(const W& w, int64_t b0, int64_t b1, int64_t K, const float* x, float* y, int64_t N) {
  constexpr int NB = R == 1 ? 4 : R <= 3 ? 2 : 1;
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) tile<R, NB>(w, b, K, x, y, N);
  for (; b < b1; b++) tile<R, 1>(w, b, K, x, y, N);  // what is left when NB > 1
}

// y = x w^T for x [..., K] fp32 and a weight of `blocks` 16-output blocks.
template <class W>
static at::Tensor rows(const at::Tensor& input, const W& w, int64_t blocks) {
  auto x = input.contiguous();
  int64_t K = x.size(-1), M = K ? x.numel() / K : 0, N = blocks * 16;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
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
#define ROWS(n) case n: span<n>(w, g, std::min(g + group, b1), K, xm, ym, N); break;
          ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#undef ROWS
        }
      }
  });
  return y;
}

at::Tensor rows_mm_fp32(const at::Tensor& input, const at::Tensor& w) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 3 && w.size(2) == 16
              && input.size(-1) == w.size(1) && w.is_contiguous(), "eaglet::rows_mm_fp32: fp32 rows, kernels.pack_fp32's weight");
  return rows(input, Plain{w.data_ptr<float>(), w.size(1)}, w.size(0));
}

at::Tensor rows_mm_codes(const at::Tensor& input, const at::Tensor& q, const at::Tensor& dm) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && q.dim() == 3 && q.size(2) == 16
              && input.size(-1) == q.size(1) && q.size(1) % 32 == 0 && q.is_contiguous() && dm.scalar_type() == at::kFloat
              && dm.is_contiguous() && dm.sizes() == at::IntArrayRef({q.size(0), q.size(1) / 32, 2, 16}),
              "eaglet::rows_mm_codes: fp32 rows, kernels.pack_codes' codes and scales");
  return rows(input, Codes{q.data_ptr<int8_t>(), dm.data_ptr<float>(), q.size(1)}, q.size(0));
}

// A weight's codes, where it has them: for each 32 inputs of each output a scale, an offset and int8 codes with
// scale * code + offset == weight bit for bit, as a checkpoint converted from a llama.cpp Q4_1 or Q8_0 GGUF (the
// default model's) holds. Q4_1's offset is the block's least weight (code 0) and its scale about (greatest - least) /
// 15; Q8_0's offset is 0 and its scale the largest magnitude / 127. Both scales are fp16 values, so scale * code is
// exact in fp32; the fp16 value nearest the estimate and the two beside it are tried. Returns the codes [out, in] and
// the scales and offsets [out, in/32, 2], or empty tensors if any block has none (the weight stays fp32).
static bool block_code(const float* w, int8_t* q, float* dm) {
  float lo = w[0], hi = w[0];
  for (int j = 1; j < 32; j++) lo = std::min(lo, w[j]), hi = std::max(hi, w[j]);
  struct Form { float offset, span; int qlo, qhi; } forms[2] = {{lo, (hi - lo) / 15, 0, 15}, {0.f, std::max(-lo, hi) / 127, -128, 127}};
  for (int step : {0, -1, 1})
    for (const Form& f : forms) {
      c10::Half h(f.span);
      if (!std::isfinite(f.span) || (step < 0 && h.x == 0)) continue;
      h.x += step;
      float d = h;
      bool ok = std::isfinite(d);
      for (int j = 0; ok && j < 32; j++) {
        float c = d == 0 ? 0 : std::min<float>(f.qhi, std::max<float>(f.qlo, std::nearbyint((w[j] - f.offset) / d)));
        q[j] = (int8_t)c;
        ok = d * c + f.offset == w[j];
      }
      if (ok) {
        dm[0] = d, dm[1] = f.offset;
        return true;
      }
    }
  return false;
}

std::tuple<at::Tensor, at::Tensor> block_codes(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "eaglet::block_codes: an fp32 [out, in] weight");
  auto w = weight.contiguous();
  int64_t N = w.size(0), K = w.size(1);
  auto q = at::empty({N, K}, w.options().dtype(at::kChar));
  auto dm = at::empty({N, K / 32, 2}, w.options());
  if (K % 32) return {q.new_empty({0}), dm.new_empty({0})};
  std::atomic<bool> exact{true};
  at::parallel_for(0, N * (K / 32), 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1 && exact; i++)
      if (!block_code(w.data_ptr<float>() + i * 32, q.data_ptr<int8_t>() + i * 32, dm.data_ptr<float>() + i * 2)) exact = false;
  });
  if (!exact) return {q.new_empty({0}), dm.new_empty({0})};
  return {q, dm};
}

// A fragment: kernels.cpp defines the eaglet namespace's other ops where the CPU has AVX-512, and either may load alone.
TORCH_LIBRARY_FRAGMENT(eaglet, m) {
  m.def("rows_mm_fp32(Tensor x, Tensor w) -> Tensor");
  m.def("rows_mm_codes(Tensor x, Tensor q, Tensor dm) -> Tensor");
  m.def("block_codes(Tensor w) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(eaglet, CPU, m) {
  m.impl("rows_mm_fp32", &rows_mm_fp32);
  m.impl("rows_mm_codes", &rows_mm_codes);
  m.impl("block_codes", &block_codes);
}
