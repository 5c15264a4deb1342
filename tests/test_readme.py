"""README.md and docs/*.md: every shell command in their ```bash blocks runs as written, each
file's in order (a command shown twice, once), with tiny models and a few steps appended where a
command would train or sample long. The README's first training run is the run the other files'
placeholders name; after it, the files run one after another, each in a folder of its own, each
`python ...` a process forked from one that has imported torch and Hydra (tests/forked_commands.py).
conftest starts them in the background when the session starts, on the core the in-process tests
leave idle."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import ROOT, clean_env, gguf_file, gguf_tokenizer_keys, hf_folder, hf_gpt2

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TINY_TRAINING = ["model=tiny", "train.batch_size=2", "train.max_iters=2", "train.eval_interval=1",
                 "train.eval_iters=1", "train.warmup_iters=1", "train.sample_tokens=20",
                 "train.compile=false", "train.full_val=false"]
APPENDED = {  # what each command line gets appended (last wins in Hydra's overrides)
    "train.py": TINY_TRAINING,
    # batch 16: each run scores the whole val split, batch_size windows at a time (batch 2: 1,743 passes);
    # no windowed runs (3 runs and the loss by position of 3: ~70% of the command; test_study's run has them)
    "benchmarks/attention_study.py": [*TINY_TRAINING, "train.batch_size=16", "study.variants=[mha]",
                                      "study.seeds=[0]", "study.uptrain_iters=2", "study.decode_context=32",
                                      "study.decode_batch_sizes=[1,2]", "study.window=[]",
                                      "study.local_global=[]", "study.sinks=[]"],
    "generate.py": ["max_new_tokens=8"],
    # the tiny Llama's block is 96 and its heads 16 wide (8 RoPE pairs); 64 held-out tokens, 1 step
    "benchmarks/real_study.py": ["--context", "32", "--eval-tokens", "64", "--windows", "8", "--latent",
                                 "12", "--rope-pairs", "2", "--int4-group", "8", "--int4-recent", "4",
                                 "--steps", "1", "--train-context", "16"],
}
SKIPPED = ("pip ", "pytest")  # the environment is installed already, and the suite is running


def bash_commands(path) -> list[str]:
    """The shell commands of a markdown file's bash blocks: continued lines joined, comments
    dropped, `a && b` split into a and b, installs and the test run itself left out."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            commands += [part for part in line.split(" && ") if part and not part.startswith(SKIPPED)]
    return commands


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def tiny(command: str, run: str, hf_dir: str) -> str:
    """The command with the placeholders filled in and tiny settings appended (hf_dir: the folder
    holding a tiny GPT-2, Llama and Qwen3, for path/to/gpt2, SmolLM2-135M and Qwen3-0.6B, the Llama
    with a chat template for SmolLM2-135M-Instruct, and a GGUF file of a Llama for its .gguf)."""
    folders = {"path/to/SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2.gguf",  # (each before its prefixes)
               "path/to/SmolLM2-135M-Instruct": "llama", "path/to/SmolLM2-135M": "llama",
               "path/to/gpt2": "gpt2", "path/to/Qwen3-0.6B": "qwen3"}
    command = (command.replace("outputs/2026-11-21/10-00-00", run).replace("ckpt=...", f"ckpt={run}")
               .replace("outputs/mha_run", run))
    for placeholder, name in folders.items():
        command = command.replace(placeholder, f"{hf_dir}/{name}")
    script = re.search(r"(train\.py|generate\.py|benchmarks/attention_study\.py|benchmarks/real_study\.py)",
                       command)
    appended = APPENDED[script.group(1)] if script else []
    if "train.resume=" in command:  # a resumed run keeps its model: model=tiny would change it
        appended = [o for o in appended if not o.startswith("model=")]
    return " ".join([command, *map(shlex.quote, appended)])


def test_the_docs_list_the_commands_this_test_runs():
    readme = bash_commands(ROOT / "README.md")
    assert readme[0] == "python train.py" and "python generate.py" in readme
    everywhere = [c for path in DOCS for c in bash_commands(path)]
    for shown in ("torchrun ", "python -m cli.convert", "python -m cli.prepare", "python generate.py"):
        assert any(c.startswith(shown) for c in everywhere), shown
    assert not any(c.startswith(SKIPPED) for c in everywhere)
    linked = set(re.findall(r"\(docs/(\w+\.md)\)", (ROOT / "README.md").read_text()))
    assert linked == {p.name for p in DOCS[1:]}  # every docs page is linked from the README


def folder(tmp_path, name: str):
    """A fresh working folder with the repo's scripts and a prompts file, as a user's checkout."""
    work = tmp_path / name
    work.mkdir()
    for entry in ("train.py", "generate.py", "configs", "benchmarks"):
        (work / entry).symlink_to(ROOT / entry)
    (work / "prompts.txt").write_text("ROMEO:\nJULIET:\n")
    return work


def run_all(lanes: list, env) -> None:
    """Each (folder, commands) of `lanes` in turn, its commands one after another in it, each
    `python ...` a process forked from one that has imported torch and Hydra already
    (tests/forked_commands.py), any other through bash."""
    lanes = [(str(cwd), commands) for cwd, commands in lanes if commands]
    runner = subprocess.run([sys.executable, str(ROOT / "tests" / "forked_commands.py"), json.dumps(lanes)],
                            env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    results = [json.loads(line) for line in runner.stdout.splitlines()]
    assert runner.returncode == 0, runner.stderr[-3000:]
    for result in results:
        assert result["returncode"] == 0, f"{result['command']}\n{result['stderr'][-3000:]}"
    assert [r["command"] for r in results] == [c for _, commands in lanes for c in commands]


def run_every_command(tmp_path):
    """The README's commands in order, then each docs page's in order, one page after another: set up
    here (the GPT-2 directory, the environment), in the calling thread, and returned as the function
    that runs them (conftest runs it in a thread of its own, beside the suite)."""
    hf_dir = str(tmp_path / "hf")
    hf_gpt2(f"{hf_dir}/gpt2", vocab_size=50257, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    for family in ("llama", "qwen3"):
        hf_folder(f"{hf_dir}/{family}", family)
    (tmp_path / "hf" / "llama" / "chat_template.jinja").write_text(CHATML)
    plain = hf_folder(tmp_path / "plain_llama", "llama", rope_scaling=None)  # (GGUF: no Llama 3 scaling)
    gguf_file(tmp_path / "hf" / "smollm2.gguf", plain, meta=gguf_tokenizer_keys(CHATML))
    env = clean_env(PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
                    OMP_NUM_THREADS="1")

    def run_commands() -> None:
        readme = folder(tmp_path, "readme")
        first, *rest = dict.fromkeys(bash_commands(ROOT / "README.md"))  # a command shown twice runs once
        run_all([(readme, [tiny(first, "outputs/none-yet", hf_dir)])], env)
        run = str(next((readme / "outputs").glob("*/*")))  # the run later commands name
        lanes, shown = [(readme, rest)], {first, *rest}
        for path in DOCS[1:]:  # each page in a folder of its own, without the commands the README runs
            lanes.append((folder(tmp_path, path.stem), [c for c in bash_commands(path) if c not in shown]))
        run_all([(cwd, [tiny(c, run, hf_dir) for c in commands]) for cwd, commands in lanes], env)

    return run_commands


@pytest.mark.slow
def test_every_command_of_the_readme_and_docs_runs_as_written(started_run):
    started_run.result()  # started by conftest with the session; raises what a command raised
