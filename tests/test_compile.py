# torch.compile wiring: compiled steps give the eager tokens and never recompile once warm. On a GPU
# the decode step and the cycle are CUDA graphs (mode reduce-overhead); on a CPU Inductor's C++ code with the
# settings of inductor.CPU_INDUCTOR and the weights prepacked for oneDNN (linears.PackedLinear): the fp32 equality
# below proves the packed layers compute what nn.Linear does and that the steps keep every buffer they mutate.
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

import generator
import spectree
import speculate
from cpu import inductor, kernels
from eaglet import Generator
from sampling import Sampling
from speculate import TreeSpec

REPO = Path(__file__).resolve().parents[1]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]
SPECS = [None, TreeSpec("eagle2", depth=3, topk=4, num_draft_tokens=8, lookup_slots=3),
         TreeSpec.static(),
         TreeSpec.chain("sps", 3), TreeSpec.chain("lookup", 4)]


@pytest.fixture
def lazy_compile(monkeypatch):
    """Steps compiled by torch.compile at their first call (a GPU's way, and --compile max's), not built into packages:
    what the tests of Dynamo's tracing, guards and generated code look at."""
    monkeypatch.setenv("EAGLET_PACKAGES", "0")


def prompts(lengths):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("spec", SPECS[:2], ids=["none", "eagle2-lookup-slots"])
def test_generate_sets_no_attribute_on_the_models(tiny_args, random_model, random_head, single_thread, spec):
    # Dynamo passes an unchanged module's guards by its __dict__'s tag alone: an attribute that generate() set on
    # the target (even one no step reads) sent every later call of a compiled step through all its guards.
    args = tiny_args()
    gen = Generator(random_model(args, seed=0), spec, head=random_head(args, seed=1) if spec else None)
    first, second = prompts([7, 13])
    gen.generate(first, 8, Sampling())  # sizes the caches
    modules = [m for root in (gen.target, gen.head, gen.state) if root is not None for m in root.modules()]
    before = [dict(vars(m)) for m in modules]
    gen.generate(second, 8, Sampling())
    gen.generate(second + gen.generate(second, 8, Sampling()).token_ids + first, 8, Sampling(), reuse=True)
    for module, was in zip(modules, before):
        now = vars(module)
        assert now.keys() == was.keys() and all(now[k] is was[k] for k in was), type(module).__name__


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=["none", "eagle2-lookup-slots", "eagle", "sps", "lookup"])
def test_compiled_matches_eager_without_recompiling(tiny_args, random_model, random_head, single_thread, device, spec):
    args = tiny_args()
    target = random_model(args, seed=0).to(device)
    kw = {}
    if spec and spec.mode == "sps":
        kw["draft_model"] = random_model(tiny_args(n_layer=1), seed=2).to(device)
    elif spec:
        kw["head"] = random_head(args, seed=1).to(device)
    eager = Generator(target, spec, **kw)
    compiled = Generator(target, spec, **kw, compile=True)
    if device == "cpu":
        assert all(getattr(inductor_config, k) == v for k, v in inductor.CPU_INDUCTOR.items())
    torch._dynamo.reset()
    first, *rest = prompts([7, 13, 29])
    assert compiled.generate(first, 24, Sampling()).token_ids == eager.generate(first, 24, Sampling()).token_ids
    # A new prompt length must reuse the dynamic prefill graph, and the decode step / cycle must
    # replay as they are: any recompilation raises here.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in rest:
            assert compiled.generate(prompt, 24, Sampling()).token_ids == eager.generate(prompt, 24, Sampling()).token_ids
        # A chat's next turn: the compiled steps prefill from the reused prefix on, with nothing recompiled.
        turn = rest[-1] + compiled.generate(rest[-1], 24, Sampling()).token_ids + prompts([5])[0]
        reused = compiled.generate(turn, 24, Sampling(), reuse=True)
        assert reused.prefilled < len(turn) // 2 or (spec and spec.mode == "sps")  # a draft LLM always prefills afresh
        assert reused.token_ids == eager.generate(turn, 24, Sampling()).token_ids


