"""cli/errors.py: the one guard every command line uses, and each entry point's one-line errors."""

import time

import pytest
import torch

from cli import errors
from cli.errors import exit_on_user_error, naming, raised_inside_torch, user_error
from model.config import GPTConfig
from tests.helpers import assert_one_line_error, finish, run_in_process, start_cli
from training.distributed import check_processes

# Each entry point run as a real process, with a bad value the other tests do not cover, and the
# words its one-line error must hold: the exit code and the one line are the interpreter's, not
# a stand-in's (the other tests run the command lines in this process).
ENTRY_POINTS = {
    "train.py": (["train.py", "experiment=shakespeare_char_cpu", "train.eval_iters=0"],
                 "train.eval_iters must be >= 1"),
    "generate.py": (["generate.py", "ckpt=/nonexistent/run"], "ckpt: checkpoint not found: /nonexistent/run"),
    "cli.prepare": (["-m", "cli.prepare", "data.val_fraction=1.5"], "data.val_fraction must be in [0, 1)"),
    "cli.convert": (["-m", "cli.convert", "/nonexistent/run", "--n-kv-head", "2", "--out", "a.pt"],
                      "checkpoint not found: /nonexistent/run"),
    "attention_study": (["benchmarks/attention_study.py", "study.variants=[mha,mla2]"],
                        "mla2 is not an option of the attention group"),
}


