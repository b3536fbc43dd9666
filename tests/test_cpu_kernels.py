# The bf16 rows kernel (kernels.py, over bf16 weights or int8 codes): what it computes, that a row's values do not depend
# on the rows beside it, and the layer around it (packing, casts, loads, copies, vmap, a compiled graph, a draft head's
# int8 linears). Runs where the CPU has AVX512-BF16; where it has AMX too, the kernels are checked on both paths
# (vdpbf16ps and AMX tiles).
import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch._inductor.utils import run_and_get_code

import quant
import sampling
from cpu import kernels, linears

pytestmark = pytest.mark.skipif(not kernels.cpu_has_bf16_dot(), reason="needs a CPU with AVX512-BF16")


@pytest.fixture(params=["vdpbf16ps", "amx"])
def path(request):
    """The kernels' path for the test: vdpbf16ps everywhere, AMX tiles for every row count where the CPU has them
    (skipped elsewhere)."""
    assert kernels.build()
    if request.param == "amx" and not kernels.AMX:
        pytest.skip("needs a CPU with AMX")
    torch.ops.eaglet.amx_set(request.param == "amx", 1, 1)
    yield request.param
    torch.ops.eaglet.amx_set(kernels.AMX, kernels.AMX_MIN_ROWS, kernels.AMX_ATTEND_ROWS)


def reference(x, w):
    return x.double() @ w.double().t()


@pytest.mark.parametrize("out_features,in_features", [(16, 2), (48, 64), (960, 576), (576, 1536)])
def test_rows_mm_is_the_product(out_features, in_features, path):
    """Every row count 1-17, and past 16 the groups of 16 that share a pass (2, 3 and 4 of them, and 64 then 6), with
    leading dims: the double-precision product rounded once to bf16, give or take one bf16 step (the kernel's fp32 sums
    run in their own order). A wrong layout, a row read from the wrong place or an output block skipped misses by far
    more."""
    assert kernels.build()
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features).bfloat16()
    packed = kernels.pack(w)
    for rows in [*range(1, 18), 32, 33, 40, 64, 70]:
        x = torch.randn(2, rows, in_features).bfloat16()
        y = torch.ops.eaglet.rows_mm(x, packed)
        ref = reference(x, w)
        assert y.shape == ref.shape and y.dtype == torch.bfloat16
        step = ref.abs().clamp(min=in_features ** 0.5 * 1e-3) * 2 ** -7  # one bf16 step at the value's magnitude
        assert ((y.double() - ref).abs() <= step).all(), (rows, (y.double() - ref).abs().max())


def int8_op(w):
    """rows_mm_int8 over quant.quantize_int8's codes of w -> (the product as a function of x, the weight it stands for)."""
    codes, scales = quant.quantize_int8(w)
    packed = kernels.pack_int8(codes)
    return (lambda x: torch.ops.eaglet.rows_mm_int8(x, packed, scales)), codes.double() * scales.double()[:, None]


@pytest.mark.parametrize("out_features,in_features", [(16, 2), (48, 64), (960, 576)])
def test_rows_mm_int8_is_the_product_of_its_codes(out_features, in_features, path):
    """rows_mm_int8 multiplies by codes * scale (one scale per output): the double-precision product rounded once to
    bf16, give or take one bf16 step, for 1-17 and 32-70 rows. The bf16 layout's words, a scale of the wrong output or none
    miss by far more."""
    assert kernels.build()
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features).bfloat16() * torch.rand(out_features, 1).bfloat16()  # scales differ
    op, dequantised = int8_op(w)
    for rows in [*range(1, 18), 32, 33, 40, 64, 70]:
        x = torch.randn(2, rows, in_features).bfloat16()
        y = op(x)
        ref = x.double() @ dequantised.t()
        assert y.shape == ref.shape and y.dtype == torch.bfloat16
        step = ref.abs().clamp(min=in_features ** 0.5 * 1e-3) * 2 ** -7
        assert ((y.double() - ref).abs() <= step).all(), (rows, (y.double() - ref).abs().max())


@pytest.mark.parametrize("op", ["rows_mm", "rows_mm_f32", "rows_mm_int8"])
def test_a_row_does_not_depend_on_its_neighbours(op, path):
    """On either path, row r of an M-row product equals the one-row product of row r bit for bit, for M up to 17 and
    past it in groups of 16 sharing a pass: so a tree verify scores a node exactly as the one-row decode step would (the
    grouping of output blocks and rows changes with M, the order of each output's sum must not). The same for the fp32
    logits of rows_mm_f32 and the int8 codes of rows_mm_int8. Where AMX runs, 1-2 rows take the other path
    (test_amx_takes_the_passes_of_enough_rows)."""
    assert kernels.build()
    torch.manual_seed(1)
    w = torch.randn(3072, 576).bfloat16()
    if op == "rows_mm_int8":
        op = int8_op(w)[0]
    else:
        op = functools.partial(getattr(torch.ops.eaglet, op), w=kernels.pack(w))
    x = torch.randn(70, 576).bfloat16()
    alone = torch.cat([op(x[i : i + 1]) for i in range(70)])
    for rows in [*range(2, 18), 31, 40, 64, 70]:
        assert torch.equal(op(x[:rows]), alone[:rows]), rows


