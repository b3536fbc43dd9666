# The fp32 rows kernel (kernels_fp32.cpp, AVX2): what it computes, that a row's values do not depend on the rows beside
# it, and the layer around it (packing, vmap, a compiled graph, the hand-off to the GEMM). Runs where the CPU has AVX2
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
    assert linears.packed_kernel(torch.float32) == "fp32 rows kernel"
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.vmap(layer)(x), linear(x), rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False, cpp_wrapper=False):
            out, (code, *_) = run_and_get_code(torch.compile(layer, fullgraph=True), x)
        torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)
        assert "rows_mm_fp32" in code
        layer.packed = torch.zeros_like(layer.packed)
        many = torch.randn(linears.GEMM_ROWS, 64)
        torch.testing.assert_close(layer(many), linear(many), rtol=1e-5, atol=1e-5)
        assert torch.equal(layer(many[:-1]), linear.bias.expand(linears.GEMM_ROWS - 1, 48))
