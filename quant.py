# Weight-only int8 / int4 quantisation: the QuantLinear layer and the hooks the loaders call (quantize.py is
# the CLI that writes quantised checkpoint directories).
#
# Stored format, the same on every device:
#   int8  weight int8 [out, in] and one scale per output channel: w = q * scale
#   int4  weight uint8 [out, in_padded/2], two codes per byte with the even column in the high nibble, and one
#         scale and zero per group of input columns: w = (q - 8) * scale + zero
# Kernel layouts (tinygemm on CUDA, the CPU int4 kernel's) are built from it whenever the layer is moved or cast.

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import find_multiple

MODES = ("int8", "int4")
GROUPSIZES = (32, 64, 128)
# Rows (tokens) up to which the weight-only kernels run. They are memory bound and tinygemm computes 16-row
# tiles, so up to 16 rows they cost about what one row costs. Past that they lose to dequantising the weight
# once and running a dense tensor-core GEMM, whose time barely grows with rows (gpt-fast's weight-only layers grow
# many times over by 64 rows). A tree verify has about 60 rows, a draft step 1 to topk.
KERNEL_MAX_ROWS = 16
ROWS_CHUNK = 8


# ---------------------------------------------------------------- quantising tensors

def quantize_int8(w: Tensor):
    """Symmetric per output channel -> (int8 codes [out, in], fp32 scales [out])."""
    w = w.float()
    # Scales are rounded to bf16 first, so bf16 activations (scales cast to bf16 at load) see the exact grid.
    scales = (w.abs().amax(dim=1).clamp(min=1e-8) / 127).bfloat16().float()
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def quantize_int4(w: Tensor, groupsize: int):
    """Asymmetric min/max per group -> (packed uint8 [out, in_padded/2], fp32 scales and zeros [out, groups])."""
    out_features, in_features = w.shape
    # Replicating the last column keeps the padding inside the last group's min/max range.
    w = F.pad(w.float(), (0, find_multiple(in_features, groupsize) - in_features), mode="replicate")
    w = w.view(out_features, -1, groupsize)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo).clamp(min=1e-8) / 15).bfloat16().float()
    zeros = (lo + 8 * scales).bfloat16().float()  # the value at the middle code, as the int4 kernels take it
    codes = torch.round((w - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15).to(torch.uint8).flatten(1)
    return codes[:, ::2] << 4 | codes[:, 1::2], scales, zeros


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [out, k/2] -> codes uint8 [out, k]."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).flatten(1)


def block_words(codes: Tensor) -> Tensor:
    """int8 or uint8 codes [out, bytes] -> [out/8, bytes/4, 8] 32-bit words typed fp32, for the *_rows_mm kernels:
    word (b, c, i) holds bytes 4c..4c+3 of output 8b+i, byte j in bits 8j..8j+7 (little endian). Typed fp32 because
    Inductor's AVX2 code loads an int32 vector through a stack copy (a store-forwarding stall each load);
    a float load is direct, and the kernels view the words as int32 again."""
    out_features, nbytes = codes.shape
    return codes.view(torch.int32).view(out_features // 8, 8, nbytes // 4).transpose(1, 2).contiguous().view(torch.float32)


def block_groups(t: Tensor) -> Tensor:
    """Per-group values [out, groups] -> [out/8, groups, 1, 8], the int4 words' order."""
    return t.view(t.shape[0] // 8, 8, -1).transpose(1, 2).contiguous()[:, :, None, :]


# int8_rows_mm and int4_rows_mm are tensor code written for Inductor's CPU backend, which makes each one loop over
# the weight words: bytes or nibbles taken out by shifts, converted once and fed to every row's accumulator (8
# outputs a vector). So the weight is read in its quantised form, a quarter or an eighth of fp32's bytes, faster than
# fp32's F.linear and than torch's int8 pack kernel with fp32 activations (docs/cpu.md); int4 does more decode work
# per byte. Eager, their unfused temporaries would cost far more: compiling_unfrozen() guards them.

def int8_rows_mm(x: Tensor, words: Tensor, scales: Tensor) -> Tensor:
    """x [rows <= ROWS_CHUNK, in] fp32, block_words(int8 weight) -> [rows, out]."""
    words = words.view(torch.int32)
    codes = [((words << (24 - 8 * j)) >> 24).to(x.dtype) for j in range(4)]  # byte j, sign-extended
    cols = x.view(x.shape[0], -1, 4)
    rows = [sum(codes[j] * cols[r, None, :, j, None] for j in range(4)).sum(1).flatten() for r in range(x.shape[0])]
    return torch.stack(rows) * scales


def int4_rows_mm(x: Tensor, words: Tensor, scales: Tensor, offsets: Tensor) -> Tensor:
    """x [rows <= ROWS_CHUNK, in padded] fp32, block_words(int4 weight) viewed [out/8, groups, groupsize/8, 8] ->
    [rows, out]; scales and offsets (zero - 8 * scale) block_groups'. Column 8c + t is nibble t of word c, the even
    column in a byte's high nibble: w = code * scale + offset, summed as scale * (x . codes) + offset * sum(x)."""
    words = words.view(torch.int32)
    codes = [((words >> (8 * (t // 2) + 4 * (1 - t % 2))) & 15).to(x.dtype) for t in range(8)]
    cols = x.view(x.shape[0], *words.shape[1:3], 8)
    rows = []
    for r in range(x.shape[0]):
        dots = sum(codes[t] * cols[r, None, :, :, t, None] for t in range(8))
        rows.append((scales * dots + offsets * cols[r].sum(-1)[None, :, :, None]).sum((1, 2)).flatten())
    return torch.stack(rows)


def compiling_unfrozen() -> bool:
    """Inside a graph torch.compile traces, with the weights left as inputs: where the *_rows_mm kernels pay. Under
    Inductor's freezing (--compile max) the weights are constants, and their decoded byte planes would be folded into
    fp32 constants: as many bytes as the float weight."""
    import torch._inductor.config as inductor_config

    return torch.compiler.is_compiling() and not inductor_config.freezing


def has_tinygemm(device: torch.device) -> bool:
    # tinygemm is built for NVIDIA bf16 tensor cores (sm80+); ROCm builds lack a working int4 path.
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 0)


# ---------------------------------------------------------------- the layer

class QuantLinear(nn.Module):
    """nn.Linear with int8 or int4 weights. The forward picks the kernel by the number of rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool, mode: str, groupsize: int = 0, device=None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown quantization mode {mode!r} (known: {', '.join(MODES)})")
        if mode == "int4" and groupsize not in GROUPSIZES:
            raise ValueError(f"int4 groupsize must be one of {GROUPSIZES}, got {groupsize}")
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        self.groupsize = groupsize if mode == "int4" else 0
        if mode == "int8":
            self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(out_features, device=device))
        else:
            groups = find_multiple(in_features, groupsize) // groupsize
            self.register_buffer("weight", torch.empty(out_features, groups * groupsize // 2, dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.empty(out_features, groups, device=device))
            self.register_buffer("zeros", torch.empty(out_features, groups, device=device))
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features, device=device)) if bias else None)
        # The weight-only kernel's operands for the current device, built by pack(); None: no kernel here.
        self.kernel = None
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("scales_and_zeros", None, persistent=False)
        # The *_rows_mm kernels' operands (block_words, block_groups), for compiled CPU steps
        self.register_buffer("words", None, persistent=False)
        self.register_buffer("group_scales", None, persistent=False)
        self.register_buffer("group_offsets", None, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, groupsize: int = 0) -> "QuantLinear":
        w = linear.weight.detach()
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, mode, groupsize, device=w.device)
        if mode == "int8":
            q.weight, scales = quantize_int8(w)
        else:
            q.weight, scales, zeros = quantize_int4(w, groupsize)
            q.zeros = zeros.to(w.dtype)
        q.scales = scales.to(w.dtype)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        q.pack()
        return q

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, groupsize={self.groupsize}, kernel={self.kernel}"

    def pack(self):
        """Builds the weight-only kernel's operands for the weight's device and the scales' dtype."""
        self._drop_kernels()
        try:  # a build may lack the kernel for this device, dtype or shape: then the small-row path dequantises
            self._pack()
        except (RuntimeError, NotImplementedError):
            self._drop_kernels()

    def _drop_kernels(self):
        self.kernel = self.packed = self.scales_and_zeros = self.words = self.group_scales = self.group_offsets = None

    def _pack(self):
        device, dtype = self.weight.device, self.scales.dtype
        if self.mode == "int8":
            # Which int8 kernel where (measured):
            #   CPU   torch._weight_int8pack_mm with the activations' dtype: at one row it reads the int8 weight
            #         once, a fraction of the bf16 F.linear's time; fp32 activations made the whole int8 decode
            #         slower than fp32, so run it in bf16 (dtypes.py's default where bf16 is native; docs/cpu.md).
            #   CUDA  gpt-fast's F.linear(x, w.to(x.dtype)) * scales (weight_only_mm's fallback), which Inductor
            #         fuses into one GEMV (compiled() turns on coordinate-descent tuning there): the pack kernel is
            #         one thread per output with a serial loop over K, and a 10-row draft step reads every weight
            #         row 10 times.
            #   CPU, compiled, fp32 activations: int8_rows_mm (the int8 pack kernel with fp32 activations is several
            #         times slower on AVX2); bf16 activations keep the pack kernel.
            if device.type != "cpu":
                return
            self.kernel = "int8pack"
            if self.out_features % 8 == 0 and self.in_features % 4 == 0:
                self.words = block_words(self.weight)
        elif device.type == "cpu" and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(self.weight).int(), 2)
            self.kernel = "int4pack_cpu"
            if self.out_features % 8 == 0:  # compiled, fp32 activations: int4_rows_mm (faster than the int4 pack kernel)
                groups = self.scales.shape[1]
                self.words = block_words(self.weight).view(self.out_features // 8, groups, self.groupsize // 8, 8)
                self.group_scales = block_groups(self.scales.float())
                self.group_offsets = block_groups(self.zeros.float() - 8 * self.scales.float())
        elif has_tinygemm(device) and dtype == torch.bfloat16:
            k = self.weight.shape[1] * 2  # tinygemm packs from the [out][in/2] uint8 layout we store
            inner_k_tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(self.weight.contiguous(), inner_k_tiles)
            self.kernel = "tinygemm"
        if self.kernel is None:
            return
        if self.mode == "int4":
            self.scales_and_zeros = torch.stack([self.scales.t(), self.zeros.t()], dim=-1).contiguous()
        self.weight_only_mm(torch.zeros(1, self.in_features, device=device, dtype=dtype))

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / casts move or cast the stored tensors; the kernel layouts depend on both, so rebuild
        # them (as nn.RNNBase re-flattens its weights here).
        super()._apply(fn, recurse)
        if self.weight.device.type != "meta":
            self.pack()
        return self

    def dequantize(self, dtype) -> Tensor:
        """The weight [out, in] in dtype."""
        scales = self.scales.to(dtype)
        if self.mode == "int8":
            # Scale the weight, not the output: past KERNEL_MAX_ROWS rows gpt-fast's linear(x, w.to(dtype)) * scales
            # compiled into a kernel far slower at 64 rows than at one. weight_only_mm keeps that form for the few
            # rows below the threshold, where Inductor makes it one GEMV that reads the int8 weight once.
            return self.weight.to(dtype) * scales[:, None]
        codes = unpack_int4(self.weight).view(self.out_features, -1, self.groupsize).to(dtype)
        w = (codes - 8) * scales[..., None] + self.zeros.to(dtype)[..., None]
        return w.flatten(1)[:, : self.in_features]

    def weight_only_mm(self, x: Tensor) -> Tensor:
        """x [rows, in] -> [rows, out], reading the weight in its quantised form where a kernel exists."""
        rows_kernel = self.words is not None and x.dtype == torch.float32 and compiling_unfrozen()
        if rows_kernel and self.mode == "int8":
            return torch.cat([int8_rows_mm(rows, self.words, self.scales) for rows in x.split(ROWS_CHUNK)])
        if self.kernel == "int8pack":
            return torch._weight_int8pack_mm(x, self.weight, self.scales)
        if self.mode == "int8":
            return F.linear(x, self.weight.to(x.dtype)) * self.scales  # Inductor fuses the convert into a GEMV
        if self.kernel is None:
            return F.linear(x, self.dequantize(x.dtype))
        k = self.weight.shape[1] * 2
        if k != self.in_features:
            x = F.pad(x, (0, k - self.in_features))
        if rows_kernel:
            return torch.cat([int4_rows_mm(rows, self.words, self.group_scales, self.group_offsets) for rows in x.split(ROWS_CHUNK)])
        if self.kernel == "tinygemm":
            return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.groupsize, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.groupsize, self.scales_and_zeros)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features  # a static shape under torch.compile: each graph keeps one branch
        if rows > KERNEL_MAX_ROWS:
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        y = self.weight_only_mm(x.reshape(rows, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


# ---------------------------------------------------------------- float weights prepacked for a CPU
# ---------------------------------------------------------------- models

def replace_linears(model: nn.Module, make):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))


def quantize_model(model: nn.Module, mode: str, groupsize: int = 0) -> nn.Module:
    """Quantises every nn.Linear in place (a tied LM head gets its own copy; the embedding stays float)."""
    replace_linears(model, lambda linear: QuantLinear.from_linear(linear, mode, groupsize))
    return model


def prepare(model: nn.Module, config: dict) -> nn.Module:
    """For a checkpoint whose config.json has "quantization": swaps every nn.Linear of the meta-device model
    for an empty QuantLinear, so that load_state_dict(assign=True) takes the quantised tensors. The loader's
    .to(device, dtype) then casts only the float tensors and builds the kernel layouts."""
    q = config.get("quantization")
    if not q:
        return model
    if config.get("tie_embeddings"):
        raise ValueError("a quantised checkpoint keeps its own LM head, so tie_embeddings must be false")
    replace_linears(model, lambda linear: QuantLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                                      q.get("mode"), q.get("groupsize", 0), device=linear.weight.device))
    return model