def test_rows_mm_f32_writes_the_sums_unrounded(path):
    """rows_mm_f32 writes the fp32 sums rows_mm rounds: within fp32's rounding of the double-precision product (far
    inside one bf16 step), rows_mm's output being exactly these sums rounded to bf16, for 1 to 17 rows."""
    assert kernels.build()
    torch.manual_seed(2)
    w = torch.randn(960, 576).bfloat16()
    packed = kernels.pack(w)
    x = torch.randn(17, 576).bfloat16()
    for rows in range(1, 18):
        y = torch.ops.eaglet.rows_mm_f32(x[:rows], packed)
        ref = reference(x[:rows], w)
        assert y.dtype == torch.float32 and (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), rows
        assert torch.equal(torch.ops.eaglet.rows_mm(x[:rows], packed), y.bfloat16()), rows


def test_amx_takes_the_passes_of_enough_rows():
    """Where /proc/cpuinfo lists amx_tile and amx_bf16, the kernels take the tiles (Linux granted the tile state) for
    passes of AMX_MIN_ROWS rows or more, and vdpbf16ps below: each pass gives exactly its path's values (the two add a
    row's products in different orders, so their fp32 sums differ in the last bits)."""
    assert kernels.build()
    if not kernels.cpu_has_amx():
        pytest.skip("needs a CPU with AMX")
    assert kernels.AMX
    torch.manual_seed(3)
    w, x = torch.randn(960, 576).bfloat16(), torch.randn(17, 576).bfloat16()
    packed = kernels.pack(w)
    op = lambda rows: torch.ops.eaglet.rows_mm_f32(x[:rows], packed)  # noqa: E731
    try:
        torch.ops.eaglet.amx_set(False, 1, 1)
        vdp = [op(rows) for rows in range(1, 18)]
        torch.ops.eaglet.amx_set(True, 1, 1)
        tiles = [op(rows) for rows in range(1, 18)]
        torch.ops.eaglet.amx_set(True, kernels.AMX_MIN_ROWS, kernels.AMX_ATTEND_ROWS)
        for rows in range(1, 18):
            assert torch.equal(op(rows), (tiles if rows >= kernels.AMX_MIN_ROWS else vdp)[rows - 1]), rows
    finally:
        torch.ops.eaglet.amx_set(kernels.AMX, kernels.AMX_MIN_ROWS, kernels.AMX_ATTEND_ROWS)
    for a, b in zip(vdp, tiles):
        assert not torch.equal(a, b) and (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_logits_in_fp32_break_a_near_tie_by_value():
    """linears.logits_in_fp32: two logits 0.1 apart near 25 round to one bf16 value (0.125 apart there), where argmax
    takes the lower token id; written in fp32 the larger one wins. The Generator installs it on a bf16 target (the LM
    head's weight still the tied embedding's), and its decode step reads fp32 logits."""
    from eaglet import Generator

    assert kernels.build()
    w = torch.zeros(64, 64)
    w[3, :2] = torch.tensor([25.0, 0.1875])  # token 3: 25 + 0.1875 * 1.0625 = 25.19921875
    w[5, :2] = torch.tensor([25.0, 0.28125])  # token 5: 25 + 0.28125 * 1.0625 = 25.298828125
    model = nn.Module()
    model.output = nn.Linear(64, 64, bias=False).bfloat16()
    model.output.weight.data.copy_(w)
    h = torch.zeros(1, 64).bfloat16()
    h[0, :2] = torch.tensor([1.0, 1.0625])
    with torch.no_grad():
        assert model.output(h).argmax().item() == 3  # both round to 25.25: the lower id
        linears.logits_in_fp32(model)
        logits = model.output(h)
    assert logits.dtype == torch.float32 and logits.argmax().item() == 5
    assert logits[0, 5].item() == 25.298828125 and logits[0, 3].item() == 25.19921875

    from conftest import _random_model, _tiny_args

    target = _random_model(_tiny_args(tie_embeddings=True), seed=0).bfloat16()
    gen = Generator(target)
    assert isinstance(target.output, linears.RowsLinear) and target.output.fp32_out
    assert target.output.weight is target.tok_embeddings.weight
    with torch.no_grad():
        assert target.output(torch.randn(2, 64).bfloat16()).dtype == torch.float32
    assert len(gen.generate([1, 2, 3], max_new_tokens=4).token_ids) == 4


def test_rows_linear_follows_its_weight():
    """linears.pack_linears installs linears.RowsLinear for a bf16 weight; it computes what nn.Linear does (bias
    included), packs again when its weight is loaded or cast, keeps its own copy in a deep copy, and cast to fp32
    packs for the fp32 kernel. A stale packed copy would answer with the old weights."""
    assert kernels.build()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48, bias=True)).bfloat16()
    linears.pack_linears(model)
    layer = model[0]
    assert isinstance(layer, linears.RowsLinear) and layer.packed is not None and layer.packed.dtype == torch.int32
    x = torch.randn(3, 5, 64).bfloat16()
    with torch.no_grad():
        expect = lambda lin: (reference(x, lin.weight) + lin.bias.double())  # noqa: E731
        torch.testing.assert_close(layer(x).double(), expect(layer), rtol=2e-2, atol=2e-2)
        other = nn.Linear(64, 48, bias=True).bfloat16()
        layer.load_state_dict(other.state_dict())
        torch.testing.assert_close(layer(x).double(), expect(other), rtol=2e-2, atol=2e-2)
        twin = copy.deepcopy(layer)
        assert twin.packed is not None and twin.packed is not layer.packed and torch.equal(twin(x), layer(x))
        layer.float()
        assert layer.packed is not None and layer.packed.dtype == torch.float32  # the fp32 kernel's layout (AVX2)
        torch.testing.assert_close(layer(x.float()).double(), expect(other.float()), rtol=1e-2, atol=1e-2)
    assert not kernels.fits(nn.Linear(63, 48).bfloat16()) and not kernels.fits(nn.Linear(64, 40).bfloat16())