@pytest.mark.parametrize("batch", [1, 2])
def test_the_compiled_tree_cycle_writes_the_cache_without_copying_it(tiny_args, random_model, random_head, single_thread, batch, lazy_compile):
    """A graph that writes a buffer twice (a verify's tree rows, then the accepted ones moved) made Inductor copy
    each layer's whole KV cache twice a cycle, a cost that grows with the cache; the tree now waits in k_tree and
    commit writes the cache once. Alone and as batch.py's rows, the cycle's code holds no loop over a whole cache."""
    args = tiny_args(block_size=1024)  # 768 cache slots: a loop over a whole cache has a bound no other loop has
    gen = Generator(random_model(args, seed=0), SPECS[1], head=random_head(args, seed=1), compile=True)
    torch._dynamo.reset()
    inductor = dict(fx_graph_cache=False, cpp_wrapper=False)  # caches would hand back code built before
    with torch._functorch.config.patch(enable_autograd_cache=False), inductor_config.patch(inductor):
        run = (lambda: gen.generate(prompts([700])[0], 24, Sampling())) if batch == 1 else (
            lambda: gen.generate_batch(prompts([700, 650]), 24, Sampling()))
        _, code = run_and_get_code(run)
    cache = gen.target.layers[0].attention.kv_cache.k_cache
    whole = [f"static_cast<int64_t>({batch * cache.numel()}L)", f"static_cast<int64_t>({batch * cache.numel() // 2}L)"]
    cycle = [c for c in code if "argmax" in c and "index_put" in c]  # the cycle's graph: draws, then commits
    assert cycle and not any(w in c for w in whole for c in cycle)


def test_many_tree_shapes_in_one_process_each_get_their_own_compile_cache(tiny_args, random_model, random_head, single_thread, monkeypatch, lazy_compile):
    # Dynamo's recompile limit is per code object; were the cycles of all Generators one code object, the
    # ninth tree shape would raise FailOnRecompileLimitHit under fullgraph. The eager backend runs Dynamo's
    # tracing, guards and caches without Inductor's codegen (test_compiled_matches_eager covers Inductor).
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **(kw | {"backend": "eager"})))
    args = tiny_args()
    target, head = random_model(args, seed=0), random_head(args, seed=1)
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)  # else Dynamo falls back to eager, silently
    shapes = [(m, d, k) for d, k in [(2, 2), (3, 2), (3, 4), (4, 3)] for m in (2, 5, 8)]
    specs = [TreeSpec("eagle2", depth=d, topk=k, num_draft_tokens=m) for m, d, k in shapes] + [TreeSpec.static()]
    prompt = prompts([9])[0]
    reference = Generator(target).generate(prompt, 12, Sampling()).token_ids
    cycles = []
    for spec in specs:
        gen = Generator(target, spec, head=head, compile=True)
        assert gen.generate(prompt, 12, Sampling()).token_ids == reference
        cycles.append(gen.step("cycle", "greedy"))
    assert len(specs) >= 13
    assert len({id(c._torchdynamo_orig_callable.__code__) for c in cycles}) == len(specs)  # one cache each


def recording_backend(monkeypatch) -> list:
    """torch.compile on Dynamo's eager backend (tracing, guards and caches without Inductor's codegen), keeping
    every graph it compiles."""
    graphs, real_compile = [], torch.compile

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **(kw | {"backend": backend})))
    torch._dynamo.reset()
    return graphs


def symbolic(gm) -> bool:
    values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    return any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape))
               for v in values)


def test_a_second_tree_shape_compiles_static(tiny_args, random_model, random_head, single_thread, monkeypatch, lazy_compile):
    # Dynamo's automatic dynamic shapes remember a function by its source location: without dynamic=False the
    # second shape's cycle would trace with symbolic sizes (slower kernels, SDPA instead of model.attend_few).
    graphs = recording_backend(monkeypatch)
    args = tiny_args()
    target, head = random_model(args, seed=0), random_head(args, seed=1)
    prompt = prompts([9])[0]
    for spec in (TreeSpec("eagle2", depth=2, topk=2, num_draft_tokens=3), TreeSpec("eagle2", depth=3, topk=4, num_draft_tokens=8)):
        before = len(graphs)
        Generator(target, spec, head=head, compile=True).generate(prompt, 12, Sampling())
        cycle_graphs = graphs[before:][1:]  # the first is the prefill's, dynamic by design
        assert cycle_graphs and not any(symbolic(g) for g in cycle_graphs)


