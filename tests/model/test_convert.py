"""model/convert.py: MHA -> GQA/MQA by mean-pooling K/V heads; python -m cli.convert, then uptraining."""

import json

import pytest
import torch

from model import GPT, checkpoint, generate
from model.convert import mean_pool_kv
from tests.helpers import (
    assert_one_line_error,
    compose,
    read_metrics,
    run_in_process,
    tiny_model,
    train_checked,
)


@pytest.mark.parametrize("kv_share", [1, 2])
def test_conversion_to_n_head_leaves_logits_unchanged(kv_share):
    model = tiny_model(qk_norm=True, kv_share=kv_share)
    config = model.config
    state, same = mean_pool_kv(model.state_dict(), config, 4)
    converted = GPT(same).eval()
    converted.load_state_dict(state)
    idx = torch.randint(0, 37, (2, 12))
    assert torch.equal(converted(idx), model(idx))


@pytest.mark.parametrize("kv_share", [1, 2])
@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_converted_model_loads_generates_and_shrinks_its_cache(n_kv_head, kv_share):
    """With kv_share=2, layer 1 has no K/V to pool and the pooled cache is as much smaller."""
    model = tiny_model(qk_norm=True, kv_share=kv_share)
    config = model.config
    state, new_config = mean_pool_kv(model.state_dict(), config, n_kv_head)
    converted = GPT(new_config).eval()
    converted.load_state_dict(state)
    # each new K head is the mean of its group's old heads
    C, hd = 16, 4
    old_k = model.blocks[0].attn.qkv.weight[C:2 * C].view(4, hd, C)
    new_k = converted.blocks[0].attn.qkv.weight[C:C + n_kv_head * hd].view(n_kv_head, hd, C)
    torch.testing.assert_close(new_k, old_k.view(n_kv_head, 4 // n_kv_head, hd, C).mean(1))
    assert generate(converted, torch.randint(0, 37, (1, 5)), 10, temperature=0).shape == (1, 15)
    assert model.new_kv_cache(1).nbytes == (4 // n_kv_head) * converted.new_kv_cache(1).nbytes


def test_bad_conversion_target_names_the_field():
    model = tiny_model(qk_norm=True)
    config = model.config
    with pytest.raises(ValueError, match="n_kv_head"):
        mean_pool_kv(model.state_dict(), config, 3)
    mla = tiny_model(mla_latent_dim=8)
    with pytest.raises(ValueError, match="multi-head latent attention"):
        mean_pool_kv(mla.state_dict(), mla.config, 2)


@pytest.mark.slow
def test_convert_command_then_uptrain_ends_near_the_parent(tiny_run, tmp_path):
    parent = tmp_path / "parent"
    train_checked(compose(*tiny_run, "train.max_iters=150", "train.eval_interval=50", "train.eval_iters=8",
                  "train.lr=1e-2", "train.min_lr=1e-3"), parent)
    parent_val = checkpoint.load(parent / "best.pt").best_val
    converted = tmp_path / "mqa.pt"
    result = run_in_process("-m", "cli.convert", str(parent), "--n-kv-head", "1", "--out", str(converted))
    assert result.returncode == 0, result.stderr
    assert "4x smaller" in result.stdout
    uptrained = tmp_path / "uptrained"
    train_checked(compose(*tiny_run, f"init_from={converted}", "train.max_iters=30", "train.eval_interval=10",
                  "train.eval_iters=8", "train.lr=1e-3", "train.min_lr=1e-3"), uptrained)
    evals = [m["val_loss"] for m in read_metrics(uptrained) if "val_loss" in m]
    assert checkpoint.load(uptrained).model_config.n_kv_head == 1
    assert checkpoint.load(converted).converted_from == {"path": str(parent), "n_kv_head": 4}
    assert evals[-1] < evals[0]          # uptraining recovers what pooling lost
    assert evals[-1] < parent_val + 0.1  # and ends near the parent
    print(json.dumps({"parent_val": parent_val, "converted_val": evals[0], "uptrained_val": evals[-1]}))


def test_convert_command_errors_are_one_line(tiny_ckpt, tmp_path):
    convert = lambda n_kv_head, out: run_in_process("-m", "cli.convert", str(tiny_ckpt), "--n-kv-head",
                                                    n_kv_head, "--out", str(out))
    # Named as typed: the option, not mean_pool_kv's argument or GPTConfig's field.
    assert_one_line_error(convert("3", tmp_path / "a.pt"), "error: --n-kv-head=3 must divide the checkpoint")
    assert_one_line_error(convert("0", tmp_path / "a.pt"), "error: --n-kv-head must be an integer >= 1")
    (tmp_path / "folder.pt").mkdir()
    result = convert("2", tmp_path / "folder.pt")
    assert_one_line_error(result, f"--out {tmp_path / 'folder.pt'} already exists (nothing is overwritten)")
    assert [p.name for p in tmp_path.iterdir()] == ["folder.pt"]  # nothing written, no temp file left
