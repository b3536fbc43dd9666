# The CPU's float linears: weights prepacked once for oneDNN (PackedLinear) or, where kernels.py's rows kernels run
# (bf16 on AVX512-BF16, fp32 on AVX2, a GGUF's block codes of fp32 weights), for them (RowsLinear; RowsLinearInt8 for a bf16 draft head), and the two Inductor adjustments a packed weight that is a
# graph input needs. cpu/__init__.py swaps them in for a model's nn.Linear layers (pack_linears).
import functools

import torch
import torch.nn as nn
from torch import Tensor

from cpu import kernels
from quant import quantize_int8, replace_linears

GEMM_ROWS = 2048  # rows from which a bf16 RowsLinear hands its product to oneDNN's GEMM


class PackedLinear(nn.Linear):
    """nn.Linear whose CPU forward reads its weight prepacked in oneDNN's blocked layout, packed once here. An
    unpacked bf16 weight costs oneDNN a reorder at every call (docs/cpu.md). Inductor's freezing packs too, but as
    constants of each graph, which every graph copies and its FX graph cache refuses as it comes
    (inductor.cache_frozen_graphs lets it store them, for --compile max); a packed buffer
    is an ordinary graph input, one copy for every graph (lower_packed_linear_as_a_call makes the op a plain call)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # kept: loaders, converters and non-CPU devices read it
        self.register_buffer("packed", None, persistent=False)
        self.register_load_state_dict_post_hook(PackedLinear.repack)  # new weights, new packed copy
        self.pack()
        batch_packed_linear()

    def pack(self):
        # oneDNN's bf16 kernels need a CPU it supports them on (the check Inductor's own prepacking makes); else nn.Linear
        dtypes = (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
        cpu = self.weight.device.type == "cpu" and self.weight.dtype in dtypes
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1) if cpu else None

    @staticmethod
    def repack(module, incompatible_keys):
        module.pack()

    def _apply(self, fn, recurse=True):
        self.packed = None  # an opaque oneDNN tensor neither moves nor casts: pack the moved weight again
        super()._apply(fn, recurse)
        self.pack()
        return self

    def __getstate__(self):  # deepcopy, pickle: an opaque oneDNN tensor has no storage to copy; the copy packs its own
        return self.__dict__ | {"_buffers": self._buffers | {"packed": None}}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.pack()

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None or x.dtype != self.weight.dtype:
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class RowsLinear(PackedLinear):
    """PackedLinear whose weight is packed for a rows kernel instead (where kernels.fits it: bf16 on AVX512-BF16, fp32
    on AVX2): the weight read once for up to 16 rows (fp32: 6 a pass, the weight from cache for the next 6), where oneDNN and the GEMM
    templates turn compute-bound past a few. From GEMM_ROWS rows on (a long prompt's prefill, a batch of prompts)
    oneDNN's GEMM on the plain weight is faster."""

    fp32_out = False  # logits_in_fp32: a bf16 weight's sums written as they are, not rounded to bf16

    def pack(self):
        fits, w = kernels.fits(self), self.weight.detach()
        codes = kernels.block_codes(w) if fits and w.dtype == torch.float32 else None
        self.packed = None if not fits else kernels.pack(w) if w.dtype == torch.bfloat16 else codes[0] if codes \
            else kernels.pack_fp32(w)
        # An fp32 weight that is a GGUF's Q4_1 or Q8_0 blocks, bit for bit, is read as its int8 codes with a scale and
        # an offset every 32 inputs: a quarter of the bytes, the same fp32 weights and sums (kernels_fp32.cpp).
        self.register_buffer("scales", codes[1] if codes else None, persistent=False)
        self.screen()

    def screen(self):
        """An LM head's int8 codes and error bounds (kernels.screen_codes), from which kernels.lm_head_argmax draws
        without computing every logit, where it serves; else none."""
        serves = self.fp32_out and self.packed is not None and kernels.screens(self)
        codes, stats = kernels.screen_codes(self.weight.detach()) if serves else (None, None)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("stats", stats, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        gemm = not self.fp32_out and x.numel() >= GEMM_ROWS * self.in_features  # fp32 logits stay the kernel's
        if self.packed is None or x.dtype != self.weight.dtype or gemm:
            return nn.Linear.forward(self, x)
        if self.scales is not None:
            y = torch.ops.eaglet.rows_mm_codes(x, self.packed, self.scales)
        else:
            op = torch.ops.eaglet.rows_mm_fp32 if x.dtype == torch.float32 else torch.ops.eaglet.rows_mm_f32 if self.fp32_out \
                else torch.ops.eaglet.rows_mm
            y = op(x, self.packed)
        return y if self.bias is None else y + self.bias


class RowsLinearInt8(RowsLinear):
    """RowsLinear reading int8 codes of its weight (quantize_int8's, one scale per output), half the bytes: for a draft
    head, whose outputs only rank drafts, the verify deciding what is kept. A cycle reads the head first just after the
    verify streamed the whole target through the caches, so its bytes come cold: half of them halves its time, at the
    same tau (docs/cpu.md)."""

    def pack(self):
        bf16 = self.weight.dtype == torch.bfloat16 and kernels.fits(self)
        codes, scales = quantize_int8(self.weight.detach()) if bf16 else (None, None)
        self.packed = None if codes is None else kernels.pack_int8(codes)
        self.register_buffer("scales", scales, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None or x.dtype != self.weight.dtype:
            return nn.Linear.forward(self, x)
        y = torch.ops.eaglet.rows_mm_int8(x, self.packed, self.scales)
        return y if self.bias is None else y + self.bias


def draft_head_in_int8(head: nn.Module) -> nn.Module:
    """Every packed bf16 linear of a draft head (pack_linears' RowsLinear) as a RowsLinearInt8; others unchanged."""
    def int8(linear):
        bf16 = type(linear) is RowsLinear and linear.packed is not None and linear.weight.dtype == torch.bfloat16
        return RowsLinearInt8(linear) if bf16 else linear

    replace_linears(head, int8)
    return head


def logits_in_fp32(model: nn.Module) -> nn.Module:
    """A bf16 model's LM head as a RowsLinear writing fp32 logits, where the rows kernel runs (else unchanged). Rounded
    to bf16, logits near 25 lie 0.125 apart and near-ties break by token id: SmolLM2 answered "What is the capital of
    France?" with "L'Étoile..." where fp32 says "The capital of France is Paris." (25.33 against 25.24 in fp32; 25.38
    both in bf16; 25.43 against 25.34 as fp32 sums of the same bf16 products). No autograd: for decoding only."""
    if model.output.weight.dtype == torch.bfloat16 and kernels.fits(model.output):
        if not isinstance(model.output, RowsLinear):
            model.output = RowsLinear(model.output)
        if not model.output.fp32_out:  # prepared once already (the sizing's, then the Generator's): screened once
            model.output.fp32_out = True
            model.output.screen()
    return model


def screens(linear: nn.Module) -> bool:
    """Whether kernels.lm_head_argmax draws from this LM head (cpu.lm_head_draw asks)."""
    return getattr(linear, "codes", None) is not None


def pack_linears(*models):
    """Every float nn.Linear of the CPU models given (None: skipped) in place as a RowsLinear (bf16 on a CPU with
    AVX512-BF16, fp32 with AVX2) or a PackedLinear, where this build has oneDNN. The CPU's compiled steps read them so; other devices
    stay as they are."""
    lower_packed_linear_as_a_call()
    for model in models:
        if model is not None and next(model.parameters()).device.type == "cpu" and torch.backends.mkldnn.is_available():
            replace_linears(model, pack_linear)


def pack_linear(linear: nn.Linear) -> nn.Linear:
    """A rows kernel where one serves (kernels.cpp's bf16 on AVX512-BF16, kernels_fp32.cpp's fp32 on AVX2); else
    oneDNN's packed layout."""
    if isinstance(linear, PackedLinear):
        return linear
    return RowsLinear(linear) if kernels.fits(linear) else PackedLinear(linear)


def packed_kernel(linear: nn.Linear) -> str:
    """What runs this CPU linear once packed (part of the keys of measured costs: the kernels cost differently)."""
    dtype = linear.weight.dtype
    if dtype == torch.float32 and kernels.build_fp32():
        codes = linear.scales is not None if isinstance(linear, RowsLinear) else kernels.block_codes(linear.weight) is not None
        return "fp32 rows kernel" + " over block codes" * codes
    if dtype != torch.bfloat16 or not kernels.build():
        return "oneDNN"
    return f"rows kernel, AMX from {kernels.AMX_MIN_ROWS} rows" if kernels.AMX else "rows kernel"


@functools.cache
def lower_packed_linear_as_a_call():
    """Inductor lowers oneDNN's packed linear only for a weight it packed itself (a frozen constant; it asserts
    so); PackedLinear's is a graph input, so the op becomes a plain call of the same kernel. Its post-grad pass
    fuses a following add into the op's `.binary` overload, which has no shape function: one is given here."""
    import torch._inductor.lowering as lowering
    import torch._inductor.mkldnn_lowerings  # noqa: F401  (registers the lowerings replaced here)

    torch.library.register_fake("mkldnn::_linear_pointwise.binary")(lambda x, other, w, b, attr: torch.empty_like(other))
    for op in (torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._linear_pointwise.binary):
        lowering.lowerings.pop(op, None)
        lowering.make_fallback(op)


@functools.cache
def batch_packed_linear():
    """oneDNN's packed linear has no vmap rule: under batch.py's vmap its fallback ran it once per row, each row
    reading the whole weight (compiled: B unrolled calls), so a batch of B cost about B single steps. A linear
    treats any leading dims as rows, so the rule is one call with the batch dim moved to the front (a plain linear
    instead, unpacked, is slower)."""

    def rule(info, in_dims, x, weight, bias, attr, scalars, algorithm):
        if any(d is not None for d in in_dims[1:3]):
            raise NotImplementedError("a packed linear batched over its weights")
        x = x if in_dims[0] is None else x.movedim(in_dims[0], 0)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, scalars, algorithm), None if in_dims[0] is None else 0

    torch.library.register_vmap("mkldnn::_linear_pointwise", rule)


