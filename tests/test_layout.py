"""The layout every change keeps: train.py and the README short, no long functions, imports that
run one way down, in no circle, and in model/ files that each open with their one concern, import
only the files below them and keep a code-first share of comments and docstrings."""

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from tests.helpers import ROOT, clean_env

PACKAGES = ("model", "data", "training", "cli")
SOURCES = sorted([ROOT / "train.py", ROOT / "generate.py",
                  *(path for package in PACKAGES for path in (ROOT / package).glob("*.py"))])


def commentary_share(path) -> float:
    """The share of a file's non-blank lines that are a comment alone or part of a docstring."""
    source = path.read_text()
    lines = {n for n, line in enumerate(source.splitlines(), 1) if line.strip()}
    prose = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            prose |= set(range(body[0].lineno, body[0].end_lineno + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.line.strip().startswith("#"):
            prose.add(token.start[0])
    return len(prose & lines) / len(lines)


def test_train_py_and_the_readme_stay_short():
    assert len((ROOT / "train.py").read_text().splitlines()) <= 300
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_is_over_60_lines(path):
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60]
    assert not long


@pytest.mark.parametrize("path", sorted((ROOT / "model").glob("*.py")), ids=lambda p: p.name)
def test_model_code_is_at_most_30_percent_comments_and_docstrings(path):
    assert commentary_share(path) <= 0.30


# ----------------------------------------------------------------------------- the import graph

# The project's packages and scripts by layer: each imports only from its own package or from a
# lower layer, never from its own layer's others (model and data are independent; scripts never
# import each other), and the library (model, data, training) never imports the command line.
LAYERS = {"model": 0, "data": 0, "training": 1, "cli": 2, "train": 3, "generate": 3, "benchmarks": 4}
# What a package may import from outside the project (the standard library aside).
MODEL_PACKAGES = {"torch", "safetensors", "gguf", "numpy"}  # (gguf and its numpy arrays: GGUF files)


def project_files() -> dict[str, Path]:
    """{module name: file} of every module of the project: packages, scripts, benchmarks."""
    files = [ROOT / "train.py", ROOT / "generate.py",
             *(p for package in LAYERS if (ROOT / package).is_dir() for p in (ROOT / package).glob("*.py"))]
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in files}


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function (the names of `from m import
    a, b` as m.a and m.b, so that `from model import checkpoint` reads as model.checkpoint)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def project_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports}."""
    modules = project_files()
    return {name: {m for m in imports_of(path) if m in modules and m != name}
            for name, path in modules.items()}


def test_each_layer_imports_only_downwards():
    wrong = [f"{module} -> {target}" for module, targets in project_graph().items() for target in targets
             if (a := module.split(".")[0]) != (b := target.split(".")[0]) and LAYERS[a] <= LAYERS[b]]
    assert not wrong


def test_model_imports_only_torch_its_file_readers_and_itself():
    stdlib = sys.stdlib_module_names
    outside = {f"{name}: {m}" for name, path in project_files().items() if name.split(".")[0] == "model"
               for m in imports_of(path) if m.split(".")[0] not in {*stdlib, *MODEL_PACKAGES, "model"}}
    assert not outside


MODEL_BUILDS = """
import sys, torch, model, data, training.loop, cli.options, generate
from cli.report import meta_cache
from model.config import GPTConfig
small = model.GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=11))
state = {k: v for k, v in small.state_dict().items() if k != "lm_head.weight"}  # (tied to wte)
read = model.GPT.from_state(small.config, state, torch.float32, "a state", "GPT")
assert all(torch.equal(v, read.state_dict()[k]) for k, v in small.state_dict().items())
cache = meta_cache(small.config, torch.float32)
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_importing_the_project_and_reading_a_model_loads_no_compiler():
    """torch.compile's machinery (dynamo, inductor: ~2 s of imports) loads only when something
    compiles, so every command starts, and a bad option fails, without it; nor does a model read
    from its weights (built on the meta device first) or a cache sized on the meta device, so
    generate.py samples without it."""
    result = subprocess.run([sys.executable, "-c", MODEL_BUILDS], cwd=ROOT, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]


def test_the_imports_have_no_circle():
    graph, state, circles = project_graph(), {}, []

    def visit(module: str, path: list[str]) -> None:  # depth first: a module met again on its path: a circle
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [module, target]))
            elif target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not circles


# ----------------------------------------------------------------------------- model/, file by file

# model/'s files from the bottom up: each imports only files before it (the package's __init__,
# its public face, sits on top). A new file takes its place here, which is where a reader finds
# the order to read them in.
MODEL_ORDER = ["core", "config", "device", "kv_cache", "quantize", "windows", "kernels", "attention",
               "latent", "rope", "pretrained", "gpt", "gguf", "checkpoint", "convert", "retrofit", "loading",
               "sampling", "prefill", "step_package", "decode_step", "recorder", "generation", "conversation",
               "timing", "__init__"]
MODEL_FILES = sorted((ROOT / "model").glob("*.py"))


def model_imports(path: Path) -> set[str]:
    """The files of model/ that `path` imports, by stem: `from model.x import a` and `from model
    import x` (x a file) are x; `from model import A` (a name of the package) is __init__."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "model":
            found |= {a.name if (ROOT / "model" / f"{a.name}.py").exists() else "__init__"
                      for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.startswith("model."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("model.")}
    return found - {path.stem}


def test_every_model_file_has_its_place_in_the_order():
    assert sorted(MODEL_ORDER) == sorted([*(p.stem for p in MODEL_FILES), "core"])  # core: a folder


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: p.name)
def test_a_model_file_imports_only_the_files_below_it(path):
    below = set(MODEL_ORDER[:MODEL_ORDER.index(path.stem)])
    assert model_imports(path) <= below, sorted(model_imports(path) - below)


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: p.name)
def test_a_model_file_opens_with_its_one_concern(path):
    """Its docstring's first sentence names what the file is for, in at most 30 words: a concern,
    not a table of contents."""
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring, "no opening docstring"
    first = re.split(r"(?<=[.!?])\s", " ".join(docstring.split()), maxsplit=1)[0]
    assert first.endswith((".", "!", "?")) and len(first.split()) <= 30, first
