"""The size limits every change keeps: train.py and the README short, no long functions, and in
model/ a code-first share of comments and docstrings."""

import ast
import io
import tokenize

import pytest

from tests.helpers import ROOT

SOURCES = sorted([ROOT / "train.py", ROOT / "generate.py", *(ROOT / "model").glob("*.py"),
                  *(ROOT / "data").glob("*.py")])


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