def test_rows_linear_hands_many_rows_to_the_gemm():
    """From linears.GEMM_ROWS rows a bf16 RowsLinear returns nn.Linear's product (oneDNN's GEMM on the plain weight),
    below them the rows kernel's, which reads the packed copy (zeroed here, so the two paths tell apart); an LM head
    writing fp32 logits keeps the kernel at any row count."""
    assert kernels.build()
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False).bfloat16()
    layer = linears.RowsLinear(copy.deepcopy(linear))
    layer.packed = torch.zeros_like(layer.packed)
    with torch.no_grad():
        many = torch.randn(linears.GEMM_ROWS, 64).bfloat16()
        assert torch.equal(layer(many), linear(many)) and linear(many).any()
        assert not layer(many[: linears.GEMM_ROWS - 1]).any()
        layer.fp32_out = True
        out = layer(many)
        assert out.dtype == torch.float32 and not out.any()


def test_rows_linear_in_compiled_and_vmapped_graphs():
    """Compiled with the CPU's settings (cpp_wrapper) the op is one call per layer and computes the eager values;
    under vmap (batch.py's rows) one call covers every row, not one per row."""
    assert kernels.build()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.SiLU(), nn.Linear(96, 32, bias=False)).bfloat16()
    linears.pack_linears(model)
    x = torch.randn(4, 3, 64).bfloat16()
    with torch.no_grad():
        eager = model(x)
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False, cpp_wrapper=True):
            out, code = run_and_get_code(torch.compile(model, fullgraph=True, dynamic=False), x)
        assert torch.equal(out, eager) and "".join(code).count('"eaglet::rows_mm"') == 2
        assert torch.equal(torch.vmap(model)(x), eager)
        torch._dynamo.reset()
        inductor = dict(fx_graph_cache=False, cpp_wrapper=False)
        with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(inductor):
            out, (code, *_) = run_and_get_code(torch.compile(torch.vmap(model), fullgraph=True), x)
    assert torch.equal(out, eager) and code.count("rows_mm.default(") == 2, code


