import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml

from model import GPT, GPTConfig
from tests.conftest import ROOT, compose, read_metrics, run_script
from train import RunError, load_checkpoint, load_weights, model_config, save_checkpoint, train

EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))


def test_model_yaml_mirrors_gpt_config():
    fields = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    base = yaml.safe_load((ROOT / "configs/model/base.yaml").read_text())
    assert base.keys() == fields.keys()
    assert {k: v for k, v in base.items() if k != "vocab_size"} == {
        k: v for k, v in fields.items() if k != "vocab_size"}
    for preset in (ROOT / "configs/model").glob("*.yaml"):
        keys = set(yaml.safe_load(preset.read_text())) - {"defaults"}
        assert keys <= fields.keys(), preset


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("attention,ratio", [("mha", 1), ("gqa", None), ("mqa", None)])
def test_every_experiment_composes(experiment, attention, ratio):
    cfg = compose(f"experiment={experiment}", f"attention={attention}")
    config = model_config(cfg.model, vocab_size=65)
    assert {"mha": config.n_head, "gqa": 2, "mqa": 1}[attention] == config.n_kv_head


def test_nanogpt_recipes():
    gpu = compose("experiment=shakespeare_char")
    assert (gpu.model.n_layer, gpu.model.n_head, gpu.model.n_embd, gpu.model.block_size) == (6, 6, 384, 256)
    assert (gpu.train.batch_size, gpu.train.max_iters) == (64, 5000)
    assert (gpu.model.dropout, gpu.train.beta2, gpu.train.lr, gpu.train.min_lr) == (0.2, 0.99, 1e-3, 1e-4)
    cpu = compose("experiment=shakespeare_char_cpu")
    assert (cpu.model.n_layer, cpu.model.n_head, cpu.model.n_embd, cpu.model.block_size) == (4, 4, 128, 64)
    assert (cpu.train.batch_size, cpu.train.max_iters, cpu.model.dropout) == (12, 2000, 0.0)


def test_override_typo_fails_with_hydras_message():
    result = run_script("train.py", "experiment=shakespeare_char_cpu", "model.n_layr=3")
    assert result.returncode != 0
    assert "Key 'n_layr' is not in struct" in result.stderr or "n_layr" in result.stderr


def test_invalid_model_is_one_line_error(tiny_run, tmp_path):
    result = run_script("train.py", *tiny_run, "model.n_kv_head=3", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: GPTConfig.n_kv_head=3")


def test_training_writes_the_run_dir(tiny_run, tmp_path):
    summary = train(compose(*tiny_run), tmp_path)
    metrics = read_metrics(tmp_path)
    evals = [m for m in metrics if "val_loss" in m]
    assert [m["step"] for m in evals] == [0, 6, 12]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert all({"loss", "lr", "tokens_per_s"} <= m.keys() for m in metrics if "loss" in m)
    assert {"best.pt", "ckpt.pt", "loss.png", "metrics.jsonl"} <= {p.name for p in tmp_path.iterdir()}
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["step"] == 12 and ckpt["best_val"] == summary["best_val"]
    assert ckpt["data_meta"]["vocab_size"] == 65 and ckpt["config"]["model"]["n_layer"] == 2


def test_resume_is_bit_identical(tiny_run, tmp_path):
    straight = train(compose(*tiny_run), tmp_path / "straight")
    # the first half stops at 6 but keeps the 12-step schedule, as an interrupted run would
    train(compose(*tiny_run, "train.max_iters=6", "train.lr_decay_iters=12"), tmp_path / "first")
    train(compose(*tiny_run, f"train.resume={tmp_path / 'first'}"), tmp_path / "second")
    losses = lambda d: {m["step"]: m["loss"] for m in read_metrics(d) if "loss" in m}
    assert len(losses(tmp_path / "second")) == 6
    assert losses(tmp_path / "second") == {s: v for s, v in losses(tmp_path / "straight").items() if s > 6}
    assert straight["best_val"] == load_checkpoint(tmp_path / "second")["best_val"]
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "second")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_resume_with_another_model_names_the_field(tiny_run, tmp_path):
    train(compose(*tiny_run, "train.max_iters=2"), tmp_path / "a")
    with pytest.raises(RunError, match=r"model\.n_kv_head=4 .* asks for 2"):
        train(compose(*tiny_run, "attention=gqa", f"train.resume={tmp_path / 'a'}"), tmp_path / "b")


