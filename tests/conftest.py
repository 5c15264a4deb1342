import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # the suite runs on 2 cores; subprocess tests use the other one

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


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


def compose(*overrides: str, config_name: str = "train"):
    """The real Hydra config, as train.py would see it (experiment given, so no auto-pick)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides), return_hydra_config=False)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory, shakespeare_path, bpe_path) -> Path:
    """One prepared-data cache for the whole session; tests pass it as data.cache_dir."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def char_data(data_cache, shakespeare_path) -> Path:
    from data.prepare import prepare

    return prepare(compose(f"data.path={shakespeare_path}", f"data.cache_dir={data_cache}").data)


@pytest.fixture(scope="session")
def bpe_data(data_cache, shakespeare_path, bpe_path) -> Path:
    from data.prepare import prepare

    return prepare(compose("data=shakespeare_bpe", f"data.path={shakespeare_path}",
                           f"data.bpe_path={bpe_path}", f"data.cache_dir={data_cache}").data)


@pytest.fixture(scope="session")
def tiny_run(data_cache, shakespeare_path, char_data) -> list[str]:
    """Overrides for a seconds-long training run of the tiny model on char TinyShakespeare."""
    return [
        "experiment=shakespeare_char_cpu", "model=tiny", f"data.path={shakespeare_path}",
        f"data.cache_dir={data_cache}", "train.batch_size=4", "train.max_iters=12",
        "train.eval_interval=6", "train.eval_iters=2", "train.log_interval=1",
        "train.warmup_iters=2", "train.sample_tokens=0",
    ]


def read_metrics(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_script(script: str, *args: str, timeout: int = 300, **kwargs):
    """`python <script> args...` from the repo root, output captured."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, **kwargs)
