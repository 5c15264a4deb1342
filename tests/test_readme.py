"""README.md: every shell command in its ```bash blocks runs as written, in order, in a fresh
folder, with tiny models and a few steps appended where a command would train or sample long."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import ROOT, clean_env, hf_gpt2

TINY_TRAINING = ["model=tiny", "train.batch_size=2", "train.max_iters=2", "train.eval_interval=1",
                 "train.eval_iters=1", "train.warmup_iters=1", "train.sample_tokens=20",
                 "train.compile=false", "train.full_val=false"]
APPENDED = {  # what each command line gets appended (last wins in Hydra's overrides)
    "train.py": TINY_TRAINING,
    "benchmarks/attention_study.py": [*TINY_TRAINING, "study.variants=[mha]", "study.seeds=[0]",
                                      "study.uptrain_iters=2", "study.decode_context=32",
                                      "study.decode_batch_sizes=[1,2]"],
    "generate.py": ["max_new_tokens=8"],
}
SKIPPED = ("pip ", "pytest")  # the environment is installed already, and the suite is running


def readme_commands() -> list[str]:
    """The shell commands of README.md's bash blocks: continued lines joined, comments dropped,
    `a && b` split into a and b, installs and the test run itself left out."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            commands += [part for part in line.split(" && ") if part and not part.startswith(SKIPPED)]
    return commands


def tiny(command: str, run: str, hf_dir: str) -> str:
    """The command with the README's placeholders filled in and tiny settings appended."""
    command = (command.replace("outputs/2026-11-21/10-00-00", run).replace("ckpt=...", f"ckpt={run}")
               .replace("outputs/mha_run", run).replace("path/to/gpt2", hf_dir))
    script = re.search(r"(train\.py|generate\.py|benchmarks/attention_study\.py)", command)
    appended = APPENDED[script.group(1)] if script else []
    if "train.resume=" in command:  # a resumed run keeps its model: model=tiny would change it
        appended = [o for o in appended if not o.startswith("model=")]
    return " ".join([command, *map(shlex.quote, appended)])


def test_the_readme_lists_the_commands_this_test_runs():
    commands = readme_commands()
    assert "python train.py" in commands and "python generate.py" in commands
    assert any(c.startswith("torchrun ") for c in commands) and any("-m model.convert" in c for c in commands)
    assert not any(c.startswith(SKIPPED) for c in commands)


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path):
    for name in ("train.py", "generate.py", "configs", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "prompts.txt").write_text("ROMEO:\nJULIET:\n")
    hf_gpt2(tmp_path / "gpt2", vocab_size=50257, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    env = clean_env(PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    run = None
    for command in readme_commands():
        command = tiny(command, run or "outputs/none-yet", str(tmp_path / "gpt2"))
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        if run is None and command.startswith("python train.py"):  # the run later commands use
            run = str(next((tmp_path / "outputs").glob("*/*")).relative_to(tmp_path))
