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
