# Two hand-written kernels for bf16 passes of few rows on a CPU with AVX512-BF16, built on first use (g++ through
# torch.utils.cpp_extension): a linear layer (rows_mm) and attention for few queries (attend).
#
# A decode step, a tree verify, a draft level and a lookup chain multiply 1 to ~16 rows by every weight. Without
# AMX, Inductor's GEMM templates widen bf16 to fp32 (CppMicroGemmFP32Vec) and turn compute-bound past 3 rows, and
# oneDNN does not overlap its compute with streaming cold weights (BENCHMARKS.md). vdpbf16ps multiplies bf16 pairs
# natively, 32 products an instruction. The weight is stored [out/16, in/2, 16] int32: a 64-byte load is 16 outputs'
# next 2 inputs, read once and fed to every row's accumulator, so the weight streams from memory once for up to 16
# rows and no sum crosses lanes. attend scores each query row against its KV head's keys with the same instruction,
# then takes the softmax and the values in fp32; Inductor's fused loops for the same took 2.3x as long. In both, a row's
# sums run in the same order whatever rows share its pass (rows_mm: a verify's linears give the one-row step's values).
import functools
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

LANES = 16  # outputs a vector holds (fp32 accumulators)
ATTENDS = False  # eaglet::attend is registered (available() built the kernels)

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

// R rows (<= 16) times NB blocks of 16 outputs: NB * R accumulators in registers, NB weight loads per input pair.
template <int R, int NB>
static inline void tile(const int32_t* __restrict w, int64_t block, const int32_t* __restrict x, int64_t xs, int64_t pairs,
                        at::BFloat16* __restrict y, int64_t ys) {
  __m512 acc[NB][R];
#pragma GCC unroll 16
  for (int b = 0; b < NB; b++)
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[b][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p++) {
    __m512i wv[NB];
#pragma GCC unroll 16
    for (int b = 0; b < NB; b++) {
      _mm_prefetch((const char*)(w + b * block + p * 16 + 256), _MM_HINT_T0);  // 1 KB ahead: 16 rows at 1.4x the time, not 2x
      wv[b] = _mm512_loadu_si512(w + b * block + p * 16);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      __m512i xv = _mm512_set1_epi32(x[r * xs + p]);  // row r's inputs 2p, 2p+1 in every lane
#pragma GCC unroll 16
      for (int b = 0; b < NB; b++) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], (__m512bh)xv, (__m512bh)wv[b]);
    }
  }
#pragma GCC unroll 16
  for (int b = 0; b < NB; b++)
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
      _mm256_storeu_si256((__m256i*)(y + r * ys + b * 16), (__m256i)_mm512_cvtneps_pbh(acc[b][r]));
}

// Blocks [b0, b1) NB at a time, the rest in halves: NB * R independent accumulators hide vdpbf16ps' latency when rows
// are few.
template <int R, int NB>
static void span(const int32_t* w, int64_t b0, int64_t b1, int64_t pairs, const int32_t* x, at::BFloat16* y, int64_t ys) {
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) tile<R, NB>(w + b * pairs * 16, pairs * 16, x, pairs, pairs, y + b * 16, ys);
  if constexpr (NB > 1)
    if (b < b1) span<R, NB / 2>(w, b, b1, pairs, x, y, ys);
}

template <int R>
static void rows(const int32_t* w, int64_t blocks, int64_t pairs, const int32_t* x, at::BFloat16* y, int64_t ys) {
  constexpr int NB = R <= 2 ? 8 : R <= 4 ? 4 : R <= 12 ? 2 : 1;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { span<R, NB>(w, b0, b1, pairs, x, y, ys); });
}