@pytest.fixture(scope="module", autouse=True)
def entry_point_runs(request, tmp_path_factory):
    """The processes of the ENTRY_POINTS the session runs, all started with this module's first
    test: the seconds each spends importing torch and Hydra are spent side by side, and beside the
    module's other tests, in this process; test_every_entry_point_reports_one_line awaits them."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.originalname == "test_every_entry_point_reports_one_line"]
    runs = {}
    for name in names:
        args = ENTRY_POINTS[name][0]
        if not name.startswith("cli."):  # (python -m cli.*: no run dir)
            args = [*args, f"hydra.run.dir={tmp_path_factory.mktemp('run')}"]
        runs[name] = start_cli(*args)
    yield runs
    for proc in runs.values():
        if proc.returncode is None:  # not awaited: its test was deselected or failed before
            proc.kill()
            proc.communicate()


# Bad files, folders and combinations on the command line: each stops before any work with one
# line naming what to fix (a value out of range takes the same path: ENTRY_POINTS above, and
# tests/test_configs.py for every range). {tmp} is the test's folder, {file} a plain file in it, {text}
# a text file of 200 characters (a corpus that prepares in a moment, where TinyShakespeare takes seconds).
BAD_INPUTS = [
    (["train.py", "data=text_files", "data.path={text}", "data.val_fraction=0"],
     "model.block_size=64 is too long for the val split (0 tokens)"),
    (["train.py", "data=text_files"], "data.path is not set"),
    (["train.py", "data=text_files", "data.path={tmp}/missing.txt"], "data.path: no such file"),
    (["train.py", "data=text_files", "data.path={file}"], "is not UTF-8 text: byte 0xff at offset 4"),
    (["train.py", "data.cache_dir={file}/cache"], "data.cache_dir: cannot write to"),
    (["train.py", "+model.n_layr=2"], "model.n_layr is not a field of GPTConfig"),
    (["train.py", "wandb.mode=online"], "wandb.mode=online (or log locally with wandb.mode=offline): No API"),
    (["train.py", "hydra.run.dir={file}/run"], "hydra.run.dir: cannot write to"),
    (["train.py", "train.resume={tmp}/missing"], "train.resume: checkpoint not found"),
    (["train.py", "init_from={file}"], "init_from: cannot read checkpoint"),
    (["generate.py", "ckpt={file}"], "ckpt: cannot read checkpoint"),
    (["generate.py", "ckpt={tmp}"], "ckpt: no checkpoint (ckpt.pt or best.pt) in"),
    (["generate.py"], "ckpt is not set and outputs/ holds no run"),
    (["generate.py", "prompt_file={file}"], "prompt_file: {file} is not UTF-8 text: byte 0xff at offset 4"),
    (["-m", "cli.prepare", "data.path={file}"], "is not UTF-8 text"),
    (["-m", "cli.convert", "{tmp}", "--n-kv-head", "2", "--out", "{tmp}"], "already exists (nothing is"),
    (["-m", "cli.convert", "{file}", "--n-kv-head", "2", "--out", "{tmp}/new/"],
     "--out {tmp}/new/ names a folder: give the file to write, e.g. --out {tmp}/new/converted.pt"),
    (["-m", "cli.convert", "{file}", "--n-kv-head", "two", "--out", "a.pt"],
     "argument --n-kv-head: invalid int value: 'two'"),
    (["-m", "data.prepare"], "data.prepare is a library module now; the command is python -m cli.prepare"),
    (["-m", "model.convert"], "model.convert is a library module now; the command is python -m cli.convert"),
    (["generate.py", "prompt=a", "prompt_file={file}"], "prompt and prompt_file={file} both give the"),
    (["generate.py", "prompt_file={tmp}"], "prompt_file={tmp} is a folder: give a file of prompts"),
    (["generate.py", "prompt_file="], "prompt_file is empty"),
    (["generate.py", "inspect="], "inspect is empty: give a file name, or leave inspect out"),
    (["generate.py", "attn_plot="], "attn_plot is empty: give a file name, or leave attn_plot out"),
    (["generate.py", "stop="], "stop is empty"),
    (["benchmarks/decode.py", "--threads", "-1"], "--threads must be an integer >= 0, got -1"),
    (["benchmarks/decode.py", "--threads", "1.5"], "argument --threads: invalid int value: '1.5'"),
    (["benchmarks/decode.py", "--new", "0"], "--new must be an integer >= 1, got 0"),
    (["benchmarks/decode.py", "--new", "100001"], "--new must be at most 100000, got 100001"),
    (["benchmarks/hf_generate.py", "{tmp}", "--max-new-tokens", "1000001"],
     "--max-new-tokens must be at most 1000000, got 1000001"),
    (["benchmarks/decode.py", "--code", "{tmp}/missing"],
     "--code {tmp}/missing is not a checkout of this project: it does not exist"),
    (["benchmarks/decode.py", "--before", "{tmp}"],
     "--before {tmp} is not a checkout of this project: it has no model/__init__.py"),
    (["benchmarks/decode.py", "--ckpt", "{tmp}/missing"], "--ckpt: checkpoint not found"),
    (["benchmarks/train_cpu.py", "--nanogpt", "{tmp}"], "is not a nanoGPT checkout"),
    (["benchmarks/gpu.py", "--smoke", "--against", "1.4", "-3"], "--against VAL SECONDS: nanoGPT's best val"),
    (["benchmarks/gpu.py", "--smoke", "--out", "{file}"], "--out {file} is a file: give a folder"),
]


@pytest.mark.parametrize("args, message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_naming_what_to_fix(args, message, tmp_path):
    (tmp_path / "file").write_bytes(b"text\xff\xfe binary")
    (tmp_path / "text.txt").write_text("some text\n" * 20)
    home = tmp_path / "home"  # no ~/.netrc: no wandb API key
    home.mkdir()
    args = [a.format(tmp=tmp_path, file=tmp_path / "file", text=tmp_path / "text.txt") for a in args]
    if args[0] == "train.py" and not any(a.startswith("hydra.run.dir=") for a in args):
        args.append(f"hydra.run.dir={tmp_path / 'run'}")
    message = message.format(tmp=tmp_path, file=tmp_path / "file")
    assert_one_line_error(run_in_process(*args, cwd=tmp_path, env={"HOME": str(home)}), message)


def test_the_decode_benchmark_checks_its_checkpoint_before_any_section(tiny_ckpt, tmp_path):
    """Its sections take seconds to minutes each: the checkpoint the later ones need (the latest run in
    outputs/ without --ckpt, and one transformers' Llama takes) is refused before the first prints."""
    for args, message in ((["--sections", "char", "main"], "--ckpt is not set and outputs/ holds no run"),
                          (["--ckpt", str(tiny_ckpt), "--sections", "char", "main"],
                           "a Llama needs model.pos_emb=rope")):
        result = run_in_process("benchmarks/decode.py", *args, cwd=tmp_path)
        assert_one_line_error(result, message)
        assert result.stdout == ""  # no section ran


# Options a run once took and then failed on, after .hydra/ and .lock were written or after the
# whole run had trained: each is refused before the run dir exists.
BEFORE_THE_RUN_DIR = [
    (["train.seed=-1"], "train.seed must be >= 0, got -1"),
    (["train.seed=99999999999999999999"], "train.seed=99999999999999999999 is out of range"),
    (["data=text_files", "data.path={tmp}"], "data.path={tmp} is a folder: give its files"),
    (["data=text_files", "data.path={file}", "data.name=a/b"], "data.name='a/b' must be a plain name"),
    (["data=text_files", "data.path=corp/(x).txt"], "quote the value for Hydra, in a shell "
                                                     "\"data.path='corp/(x).txt'\""),
]


@pytest.mark.parametrize("args, message", BEFORE_THE_RUN_DIR, ids=[" ".join(a) for a, _ in
                                                                   BEFORE_THE_RUN_DIR])
def test_a_bad_option_is_refused_before_the_run_dir_exists(args, message, tmp_path):
    (tmp_path / "file").write_text("text\n" * 100)
    args = [a.format(tmp=tmp_path, file=tmp_path / "file") for a in args]
    result = run_in_process("train.py", "experiment=shakespeare_char_cpu", "model=tiny", *args,
                            f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_one_line_error(result, message.format(tmp=tmp_path))
    assert not (tmp_path / "run").exists()


def test_hydra_full_error_shows_the_traceback(tmp_path):
    """The error is not caught: the interpreter prints its traceback."""
    with pytest.raises(FileNotFoundError, match="^ckpt: checkpoint not found"):
        run_in_process("generate.py", "ckpt=/nonexistent/run", env={"HYDRA_FULL_ERROR": "1"})


@pytest.mark.parametrize("error", [ValueError("bad value\nsecond line"), FileNotFoundError("no file"),
                                   FloatingPointError("loss is nan")])
def test_user_errors_become_one_line_and_exit_1(error):
    def fail():
        raise error

    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(fail)
    assert exit_info.value.code == f"error: {str(error).splitlines()[0]}"


@pytest.mark.parametrize("bug", [TypeError("unsupported operand"), KeyError("model"),
                                 RuntimeError("shape mismatch"), AttributeError("no attribute")])
def test_bugs_are_not_dressed_up_as_user_errors(bug):
    def fail():
        raise bug

    with pytest.raises(type(bug)):
        exit_on_user_error(fail)


def test_a_value_error_from_inside_torch_is_a_bug_not_a_user_error():
    """We check every user value before torch sees it: torch rejecting one is our mistake."""
    import torch
    import torch.nn.functional as F

    def fail():
        F.cross_entropy(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long))  # batch 3 vs 4

    with pytest.raises(ValueError, match="batch_size"):
        exit_on_user_error(fail)


def test_the_result_passes_through():
    assert exit_on_user_error(lambda a, b=0: a + b, 2, b=3) == 5


def test_hydra_full_error_reraises_in_process(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="bad"):
        exit_on_user_error(lambda: int("bad"))


# Last in this module: entry_point_runs' processes have run meanwhile.
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_reports_one_line(name, entry_point_runs):
    assert_one_line_error(finish(entry_point_runs[name]), ENTRY_POINTS[name][1])


def test_under_torchrun_the_first_process_of_each_machine_says_the_error(monkeypatch):
    """Every process checks the same options; the others exit 1 without a word (a job's one line),
    after waiting for the first to say it (torchrun stops every process when one fails)."""
    assert user_error("bad") == "error: bad"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert user_error("bad") == "error: bad"
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(errors, "LATER_RANKS_WAIT_S", 0.2)
    start = time.monotonic()
    assert user_error("bad") == 1 and time.monotonic() - start >= 0.2


# Every naming(option, argument) of the repo (cli/options.py, cli/configs.py, the attention study),
# with a message that has the argument's word as prose and as the option: only the option is renamed.
NAMING = [
    ("train.device", "device",
     "device=cuda:3 but this machine has 1 CUDA device: one process per device, in the device's memory "
     "(devices: 1; or device=cpu)",
     "train.device=cuda:3 but this machine has 1 CUDA device: one process per device, in the device's "
     "memory (devices: 1; or train.device=cpu)"),
    ("model", "GPTConfig", "GPTConfig.n_embd=48 must be divisible by n_head=5: a GPTConfig splits it "
     "over the heads (GPTConfig)", "model.n_embd=48 must be divisible by n_head=5: a GPTConfig splits "
     "it over the heads (GPTConfig)"),
    ("hydra.run.dir", "run_dir", "run_dir: cannot write to /r: not a run_dir, as run_dirs hold .hydra/ "
     "(or run_dir=/s)", "hydra.run.dir: cannot write to /r: not a run_dir, as run_dirs hold .hydra/ "
     "(or hydra.run.dir=/s)"),
    ("hydra.run.dir", "run_dir", "run_dir=/r is in use: write this run to another folder: run_dir=<folder>",
     "hydra.run.dir=/r is in use: write this run to another folder: hydra.run.dir=<folder>"),
    ("study.window_pattern", "model.window_pattern", "model.window_pattern='SX' must be letters S or L: "
     "each model's window_pattern, not --model.window_pattern=SL", "study.window_pattern='SX' must be "
     "letters S or L: each model's window_pattern, not --model.window_pattern=SL"),
    ("study.sink_count", "model.attn_sinks", "model.attn_sinks must be an integer >= 0: the model's "
     "attn_sinks, as --model.attn_sinks=1", "study.sink_count must be an integer >= 0: the model's "
     "attn_sinks, as --model.attn_sinks=1"),
]


@pytest.mark.parametrize("option, argument, message, expected", NAMING,
                         ids=[f"{a}->{o}" for o, a, _, _ in NAMING])
def test_naming_renames_the_option_not_the_prose(option, argument, message, expected):
    with pytest.raises(ValueError) as info, naming(option, argument):
        raise ValueError(message)
    assert str(info.value) == expected


def test_naming_keeps_the_torchrun_message_readable():
    """check_processes' CUDA device in prose stays; its device=cpu is the option train.device."""
    with pytest.raises(ValueError) as info, naming("train.device", "device"):
        check_processes(torch.device("cuda"), 2, 1)
    assert "which has 1 CUDA device: one process per GPU" in str(info.value)
    assert str(info.value).endswith("so --nproc_per_node=1 at most (or train.device=cpu)")


def test_naming_leaves_an_error_not_about_its_option_as_raised():
    """train.py names its whole run's errors (hydra.run.dir); one that is not the run dir's keeps its
    traceback, so a ValueError of torch's own is still a bug, not dressed up as the user's."""
    with pytest.raises(ValueError) as info, naming("hydra.run.dir", "run_dir"):
        torch.optim.SGD([], lr=0.1)  # torch: "optimizer got an empty parameter list"
    assert raised_inside_torch(info.value)


@pytest.mark.parametrize("fields, message", [
    ({"attn_window": 8, "window_pattern": "SX"}, "study.window_pattern='SX' must be 1..n_layer=2 letters"),
    ({"attn_window": 8, "attn_sinks": -1}, "study.sink_count must be an integer >= 0, got -1"),
])
def test_nested_naming_renames_what_the_inner_one_renamed(fields, message):
    """The study's names over the model's (GPTConfig.attn_sinks -> model.attn_sinks -> study.sink_count)."""
    with (pytest.raises(ValueError) as info, naming("study.window_pattern", "model.window_pattern"),
          naming("study.sink_count", "model.attn_sinks"), naming("model", "GPTConfig")):
        GPTConfig(**{"block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 8, **fields})
    assert str(info.value).startswith(message)
