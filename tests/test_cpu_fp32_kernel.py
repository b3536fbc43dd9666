# The fp32 rows kernel (kernels_fp32.cpp, AVX2): what it computes, that a row's values do not depend on the rows beside
# it, the block codes of a GGUF's weights it also reads, and the layer around it (packing, vmap, a compiled graph, the
# hand-off to the GEMM). Runs where the CPU has AVX2
# and FMA.
import copy

import pytest
import torch
import torch.nn as nn
from torch._inductor.utils import run_and_get_code

from cpu import kernels, linears

pytestmark = pytest.mark.skipif(not kernels.cpu_has_fma(), reason="needs a CPU with AVX2 and FMA")


@pytest.mark.parametrize("out_features,in_features", [(16, 1), (48, 64), (960, 576), (576, 1536)])
def test_rows_mm_fp32_is_the_product_and_a_row_is_the_same_whatever_rows_share_its_pass(out_features, in_features):
    """Every row count 1-13 (12 share the registers; the 13th starts a second pass), 25 and 40, with leading dims: the
    double-precision product within fp32 rounding of a sum of in_features terms, and each row bit for bit what it is
    alone (a verify's rows must give the decode step's values). A wrong layout, a row read from the wrong place or an
    output half skipped misses by far more."""
    assert kernels.build_fp32()
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features)
    packed = kernels.pack_fp32(w)
    for rows in [*range(1, 14), 25, 40]:
        x = torch.randn(2, rows, in_features)
        y = torch.ops.eaglet.rows_mm_fp32(x, packed)
        ref = x.double() @ w.double().t()
        bound = (x.double().abs() @ w.double().abs().t()) * in_features * 2 ** -24
        assert y.shape == ref.shape and y.dtype == torch.float32
        assert ((y.double() - ref).abs() <= bound).all(), (rows, (y.double() - ref).abs().max())
        alone = torch.ops.eaglet.rows_mm_fp32(x[1, -1:], packed)
        assert torch.equal(alone[0], y[1, -1]), rows


def test_fp32_rows_linear_in_eager_vmapped_and_compiled_passes():
    """linears.pack_linear gives an fp32 nn.Linear a RowsLinear over the fp32 kernel: nn.Linear's product (bias
    included) eagerly, under vmap (batch.py's rows: one call) and in a compiled graph, which calls the kernel (a silent
    fall-back to oneDNN would not). From linears.GEMM_ROWS rows nn.Linear's GEMM serves instead (the packed copy is
    zeroed here, so the two paths tell apart)."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    layer = linears.pack_linear(copy.deepcopy(linear))
    assert type(layer) is linears.RowsLinear and layer.packed.dtype == torch.float32
    assert linears.packed_kernel(layer) == "fp32 rows kernel"
    with torch.no_grad():
        assert_the_product_every_way(layer, linear, torch.randn(3, 5, 64), "rows_mm_fp32")
        layer.packed = torch.zeros_like(layer.packed)
        many = torch.randn(linears.GEMM_ROWS, 64)
        torch.testing.assert_close(layer(many), linear(many), rtol=1e-5, atol=1e-5)
        assert torch.equal(layer(many[:-1]), linear.bias.expand(linears.GEMM_ROWS - 1, 48))


def assert_the_product_every_way(layer, linear, x, kernel: str):
    """layer(x) is linear(x) eagerly, under vmap and compiled, and the compiled graph calls kernel."""
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.vmap(layer)(x), linear(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, cpp_wrapper=False):
        out, (code, *_) = run_and_get_code(torch.compile(layer, fullgraph=True), x)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)
    assert kernel in code


def gguf_weights(shape, qtype: str, seed: int = 0) -> torch.Tensor:
    """fp32 weights as a llama.cpp GGUF of this type holds them: quantised and dequantised by gguf-py's reference code
    (what convert_hf_checkpoint.convert_gguf reads the default model's Q4_1 and Q8_0 tensors with)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, qtype)
    w = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=w) * 0.05).numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).copy())


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_block_codes_are_found_for_a_gguf_s_weights_and_give_the_fp32_kernel_s_sums_bit_for_bit(qtype):
    """A weight a Q4_1 or Q8_0 GGUF dequantises to has int8 codes with a scale and an offset every 32 inputs
    (kernels.block_codes); rows_mm_codes over them computes the weights back exactly and sums in the fp32 kernel's
    order, so every row count gives rows_mm_fp32's values over the fp32 weights bit for bit. A code, a scale or an
    offset read from the wrong place, or a weight rounded on the way, would not. Weights that are not such blocks (one
    weight moved by one ulp, plain random fp32) have no codes: they must stay fp32, never be rounded to codes."""
    assert kernels.build_fp32()
    w = torch.cat([gguf_weights((960, 576), qtype), gguf_weights((32, 576), "Q8_0", seed=1)])  # rows of both kinds
    found = kernels.block_codes(w)
    assert found is not None
    codes, dm = found
    assert codes.dtype == torch.int8 and codes.shape == (992 // 16, 576, 16) and dm.shape == (992 // 16, 576 // 32, 2, 16)
    plain = kernels.pack_fp32(w)
    torch.manual_seed(0)
    for rows in [*range(1, 14), 25]:
        x = torch.randn(rows, 576)
        assert torch.equal(torch.ops.eaglet.rows_mm_codes(x, codes, dm), torch.ops.eaglet.rows_mm_fp32(x, plain)), rows
    nudged = w.clone()
    nudged[700, 300] = torch.nextafter(nudged[700, 300], torch.tensor(1.0))
    assert kernels.block_codes(nudged) is None
    assert kernels.block_codes(torch.randn(64, 576)) is None
    assert kernels.block_codes(gguf_weights((64, 64), qtype)[:, :40]) is None  # inputs not a whole number of blocks


def test_a_linear_with_block_codes_runs_on_them_in_eager_vmapped_and_compiled_passes():
    """pack_linear reads a GGUF-valued fp32 weight as its codes (a quarter of the bytes): nn.Linear's product in every
    way it is called, the compiled graph calling rows_mm_codes, and the kernel's name (part of the keys of measured
    costs) saying so; an fp32 weight without codes keeps the plain fp32 kernel."""
    linear = nn.Linear(576, 64, bias=True)
    with torch.no_grad():
        linear.weight.copy_(gguf_weights((64, 576), "Q4_1"))
    layer = linears.pack_linear(copy.deepcopy(linear))
    assert type(layer) is linears.RowsLinear and layer.packed.dtype == torch.int8 and layer.scales is not None
    assert linears.packed_kernel(layer) == linears.packed_kernel(linear) == "fp32 rows kernel over block codes"
    assert linears.packed_kernel(nn.Linear(576, 64)) == "fp32 rows kernel"
    with torch.no_grad():
        assert_the_product_every_way(layer, linear, torch.randn(3, 5, 576), "rows_mm_codes")


def test_compile_auto_times_a_target_with_block_codes_over_codes(tiny_args):
    """--compile auto times packed against the templates on a random model of the target's shapes; for a target read as
    block codes those random weights are made Q8_0 blocks (inductor.as_q8_0_blocks), so packed is timed on codes too."""
    from cpu import inductor
    from model import Transformer

    torch.manual_seed(0)
    model = Transformer(tiny_args())
    inductor.as_q8_0_blocks(model)
    names = {linears.packed_kernel(m) for m in model.modules() if isinstance(m, nn.Linear)}
    assert names == {"fp32 rows kernel over block codes"}