at::Tensor rows_mm(const at::Tensor& input, const at::Tensor& w) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kInt && w.dim() == 3 && w.size(2) == 16
              && input.size(-1) == 2 * w.size(1) && w.is_contiguous(), "eaglet::rows_mm: bf16 rows, rowsmm.pack's weight");
  auto x = input.contiguous();
  int64_t K = x.size(-1), M = K ? x.numel() / K : 0, blocks = w.size(0), pairs = w.size(1), N = blocks * 16;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  auto xp = (const int32_t*)x.data_ptr();
  auto wp = w.data_ptr<int32_t>();
  auto yp = y.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < M; m += 16) {  // more rows: 16 at a time, the weight read again for each
    auto xm = xp + m * pairs;
    auto ym = yp + m * N;
    switch (std::min<int64_t>(16, M - m)) {
#define ROWS(n) case n: rows<n>(wp, blocks, pairs, xm, ym, N); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
      ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
    }
  }
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

// One query row against the keys of its KV head: the cache's S rows, then a tree verify's own Tt rows; softmax in fp32.
// Each row on its own and in the same order whatever the rows beside it, as rows_mm.
template <int C>  // head_dim / 32
static void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        const at::Tensor& kt, const at::Tensor& vt, double scale, at::Tensor& y) {
  int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2), Tt = kt.size(2);
  auto qp = (const int32_t*)q.data_ptr();
  auto yp = y.data_ptr<at::BFloat16>();
  auto mp = mask.data_ptr<bool>();
  const int64_t ms[4] = {mask.stride(0), mask.stride(1), mask.stride(2), mask.stride(3)};
  const at::Tensor* keys[2] = {&k, &kt};
  const at::Tensor* values[2] = {&v, &vt};
  at::parallel_for(0, B * H * T, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> score(S + Tt + 16);
    for (int64_t r = r0; r < r1; r++) {
      int64_t b = r / (H * T), h = r / T % H, t = r % T, kvh = h / (H / Hkv);
      __m512bh qv[C];
      for (int64_t c = 0; c < C; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qp + r * D / 2 + c * 16);
      const bool* m = mp + b * ms[0] + h * ms[1] + t * ms[2];
      float top = -INFINITY;
      for (int part = 0; part < 2; part++) {
        const at::Tensor& kk = *keys[part];
        int64_t n = part ? Tt : S, off = part ? S : 0, row = kk.stride(2);
        auto kp = (const at::BFloat16*)kk.data_ptr() + b * kk.stride(0) + kvh * kk.stride(1);
        for (int64_t s = 0; s < n; s++) {
          if (!m[(off + s) * ms[3]]) { score[off + s] = -INFINITY; continue; }
          __m512 acc = _mm512_setzero_ps();
          for (int64_t c = 0; c < C; c++)
            acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(kp + s * row + c * 32));
          float x = _mm512_reduce_add_ps(acc) * (float)scale;
          score[off + s] = x;
          top = std::max(top, x);
        }
      }
      __m512 out[2 * C];
      for (int64_t c = 0; c < 2 * C; c++) out[c] = _mm512_setzero_ps();
      if (top == -INFINITY) top = 0;  // a row that may read nothing: zeros, not NaN
      __m512 sum = _mm512_setzero_ps();
      int64_t total = S + Tt;
      for (int64_t s = 0; s < total; s += 16) {
        __mmask16 live = total - s >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (total - s)) - 1);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, score.data() + s), _mm512_set1_ps(top)));
        e = _mm512_maskz_mov_ps(live, e);
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(score.data() + s, e);
      }
      for (int part = 0; part < 2; part++) {
        const at::Tensor& vv = *values[part];
        int64_t n = part ? Tt : S, off = part ? S : 0, row = vv.stride(2);
        auto vp = (const at::BFloat16*)vv.data_ptr() + b * vv.stride(0) + kvh * vv.stride(1);
        for (int64_t s = 0; s < n; s++) {
          float p = score[off + s];
          if (p == 0.0f) continue;
          __m512 pv = _mm512_set1_ps(p);
          for (int64_t c = 0; c < 2 * C; c++) {
            __m256i half = _mm256_loadu_si256((const __m256i*)(vp + s * row + c * 16));
            __m512 vf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));  // bf16 -> fp32
            out[c] = _mm512_fmadd_ps(pv, vf, out[c]);
          }
        }
      }
      __m512 inv = _mm512_set1_ps(1.0f / std::max(_mm512_reduce_add_ps(sum), 1e-30f));
      for (int64_t c = 0; c < 2 * C; c++)
        _mm256_storeu_si256((__m256i*)(yp + r * D + c * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(out[c], inv)));
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
  auto y = at::empty_like(q);
  switch (D / 32) {
    case 1: attend_rows<1>(q, k, v, mask, kt, vt, scale, y); break;
    case 2: attend_rows<2>(q, k, v, mask, kt, vt, scale, y); break;
    case 4: attend_rows<4>(q, k, v, mask, kt, vt, scale, y); break;
    case 8: attend_rows<8>(q, k, v, mask, kt, vt, scale, y); break;
  }
  return y;
}

