"""benchmarks/gpu.py and the GPU plan (benchmarks/README.md, "Measuring on a rented GPU"), on the
CPU: every command of the plan runs with --smoke on a prepared corpus with `datasets` made
unimportable, each measurement is on disk when it ends (a killed run keeps them), and a failed
measurement is a row while the next runs."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from benchmarks.gpu import (
    COLD_GROUPS,
    COLD_LEVERS,
    LEVER_GROUPS,
    SMOKE_RUNS,
    Results,
    cold_lever_names,
    lever_overrides,
    main,
)
from tests.helpers import ROOT, clean_env, compose

# A command of the plan as the GPU machine runs it, but with `datasets` unimportable, as it is there:
# an import of it fails the measurement, and none of what it pulls may have been imported at the end.
WITHOUT_DATASETS = """import runpy, sys
sys.modules["datasets"] = None
sys.argv = {argv!r}
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    pulled = [m for m in ("pyarrow", "multiprocess", "xxhash") if m in sys.modules]
    assert not pulled, f"imported what datasets pulls: {{pulled}}"
"""


def plan_commands() -> list[str]:
    """The commands of benchmarks/README.md's plan, in order, comments dropped."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    plan = text[text.index("## Measuring on a rented GPU"):]
    block = re.search(r"```sh\n(.*?)```", plan, flags=re.S).group(1)
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines() if line.strip()]


def test_the_plan_measures_every_coldstart_lever_and_ends_with_the_cuda_checks():
    commands = plan_commands()
    gpu = [shlex.split(c) for c in commands if c.startswith("python3 benchmarks/gpu.py")]
    assert commands[-1].startswith("python3 -m pytest --gpu tests/test_gpu.py")
    sections = {s for argv in gpu for s in " ".join(argv).split("--section ")[1].split(" --")[0].split()}
    assert sections == {"coldstart", "exactness"}
    assert set(plan_groups()) <= set(COLD_GROUPS)  # the last rental's; the earlier ones' stay runnable
    every_group = {name.removesuffix(", warm caches") for name in cold_lever_names(list(COLD_GROUPS))}
    assert every_group == set(COLD_LEVERS)  # each lever measured by some command
    assert all(argv[argv.index("--out") + 1] == "$OUT/gpu" for argv in gpu)  # one results file


def plan_groups() -> list[str]:
    """The coldstart groups the plan's commands name, in order."""
    return [name for c in plan_commands() if c.startswith("python3 benchmarks/gpu.py")
            for name in c.split("--levers ")[1].split(" --")[0].split()]


@pytest.mark.parametrize("lever", COLD_LEVERS)
def test_every_coldstart_lever_is_a_valid_gpu_run(lever):
    """The overrides each lever adds to `python train.py` on a GPU (a smoke run turns off what it
    cannot run on a CPU): every value passes the train group's schema."""
    cfg = compose("experiment=shakespeare_char_gpu", *COLD_LEVERS[lever])
    assert OmegaConf.to_object(cfg.train).max_iters >= 1


def run_the_plan(tmp_path):
    """The plan's gpu.py commands, with --smoke, in order, into one --out: returned as the function
    that runs them and returns that folder, their environment taken here, in the calling thread (a
    test's monkeypatch later must not reach them). The session's prepared corpus (KVGPT_CACHE;
    conftest prepares it first) stands in for the one the plan carries. conftest starts this with
    the session, beside the suite."""
    env = clean_env()

    def run_commands() -> Path:
        for command in plan_commands():
            if command.startswith("python3 benchmarks/gpu.py"):
                argv = [*shlex.split(command.replace("$OUT", str(tmp_path)))[1:], "--smoke"]
                # `ulimit -f unlimited`: a full-disk test lowers this process's file-size limit for a
                # moment, and a command started meanwhile would inherit it (as test_readme's do).
                result = subprocess.run(["bash", "-c", 'ulimit -f unlimited; exec "$0" "$@"', sys.executable,
                                         "-c", WITHOUT_DATASETS.format(argv=argv)], cwd=ROOT,
                                        env=env, capture_output=True, text=True, timeout=300)
                assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        return tmp_path / "gpu"

    return run_commands


