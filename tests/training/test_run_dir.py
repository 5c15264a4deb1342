"""training/run_dir.py and training/rng.py: a run dir claimed once and never over a run, stale temp
files, the metrics file written a whole line at a time and read back, and the RNG state each
process restores."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from model import GPT, checkpoint
from model.checkpoint import Checkpoint
from tests.helpers import ROOT, disk_full_after, tiny_model
from training.rng import restore_rng, rng_state, rng_states_of_ranks, seed_rngs
from training.run_dir import (
    RUN_MARKERS,
    MetricsLog,
    claim_run_dir,
    read_metrics,
    release_run_dir,
    remove_stale_temp_files,
)


def write(path, model: GPT, **fields) -> None:
    checkpoint.save(path, Checkpoint(model=model.state_dict(), model_config=model.config,
                                     data_meta={"tokenizer": "char", "vocab": None}, **fields))


def test_a_run_dir_is_claimed_once_and_never_over_a_run(tmp_path):
    run_dir = claim_run_dir(tmp_path / "run")
    assert claim_run_dir(tmp_path / "run") == run_dir  # idempotent in one process
    in_use = subprocess.run([sys.executable, "-c", "import sys; from training.run_dir import claim_run_dir; "
                             "claim_run_dir(sys.argv[1])", str(run_dir)],
                            cwd=ROOT, capture_output=True, text=True)
    assert in_use.returncode != 0 and "is in use: another process is training there" in in_use.stderr
    write(run_dir / "ckpt.pt", tiny_model())
    release_run_dir(run_dir)
    for marker in RUN_MARKERS:
        (tmp_path / marker).mkdir()
        (tmp_path / marker / marker).touch()
        with pytest.raises(FileExistsError, match=rf"already holds a run \({marker}\).*train.resume="):
            claim_run_dir(tmp_path / marker)
    with pytest.raises(OSError, match=r"^run_dir: cannot write to .*a_file/run"):
        (tmp_path / "a_file").touch()
        claim_run_dir(tmp_path / "a_file" / "run")


def test_temp_files_of_a_killed_save_go_at_the_next_start_unless_a_writer_lives(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    litter = [run_dir / ".ckpt.pt.abc123", run_dir / ".best.pt.x9", run_dir / ".loss.png.k2j4"]
    for temp in litter:
        temp.write_bytes(b"half a checkpoint")
    (run_dir / "keep.txt").touch()
    writer = subprocess.Popen([sys.executable, "-c", "import sys, time; from training.run_dir import "
                               "claim_run_dir; claim_run_dir(sys.argv[1]); print('ok', flush=True); "
                               "time.sleep(60)", str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "ok\n"
        for temp in litter:  # the claim removed those of a dead writer; now a live one may write
            temp.write_bytes(b"being written")
        assert remove_stale_temp_files(run_dir) == []
    finally:
        writer.kill()
        writer.wait()
    assert sorted(remove_stale_temp_files(run_dir)) == sorted(litter)
    assert [p.name for p in run_dir.iterdir() if not p.name.startswith(".lock")] == ["keep.txt"]


def test_rng_state_round_trips():
    cpu = torch.device("cpu")
    seed_rngs(3)
    processes = rng_states_of_ranks(cpu)  # one process: its own
    assert len(processes) == 1 and processes[0]["cuda"] is None
    first = (torch.rand(3).tolist(), np.random.rand(), random.random())
    restore_rng(processes, 0, cpu)
    assert (torch.rand(3).tolist(), np.random.rand(), random.random()) == first


def test_each_rank_restores_its_own_rng_state_whatever_the_device_count():
    """A run saved by 3 processes on 3 GPUs resumes on a CPU with 2 processes and with 4: rank r takes
    rank r's torch state; the CUDA states are skipped on a CPU; a rank the run did not have keeps
    its own seed. (CUDA's state goes only to this process's device: torch.cuda.set_rng_state.)"""
    cpu, processes = torch.device("cpu"), []
    for rank in range(3):
        seed_rngs(100 + rank)
        state = rng_state(cpu)
        state["cuda"] = torch.zeros(16, dtype=torch.uint8)  # what torch.cuda.get_rng_state gives
        processes.append(state)
    draws = []
    for seed in (100, 101, 102, 7):
        seed_rngs(seed)
        draws.append(torch.rand(4))
    for rank in range(4):
        seed_rngs(7)  # the fresh seed of a resumed process
        restore_rng(processes, rank, cpu)
        assert torch.equal(torch.rand(4), draws[rank]), rank


def test_a_damaged_metrics_file_names_its_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n[3]\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a metrics record .*'\{\"step\": 2, "):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"loss": 1.0}\n')
    with pytest.raises(ValueError, match="line 2: not a metrics record"):
        read_metrics(tmp_path)


def test_a_metrics_line_the_disk_refuses_part_way_is_cut_off_and_the_earlier_lines_stay(tmp_path):
    """The disk fills up 10 bytes into a record's line: the part written goes, the lines before it
    stay byte for byte, and the error is the run dir's (the command line names it hydra.run.dir)."""
    log = MetricsLog(tmp_path, {"wandb": {"mode": "disabled", "project": "p", "name": None}}, True, 0, 9)
    log.record({"step": 1, "loss": 2.0})
    earlier = (tmp_path / "metrics.jsonl").read_bytes()
    message = r"^run_dir: cannot write .*/metrics\.jsonl: File too large; its earlier lines are intact$"
    with disk_full_after(len(earlier) + 10), pytest.raises(OSError, match=message):
        log.record({"step": 2, "loss": 1.5, "lr": 0.001})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == earlier and len(read_metrics(tmp_path)) == 1


def test_a_number_that_is_not_finite_is_written_as_null_never_as_non_json(tmp_path):
    """Python's json writes NaN and Infinity, which a strict reader (JavaScript's, jq, pandas' default)
    refuses: a diverged val loss or an overflowed MFU is null, in a line any JSON reader takes."""
    log = MetricsLog(tmp_path, {"wandb": {"mode": "disabled", "project": "p", "name": None}}, True, 0, 9)
    log.record({"step": 1, "val_loss": float("nan"), "mfu": float("inf"), "lr": -float("inf"), "loss": 2.5,
                "nested": [float("nan"), {"x": float("inf")}]})
    log.close()

    def refuse(word):
        raise ValueError(f"not JSON: {word}")

    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line, parse_constant=refuse)
    assert {k: record[k] for k in ("val_loss", "mfu", "lr", "loss", "nested")} == {
        "val_loss": None, "mfu": None, "lr": None, "loss": 2.5, "nested": [None, {"x": None}]}
