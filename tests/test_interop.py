import json
import subprocess
import sys

import pytest
import torch

from model import GPT, GPTConfig
from model.convert import mean_pool_kv
from tests.conftest import ROOT, compose, read_metrics, run_script
from train import load_checkpoint, train

transformers = pytest.importorskip("transformers")


def hf_gpt2(tmp_path, **overrides):
    """A small random GPT-2 written by transformers' save_pretrained."""
    torch.manual_seed(0)
    kw = dict(vocab_size=97, n_positions=48, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
              eos_token_id=0, layer_norm_epsilon=1e-5)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**(kw | overrides))).eval()
    model.save_pretrained(tmp_path)
    return model


def test_logits_match_transformers(tmp_path):
    hf = hf_gpt2(tmp_path)
    ours = GPT.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-5, rtol=0)
    assert ours.config.n_kv_head == 4 and ours.config.block_size == 48


@pytest.mark.parametrize("kv_cache", [True, False])
def test_greedy_generation_matches_transformers(tmp_path, kv_cache):
    hf = hf_gpt2(tmp_path)
    ours = GPT.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 97, (2, 7))
    expected = hf.generate(idx, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(idx, 30, temperature=0, kv_cache=kv_cache), expected)


@pytest.mark.parametrize("field,value", [("activation_function", "relu"), ("n_inner", 64),
                                         ("scale_attn_by_inverse_layer_idx", True)])
def test_unsupported_gpt2_config_names_the_field(tmp_path, field, value):
    hf_gpt2(tmp_path, **{field: value})
    with pytest.raises(ValueError, match=rf"unsupported GPT-2 config: {field}="):
        GPT.from_pretrained(tmp_path)


@pytest.mark.slow
def test_finetune_from_hugging_face_then_sample(tmp_path, data_cache, shakespeare_path, bpe_path):
    hf_dir = tmp_path / "hf"
    hf_gpt2(hf_dir, vocab_size=50257, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    run = tmp_path / "run"
    train(compose("experiment=shakespeare_bpe", f"init_from={hf_dir}", f"data.path={shakespeare_path}",
                  f"data.bpe_path={bpe_path}", f"data.cache_dir={data_cache}", "train.max_iters=4",
                  "train.eval_interval=2", "train.eval_iters=1", "train.batch_size=2",
                  "train.lr=3e-5", "train.min_lr=3e-5", "train.warmup_iters=0", "train.sample_tokens=0"), run)
    ckpt = load_checkpoint(run)
    assert ckpt["model_config"]["n_embd"] == 16 and ckpt["model_config"]["block_size"] == 64
    assert ckpt["data_meta"]["tokenizer"] == "bpe"
    result = run_script("generate.py", f"ckpt={run}", "prompt=ROMEO:", "max_new_tokens=8",
                        f"bpe_path={bpe_path}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:")


def tiny_mha() -> tuple[GPT, GPTConfig]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=37, block_size=32, n_layer=2, n_head=4, n_embd=16, qk_norm=True)
    return GPT(config).eval(), config


def test_conversion_to_n_head_leaves_logits_unchanged():
    model, config = tiny_mha()
    state, same = mean_pool_kv(model.state_dict(), config, 4)
    converted = GPT(same).eval()
    converted.load_state_dict(state)
    idx = torch.randint(0, 37, (2, 12))
    assert torch.equal(converted(idx), model(idx))


@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_converted_model_loads_generates_and_shrinks_its_cache(n_kv_head):
    model, config = tiny_mha()
    state, new_config = mean_pool_kv(model.state_dict(), config, n_kv_head)
    converted = GPT(new_config).eval()
    converted.load_state_dict(state)
    # each new K head is the mean of its group's old heads
    C, hd = 16, 4
    old_k = model.blocks[0].attn.qkv.weight[C:2 * C].view(4, hd, C)
    new_k = converted.blocks[0].attn.qkv.weight[C:C + n_kv_head * hd].view(n_kv_head, hd, C)
    torch.testing.assert_close(new_k, old_k.view(n_kv_head, 4 // n_kv_head, hd, C).mean(1))
    assert converted.generate(torch.randint(0, 37, (1, 5)), 10, temperature=0).shape == (1, 15)
    assert model.new_kv_cache(1).nbytes == (4 // n_kv_head) * converted.new_kv_cache(1).nbytes


def test_bad_conversion_target_names_the_field():
    model, config = tiny_mha()
    with pytest.raises(ValueError, match="n_kv_head"):
        mean_pool_kv(model.state_dict(), config, 3)


@pytest.mark.slow
def test_convert_command_then_uptrain_ends_near_the_parent(tiny_run, tmp_path):
    parent = tmp_path / "parent"
    train(compose(*tiny_run, "train.max_iters=150", "train.eval_interval=50", "train.eval_iters=8",
                  "train.lr=1e-2", "train.min_lr=1e-3"), parent)
    parent_val = load_checkpoint(parent / "best.pt")["best_val"]
    converted = tmp_path / "mqa.pt"
    result = subprocess.run([sys.executable, "-m", "model.convert", str(parent), "--n-kv-head", "1",
                             "--out", str(converted)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "4x smaller" in result.stdout
    uptrained = tmp_path / "uptrained"
    train(compose(*tiny_run, f"init_from={converted}", "train.max_iters=30", "train.eval_interval=10",
                  "train.eval_iters=8", "train.lr=1e-3", "train.min_lr=1e-3"), uptrained)
    evals = [m["val_loss"] for m in read_metrics(uptrained) if "val_loss" in m]
    assert load_checkpoint(uptrained)["model_config"]["n_kv_head"] == 1
    assert evals[-1] < evals[0]          # uptraining recovers what pooling lost
    assert evals[-1] < parent_val + 0.1  # and ends near the parent
    print(json.dumps({"parent_val": parent_val, "converted_val": evals[0], "uptrained_val": evals[-1]}))
