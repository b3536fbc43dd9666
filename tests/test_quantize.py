# Weight-only int8 / int4: the layer against nn.Linear and across its row-count switch, quantised checkpoints
# through the loaders, and speculative greedy output against vanilla on the same quantised model.
import copy
import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch._inductor.utils import run_and_get_code

import quant
import quantize
from cpu import linears
from draft import EagleHead
from checkpoint import load_model
from eaglet import Generator
from sampling import Sampling
from speculate import TreeSpec
from model import ModelArgs, Transformer
from quant import KERNEL_MAX_ROWS, QuantLinear
from weights import load_head, save_head

# Relative RMS output error against the float layer, Gaussian weights and inputs, 192 -> 256, worst of 5 seeds
# at 1 and 64 rows: int8 0.0072, int4 g32 0.085, g64 0.092, g128 0.108. The bounds sit a little above.
ERROR_BOUND = {("int8", 0): 0.009, ("int4", 32): 0.10, ("int4", 64): 0.11, ("int4", 128): 0.125}
CASES = list(ERROR_BOUND)
TINY = ModelArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=128, vocab_size=96, block_size=512, tie_embeddings=True)


def relative_error(y, ref):
    return ((y - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("mode,groupsize", CASES)
def test_quant_linear_error_and_row_switch(mode, groupsize):
    torch.manual_seed(0)
    # in_features 192 is not a multiple of 128: g128 pads its last group
    linear = nn.Linear(192, 256, bias=True)
    nn.init.normal_(linear.weight, std=192 ** -0.5)
    q = QuantLinear.from_linear(linear, mode, groupsize)
    assert q.kernel is not None, "torch on the CPU has the weight-only kernels; the small-row path must use them"
    with torch.no_grad():
        for rows in (1, 64):
            x = torch.randn(1, rows, 192)
            assert relative_error(q(x), linear(x)) < ERROR_BOUND[mode, groupsize]
        # the same 64 rows through the large-row path (one call) and the small-row path (row by row)
        dense = q(x)
        small = torch.cat([q(x[:, i:i + 1]) for i in range(64)], dim=1)
        blocks = torch.cat([q(x[:, i:i + KERNEL_MAX_ROWS]) for i in range(0, 64, KERNEL_MAX_ROWS)], dim=1)
        torch.testing.assert_close(small, dense, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(blocks, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,groupsize", [("int8", 0), ("int4", 32), ("int4", 128)])
def test_compiled_cpu_layer_reads_quantised_words(mode, groupsize):
    """Compiled on a CPU with fp32 activations, a quantised layer runs quant.int8_rows_mm / int4_rows_mm (codes
    taken out of block_words' 32-bit words by shifts; not the pack kernels) and computes the dequantised weight's
    product at each row count up to KERNEL_MAX_ROWS, chunks included (g128 pads 192 inputs to 256); a shape
    block_words cannot tile keeps the pack kernel where there is one."""
    torch.manual_seed(0)
    for out_features, tiled in ((256, True), (100, False)):
        q = QuantLinear.from_linear(nn.Linear(192, out_features, bias=True), mode, groupsize)
        assert (q.words is not None) == tiled
        w = q.dequantize(torch.float64)
        step = torch.compile(q, dynamic=False)
        with torch.inference_mode():
            for rows in (1, 5, 13) if tiled else (3,):
                x = torch.randn(rows, 192)
                y, code = run_and_get_code(step, x)
                assert ("pack_mm" in "".join(code)) == (not tiled and q.kernel is not None)
                torch.testing.assert_close(y.double(), x.double() @ w.t() + q.bias.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_linear_follows_its_weight():
    """linears.PackedLinear computes what nn.Linear does, in fp32 and bf16, and packs again when its weight is cast or
    loaded, and in a deep copy (bench.py quantises a copy of a compiled target): a stale packed copy would answer
    with the old weights, and an opaque oneDNN tensor has no storage to copy."""
    torch.manual_seed(0)
    linear = nn.Linear(192, 256, bias=True)
    ref = nn.Linear(192, 256, bias=True)
    ref.load_state_dict(linear.state_dict())
    packed = linears.PackedLinear(linear)
    x = torch.randn(1, 9, 192)
    with torch.no_grad():
        assert packed.packed is not None
        torch.testing.assert_close(packed(x), ref(x), rtol=1e-5, atol=1e-5)
        other = nn.Linear(192, 256, bias=True)
        packed.load_state_dict(other.state_dict())
        torch.testing.assert_close(packed(x), other(x), rtol=1e-5, atol=1e-5)
        twin = copy.deepcopy(packed)
        assert twin.packed is not None and twin.packed is not packed.packed
        torch.testing.assert_close(twin(x), packed(x), rtol=0, atol=0)
        packed.to(torch.bfloat16)
        xb = x.bfloat16()
        bf16_packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # not on a CPU without AVX-512 (AMD Zen 3)
        assert (packed.packed is not None) == bf16_packs
        torch.testing.assert_close(packed(xb), other.to(torch.bfloat16)(xb), rtol=2e-2, atol=2e-2)
        twin = copy.deepcopy(packed)
        assert (twin.packed is not None) == bf16_packs and (twin.packed is None or twin.packed is not packed.packed)
        torch.testing.assert_close(twin(xb), packed(xb), rtol=0, atol=0)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_linear_batches_rows_in_one_call():
    """Under vmap (batch.py's rows) linears.PackedLinear is one packed call over every row: oneDNN's op has no
    batching rule of its own, and vmap's fallback ran it once per row (compiled: B unrolled calls, each reading
    the whole weight, which made a batch of B cost about B single steps)."""
    torch.manual_seed(0)
    linear = nn.Linear(192, 256, bias=False)
    packed = linears.PackedLinear(linear)
    linears.lower_packed_linear_as_a_call()
    x = torch.randn(4, 3, 192)
    rows = lambda x: packed(x)  # noqa: E731  (as batch.batched vmaps a step that calls the modules)
    with torch.no_grad():
        torch.testing.assert_close(torch.vmap(rows)(x), linear(x), rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        # Uncached: the caches key the graph Dynamo traced, in which vmap is not yet expanded, so a hit would hand
        # back whatever code an earlier process built for it. Python wrapper code, whatever an earlier test set.
        inductor = dict(fx_graph_cache=False, cpp_wrapper=False)
        with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(inductor):
            out, (code, *_) = run_and_get_code(torch.compile(torch.vmap(rows), fullgraph=True), x)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)
    assert code.count("_linear_pointwise.default(") == 1, code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode,groupsize", CASES)
def test_quant_linear_cuda_bf16(mode, groupsize):
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=False)  # SmolLM2's MLP shape; 576 is not a multiple of 128
    nn.init.normal_(linear.weight, std=576 ** -0.5)
    q = QuantLinear.from_linear(linear, mode, groupsize).to("cuda", torch.bfloat16)
    linear = linear.to("cuda", torch.bfloat16)
    if mode == "int4" and quant.has_tinygemm(torch.device("cuda")):
        assert q.kernel == "tinygemm"
    with torch.no_grad():
        x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
        dense = q(x)
        small = torch.cat([q(x[i:i + 1]) for i in range(64)])
        assert relative_error(dense.float(), linear(x).float()) < ERROR_BOUND[mode, groupsize] + 0.01
        assert relative_error(small.float(), dense.float()) < 0.01  # bf16 rounding of different reductions


def random_target(args=TINY, seed=0):
    torch.manual_seed(seed)
    model = Transformer(args)
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)  # sharp logits, so greedy choices are far from ties
    return model.eval()


def random_head(args=TINY, seed=1):
    torch.manual_seed(seed)
    head = EagleHead(args)
    for p in head.parameters():
        nn.init.normal_(p, std=0.1)
    return head.eval()


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    target_dir, head_dir = root / "target", root / "head"
    target_dir.mkdir()
    model = random_target()
    TINY.save(target_dir / "config.json")
    state = {k: v for k, v in model.state_dict().items() if k != "output.weight"}  # tied, as the converter writes it
    save_file({k: v.contiguous() for k, v in state.items()}, str(target_dir / "model.safetensors"))
    (target_dir / "tokenizer.json").write_text("{}")
    save_head(random_head(), head_dir)
    return target_dir, head_dir


@pytest.mark.parametrize("mode,groupsize", [("int8", 32), ("int4", 32)])
def test_checkpoint_round_trip(float_dirs, mode, groupsize):
    target_dir, head_dir = float_dirs
    assert quantize.main(["--checkpoint", str(target_dir), "--mode", mode, "--groupsize", str(groupsize)]) == 0
    out = quantize.default_out(target_dir, mode, groupsize)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["mode"] == mode and config["quantization"]["untied_lm_head"]
    assert not config["tie_embeddings"] and (out / "tokenizer.json").read_text() == "{}"
    model = load_model(out)
    assert isinstance(model.output, QuantLinear) and isinstance(model.layers[0].attention.wqkv, QuantLinear)
    assert model.tok_embeddings.weight.dtype == torch.float32 and model.output.scales.dtype == torch.float32
    assert len(Generator(model).generate([1, 2, 3], 8, Sampling()).token_ids) == 8

    head_out = head_dir.with_name(f"head-{mode}")
    assert quantize.main(["--checkpoint", str(head_dir), "--mode", mode, "--out", str(head_out)]) == 0
    head = load_head(head_out, model.args)
    assert isinstance(head.fc, QuantLinear) and head.fc.bias is not None
    assert isinstance(head.layers[0].feed_forward.w2, QuantLinear)


def test_logit_error(float_dirs):
    target_dir, _ = float_dirs
    out = quantize.quantize_checkpoint(target_dir, target_dir.with_name("target-eval"), "int8")
    err = quantize.logit_error(target_dir, out, prompt_ids=list(range(3, 40)))
    assert err["tokens"] == 37 and 0 < err["mean_abs_delta"] <= err["max_abs_delta"] and 0.9 <= err["top1_agreement"] <= 1


@pytest.mark.parametrize("mode,groupsize", [("int8", 0), ("int4", 32)])
def test_speculative_matches_vanilla_on_quantised_model(mode, groupsize):
    target = quant.quantize_model(random_target(), mode, groupsize)
    head = quant.quantize_model(random_head(), mode, groupsize)
    draft_model = quant.quantize_model(random_target(ModelArgs(dim=32, n_layer=1, n_head=2, intermediate_size=64, vocab_size=96, block_size=512), seed=2), mode, groupsize)
    prompt = torch.randint(0, TINY.vocab_size, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = Generator(target).generate(prompt, 32, Sampling()).token_ids
    # eagle2 verifies 17 rows (the large-row path), vanilla decodes one (the kernel path); sps verifies 5
    for spec, kw in [(TreeSpec("eagle2", 6, 10, 16), {"head": head}), (TreeSpec.chain("sps", 4), {"draft_model": draft_model})]:
        assert Generator(target, spec, **kw).generate(prompt, 32, Sampling()).token_ids == ref, spec.mode


def test_cli_errors(float_dirs, tmp_path, capsys):
    target_dir, _ = float_dirs
    for argv in (["--checkpoint", str(tmp_path / "missing"), "--mode", "int8"],
                 ["--checkpoint", str(target_dir), "--mode", "int4", "--groupsize", "48"],
                 ["--checkpoint", str(target_dir)]):
        assert quantize.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
    quantize.main(["--checkpoint", str(target_dir), "--mode", "int8", "--out", str(tmp_path / "q")])
    assert quantize.main(["--checkpoint", str(tmp_path / "q"), "--mode", "int8", "--out", str(tmp_path / "qq")]) == 2
    assert "already quantised" in capsys.readouterr().err