@pytest.mark.slow
def test_every_command_of_the_plan_runs_on_the_cpu_without_datasets(started_run):
    out = started_run.result()  # raises what a command raised
    rows = Results(out).rows()
    assert not [r for r in rows if "error" in r]
    assert {r["section"] for r in rows} == {"coldstart", "exactness"}
    trained = [r["name"].removeprefix("python train.py: ") for r in rows
               if r["name"].startswith("python train.py")]
    assert trained == [name for group in plan_groups() for name in COLD_GROUPS[group][:SMOKE_RUNS]]
    assert all(r["val (whole split)"] is None or r["val (whole split)"] > 0 for r in rows if "overrides" in r)
    sampled = [r for r in rows if r["name"].startswith(("python generate.py:", "transformers"))]
    assert len(sampled) == 4 and all(r["tokens/s from the first"] > 0 for r in sampled)
    tables = (out / "tables.md").read_text()
    assert "### coldstart" in tables and "### exactness" in tables
    assert "$ " in (out / "coldstart.log").read_text()
    assert "Self CPU" in (out / "profile_generate_default.txt").read_text()


KILLED_MIDWAY = "test_a_run_killed_midway_keeps_every_measurement_it_finished"


def kill_once_a_row_is_written(proc: subprocess.Popen, out: Path) -> int:
    """SIGKILL to `proc` once out/tables.md is on disk (its first row written, or the process ended, or
    two minutes passed): its exit status."""
    deadline = time.monotonic() + 120
    while not (out / "tables.md").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    return proc.wait()


@pytest.fixture(scope="module", autouse=True)
def killed_midway(request, tmp_path_factory):
    """(--out, the future of its exit status) of `benchmarks/gpu.py --smoke --section train --levers
    speed` (7 levers), started with this module's first test and killed by a thread once its first
    row is on disk (kill_once_a_row_is_written): its seconds are spent beside the module's other
    tests, in this process. None where that test is not selected."""
    if not any(item.name == KILLED_MIDWAY for item in request.session.items):
        yield None
        return
    request.getfixturevalue("char_data")  # the corpus its levers train on
    out = tmp_path_factory.mktemp("killed") / "gpu"
    proc = subprocess.Popen([sys.executable, "benchmarks/gpu.py", "--smoke", "--section", "train", "--levers",
                             "speed", "--out", str(out)], cwd=ROOT, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield out, pool.submit(kill_once_a_row_is_written, proc, out)


def test_a_run_killed_midway_keeps_every_measurement_it_finished(killed_midway):
    """SIGKILL after the first lever's row: that row and the tables are on disk, whole."""
    out, status = killed_midway
    assert status.result() == -signal.SIGKILL  # killed before the last of its 7 levers
    lines = (out / "results.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line whole
    assert 1 <= len(rows) < 7 and rows[0]["name"] == "recipe" and rows[0]["tokens/s"] > 0
    assert "| recipe |" in (out / "tables.md").read_text()


def test_a_failed_measurement_is_a_row_and_the_next_one_runs(tmp_path, char_data, capsys):
    """A lever given as overrides that no model takes (5 K/V heads for 2 query heads) fails with its
    one-line reason; the recipe after it is measured; the run ends with exit 1 naming the failure."""
    with pytest.raises(SystemExit, match=r"1 of 2 measurements failed: train: model.n_kv_head=5"):
        main(["--smoke", "--section", "train", "--levers", "model.n_kv_head=5", "recipe",
              "--out", str(tmp_path)])
    failed, recipe = Results(tmp_path).rows()
    assert failed["error"].startswith("ValueError: ") and "n_kv_head" in failed["error"]
    assert recipe["name"] == "recipe" and recipe["tokens/s"] > 0 and "error" not in recipe
    assert "FAILED train: model.n_kv_head=5: ValueError" in capsys.readouterr().out


def test_lever_names_groups_and_overrides_are_read_and_anything_else_refused():
    assert list(lever_overrides(["tuning"])) == LEVER_GROUPS["tuning"]
    assert lever_overrides(["RMSNorm", "train.lr=3e-3 model.dropout=0"]) == {
        "RMSNorm": ["model.norm=rmsnorm"],
        "train.lr=3e-3 model.dropout=0": ["train.lr=3e-3", "model.dropout=0"]}
    with pytest.raises(SystemExit, match="--levers: 'rmsnorm' is not a group"):
        lever_overrides(["rmsnorm"])


def test_rows_cut_short_by_a_kill_are_skipped(tmp_path):
    results = Results(tmp_path)
    results.add({"section": "train", "name": "recipe", "tokens/s": 1.0})
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"section": "train", "name": "RoP')  # killed while writing
    assert [r["name"] for r in results.rows()] == ["recipe"]
