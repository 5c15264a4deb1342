"""benchmarks/real_study.py end to end on a small random Llama folder: every row written, its KV
bytes per token by the formula equal to those its cache measures; a run stopped part-way and started
again keeps the rows done; and each option refused in one line before anything is scored."""

import json

import pytest

from benchmarks import real_study
from tests.helpers import ROOT, hf_folder

# A tiny study: the folder's head_dim is 16 (8 RoPE pairs), 2 of its 4 heads are K/V heads.
OPTIONS = ["--context", "32", "--eval-tokens", "300", "--windows", "8", "16", "--sinks", "2",
           "--int4-recent", "4", "--int4-group", "8", "--latent", "24", "12", "--rope-pairs", "2",
           "--steps", "2", "--batch", "2", "--train-context", "16"]
ROWS = ["as is, float32 cache", "as is, bfloat16 cache", "int8 cache", "int4 cache, last 4 float32",
        "window 8", "window 8 + 2 sinks", "window 16", "window 16 + 2 sinks", "GQA 2 -> MQA",
        "MLA retrofit, d_c 24, 2 RoPE pairs", "MLA retrofit, d_c 12, 2 RoPE pairs", "kv_share 2"]
UPTRAINED = ["as is", *ROWS[-4:]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(a small random Llama folder, a text file of 40,000 characters of TinyShakespeare)."""
    root = tmp_path_factory.mktemp("real_study")
    hf_folder(root / "llama", "llama")
    text = root / "text.txt"
    text.write_text((ROOT / "data" / "assets" / "tinyshakespeare.txt").read_text()[:40_000])
    return root / "llama", text


@pytest.fixture(scope="module")
def study(folder, tmp_path_factory):
    """The study's command line run once, and its output folder."""
    out = tmp_path_factory.mktemp("real_study_out")
    argv = ["--ckpt", str(folder[0]), "--text", str(folder[1]), "--out", str(out), *OPTIONS]
    real_study.main(argv)
    return argv, out


def test_every_row_is_written_with_its_kv_bytes_by_the_formula_equal_to_those_measured(study):
    _, out = study
    records = json.loads((out / "real_study.json").read_text())
    assert [r["key"] for r in records] == ROWS + [f"{name} (uptrained)" for name in UPTRAINED]
    for r in records:
        assert r["kv_bytes_formula"] == pytest.approx(r["kv_bytes_measured"], rel=1e-12), r["key"]
        assert r["loss"] > 0 and r["decode_tokens_per_s"] > 0 and len(r["loss_by_position"]) == 2
    bytes_of = {r["key"]: r["kv_bytes_measured"] for r in records}
    full = bytes_of["as is, float32 cache"]  # 3 layers x K and V x 2 heads x 16 numbers x 4 bytes
    assert full == 3 * 2 * 2 * 16 * 4
    assert bytes_of["as is, bfloat16 cache"] == full / 2 and bytes_of["GQA 2 -> MQA"] == full / 2
    assert bytes_of["kv_share 2"] == full * 2 / 3  # layers 0 and 2 keep K/V (3 layers)
    assert bytes_of["window 8"] == full * 8 / 32 and bytes_of["window 8 + 2 sinks"] == full * 10 / 32
    assert bytes_of["MLA retrofit, d_c 12, 2 RoPE pairs"] == 3 * (12 + 2 * 2 * 2) * 4
    losses = {r["key"]: r["loss"] for r in records}
    assert abs(losses["as is, bfloat16 cache"] - losses["as is, float32 cache"]) < 0.01
    table = (out / "real_study.md").read_text()
    assert all(f"| {name} |" in table for name in ROWS) and "uptrained, 2 steps each" in table
    assert all((out / name).stat().st_size > 10_000 for name in ("pareto.png", "loss_by_position.png"))


def test_a_run_stopped_part_way_keeps_its_rows_when_started_again(study, capsys):
    argv, out = study
    file = out / "rows.jsonl"
    lines = file.read_text().splitlines()
    file.write_text("\n".join(lines[:-2]) + "\n")  # a run stopped before its last two rows
    capsys.readouterr()
    real_study.main(argv)
    again = file.read_text().splitlines()
    assert again[:-2] == lines[:-2] and len(again) == len(lines)
    first = capsys.readouterr().out.splitlines()[0]
    n = len(ROWS) + len(UPTRAINED)
    assert first.startswith(f"{n} rows") and f"{n - 2} done before" in first, first


@pytest.mark.parametrize("change, option", [
    (["--windows", "32"], "--windows"),          # not under the context: changes nothing
    (["--context", "8"], "--context"),
    (["--int4-group", "5"], "--int4-group"),     # does not divide the heads' 16
    (["--int4-recent", "-1"], "--int4-recent"),
    (["--latent", "0"], "--latent"),
    (["--latent", "100000"], "--latent"),
    (["--rope-pairs", "9"], "--rope-pairs"),     # a head of 16 has 8 pairs
    (["--steps", "-1"], "--steps"),
    (["--lr", "0"], "--lr"),
    (["--text", "/no/such/file.txt"], "--text"),
    (["--ckpt", "/no/such/folder"], "--ckpt"),
    (["--device", "cuda"], "--device"),          # the suite hides CUDA
])
def test_each_option_is_refused_in_one_line_naming_it_before_anything_is_scored(folder, tmp_path, change,
                                                                                 option, capsys):
    argv = ["--ckpt", str(folder[0]), "--text", str(folder[1]), "--out", str(tmp_path / "out"), *OPTIONS,
            *change]
    with pytest.raises(SystemExit) as exit_:
        real_study.main(argv)
    message = str(exit_.value.code)
    assert message.startswith(f"error: {option}") and "\n" not in message, message
    assert not (tmp_path / "out" / "rows.jsonl").exists() or len(
        (tmp_path / "out" / "rows.jsonl").read_text().splitlines()) <= 1