@pytest.mark.parametrize("spec", [None, TreeSpec("eagle2", depth=3, topk=4, num_draft_tokens=8)], ids=["none", "eagle2"])
def test_guards_still_pick_each_samplings_own_graph(tiny_args, random_model, random_head, single_thread, monkeypatch, spec, lazy_compile):
    # Guards skip modules whose dicts are unchanged (compiling.compiled). Greedy and sampled steps are different
    # graphs of one step: each answer must still run its own.
    recording_backend(monkeypatch)
    args = tiny_args()
    target = random_model(args, seed=0)
    head = random_head(args, seed=1) if spec else None
    compiled, eager = Generator(target, spec, head, compile=True), Generator(target, spec, head)
    prompt, hot = prompts([9])[0], Sampling(temperature=1.0)

    def answer(gen, sampling):
        torch.manual_seed(7)
        return gen.generate(prompt, 24, sampling).token_ids
    greedy, sampled = answer(eager, Sampling()), answer(eager, hot)
    assert sampled != greedy
    for sampling, expected in ((Sampling(), greedy), (hot, sampled), (Sampling(), greedy), (hot, sampled)):
        assert answer(compiled, sampling) == expected


def test_the_warm_up_after_a_build_puts_the_random_state_back_and_leaves_nothing_to_reuse(tiny_args, random_model, random_head, single_thread):
    # Generator.build runs a short answer through the steps it built: a seeded answer must draw as if it had not run,
    # and a chat's next turn must not reuse the caches that answer wrote.
    args = tiny_args()
    gen = Generator(random_model(args, seed=0), TreeSpec("eagle2", depth=2, topk=2, num_draft_tokens=4), head=random_head(args, seed=1), compile=True)
    prompt, hot, cut = prompts([9])[0], Sampling(temperature=1.0), Sampling(temperature=1.0, top_k=8)

    def answer(rule=hot, reuse=False):
        torch.manual_seed(7)
        return gen.generate(prompt, 24, rule, stop_ids=set(), reuse=reuse)
    first = answer()  # builds the T=1 steps and warms them up, then answers
    assert answer().token_ids == first.token_ids  # no build this time: the same draws
    gen.generate(prompt, 8, Sampling(), stop_ids=set())  # greedy: built and warmed up, an answer a next turn could reuse
    again = answer(cut, reuse=True)  # a top-k rule: its steps built (loaded) and warmed up now, over those caches
    assert again.prefilled == len(prompt) and again.token_ids == answer(cut).token_ids
    assert answer(reuse=True).prefilled < len(prompt)  # built already: this next turn reuses what the last answer left


def test_a_compiled_vanilla_answer_runs_one_graph_and_compiles_nothing_inside_its_loop(tiny_args, random_model, single_thread, monkeypatch):
    """N tokens of compiled vanilla decoding: Dynamo traces and Inductor compiles nothing once the answer has started
    (its counters stand still), the decode step is called N - 1 times and every call runs the one compiled graph the
    build made, never the eager function (a step that fell back or recompiled inside the loop would show here), and a
    compiled step that ran slower than eager at warm-up would be dropped for eager: on the tiny model it is not."""
    from torch._dynamo.utils import counters

    gen = Generator(random_model(tiny_args(), seed=0), compile=True)
    gen.build("greedy")
    assert gen.step("plain", "greedy") is not generator.plain_step  # the compiled step was kept
    calls, eager_calls, bind = [], [], gen.step

    def step(name, *a, **kw):  # the steps as the answer binds them, each call of the decode step counted
        fn = bind(name, *a, **kw)
        return (lambda *args: calls.append(1) or fn(*args)) if name == "plain" else fn
    gen.step = step
    monkeypatch.setattr(generator, "plain_step", lambda *a: eager_calls.append(1) or speculate.plain_step(*a))
    before = (dict(counters["stats"]), dict(counters["inductor"]))
    n = 40
    out = gen.generate(prompts([9])[0], n, Sampling(), stop_ids=set())
    assert len(out.token_ids) == n and len(calls) == n - 1 and not eager_calls
    assert (dict(counters["stats"]), dict(counters["inductor"])) == before


