"""Fixtures: a hermetic environment, the shipped data prepared, a tiny training run and its checkpoint.
Builders live in tests/helpers.py."""

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import FOREIGN_ENV, compose, data_config

torch.set_num_threads(1)  # the suite runs on 2 cores; subprocess tests use the other one


@pytest.fixture(scope="session", autouse=True)
def hermetic_env(tmp_path_factory):
    """Tests, and the commands they run, see none of the user's HF_*, WANDB_*, HYDRA_*, TIKTOKEN_*
    and KVGPT_* variables; KVGPT_CACHE points at one prepared-data cache for the session, so
    nothing is written to the user's ~/.cache/kvgpt (autouse and session-wide: in force before
    any other fixture runs)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith(FOREIGN_ENV)]:
            mp.delenv(name)
        mp.setenv("KVGPT_CACHE", str(tmp_path_factory.mktemp("data_cache")))
        yield


@pytest.fixture(scope="session")
def data_cache(hermetic_env) -> Path:
    """The session's prepared-data cache (data.cache_dir's default under the tests)."""
    return Path(os.environ["KVGPT_CACHE"])


@pytest.fixture(scope="session")
def char_data(data_cache) -> Path:
    """The shipped TinyShakespeare, prepared with the char tokenizer."""
    from data.prepare import prepare

    return prepare(data_config(f"data.cache_dir={data_cache}"))


@pytest.fixture(scope="session")
def bpe_data(data_cache) -> Path:
    """The shipped TinyShakespeare, prepared with GPT-2's BPE."""
    from data.prepare import prepare

    return prepare(data_config("data=shakespeare_bpe", f"data.cache_dir={data_cache}"))


@pytest.fixture(scope="session")
def tiny_run(char_data) -> list[str]:
    """Overrides for a seconds-long training run of the tiny model on char TinyShakespeare. Without
    the loss over the whole val split at the end (a second a run): the tests that need it set
    train.full_val=true."""
    return [
        "experiment=shakespeare_char_cpu", "model=tiny", "train.batch_size=4", "train.max_iters=12",
        "train.eval_interval=6", "train.eval_iters=2", "train.log_interval=1",
        "train.warmup_iters=2", "train.sample_tokens=0", "train.full_val=false",
    ]


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_run, tmp_path_factory) -> Path:
    """The run dir of a 30-step training run of the tiny model."""
    from tests.helpers import train_checked

    run_dir = tmp_path_factory.mktemp("tiny_ckpt")
    train_checked(compose(*tiny_run, "train.max_iters=30", "train.eval_interval=15"), run_dir)
    return run_dir


@pytest.fixture(scope="session", autouse=True)
def docs_commands(request, hermetic_env, tmp_path_factory):
    """When the session runs tests/test_readme.py's run of every README and docs command, those
    commands start now, in a background thread, and run beside the rest of the suite; the test
    waits for them. Yields the future of that run (None when not selected)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_readme import run_every_command

    if not any(item.name == "test_every_command_of_the_readme_and_docs_runs_as_written"
               for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(run_every_command, tmp_path_factory.mktemp("docs_commands"))
        yield future
        future.cancel()
