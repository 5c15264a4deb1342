"""model/optimizer.py: which parameters Muon and AdamW each get, and train.optimizer=muon trains,
checkpoints and resumes bit-identically, as AdamW does."""

import pytest
import torch

from model import checkpoint
from model.optimizer import MuonAndAdamW, configure_optimizer
from tests.helpers import compose, read_metrics, step_losses, tiny_model, train_checked


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = tiny_model(bias=True, norm="layernorm")
    optimizer = configure_optimizer(model, "muon", lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    assert isinstance(optimizer, MuonAndAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    on_muon = {names[id(p)] for g in optimizer.optimizers["muon"].param_groups for p in g["params"]}
    on_adamw = {names[id(p)] for g in optimizer.optimizers["adamw"].param_groups for p in g["params"]}
    assert on_muon == {f"blocks.{i}.{m}.weight" for i in range(2)
                       for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert on_muon.isdisjoint(on_adamw) and on_muon | on_adamw == set(names.values())
    assert {"wte.weight", "wpe.weight", "norm_f.weight", "blocks.0.attn.qkv.bias"} <= on_adamw
    # one learning rate for all: the loop sets it on every group
    assert len(optimizer.param_groups) == 3
    decayed = [g["weight_decay"] for g in optimizer.optimizers["adamw"].param_groups]
    assert decayed == [0.1, 0.0]  # AdamW decays the embeddings, not norms and biases


def test_adamw_is_one_torch_optimizer_over_every_parameter():
    model = tiny_model()
    optimizer = configure_optimizer(model, "adamw", lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_muon_trains_checkpoints_and_resumes_bit_identically(tiny_run, tmp_path):
    muon = [*tiny_run, "train.optimizer=muon"]
    straight = train_checked(compose(*muon, "train.full_val=true"), tmp_path / "straight")
    train_checked(compose(*muon, "train.max_iters=6", "train.lr_decay_iters=12"), tmp_path / "first")
    train_checked(compose(*muon, f"train.resume={tmp_path / 'first'}"), tmp_path / "second")
    straight_losses = step_losses(tmp_path / "straight")
    assert step_losses(tmp_path / "second") == {s: v for s, v in straight_losses.items() if s > 6}
    a, b = checkpoint.load(tmp_path / "straight"), checkpoint.load(tmp_path / "second")
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    assert set(a.optimizer) == {"muon", "adamw"} and a.optimizer["muon"]["state"]  # momentum saved
    evals = [m["val_loss"] for m in read_metrics(tmp_path / "straight") if "val_loss" in m]
    assert evals[-1] < evals[0] and straight["val_loss_full"] < evals[0]


def test_resuming_with_the_other_optimizer_names_the_option(tiny_run, tmp_path):
    train_checked(compose(*tiny_run, "train.max_iters=2", "train.optimizer=muon"), tmp_path / "a")
    with pytest.raises(ValueError, match=r"trained with train\.optimizer=muon, not adamw"):
        train_checked(compose(*tiny_run, "train.optimizer=adamw", f"train.resume={tmp_path / 'a'}"),
                      tmp_path / "b")