@pytest.mark.parametrize("spec", [None, TreeSpec("eagle2", depth=3, topk=4, num_draft_tokens=8, lookup_slots=3)], ids=["none", "eagle2"])
def test_a_regrown_cache_still_recompiles_the_steps(tiny_args, random_model, random_head, single_thread, spec, lazy_compile):
    # Caches reallocated for a longer answer must send every compiled step to a new graph, never replay the old one
    # over them: Dynamo's identity guards on the buffers do it, and a guard filter that drops them (to save what module
    # guards cost a call) fails here with an index out of bounds.
    args = tiny_args()
    target = random_model(args, seed=0)
    head = random_head(args, seed=1) if spec else None
    compiled, eager = Generator(target, spec, head, compile=True), Generator(target, spec, head)
    short, long = prompts([7, 9])
    assert compiled.generate(short, 16, Sampling(), stop_ids=set()).token_ids == eager.generate(short, 16, Sampling(), stop_ids=set()).token_ids
    before = target.max_seq_length
    assert compiled.generate(long, 300, Sampling(), stop_ids=set()).token_ids == eager.generate(long, 300, Sampling(), stop_ids=set()).token_ids
    assert target.max_seq_length > before


def test_packaged_steps_are_built_again_for_regrown_caches(tiny_args, random_model, single_thread, compile_cache):
    # A packaged step keeps no guards: its sizes are its caches' at build time. Caches regrown after it was built
    # (a server reserving its context, a longer answer) must get steps built for their size, never the old one replayed
    # over them (which ran, on the default model, at half its speed).
    args = tiny_args(block_size=4096)
    target = random_model(args, seed=0)
    compiled, eager = Generator(target, compile=True), Generator(target)
    short = prompts([7])[0]
    expected = eager.generate(short, 8, Sampling(), stop_ids=set()).token_ids
    assert compiled.generate(short, 8, Sampling(), stop_ids=set()).token_ids == expected
    before = target.max_seq_length
    seconds = compiled.compile_seconds
    compiled.reserve(before + 1)
    assert target.max_seq_length > before
    assert compiled.generate(short, 8, Sampling(), stop_ids=set()).token_ids == expected
    assert compiled.compile_seconds > seconds  # its steps built anew


WARM_START = r"""
import json, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import torch
from torch._dynamo.utils import counters
from conftest import _random_head, _random_model, _tiny_args
from eaglet import Generator
from sampling import Sampling
from speculate import TreeSpec

torch.set_num_threads(1)
if sys.argv[2:] == ["kernels"]:  # the bf16 kernels registered, as after preparing a bf16 model
    from cpu import kernels
    kernels.build()
args = _tiny_args()
target, head = _random_model(args, 0), _random_head(args, 1)
spec = dict(none=None, eagle2=TreeSpec("eagle2", depth=3, topk=4, num_draft_tokens=8, lookup_slots=3))[sys.argv[1]]
prompts = (list(range(3, 12)), list(range(40, 3, -3)))
gen = Generator(target, spec, head if spec else None, compile=True)
gen.build("greedy")
graphs = counters["stats"]["unique_graphs"]
tokens = [gen.generate(p, 24, Sampling()).token_ids for p in prompts]
eager = [Generator(target, spec, head if spec else None).generate(p, 24, Sampling()).token_ids for p in prompts]
print(json.dumps({{"compile_s": gen.compile_seconds, "tokens": tokens, "eager": eager,
                  "graphs_in_answers": counters["stats"]["unique_graphs"] - graphs}}))
"""