def attention_reference(q, k, v, mask, kt, vt):
    B, H, T, D = q.shape
    keys = torch.cat([k, kt], 2).repeat_interleave(H // k.shape[1], 1).double()
    values = torch.cat([v, vt], 2).repeat_interleave(H // k.shape[1], 1).double()
    scores = (q.double() @ keys.transpose(-1, -2) * D**-0.5).masked_fill(~mask.expand(B, H, T, -1), float("-inf"))
    return torch.softmax(scores, -1) @ values


@pytest.mark.parametrize("B,H,n_kv,D,S,T,tree", [(1, 9, 3, 64, 200, 1, 0), (1, 9, 3, 64, 130, 9, 9), (2, 4, 2, 128, 37, 5, 3),
                                                 (1, 4, 4, 32, 17, 16, 0), (1, 9, 3, 64, 31, 13, 13), (1, 8, 1, 64, 64, 4, 4)])
def test_attend_is_softmax_attention(B, H, n_kv, D, S, T, tree, path):
    """eaglet::attend over a cache's first S slots (a strided slice, as KVCache.update hands it) and a tree's own rows,
    under a random mask of each shape attend_few takes ([T, S'], [B, 1, T, S'], [B, H, T, S'] expanded), GQA: the
    double-precision softmax attention within bf16's rounding of the result. Rows depend on nothing beside them (on
    either path: the tiles take more than 16 rows of a KV head in several passes, and blocks that straddle the cache's
    end and the tree's start)."""
    assert kernels.build()
    torch.manual_seed(0)
    k, v = (torch.randn(B, n_kv, S + 40, D).bfloat16()[:, :, :S] for _ in range(2))
    kt, vt = (torch.randn(B, n_kv, tree, D).bfloat16() for _ in range(2))
    q = torch.randn(B, T, H, D).bfloat16().transpose(1, 2)  # as Attention.forward makes it
    for mask in (torch.rand(T, S + tree) < 0.6, torch.rand(B, 1, T, S + tree) < 0.6, torch.rand(B, H, T, S + tree) < 0.6):
        mask[..., 0] = True
        y = torch.ops.eaglet.attend(q, k, v, mask.expand(B, H, T, -1), kt, vt, D**-0.5)
        ref = attention_reference(q, k, v, mask, kt, vt)
        assert y.shape == ref.shape and (y.double() - ref).abs().max() <= 2**-8 * ref.abs().max() + 1e-3
        for t in range(T):
            row = torch.ops.eaglet.attend(q[:, :, t : t + 1], k, v, mask.expand(B, H, T, -1)[:, :, t : t + 1], kt, vt, D**-0.5)
            assert torch.equal(row, y[:, :, t : t + 1])


def test_attend_takes_the_tiles_for_enough_rows():
    """With AMX, a KV head's AMX_ATTEND_ROWS query rows or more go to the tiles, fewer to the vector kernel: each gives
    exactly its path's values, and the two agree within bf16's rounding."""
    assert kernels.build()
    if not kernels.AMX:
        pytest.skip("needs a CPU with AMX")
    torch.manual_seed(1)
    k, v = (torch.randn(1, 3, 150, 64).bfloat16() for _ in range(2))
    k = (k.float() * 2.0 ** torch.randint(0, 24, k.shape)).bfloat16()  # products of every size: the sums' order shows
    kt, vt = (torch.randn(1, 3, 13, 64).bfloat16() for _ in range(2))
    q = torch.randn(1, 9, 13, 64).bfloat16()
    mask = (torch.rand(1, 1, 13, 163) < 0.7).expand(1, 9, 13, -1)
    op = lambda T: torch.ops.eaglet.attend(q[:, :, :T], k, v, mask[:, :, :T], kt, vt, 2.0**-22)  # noqa: E731
    try:
        torch.ops.eaglet.amx_set(True, kernels.AMX_MIN_ROWS, 1000)
        vector = [op(T) for T in range(1, 14)]
        torch.ops.eaglet.amx_set(True, kernels.AMX_MIN_ROWS, 1)
        tiles = [op(T) for T in range(1, 14)]
    finally:
        torch.ops.eaglet.amx_set(kernels.AMX, kernels.AMX_MIN_ROWS, kernels.AMX_ATTEND_ROWS)
    for T in range(1, 14):
        assert torch.equal(op(T), (tiles if 3 * T >= kernels.AMX_ATTEND_ROWS else vector)[T - 1]), T
        assert (tiles[T - 1].float() - vector[T - 1].float()).abs().max() <= 2e-2, T
    assert not torch.equal(tiles[-1], vector[-1])


def test_argmax_is_torch_argmax():
    """eaglet::argmax (greedy decoding's draw on a CPU with the kernels): torch.argmax's index, the first of equal
    maxima, over rows of any length and leading shape, rows of -inf included, eager, compiled and under vmap."""
    assert kernels.build()
    torch.manual_seed(0)
    for shape in [(49152,), (13, 49152), (3, 5, 17), (2, 7), (4, 1)]:
        x = torch.randn(shape)
        assert torch.equal(kernels.argmax(x), torch.argmax(x, -1)), shape
    x = torch.randint(0, 3, (64, 100)).float()  # many ties, in lanes and across them
    x[5] = float("-inf")
    x[6, 99] = 7.0  # the maximum in the scalar tail
    assert torch.equal(torch.ops.eaglet.argmax(x), torch.argmax(x, -1))
    assert torch.equal(torch.ops.eaglet.argmax(x[:, ::2]), torch.argmax(x[:, ::2], -1))  # strided
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, (code, *_) = run_and_get_code(torch.compile(lambda x: kernels.argmax(x * 2), fullgraph=True, dynamic=False), x)
    assert torch.equal(out, torch.argmax(x, -1)) and "eaglet.argmax" in code
    assert torch.equal(torch.vmap(kernels.argmax)(x.view(4, 16, 100)), torch.argmax(x, -1).view(4, 16))


def stable_topk(x, k):
    """torch.topk with ties broken toward the lower index (a stable descending sort's first k)."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


@pytest.mark.parametrize("k", [1, 4, 10, 16])
def test_topk_is_torch_topk(k):
    """eaglet::topk (the draft tree's choice on a CPU with the kernels): torch.topk's values in descending order, the
    lower index first among equals, over rows of any length and leading shape (a draft vocabulary's, a level's pool),
    rows of -inf and heavy ties included, eager, compiled and under vmap."""
    assert kernels.build()
    torch.manual_seed(k)
    for shape in [(16384,), (4, 16384), (3, 5, 17), (2, k), (7, 100)]:
        x = torch.randn(shape)
        values, indices = torch.ops.eaglet.topk(x, k)
        expected = torch.topk(x, k, dim=-1)
        assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices), shape
    x = torch.randint(0, 4, (64, 300)).float()  # ties in lanes, across them and at the k-th place
    x[5] = float("-inf")
    x[6, : k + 1] = float("-inf")
    x[7, 299] = 9.0  # the best in the last partial vector
    for rows in (x, x[:, ::2]):  # strided too
        assert all(torch.equal(a, b) for a, b in zip(torch.ops.eaglet.topk(rows, k), stable_topk(rows, k)))
    descending = torch.arange(200.0).flip(0)  # no value after the first k beats them: nothing is inserted
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.eaglet.topk(descending, k), stable_topk(descending, k)))
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, (code, *_) = run_and_get_code(torch.compile(lambda x: kernels.topk(x * 2, k), fullgraph=True, dynamic=False), x)
    assert all(torch.equal(a, b) for a, b in zip(out, stable_topk(x * 2, k))) and "eaglet.topk" in code
    batched = torch.vmap(lambda row: kernels.topk(row, k))(x.view(4, 16, 300))
    assert all(torch.equal(a, b.view(4, 16, k)) for a, b in zip(batched, stable_topk(x, k)))


def test_sample_is_the_inverse_cdf_draw():
    """eaglet::sample (a draw at T > 0 on a CPU with the kernels) picks sampling.sample's token for the same uniforms
    (rounding may move one draw in thousands: at most one), never a -inf token; 200k draws of one row pass a
    chi-square test against softmax(logits / T) that a wrong temperature fails; compiled and under vmap too."""
    assert kernels.build()
    torch.manual_seed(0)
    for shape, n in [((49152,), 0), ((13, 49152), 1), ((3, 5, 17), 1), ((3000, 37), 1)]:
        logits = torch.randn(shape) * 3
        logits[..., 5] = float("-inf")
        u = torch.rand(shape[:-1], dtype=torch.float64)
        cdf = torch.softmax(logits / 0.7, -1).double().cumsum(-1)
        want = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1), right=True).squeeze(-1)
        got = torch.ops.eaglet.sample(logits, u, 1 / 0.7)
        assert (got != want).sum() <= n and not (got == 5).any(), shape
    logits = torch.randn(37) * 2
    logits[3] = float("-inf")
    expected = torch.softmax(logits.double(), -1) * 200_000
    live = expected > 5

    def chi2(temperature):
        draws = kernels.sample(logits.expand(200_000, 37).contiguous(), temperature, sampling.uniform((200_000,), "cpu"))
        counts = torch.bincount(draws, minlength=37).double()
        return (((counts - expected) ** 2)[live] / expected[live]).sum().item(), counts[3].item()

    stat, minus_inf = chi2(1.0)
    assert stat < 70 and minus_inf == 0  # the 0.999 quantile of chi-square at 34-36 degrees of freedom: 65.2-68.0
    assert chi2(0.9)[0] > 200
    x = torch.randn(64, 100)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, (code, *_) = run_and_get_code(torch.compile(lambda x: kernels.sample(x * 2, 0.5, sampling.uniform(x.shape[:-1], x.device)), fullgraph=True, dynamic=False), x)
    assert out.shape == (64,) and "eaglet.sample" in code
    rows = torch.vmap(lambda x: kernels.sample(x, 1.0, sampling.uniform(x.shape[:-1], x.device)), randomness="different")(x.view(4, 16, 100))
    assert rows.shape == (4, 16) and ((rows >= 0) & (rows < 100)).all()


def serial_pvalue(k: torch.Tensor, chi2_pvalue) -> float:
    """Consecutive 52-bit values' top 4 bits as the 256 cells of a grid: uniform when the values are independent."""
    top = (k.flatten() >> 48)[: k.numel() // 2 * 2].view(-1, 2)
    return chi2_pvalue(torch.bincount(top[:, 0] * 16 + top[:, 1], minlength=256), torch.full((256,), 1 / 256))


def weyl_bits(seed: int, n: int) -> torch.Tensor:
    """A deliberately wrong eaglet::random_bits: the counter's state without SplitMix64's mixing (a Weyl sequence),
    even in every single value's distribution, a lattice in consecutive pairs."""
    golden = 0x9E3779B97F4A7C15 - (1 << 64)  # as int64: the multiplication wraps as the kernel's uint64 one does
    return ((seed + torch.arange(1, n + 1) * golden) >> 12) & ((1 << 52) - 1)


def test_random_bits_are_independent_uniform_and_a_table_a_seed(chi2_pvalue):
    """eaglet::random_bits (sampling.uniform's k for tables of RANDOM_BITS_MIN elements or more): 52 bits in
    [0, 2^52), their top, middle and bottom bytes uniform and consecutive values independent, which the unmixed Weyl
    sequence fails; the same seed, the same table; under vmap one table a row's seed; compiled, in the graph; and
    through ops.random_bits from the threshold on."""
    import ops

    assert kernels.build()
    k = torch.ops.eaglet.random_bits(torch.tensor(12345), [400_000])
    assert k.dtype == torch.long and k.shape == (400_000,) and 0 <= int(k.min()) and int(k.max()) < 1 << 52
    for bits in (k >> 44, k & 255, (k >> 20) & 255):
        assert chi2_pvalue(torch.bincount(bits, minlength=256), torch.full((256,), 1 / 256)) > 1e-4
    assert serial_pvalue(k, chi2_pvalue) > 1e-4
    assert serial_pvalue(weyl_bits(12345, 400_000), chi2_pvalue) < 1e-12
    seeds = torch.tensor([7, 8, 1 << 61])
    tables = torch.ops.eaglet.random_bits(seeds, [2, 3000])
    assert tables.shape == (3, 2, 3000) and not torch.equal(tables[0], tables[1])
    assert all(torch.equal(tables[i], torch.ops.eaglet.random_bits(seeds[i], [2, 3000])) for i in range(3))
    rows = torch.vmap(lambda s: torch.ops.eaglet.random_bits(s, [3000]))(seeds)
    assert torch.equal(rows, tables[:, 0])
    torch.manual_seed(0)
    first = ops.random_bits((kernels.RANDOM_BITS_MIN,), "cpu")
    torch.manual_seed(0)
    assert torch.equal(first, ops.random_bits((kernels.RANDOM_BITS_MIN,), "cpu"))  # torch.manual_seed fixes every draw
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        u, (code, *_) = run_and_get_code(torch.compile(lambda: sampling.uniform((3, 49152), "cpu"), fullgraph=True))
    assert "eaglet.random_bits" in code and u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())


def test_attend_few_takes_the_kernel_when_compiled():
    """A compiled bf16 pass of up to FUSED_QUERIES queries runs eaglet::attend (one call a layer, no matmul) and agrees
    with the eager attend_few; under vmap (batch.py) it is one call too."""
    import model

    assert kernels.build()
    torch.manual_seed(0)
    B, H, n_kv, D, S, T = 2, 6, 2, 64, 50, 5
    q = torch.randn(B, H, T, D).bfloat16()
    k, v = (torch.randn(B, n_kv, S, D).bfloat16() for _ in range(2))
    mask = torch.rand(B, 1, T, S) < 0.7
    mask[..., 0] = True
    eager = model.attend_few(q, k, v, mask)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, cpp_wrapper=False):
        out, (code, *_) = run_and_get_code(torch.compile(model.attend_few, fullgraph=True, dynamic=False), q, k, v, mask)
        assert code.count("eaglet.attend.default(") == 1 and "mm(" not in code, code
        torch.testing.assert_close(out.float(), eager.float(), rtol=2e-2, atol=2e-2)
        rows = torch.vmap(lambda q, k, v, m: model.attend_few(q[None], k[None], v[None], m[None])[0])
        torch._dynamo.reset()
        with torch._functorch.config.patch(enable_autograd_cache=False):
            batched, (code, *_) = run_and_get_code(torch.compile(rows, fullgraph=True), q, k, v, mask)
    assert code.count("eaglet.attend.default(") == 1, code
    torch.testing.assert_close(batched.float(), eager.float(), rtol=2e-2, atol=2e-2)


def test_attend_writes_the_layout_the_output_projection_reads():
    """eaglet::attend returns [B, H, T, D] stored as [B, T, H, D], and its shape function says the same strides: so in a
    compiled layer the heads' outputs reach wo as a view, with no transpose copy between."""
    assert kernels.build()
    B, H, n_kv, D, S, T = 2, 6, 2, 64, 20, 3
    q = torch.randn(B, H, T, D).bfloat16()
    k, v = (torch.randn(B, n_kv, S, D).bfloat16() for _ in range(2))
    y = torch.ops.eaglet.attend(q, k, v, torch.ones(B, H, T, S, dtype=torch.bool), k[:, :, :0], v[:, :, :0], D**-0.5)
    assert y.shape == (B, H, T, D) and y.stride() == kernels.attend_out(q).stride()
    assert y.transpose(1, 2).is_contiguous()
    import model

    args = model.ModelArgs(dim=H * D, n_head=H, n_local_heads=n_kv, n_layer=1, vocab_size=64, intermediate_size=128)
    layer = model.Attention(args).bfloat16()
    layer.kv_cache = model.KVCache(1, n_kv, S, D, torch.bfloat16)
    rope, pos = model.rope_table(args, S), torch.arange(5, 5 + T)
    step = torch.compile(lambda x, pos, mask: layer(x, model.rope_at(rope, pos[None], 1), pos, mask), fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False, cpp_wrapper=False):
        _, (code, *_) = run_and_get_code(step, torch.randn(1, T, H * D).bfloat16(), pos, torch.ones(1, 1, T, S, dtype=torch.bool))
    calls = code[code.index("def call("):]
    # between the two linears: one fused loop (RoPE and the cache write) and the kernel, nothing after it
    assert calls.count("eaglet.attend.default(") == 1 and calls.count("cpp_fused_") == 1, calls


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_packed_draft_head_reads_int8_codes_and_stays_lossless(tiny_args, random_model, random_head, random_eagle3_head,
                                                                  single_thread, kind):
    """Compiled (packed), every linear of a draft head (its LM head included: an EAGLE-1/2 head's draft-vocabulary rows of
    the target's, an EAGLE-3 head's own) reads int8 codes: its outputs are the codes' product, and the compiled bf16
    eagle2 answers equal compiled bf16 vanilla's (the verify decides, whatever the drafts), alone and batched."""
    from eaglet import Generator
    from speculate import TreeSpec

    assert kernels.build()
    args = tiny_args(dim=128)  # head_dim 32: attention takes eaglet::attend too
    target = random_model(args, seed=0).bfloat16()
    if kind == "eagle3":
        head = random_eagle3_head(args, seed=1)
    else:
        head = random_head(args, seed=1)
        head.draft_vocab = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:48]
    head = head.bfloat16()
    vanilla = Generator(target, compile=True)
    gen = Generator(target, TreeSpec("eagle2", depth=3, topk=4, num_draft_tokens=8), head=head, compile=True)
    layers = [m for m in head.modules() if isinstance(m, nn.Linear)]
    assert len(layers) >= 6 and all(type(m) is linears.RowsLinearInt8 and m.packed.dtype == torch.int16 for m in layers)
    assert type(target.output) is linears.RowsLinear  # the target's own weights stay bf16
    lm_head = head.lm_head
    h = torch.randn(3, 128).bfloat16()
    codes, scales = quant.quantize_int8(lm_head.weight)
    with torch.no_grad():
        torch.testing.assert_close(lm_head(h).double(), h.double() @ (codes.double() * scales.double()[:, None]).t(), rtol=1e-2, atol=2e-2)
    g, accepted = torch.Generator().manual_seed(0), 0
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (7, 13, 29)]
    alone = [vanilla.generate(prompt, 24).token_ids for prompt in prompts]
    for prompt, expect in zip(prompts, alone):
        out = gen.generate(prompt, 24)
        assert out.token_ids == expect
        accepted += sum(out.accept_hist[1:])
    assert accepted  # some drafts were kept: the int8 ranks took part
    assert [r.token_ids for r in gen.generate_batch(prompts, 24)] == alone  # vmapped: the op's batch rule


