# The target's forward hands a draft head its features from the pass it already runs; attention for few queries
# on a CPU is SDPA's, and a CPU pass reads only the live part of the cache.
import operator

import pytest
import torch
import torch.nn.functional as F

import compiling
import ops
from model import ModelArgs, apply_rope, attend_few, causal_mask, eagle3_taps, rope_at, rope_table


def test_taps_return_the_states_entering_those_layers(tiny_args, random_model):
    model = random_model(tiny_args(n_layer=6), seed=0)
    model.setup_caches(32)
    idx = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)
    logits, h = model(idx, pos, pos, causal_mask(pos, 32))
    assert model.taps == () and torch.equal(h, model.hidden(idx, pos, pos, causal_mask(pos, 32))[0])

    model.taps = eagle3_taps(6)
    assert model.taps == (2, 3, 3)
    tapped_logits, fused = model(idx, pos, pos, causal_mask(pos, 32))
    entering, x = [], model.tok_embeddings(idx)  # an independent walk over the layers
    rope = model.rope[pos][None]
    for layer in model.layers:
        entering.append(x)
        x = layer(x, rope, pos, causal_mask(pos, 32))
    assert torch.equal(tapped_logits, logits)
    assert torch.allclose(fused, torch.cat([entering[2], entering[3], entering[3]], -1), atol=1e-6)
    assert eagle3_taps(30) == (2, 15, 27)

    model.taps = (6, 2)  # tap n_layer: the post-norm state, as an EAGLE-1/2 head with fused inputs reads it first
    _, both = model(idx, pos, pos, causal_mask(pos, 32))
    assert torch.equal(both[..., :64], h) and torch.allclose(both[..., 64:], entering[2], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_each_pair_by_its_angle(dtype):
    # apply_rope works on whole rows (cos row, signed sin row, pairs swapped); each pair (2i, 2i+1) must come out
    # rotated by position * frequency i, the same products and sums as the pairwise form, eager and compiled.
    args = ModelArgs(dim=64, n_layer=1, n_head=2, n_local_heads=1, head_dim=32, intermediate_size=64, vocab_size=8)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, 2, 32, generator=g) * 3).to(dtype)
    pos = torch.tensor([[0, 1, 7, 100, 511], [3, 4, 5, 6, 7]])
    angle = (pos[..., None].double() * (1.0 / 10000 ** (torch.arange(0, 32, 2).double() / 32)))[:, :, None]
    cos, sin = angle.cos().float(), angle.sin().float()
    a, b = x.float()[..., 0::2], x.float()[..., 1::2]
    want = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2).to(dtype)
    table = rope_table(args, 512)
    rope = rope_at(table, pos, 2)
    assert torch.equal(apply_rope(x, rope), want)
    assert torch.equal(torch.compile(apply_rope, fullgraph=True)(x, rope), want)
    wrong = torch.stack([a * cos + b * sin, b * cos - a * sin], -1).flatten(-2).to(dtype)  # rotated the other way
    assert not torch.equal(apply_rope(x, rope), wrong)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("mask_shape", ["[T, S]", "[B, 1, T, S]", "[B, H, T, S]"])
@pytest.mark.parametrize("tree", [False, True], ids=["cache", "cache+tree"])
def test_attend_few_is_sdpa(T, mask_shape, compiled, tree):
    # Compiled, up to FUSED_QUERIES queries take the fused loops (T 1, 5), more the matmuls (17); a tree's own keys
    # come apart from the cache's and must meet them in one softmax.
    B, H, n_kv, S, D = 2, 6, 2, 40, 16  # GQA: three query heads per KV head
    g = torch.Generator().manual_seed(T)
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, n_kv, S, D, generator=g), torch.randn(B, n_kv, S, D, generator=g)
    extra = (torch.randn(B, n_kv, T, D, generator=g), torch.randn(B, n_kv, T, D, generator=g)) if tree else None
    W = S + T if tree else S
    mask = {"[T, S]": torch.rand(T, W, generator=g) < 0.6, "[B, 1, T, S]": torch.rand(B, 1, T, W, generator=g) < 0.6,
            "[B, H, T, S]": torch.rand(B, H, T, W, generator=g) < 0.6}[mask_shape]
    mask[..., 0] = True  # every query reads at least one slot, as its own in a cache
    keys, values = (torch.cat([k, extra[0]], 2), torch.cat([v, extra[1]], 2)) if tree else (k, v)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    torch._dynamo.reset()  # one graph per case: past Dynamo's recompile limit a case would run eagerly
    attend = torch.compile(attend_few, fullgraph=True) if compiled else attend_few
    assert torch.allclose(attend(q, k, v, mask, extra), expected, atol=1e-5)


@pytest.mark.parametrize("T, fused", [(1, True), (16, True), (17, False)])
def test_few_queries_fuse_when_compiled(T, fused):
    # Up to FUSED_QUERIES queries a compiled pass has no matmul for Inductor to hand to an extern call.
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    q, k, v = torch.randn(1, 6, T, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    tree = (torch.randn(1, 2, T, 16), torch.randn(1, 2, T, 16))
    torch.compile(attend_few, backend=keep_graph, fullgraph=True)(q, k, v, torch.ones(T, 40 + T, dtype=torch.bool), tree)
    calls = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any(c in (torch.matmul, operator.matmul) for c in calls) != fused


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_cpu_pass_reads_only_the_live_part_of_the_cache(tiny_args, random_model, single_thread, compiled):
    # The slots past a pass's last one hold NaN: reading them, even masked (0 * NaN in probs @ v), gives NaN.
    model = random_model(tiny_args(), seed=0)
    idx = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))

    def run(x, pos):
        return model(x, pos, pos, causal_mask(pos, 64))[0]

    step = compiling.compiled(run, "cpu") if compiled else run
    outputs = []
    with torch.inference_mode():
        for fill, passes in ((0.0, run), (float("nan"), step)):
            model.setup_caches(64)
            for layer in model.layers:
                layer.attention.kv_cache.k_cache.fill_(fill)
                layer.attention.kv_cache.v_cache.fill_(fill)
            run(idx[:, :9], torch.arange(9))
            # One row at a time, three widths: the compiled pass replays one graph for all of them.
            with torch._dynamo.config.patch(error_on_recompile=True):
                outputs.append([passes(idx[:, s:s + 1], torch.arange(s, s + 1)) for s in (9, 10, 11)])
    for clean, poisoned in zip(*outputs):
        assert torch.isfinite(poisoned).all() and torch.allclose(poisoned, clean, atol=1e-5)
    assert ops.live_width(torch.tensor(9), 64) == 10 and causal_mask(torch.arange(3, 6), 64).shape == (3, 6)