def run_warm_start(cache: Path, mode: str, *extra) -> tuple:
    env = dict(os.environ, EAGLET_CACHE=str(cache))
    script = WARM_START.format(repo=str(REPO), tests=str(REPO / "tests"))
    r = subprocess.run([sys.executable, "-c", script, mode, *extra], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens"] == out["eager"] and out["graphs_in_answers"] == 0  # fp32 greedy: the eager tokens; nothing compiled mid-answer
    return out, [line for line in r.stderr.splitlines() if line.startswith("warning:")]


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU compile settings are measured on Linux")
@pytest.mark.parametrize("mode", ["none", "eagle2"])
def test_a_second_process_loads_the_compiled_steps_and_a_damaged_one_is_rebuilt(tmp_path, mode):
    """The first process compiles every step before its first answer and saves it (inductor.precompiled); the second
    loads them, compiling nothing, and decodes the same tokens (fp32 greedy: eager's). A package cut short, or one whose
    content belongs to another step, is said in one line and built again."""
    cold, warnings = run_warm_start(tmp_path, mode)
    packages = sorted((tmp_path / inductor.PACKAGES).glob("*.pt2"))
    assert cold["compile_s"] > 0 and not warnings and len(packages) == 2  # the prefill and the decode step or cycle
    warm, warnings = run_warm_start(tmp_path, mode)
    assert warm["compile_s"] == 0 and not warnings and warm["tokens"] == cold["tokens"]
    if mode != "none":
        return
    first, second = packages
    first_bytes = first.read_bytes()
    first.write_bytes(first_bytes[: len(first_bytes) // 2])
    second.write_bytes(first_bytes)
    damaged, warnings = run_warm_start(tmp_path, mode)
    assert damaged["compile_s"] > 0 and damaged["tokens"] == cold["tokens"]
    assert len(warnings) == 2 and all("compiling it again" in w for w in warnings), warnings
    assert any(str(second) in w and "does not match" in w for w in warnings), warnings
    assert run_warm_start(tmp_path, mode)[0]["compile_s"] == 0  # rebuilt whole


@pytest.mark.skipif(not kernels.cpu_has_bf16_dot(), reason="needs the bf16 kernels (AVX512-BF16)")
def test_a_step_traced_with_the_bf16_kernels_is_not_loaded_where_they_are_not_registered(tmp_path):
    """A process that prepared a bf16 model has eaglet's kernels registered, and an fp32 step it traces calls them
    (the draws); a process that never did has no such ops, so that step's package must not be its own: it compiles
    its own, and both decode the eager tokens. Keyed without the kernels, the second process failed inside the answer
    (aoti_torch_call_dispatcher("eaglet::argmax") failed)."""
    with_kernels, _ = run_warm_start(tmp_path, "none", "kernels")
    without, _ = run_warm_start(tmp_path, "none")
    assert with_kernels["compile_s"] > 0 and without["compile_s"] > 0 and without["tokens"] == with_kernels["tokens"]
    assert len(list((tmp_path / inductor.PACKAGES).glob("greedy_plain-*.pt2"))) == 2


COMPILE_MAX = """
import json, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import torch
from torch._dynamo.utils import counters
from conftest import _random_head, _random_model, _tiny_args
from eaglet import Generator
from sampling import Sampling
from speculate import TreeSpec

torch.set_num_threads(1)
seed, specs = int(sys.argv[1]), sys.argv[2].split(",")
args = _tiny_args(dim=128, intermediate_size=256)
target, head = _random_model(args, seed), _random_head(args, seed + 1)
out = []
for spec in [dict(none=None, eagle2=TreeSpec("eagle2", depth=3, topk=4, num_draft_tokens=8, lookup_slots=3))[s] for s in specs]:
    h = head if spec else None
    eager, compiled = Generator(target, spec, h), Generator(target, spec, h, compile="max")
    for prompt in (list(range(3, 12)), list(range(40, 3, -3))):
        out.append([compiled.generate(prompt, 16, Sampling()).token_ids, eager.generate(prompt, 16, Sampling()).token_ids])
fxgraph = {{k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")}}
print(json.dumps({{"tokens": out, "fxgraph": fxgraph}}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU compile settings are measured on Linux")
def test_compile_max_runs_gemm_templates_matches_eager_and_is_cached_by_weights(tmp_path):
    """--compile max (inductor.CPU_INDUCTOR_MAX: frozen weights, Inductor's C++ GEMM templates): fp32 greedy tokens
    equal eager decoding for vanilla and an eagle2 cycle with lookup slots, and the compiled code holds template
    micro-kernels (a silent fall-back to oneDNN's linears would fail). A second process loads every graph from the
    FX graph cache; a model of the same shapes with other weights compiles its own (a hit would decode with the
    first model's repacked weights, and its tokens would differ from its eager ones). Own processes: the settings
    are global."""
    cache = tmp_path / "inductor"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    script = COMPILE_MAX.format(repo=str(REPO), tests=str(REPO / "tests"))

    def run(seed, specs):
        r = subprocess.run([sys.executable, "-c", script, str(seed), specs], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        for compiled, eager in out["tokens"]:
            assert compiled == eager and len(eager) == 16
        return out

    cold = run(0, "none,eagle2")
    assert any("micro_gemm" in f.read_text(errors="ignore") for f in cache.rglob("*") if f.suffix in (".cpp", ".py", ".h"))
    graphs = cold["fxgraph"].get("fxgraph_cache_miss", 0)
    assert graphs >= 3 and cold["fxgraph"] == {"fxgraph_cache_miss": graphs}
    warm = run(0, "none,eagle2")
    assert warm["fxgraph"] == {"fxgraph_cache_hit": graphs} and warm["tokens"] == cold["tokens"]
    other = run(2, "none")
    assert other["fxgraph"].get("fxgraph_cache_miss", 0) >= 2 and "fxgraph_cache_hit" not in other["fxgraph"]


@pytest.fixture
def compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path))
    return tmp_path / inductor.CACHE


@pytest.mark.parametrize("packed_ms,template_ms,choice", [(10.0, 5.0, "max"), (10.0, 9.0, True), (5.0, 10.0, True)])
def test_compile_auto_takes_the_templates_where_they_measured_faster_once_then_cached(tiny_args, random_model, compile_cache,
                                                                                       monkeypatch, packed_ms, template_ms, choice):
    monkeypatch.setattr(inductor, "measure_step", lambda args, dtype, rows_kernel, codes=False: {"packed_ms": packed_ms, "template_ms": template_ms})
    target, logs = random_model(tiny_args(), seed=0), []
    assert inductor.choose("auto", target, log=logs.append) == choice
    (key, entry), = json.loads(compile_cache.read_text()).items()
    a = target.args
    assert entry["choice"] == ("max" if choice == "max" else "packed") and f"{torch.float32} | dim {a.dim} ffn {a.intermediate_size}" in key
    assert str(compile_cache) in logs[-1] and entry["choice"] in logs[-1]
    monkeypatch.setattr(inductor, "measure_step", lambda args, dtype, rows_kernel, codes=False: pytest.fail("the second call must read the cache"))
    assert inductor.choose("auto", target, log=logs.append) == choice and len(logs) == 2  # said once, when measured
    assert inductor.choose("packed", target) is True and inductor.choose("max", target) == "max"  # asked for: as asked
    assert inductor.choose(False, target) is False


def test_compile_auto_keeps_an_fp32_quantised_target_on_its_rows_kernels_and_a_bf16_one_follows_the_measurement(
        tiny_args, random_model, compile_cache, monkeypatch):
    import quant
    monkeypatch.setattr(inductor, "measure_step", lambda args, dtype, rows_kernel, codes=False: pytest.fail("an fp32 quantised target must not measure"))
    target = quant.quantize_model(random_model(tiny_args(), seed=0), "int8", 0)
    assert inductor.choose("auto", target) is True and not compile_cache.exists()  # freezing would turn its kernels off
    # bf16: packed timed over oneDNN, as its QuantLinear layers are no linears.RowsLinear, and kept apart from float targets
    monkeypatch.setattr(inductor, "measure_step", lambda args, dtype, rows_kernel, codes=False: {"packed_ms": 10.0 + rows_kernel, "template_ms": 5.0})
    assert inductor.choose("auto", quant.quantize_model(random_model(tiny_args(), seed=0).bfloat16(), "int8", 0)) == "max"
    (key, entry), = json.loads(compile_cache.read_text()).items()
    assert key.endswith("packed: oneDNN") and entry["packed_ms"] == 10.0


def test_the_step_measurement_cuts_the_target_to_a_few_hundred_mb_and_times_both_ways(tiny_args):
    from model import ModelArgs
    smol = ModelArgs(dim=576, n_layer=30, n_head=9, n_local_heads=3, intermediate_size=1536, vocab_size=49152)
    assert inductor.step_args(smol, 2).n_layer == 11  # 11 layers (7 MB each in bf16) and the 57 MB LM head: 128 MB
    assert inductor.step_args(smol, 4).n_layer == 2 and inductor.step_args(tiny_args(), 4).n_layer == tiny_args().n_layer
    ms = inductor.measure_step(tiny_args(), torch.float32)  # a child process: packing first would change the other's lowering
    assert set(ms) == {"packed_ms", "template_ms"} and all(v > 0 for v in ms.values())


def test_compile_auto_falls_back_to_packed_where_the_measurement_fails(tiny_args, random_model, compile_cache, monkeypatch):
    def fail(args, dtype, rows_kernel, codes=False):
        raise RuntimeError("timing the decode step failed: ['InductorError: no GEMM template']")
    monkeypatch.setattr(inductor, "measure_step", fail)
    logs = []
    assert inductor.choose("auto", random_model(tiny_args(), seed=0), log=logs.append) is True
    assert "packed" in logs[-1] and "no GEMM template" in logs[-1]