def test_checkpoints_load_with_weights_only(tmp_path):
    bad = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": argparse.Namespace(code="arbitrary object")}, bad)
    with pytest.raises(RunError, match="cannot read checkpoint"):
        load_checkpoint(bad)
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RunError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "corrupt.pt")
    with pytest.raises(RunError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


def test_compiled_checkpoint_loads_uncompiled_and_back(tmp_path):
    config = GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, n_embd=8)
    compiled = torch.compile(GPT(config), backend="eager")
    # a state dict as a compiled module writes it, with the _orig_mod. prefix
    save_checkpoint(tmp_path / "c.pt", {"model": compiled.state_dict(),
                                        "model_config": dataclasses.asdict(config)})
    plain = GPT(config)
    load_weights(plain, load_checkpoint(tmp_path / "c.pt")["model"])
    idx = torch.randint(0, 37, (1, 8))
    assert torch.equal(plain(idx), compiled(idx))
    again = torch.compile(GPT(config), backend="eager")
    load_weights(again, plain.state_dict())
    assert torch.equal(again(idx), plain(idx))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_run, tmp_path):
    train(compose(*tiny_run, "train.max_iters=6"), tmp_path)
    good = load_checkpoint(tmp_path)["model"]
    with pytest.raises(RunError, match="loss is (nan|inf).*last good checkpoint"):
        train(compose(*tiny_run, f"train.resume={tmp_path}", "train.lr=1e30", "train.min_lr=1e30",
                      "train.grad_clip=0", "train.eval_interval=1"), tmp_path)
    kept = load_checkpoint(tmp_path)
    assert kept["step"] == 6 and all(torch.equal(good[k], kept["model"][k]) for k in good)


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tiny_run, tmp_path):
    proc = subprocess.Popen([sys.executable, "train.py", *tiny_run, "train.max_iters=100000",
                             "train.eval_interval=100000", f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # wait until it is training
        if line.startswith("step 3/"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "SIGTERM: saved" in out and "Traceback" not in err
    assert load_checkpoint(tmp_path)["step"] >= 3


def test_wandb_offline_writes_the_run(tiny_run, tmp_path):
    os.environ["WANDB_SILENT"] = "true"
    train(compose(*tiny_run, "wandb.mode=offline", "wandb.name=tiny"), tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # The run file is wandb's record log; values are stored as JSON text inside it.
    record_log = runs[0].read_bytes()
    last_eval = [m for m in read_metrics(tmp_path) if "val_loss" in m][-1]
    assert b"val_loss" in record_log and json.dumps(last_eval["val_loss"]).encode() in record_log
    assert b"tokens_per_s" in record_log and b"n_kv_head" in record_log  # metrics and config


@pytest.mark.slow
def test_ddp_two_processes_match_one(tiny_run, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = run_script("train.py", *tiny_run, "train.batch_size=8", f"hydra.run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_port=29517", "train.py", *tiny_run, "train.batch_size=4",
                          f"hydra.run.dir={tmp_path / 'two'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [m["step"] for m in a] == [m["step"] for m in b]  # rank 0 alone wrote metrics
    for x, y in zip(a, b):
        for key in ("loss", "val_loss"):
            if key in x:
                assert abs(x[key] - y[key]) < 1e-4, (x, y)


@pytest.mark.slow
def test_multirun_sweeps_the_three_variants(tiny_run, tmp_path):
    result = run_script("train.py", "-m", "attention=mha,gqa,mqa", *tiny_run, "train.max_iters=2",
                        f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    runs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert len(runs) == 3 and all(any(v in r for r in runs) for v in ("mha", "gqa", "mqa"))
    kv_heads = {load_checkpoint(tmp_path / r)["model_config"]["n_kv_head"] for r in runs}
    assert kv_heads == {4, 2, 1}
