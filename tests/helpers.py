"""Builders the tests share: the one tiny model config, the attention variants, the real Hydra
config, one way to run a command line, and the metrics of a run dir."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from model import GPT, GPTConfig
from model.run_dir import read_metrics  # noqa: F401  (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"mha": 4, "gqa": 2, "mqa": 1}  # n_kv_head of each attention variant, for n_head = 4
# Every kind of attention as tiny_config overrides (head dim 4): the n_kv_head variants, multi-head
# latent attention, and cross-layer K/V sharing, also over a layer count it does not divide.
ATTENTION = {
    "mha": {}, "gqa": {"n_kv_head": 2}, "mqa": {"n_kv_head": 1},
    "mla": {"mla_latent_dim": 6, "mla_rope_dim": 2},
    "mqa_cla2": {"n_kv_head": 1, "kv_share": 2},
    "gqa_cla2_3_layers": {"n_kv_head": 2, "kv_share": 2, "n_layer": 3},
    "mla_cla2_3_layers": {"mla_latent_dim": 6, "mla_rope_dim": 2, "kv_share": 2, "n_layer": 3},
}
# Text whose characters take 2 to 4 bytes of UTF-8 (GPT-2's BPE cuts ’ and “ into two tokens).
MULTI_BYTE = "A’’’’ “quoted” — naïve café, 日本語 🎭 done\n"
# The user's environment must not change what a test sees (an offline flag, a wandb key, ...).
FOREIGN_ENV = ("HF_", "WANDB_", "HYDRA_", "TIKTOKEN_", "KVGPT_")


def step_losses(run_dir) -> dict:
    """{step: training loss} from a run's metrics.jsonl."""
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def tiny_config(**overrides) -> GPTConfig:
    """A few-thousand-parameter GPT: vocab 37, block 24, 2 layers, 4 heads, 16 wide."""
    return GPTConfig(**{"vocab_size": 37, "block_size": 24, "n_layer": 2, "n_head": 4, "n_embd": 16}
                     | overrides)


def tiny_model(seed: int = 0, **overrides) -> GPT:
    """tiny_config(**overrides) as a GPT in eval mode, its weights drawn from `seed`."""
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


def hf_gpt2(path, **overrides):
    """A small random GPT-2 written to `path` by transformers' save_pretrained."""
    import transformers

    torch.manual_seed(0)
    kw = dict(vocab_size=97, n_positions=48, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
              eos_token_id=0, layer_norm_epsilon=1e-5)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**(kw | overrides))).eval()
    model.save_pretrained(path)
    return model


def compose(*overrides: str, config_name: str = "train"):
    """The real Hydra config, as the command line would build it (its schemas registered)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import benchmarks.attention_study  # noqa: F401  (registers the study's schema; imports train)
    import generate  # noqa: F401  (registers GenerateConfig)

    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides))


def train_checked(cfg, run_dir, overrides: list[str] | None = None) -> dict:
    """A training run in this process, as Python starts one: train(check_options(cfg), run_dir)."""
    from train import check_options, train

    return train(check_options(cfg, overrides), run_dir)


def data_config(*overrides: str):
    """The `data` group's DataConfig, composed as train.py would."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose(*overrides).data)


def clean_env(**extra: str) -> dict:
    """This process's environment (which conftest's hermetic_env has cleaned), plus `extra`."""
    return dict(os.environ) | extra


def run_cli(*args: str, env: dict | None = None, timeout: int = 300, cwd=ROOT) -> subprocess.CompletedProcess:
    """`python <args>` (a script of the repo, or -m module), run in `cwd` (the repo root by
    default), output captured."""
    if args[0].endswith(".py"):
        args = (str(ROOT / args[0]), *args[1:])
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=clean_env(**(env or {})))




def assert_one_line_error(result: subprocess.CompletedProcess, message: str) -> None:
    """The command failed with exit code 1 and exactly `error: ...message...`, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr[-2000:]