TORCH_LIBRARY(eaglet, m) {
  m.def("rows_mm(Tensor x, Tensor w) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor k_tree, Tensor v_tree, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(eaglet, CPU, m) {
  m.impl("rows_mm", &rows_mm);
  m.impl("attend", &attend);
}
"""


def cpu_has_bf16_dot() -> bool:
    """AVX512-BF16 (vdpbf16ps), read from the CPU's flags; elsewhere the kernels are never built. EAGLET_KERNELS=0
    turns them off (oneDNN and Inductor's code serve: for comparison, and compiling.choose's quantised targets)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or os.environ.get("EAGLET_KERNELS") == "0":
        return False
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@functools.cache
def available() -> bool:
    """Whether the kernels run here: the CPU has AVX512-BF16 and they built (g++ and ninja, about 30 s the first time;
    torch's extension cache keeps them). A failed build says why once, on stderr, and leaves oneDNN and Inductor's
    code to serve."""
    if not cpu_has_bf16_dot():
        return False
    from torch.utils.cpp_extension import load_inline

    try:
        load_inline("eaglet_rows_mm", cpp_sources=SOURCE, is_python_module=False,
                    extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
                    extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja: a slower path, not a failure
        print(f"eaglet: the bf16 kernels did not build ({' '.join(str(e).split())[:200]}); oneDNN serves", file=sys.stderr)
        return False
    torch.library.register_fake("eaglet::rows_mm")(lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0] * LANES))
    torch.library.register_vmap("eaglet::rows_mm")(batch_rule)
    torch.library.register_fake("eaglet::attend")(lambda q, *_: torch.empty_like(q, memory_format=torch.contiguous_format))
    torch.library.register_vmap("eaglet::attend")(attend_batch_rule)
    global ATTENDS
    ATTENDS = True
    return True


def batch_rule(info, in_dims, x, w):
    """Under batch.py's vmap: leading dims are rows to the kernel, so the batch dim moves to the front, one call."""
    if in_dims[1] is not None:
        raise NotImplementedError("eaglet::rows_mm batched over its weights")
    return torch.ops.eaglet.rows_mm(x.movedim(in_dims[0], 0), w), 0


def attend_batch_rule(info, in_dims, *args):
    """Under batch.py's vmap: the vmapped dim joins the batch dim (an unbatched input is expanded to it), one call."""
    def join(x, dim):
        x = x.expand(info.batch_size, *x.shape) if dim is None else x.movedim(dim, 0)
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    y = torch.ops.eaglet.attend(*(join(x, dim) for x, dim in zip(args[:6], in_dims)), args[6])
    return y.view(info.batch_size, -1, *y.shape[1:]), 0


def attends(q: Tensor) -> bool:
    """Whether eaglet::attend serves these queries (model.attend_few asks while tracing: a flag, not a build)."""
    return ATTENDS and q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-1] in (32, 64, 128, 256)


def pack(weight: Tensor) -> Tensor:
    """bf16 [out, in] -> int32 [out/16, in/2, 16]: element (b, p, i) holds weight[16b + i, 2p : 2p + 2]."""
    out_features, in_features = weight.shape
    return weight.reshape(out_features // LANES, LANES, in_features // 2, 2).transpose(1, 2).contiguous() \
        .view(torch.int32).view(out_features // LANES, in_features // 2, LANES)


def fits(linear: nn.Linear) -> bool:
    w = linear.weight
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.shape[0] % LANES == 0 and w.shape[1] % 2 == 0
            and available())