def screened_head(w):
    """An LM head of bf16 rows w as linears.logits_in_fp32 leaves one: the packed rows, the screen's codes and stats."""
    head = nn.Linear(w.shape[1], w.shape[0], bias=False).bfloat16()
    head.weight.data.copy_(w)
    model = nn.Module()
    model.output = head
    linears.logits_in_fp32(model)
    assert linears.screens(model.output)
    return model.output


def one_row_logits(head, x, path=None):
    """Each row's fp32 logits as rows_mm_f32 sums them for that row alone, on vdpbf16ps (lm_head_argmax's exact sums);
    then the kernels' path as the test's fixture set it (path), or as built."""
    torch.ops.eaglet.amx_set(False, 1, 1)
    try:
        return torch.stack([torch.ops.eaglet.rows_mm_f32(r[None], head.packed)[0] for r in x.reshape(-1, x.shape[-1])])
    finally:
        if path:
            torch.ops.eaglet.amx_set(path == "amx", 1, 1)
        else:
            torch.ops.eaglet.amx_set(kernels.AMX, kernels.AMX_MIN_ROWS, kernels.AMX_ATTEND_ROWS)


def near_ties(V=4096, K=576, seed=0):
    """Rows in families of 64 near-copies (a base row plus noise at the int8 codes' step) and inputs with a few large
    entries, as a model's hidden states have: many logits within the codes' error of the best, where only the exact
    sums can tell which wins."""
    torch.manual_seed(seed)
    base = torch.randn(V // 64, K) * 0.05
    w = (base.repeat_interleave(64, 0) + torch.randn(V, K) * 0.05 / 127).bfloat16()
    w[7] = w[6]  # an exact tie: the lower token wins
    x = torch.randn(40, K)
    x[:, :4] *= 20
    x[5] = 0.0
    return w, x.bfloat16()


def test_lm_head_argmax_is_the_argmax_of_the_exact_logits(path):
    """eaglet::lm_head_argmax (the target's draws from its LM head on a CPU with the kernels): the token of the exact
    fp32 logits, not of the int8 codes' estimate, for 1-17 and 40 rows with leading dims, exact ties to the lower token,
    with fp64 Gumbel noise at a temperature argmax(logits / T + noise); on rows whose logits lie within the codes' error
    of each other. The wrong rules fail there: no error bound (the estimate's argmax, then checked exactly), or noise
    ignored."""
    w, x = near_ties()
    head = screened_head(w)
    exact = one_row_logits(head, x, path).view(40, -1)
    want = exact.argmax(-1)
    for rows in [*range(1, 18), 40]:
        got = torch.cat([kernels.lm_head_argmax(head, x[i:i + rows]) for i in range(0, 40, rows)])
        assert torch.equal(got, want), rows
    assert torch.equal(kernels.lm_head_argmax(head, x.view(2, 20, -1)), want.view(2, 20))
    tie = torch.zeros(1, x.shape[1]).bfloat16()
    tie[0, 0] = 1.0
    head.weight.data[6:8] = 1e3  # two equal rows, far above the rest
    head.pack()  # the packed rows and the screen follow the weight
    assert kernels.lm_head_argmax(head, tie).item() == 6 and one_row_logits(head, tie, path).argmax().item() == 6
    head.weight.data.copy_(w)
    head.pack()
    noise = sampling.gumbel((40, w.shape[0]), "cpu")
    drawn = (exact.double() / 0.7 + noise).argmax(-1)
    assert torch.equal(kernels.lm_head_argmax(head, x, 1 / 0.7, noise), drawn)
    assert not torch.equal(drawn, want)  # the noise moved draws: a kernel ignoring it fails above
    depths = torch.arange(40) % 3  # a tree's rows drawing with their depth's row of a table
    assert torch.equal(kernels.lm_head_argmax(head, x, 1 / 0.7, noise[:3], depths), (exact.double() / 0.7 + noise[depths]).argmax(-1))
    stats = head.stats.clone()
    head.stats[2:] = 0  # no error bound: the estimate's best, computed exactly, misses the true best
    assert not torch.equal(kernels.lm_head_argmax(head, x), want)
    head.stats.copy_(stats)


def test_lm_head_argmax_in_compiled_and_vmapped_graphs():
    """The op in a compiled graph (its shape function) and under batch.py's vmap (its batch rule), noise batched too."""
    w, x = near_ties(V=256, K=64)
    head = screened_head(w)
    want = one_row_logits(head, x).argmax(-1)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, (code, *_) = run_and_get_code(torch.compile(lambda x: kernels.lm_head_argmax(head, x + 0), fullgraph=True, dynamic=False), x)
    assert torch.equal(out, want) and "eaglet.lm_head_argmax" in code
    assert torch.equal(torch.vmap(lambda x: kernels.lm_head_argmax(head, x))(x.view(4, 10, -1)), want.view(4, 10))
    noise = sampling.gumbel((40, 256), "cpu")
    drawn = (one_row_logits(head, x).double() + noise).argmax(-1)
    got = torch.vmap(lambda x, g: kernels.lm_head_argmax(head, x, 1.0, g))(x.view(4, 10, -1), noise.view(4, 10, -1))
    assert torch.equal(got, drawn.view(4, 10))
    tables, depths = noise[:12].view(4, 3, -1), torch.arange(40).view(4, 10) % 3  # a table of 3 rows a sequence
    got = torch.vmap(lambda x, g, d: kernels.lm_head_argmax(head, x, 1.0, g, d))(x.view(4, 10, -1), tables, depths)
    want_rows = (one_row_logits(head, x).double().view(4, 10, -1) + torch.stack([t[d] for t, d in zip(tables, depths)])).argmax(-1)
    assert torch.equal(got, want_rows)


def test_draws_read_the_screen_and_decode_as_the_logits_do(monkeypatch):
    """A bf16 target's draws go through its LM head's screen (sampling.lm_head_draw), greedy and with a tree's Gumbel
    noise, never with top-p; without the screen (every logit computed, then drawn) vanilla decoding gives the same tokens."""
    from types import SimpleNamespace

    from conftest import _random_model, _tiny_args
    from eaglet import Generator

    target = _random_model(_tiny_args(vocab_size=512), seed=0).bfloat16()
    gen = Generator(target)
    calls, screened = [], kernels.lm_head_argmax
    monkeypatch.setattr(kernels, "lm_head_argmax", lambda *a: calls.append(a) or screened(*a))
    got = gen.generate([1, 2, 3], max_new_tokens=24).token_ids
    assert len(calls) == 24  # the prefill's token and every decode step's
    h = torch.randn(3, 64).bfloat16()
    noise = 0.8 * sampling.gumbel((3, 512), "cpu")  # the Gumbels times the temperature, as sampling.noise gives them
    assert torch.equal(sampling.lm_head_draw(target.output, h, "sample", None, noise),
                       (one_row_logits(target.output, h).double() + noise).argmax(-1))
    assert len(calls) == 25
    depths = torch.tensor([1, 0, 1])  # a table's rows, one picked for each of h's rows
    for screen in (True, False):
        monkeypatch.setattr(linears, "screens", lambda output, screen=screen: screen)
        assert torch.equal(sampling.lm_head_draw(target.output, h, "sample", None, noise[:2], depths),
                           (one_row_logits(target.output, h).double() + noise[depths]).argmax(-1))
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "lm_head_argmax", lambda *a: calls.append(a) or screened(*a))
    assert len(calls) == 26
    rule = SimpleNamespace(temperature=torch.tensor([0.8]), top_k=torch.tensor([0]), top_p=torch.tensor([0.9]), bias=torch.zeros(512),
                           frequency=torch.zeros(1), presence=torch.zeros(1), counts=torch.zeros(512), allowed=torch.ones(512, dtype=torch.bool))  # a state's
    sampling.lm_head_draw(target.output, h, "truncate", rule, noise)  # top-p needs every logit
    assert len(calls) == 26
    monkeypatch.setattr(linears, "screens", lambda output: False)
    assert gen.generate([1, 2, 3], max_new_tokens=24).token_ids == got and len(calls) == 26
