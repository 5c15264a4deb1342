"""Fixtures: the reference data files, prepared data, a tiny training run and its checkpoint.
Builders live in tests/helpers.py."""

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import FOREIGN_ENV, ROOT, compose, data_config

torch.set_num_threads(1)  # the suite runs on 2 cores; subprocess tests use the other one

SHARED = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def hermetic_env():
    """Tests in this process see none of the user's HF_*, WANDB_* and HYDRA_* variables (autouse
    and session-wide, so it is in force before any other fixture runs)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith(FOREIGN_ENV)]:
            mp.delenv(name)
        yield


def shared_file(env_var: str, name: str) -> Path:
    """A reference file from the environment or ../shared/data; CI must have it, elsewhere skip."""
    path = Path(os.environ.get(env_var) or SHARED / name)
    if not path.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing: set {env_var} (CI must not skip data tests)")
        pytest.skip(f"{name} not found: set {env_var}")
    return path


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    return shared_file("TINYSHAKESPEARE_PATH", "tinyshakespeare.txt")


@pytest.fixture(scope="session")
def bpe_path() -> Path:
    return shared_file("GPT2_TIKTOKEN_PATH", "gpt2.tiktoken")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One prepared-data cache for the whole session; tests pass it as data.cache_dir."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def char_data(data_cache, shakespeare_path) -> Path:
    from data.prepare import prepare

    return prepare(data_config(f"data.path={shakespeare_path}", f"data.cache_dir={data_cache}"))


@pytest.fixture(scope="session")
def bpe_data(data_cache, shakespeare_path, bpe_path) -> Path:
    from data.prepare import prepare

    return prepare(data_config("data=shakespeare_bpe", f"data.path={shakespeare_path}",
                               f"data.bpe_path={bpe_path}", f"data.cache_dir={data_cache}"))


@pytest.fixture(scope="session")
def tiny_run(data_cache, shakespeare_path, char_data) -> list[str]:
    """Overrides for a seconds-long training run of the tiny model on char TinyShakespeare."""
    return [
        "experiment=shakespeare_char_cpu", "model=tiny", f"data.path={shakespeare_path}",
        f"data.cache_dir={data_cache}", "train.batch_size=4", "train.max_iters=12",
        "train.eval_interval=6", "train.eval_iters=2", "train.log_interval=1",
        "train.warmup_iters=2", "train.sample_tokens=0",
    ]


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_run, tmp_path_factory) -> Path:
    """The run dir of a 30-step training run of the tiny model."""
    from train import train

    run_dir = tmp_path_factory.mktemp("tiny_ckpt")
    train(compose(*tiny_run, "train.max_iters=30", "train.eval_interval=15"), run_dir)
    return run_dir
