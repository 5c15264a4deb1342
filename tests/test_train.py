"""train.py and training/loop.py, end to end: the run dir, the schedule, bit-identical resume, NaN
and signal handling, wandb, DDP with gloo, sweeps."""

import io
import itertools
import json
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from omegaconf import OmegaConf

from cli.options import changed_on_command_line, resumed_config
from model import GPT, checkpoint
from tests.helpers import (
    ROOT,
    assert_one_line_error,
    clean_env,
    compose,
    disk_full_after,
    finish,
    hf_gpt2,
    read_metrics,
    run_in_process,
    start_cli,
    step_losses,
    train_checked,
)
from training.loop import lr_at
from training.run_dir import run_files


def small_memory():
    """In a child: at most 2 GiB of address space (RLIMIT_AS, as `ulimit -v 2097152`), ~1 GiB more
    than a tiny run's imports take."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))


def sigterm_in(overrides: list, started: str):
    """How test_a_sigterm_in_any_phase_... runs its process: `python train.py <overrides>`, given SIGTERM
    0.5 s into the phase its first line starting with `started` begins. Returns its result, its output
    before that line and the seconds from the signal to its end."""
    def run(tiny_run, run_dir, start):
        proc = start("train.py", *tiny_run, *overrides, f"hydra.run.dir={run_dir}")
        seen = list(itertools.takewhile(lambda line: not line.startswith(started), proc.stdout))
        time.sleep(0.5)  # inside the phase
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        result = finish(proc, timeout=120)
        return result, "".join(seen), time.monotonic() - signalled
    return run


# The processes of tests that need nothing but a folder, run with this module's first test
# (started_early), one after another: their seconds of imports and training run beside the tests
# before them, on the core those leave idle; the tests that wait for them come last. The SIGTERM
# cases first, beside in-process tests (they must end within seconds of the signal); then the
# torchrun jobs (3 processes each).
STARTED_EARLY = {  # test: its process, run to its end given tiny_run, a folder and start (start_cli's)
    # 10,000 batches a split (~50 s here); the first evaluation starts once the model is built
    "test_a_sigterm_in_any_phase_ends_the_run_within_seconds[evaluation]": sigterm_in(
        ["train.eval_iters=10000", "train.batch_size=32"], "model: "),
    # 10,000 tokens of an 8-layer model (~25 s here), after the last evaluation
    "test_a_sigterm_in_any_phase_ends_the_run_within_seconds[sample]": sigterm_in(
        ["train.max_iters=1", "train.sample_tokens=10000", "model.n_layer=8", "model.n_embd=128"],
        "step 1: train loss"),
    "test_ddp_two_processes_match_one": lambda tiny_run, run_dir, start: finish(start(
        "-c", DDP_RUNS.format(tiny_run=[*tiny_run, "train.batch_size=4", "train.full_val=true"],
                              run_dir=str(run_dir)), env={"OMP_NUM_THREADS": "1"})),
    "test_an_error_under_torchrun_is_one_line_from_the_first_process": lambda tiny_run, run_dir, start:
        finish(start("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                     *tiny_run, "train.device=mps", f"hydra.run.dir={run_dir}/run",
                     env={"OMP_NUM_THREADS": "1"})),
    "test_an_allocation_that_fails_is_one_line_naming_the_batch_size": lambda tiny_run, run_dir, start:
        finish(start("train.py", *tiny_run, "train.batch_size=80000", "train.eval_iters=1",
                     "train.max_iters=1", f"hydra.run.dir={run_dir}", preexec_fn=small_memory)),
    "test_wandb_is_not_imported_when_disabled": lambda tiny_run, run_dir, start: finish(start(
        "-c", "import sys; from tests.helpers import compose, train_checked; "
              f"train_checked(compose(*{[*tiny_run, 'train.max_iters=1']!r}), {str(run_dir)!r}); "
              "print('wandb' in sys.modules)")),
}
# Held while a process of STARTED_EARLY starts: a test that sets a limit on this process holds it, so
# that none starts with it.
EARLY_STARTS = threading.Lock()
# A torchrun job with 2 processes into run_dir/two, then resumed, again in 2, into run_dir/resumed:
# the resumed job once hung at exit 1 time in 3 (the DDP wrapper outlived its process group).
DDP_RUNS = """import subprocess, sys
torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
code = subprocess.run([*torchrun, *{tiny_run!r}, "hydra.run.dir={run_dir}/two"]).returncode
sys.exit(code or subprocess.run([*torchrun, "train.resume={run_dir}/two", "train.max_iters=14",
                                 "hydra.run.dir={run_dir}/resumed"], timeout=120).returncode)"""


class EarlyRun:
    """An entry of STARTED_EARLY and its arguments: run in started_early's thread or, if it has not
    begun there, by the first test that asks for its result (which would otherwise wait, idle)."""

    def __init__(self, run, *args):
        self.run, self.args, self.begun, self.future = run, args, threading.Lock(), Future()

    def begin(self) -> None:
        """Run it in this thread, unless it has begun in another."""
        if self.begun.acquire(blocking=False):
            try:
                self.future.set_result(self.run(*self.args))
            except BaseException as e:  # noqa: BLE001  raised in the test that asks for the result
                self.future.set_exception(e)

    def result(self):
        self.begin()
        return self.future.result()


@pytest.fixture(scope="module", autouse=True)
def started_early(request, tiny_run, tmp_path_factory):
    """{test: (its entry of STARTED_EARLY, an EarlyRun; its folder)} for the tests of STARTED_EARLY
    this session runs. One process at a time, in a background thread: on 2 cores they take the one
    the tests leave idle, and a test that reaches one not yet begun runs it beside. (Started all at
    once, they were 9 processes with torchrun's launchers and workers, which took the tests' core too:
    the tests beside them ran 4-8 times slower, the [mla] case of
    test_a_resume_that_would_change_the_model_... 10 s instead of 2.5.)"""
    selected = {item.name for item in request.session.items}
    stopping, procs = threading.Event(), []

    def start(*args, **kwargs) -> subprocess.Popen:
        with EARLY_STARTS:
            if stopping.is_set():
                raise RuntimeError("not started: this module's tests have ended")
            procs.append(start_cli(*args, **kwargs))
            return procs[-1]

    runs = {}
    for name, run in STARTED_EARLY.items():
        if name in selected:
            run_dir = tmp_path_factory.mktemp("early")
            runs[name] = (EarlyRun(run, tiny_run, run_dir, start), run_dir)

    def in_order():
        for early, _ in runs.values():
            if not stopping.is_set():
                early.begin()

    thread = threading.Thread(target=in_order, name="STARTED_EARLY")
    thread.start()
    yield runs
    with EARLY_STARTS:  # not awaited: its test failed before
        stopping.set()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()  # torchrun passes it on to its processes
    thread.join()


@pytest.fixture
def early_run(request, started_early):
    """This test's EarlyRun (its result: what its entry of STARTED_EARLY returns, once its process has
    ended), and its folder."""
    return started_early[request.node.name]


def test_training_writes_the_run_dir(tiny_run, tmp_path):
    summary = train_checked(compose(*tiny_run, "train.full_val=true"), tmp_path)
    metrics = read_metrics(tmp_path)
    evals = [m for m in metrics if "val_loss" in m]
    assert [m["step"] for m in evals] == [0, 6, 12]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    full_val = [m for m in metrics if "val_loss_full" in m]  # the whole val split, at the end
    assert [m["step"] for m in full_val] == [12] and full_val[0]["val_loss_full"] == summary["val_loss_full"]
    assert abs(summary["val_loss_full"] - evals[-1]["val_loss"]) < 0.1
    logged = [m for m in metrics if "loss" in m]
    assert logged[0]["step"] == 1 and "tokens_per_s" not in logged[0]  # step 1 compiles: not measured
    assert all({"loss", "lr", "tokens_per_s", "elapsed_s"} <= m.keys() for m in logged[1:])
    assert {"best.pt", "ckpt.pt", "loss.png", "metrics.jsonl"} <= {p.name for p in tmp_path.iterdir()}
    ckpt = checkpoint.load(tmp_path)
    assert ckpt.step == 12 and ckpt.best_val == summary["best_val"]
    assert ckpt.data_meta["vocab_size"] == 65 and ckpt.config["model"]["n_layer"] == 2
    assert ckpt.optimizer is not None and "batches" in ckpt.rng


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    tcfg = compose("train.warmup_iters=10", "train.max_iters=100", "train.lr=1.0", "train.min_lr=0.1").train
    lrs = [lr_at(step, tcfg) for step in range(120)]
    assert lrs[0] < lrs[9] < lrs[10] == 1.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[100] == lrs[119] == 0.1


def test_resume_is_bit_identical(tiny_run, tmp_path):
    straight = train_checked(compose(*tiny_run), tmp_path / "straight")
    # the first half stops at 6 but keeps the 12-step schedule, as an interrupted run would
    train_checked(compose(*tiny_run, "train.max_iters=6", "train.lr_decay_iters=12"), tmp_path / "first")
    train_checked(compose(*tiny_run, f"train.resume={tmp_path / 'first'}"), tmp_path / "second")
    assert len(step_losses(tmp_path / "second")) == 6
    straight_losses = step_losses(tmp_path / "straight")
    assert step_losses(tmp_path / "second") == {s: v for s, v in straight_losses.items() if s > 6}
    assert straight["best_val"] == checkpoint.load(tmp_path / "second").best_val
    a, b = checkpoint.load(tmp_path / "straight"), checkpoint.load(tmp_path / "second")
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)


def test_what_would_fail_at_the_end_of_a_run_adapts_and_memory_stays_a_batchs(tiny_run, tmp_path, capsys):
    """A window with learned positions generates only to block_size (32), and a corpus without a
    newline has none to start the sample from: the sample adapts instead of failing once the
    training is done. No forward, the whole val split's included, runs more than a batch's rows
    (train.batch_size). Resumed, a run that does not beat its val names the checkpoint it has."""
    corpus = tmp_path / "one_line.txt"
    corpus.write_text("to be or not to be that is the question " * 400)
    rows = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: rows.append(args[0].size(0)) if isinstance(module, GPT) else None)
    try:
        overrides = [*tiny_run, "model.attn_window=8", "train.sample_tokens=100", "train.full_val=true",
                     "data=text_files", f"data.path={corpus}"]
        summary = train_checked(compose(*overrides), tmp_path / "run")
    finally:
        hook.remove()
    sample = capsys.readouterr().out.split("--- sample ---")[1].split("\n--- end of sample ---")[0]
    assert len(sample) == 32 and sample[0] == " "  # the prompt: the vocabulary's first character
    assert summary["val_loss_full"] > 0 and max(rows) == 4 and rows.count(4) > 12  # batch_size 4
    resumed = train_checked(compose(*overrides, f"train.resume={tmp_path / 'run'}"), tmp_path / "resumed")
    assert resumed["checkpoint"] == tmp_path / "resumed" / "ckpt.pt" and resumed["checkpoint"].is_file()
    assert resumed["best_val"] == summary["best_val"]
    out = capsys.readouterr().out
    assert f"(from before the resume); checkpoint: {tmp_path / 'resumed' / 'ckpt.pt'}" in out


def train_command_line(run_dir, *overrides: str) -> dict:
    """train.py's work for `python train.py <overrides>`, in this process: the options checked
    with the command line's overrides (a resumed run takes its saved config but what they set)."""
    return train_checked(compose(*overrides), run_dir, list(overrides))


REFUSED = {  # attention option trained: ways to type a resume that would change its model
    "mla": [["attention=mha"], ["attention=gqa"], ["~attention"], ["+attention@model=gqa"],
            ["model.mla_latent_dim=null"], ["++model.mla_latent_dim=8"], ["model=tiny"],
            ["experiment=shakespeare_char_cpu"], ["+experiment@_global_=shakespeare_char_cpu"]],
    "mqa_cla2": [["attention=mqa"], ["model.kv_share=1"], ["++model.kv_share=1"], ["model.n_kv_head=2"]],
}


@pytest.mark.parametrize("attention", REFUSED)
def test_a_resume_that_would_change_the_model_is_refused_however_typed(attention, tiny_run, tmp_path):
    """A group counts as every key it sets, even to a default; keys typed, `++key` and dropping a
    group alike. Typing the model it has is not a change."""
    train_checked(compose(*tiny_run, f"attention={attention}", "train.max_iters=2"), tmp_path / "a")
    for overrides in REFUSED[attention]:
        # "its model has model.<field>=... but this run asks for ...", or the asked model is invalid
        with pytest.raises(ValueError, match=r"^(train\.resume=.*: its model has )?model\.\w+="):
            train_command_line(tmp_path / "b", f"train.resume={tmp_path / 'a'}", *overrides)
    summary = train_command_line(tmp_path / "c", f"train.resume={tmp_path / 'a'}", f"attention={attention}",
                                 "model.dropout=0.1", "~experiment")
    assert summary["step"] == 2 and checkpoint.load(tmp_path / "c").model_config.kv_share == \
        checkpoint.load(tmp_path / "a").model_config.kv_share


def test_a_checkpoint_without_each_processs_rng_state_is_refused_for_resume(tiny_ckpt, tmp_path):
    """Checkpoints of kvgpt before per-process RNG states: one line, before any work."""
    ckpt = checkpoint.load(tiny_ckpt)
    ckpt.rng = {**ckpt.rng["processes"][0], "cuda": [], "batches": ckpt.rng["batches"]}  # the old layout
    checkpoint.save(tmp_path / "ckpt.pt", ckpt)
    with pytest.raises(ValueError, match="saved by an older kvgpt, without each process's RNG state: "
                                         "start a new run from it with init_from"):
        train_command_line(tmp_path / "run", f"train.resume={tmp_path}")
    assert not (tmp_path / "run").exists()


def test_a_source_trained_with_another_tokenizer_is_refused(tiny_ckpt, tiny_run, tmp_path):
    """init_from (ours, or a Hugging Face GPT-2) and resume with data of another tokenizer: refused
    before training, whatever the vocabulary sizes."""
    (tmp_path / "abc.txt").write_text("abc abc\n" * 20)
    hf_gpt2(tmp_path / "gpt2", vocab_size=50257, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    abc = ["data=text_files", f"data.path={tmp_path / 'abc.txt'}"]
    ours, five, gpt2 = ("the char tokenizer of 65 characters", "the char tokenizer of 5 characters",
                        "GPT-2's BPE")
    for source, data, trained, has in [(f"init_from={tiny_ckpt}", abc, ours, five),
                                       (f"train.resume={tiny_ckpt}", abc, ours, five),
                                       (f"init_from={tiny_ckpt}", ["data=shakespeare_bpe"], ours, gpt2),
                                       (f"init_from={tmp_path / 'gpt2'}", [], gpt2, ours)]:
        message = f"{source} was trained with {trained}, but this data has {has}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            train_checked(compose(*tiny_run, *data, source, "train.max_iters=40"), tmp_path / "run")
        assert not run_files(tmp_path / "run")


def test_a_vocabulary_padded_past_the_tokenizers_samples_only_its_ids(tiny_run, tmp_path):
    """model.vocab_size=128 on 65 characters (nanoGPT pads GPT-2's to 50304): it trains, and the
    end-of-run sample and generate.py draw only ids the tokenizer has, even at a high temperature."""
    from generate import GenerateConfig, sample

    train_checked(compose(*tiny_run, "model.vocab_size=128", "train.max_iters=2", "train.sample_tokens=300"),
          tmp_path)
    assert checkpoint.load(tmp_path).model_config.vocab_size == 128
    text = sample(GenerateConfig(ckpt=str(tmp_path), max_new_tokens=300, temperature=10.0, top_k=None),
                  out=io.StringIO())[0]
    assert len(text) == 301


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_run, tmp_path):
    train_checked(compose(*tiny_run, "train.max_iters=6"), tmp_path / "a")
    good = checkpoint.load(tmp_path / "a").model
    with pytest.raises(FloatingPointError, match="loss is (nan|inf).*last good checkpoint"):
        train_checked(compose(*tiny_run, f"train.resume={tmp_path / 'a'}", "train.lr=1e30",
                              "train.min_lr=1e30",
                      "train.grad_clip=0", "train.eval_interval=1"), tmp_path / "b")
    for run in ("a", "b"):
        kept = checkpoint.load(tmp_path / run)
        assert kept.step == 6 and all(torch.equal(good[k], kept.model[k]) for k in good)


def test_bad_wandb_mode_names_the_option(tiny_run, tmp_path):
    with pytest.raises(ValueError, match="wandb.mode='bogus' is not one of disabled, offline, online"):
        train_checked(compose(*tiny_run, "wandb.mode=bogus"), tmp_path)


def test_bad_options_stop_before_a_run_dir_or_a_sweep_job_exists(tiny_run, tmp_path):
    """Every job of the command line is checked before Hydra creates anything: one line, exit 1."""
    single = run_in_process("train.py", *tiny_run, "train.lr=-1", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(single, "train.lr must be > 0, got -1.0")
    sweep = run_in_process("train.py", "-m", *tiny_run, "train.lr=1e-3,-1",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert_one_line_error(sweep, "train.lr must be > 0, got -1.0")
    assert not any(tmp_path.iterdir())


def test_invalid_model_is_one_line_error(tiny_run, tmp_path):
    result = run_in_process("train.py", *tiny_run, "model.n_kv_head=3", f"hydra.run.dir={tmp_path}")
    assert_one_line_error(result, "error: model.n_kv_head=3 must divide n_head=4")


def test_model_options_are_checked_before_the_data(tiny_run, tmp_path):
    """A bad model option is reported even when the data would fail too: no data work first."""
    with pytest.raises(ValueError, match=r"^model\.n_kv_head=3"):
        train_checked(compose(*tiny_run, "model.n_kv_head=3", "data.path=/nonexistent.txt"), tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_cuda_graph_asked_for_off_cuda_is_refused_before_any_work(tiny_run, tmp_path):
    with pytest.raises(ValueError, match=r"^train\.cuda_graph=true replays a step on one CUDA device"):
        train_checked(compose(*tiny_run, "train.cuda_graph=true"), tmp_path)
    assert not any(tmp_path.iterdir())


def test_only_a_training_checkpoint_resumes(tiny_ckpt, tiny_run, tmp_path):
    from model.convert import convert_checkpoint

    convert_checkpoint(tiny_ckpt, 2, tmp_path / "converted.pt")  # no optimizer state
    with pytest.raises(ValueError, match=r"converted\.pt holds no training state .*with init_from instead"):
        train_checked(compose(*tiny_run, f"train.resume={tmp_path / 'converted.pt'}", "model.n_kv_head=2",
                              "train.max_iters=40"), tmp_path / "run")
    with pytest.raises(ValueError, match=r"^train\.max_iters=5 is below the step train\.resume reached"):
        train_checked(compose(*tiny_run, f"train.resume={tiny_ckpt}", "train.max_iters=5"), tmp_path / "run")


def test_a_missing_resume_checkpoint_names_the_option(tiny_run, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^train\.resume: checkpoint not found: /nonexistent"):
        train_checked(compose(*tiny_run, "train.resume=/nonexistent/ckpt.pt"), tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^init_from: checkpoint not found: /nonexistent"):
        train_checked(compose(*tiny_run, "init_from=/nonexistent/run.pt"), tmp_path)


def default_sigint():
    """In a child: SIGINT's default action, as a terminal gives it (a background shell, which may
    run these tests, ignores SIGINT, and its children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_resume_takes_the_saved_config_but_what_the_command_line_set():
    overrides = ["attention=mha", "train.max_iters=5", "data.cache_dir=/here"]
    cfg = compose(*overrides)
    changed = changed_on_command_line(cfg, overrides, ROOT / "configs")
    # attention=mha is the default, yet it sets its four keys; lr_decay_iters only follows max_iters
    assert changed == {"model.n_kv_head", "model.mla_latent_dim", "model.mla_rope_dim", "model.kv_share",
                       "train.max_iters", "data.cache_dir"}
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved["model"] |= {"n_kv_head": 2, "n_layer": 7}
    saved["train"] |= {"lr": 0.5, "lr_decay_iters": 100, "max_iters": 100, "device": "cuda:3"}
    resumed = resumed_config(cfg, saved, overrides, ROOT / "configs")
    assert (resumed.model.n_layer, resumed.train.lr, resumed.train.lr_decay_iters) == (7, 0.5, 100)
    assert (resumed.model.n_kv_head, resumed.train.max_iters) == (resumed.model.n_head, 5)
    assert (resumed.train.device, resumed.data.cache_dir) == ("auto", "/here")  # this machine's


def start_training(tiny_run, run_dir, *overrides) -> subprocess.Popen:
    """`python train.py` in the background, returned once it has taken 3 steps."""
    proc = subprocess.Popen([sys.executable, "train.py", *tiny_run, "train.max_iters=100000",
                             "train.eval_interval=100000", f"hydra.run.dir={run_dir}", *overrides],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(), preexec_fn=default_sigint)
    for line in proc.stdout:
        if line.startswith("step 3/"):
            return proc
    raise AssertionError(proc.communicate()[1][-2000:])


@pytest.fixture(scope="module")
def interrupted_run(tiny_run, tmp_path_factory) -> dict:
    """`python train.py` (1 layer, lr 5e-3: not the defaults), Ctrl-C'd (SIGINT) once it has taken 3
    steps; first, while it trains, another run asked into its run dir (in this process). The one
    process of both tests that need a run in progress: {"run_dir", "result": the process's
    CompletedProcess, "in_use": the other run's, "running": whether the first still ran after it}."""
    run_dir = tmp_path_factory.mktemp("interrupted") / "run"
    proc = start_training(tiny_run, run_dir, "model.n_layer=1", "train.lr=5e-3")
    try:  # Hydra wrote .hydra/ once the run dir was claimed: another process trains there from then on
        in_use = run_in_process("train.py", *tiny_run, f"hydra.run.dir={run_dir}")
        running = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    return {"run_dir": run_dir, "result": subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
            "in_use": in_use, "running": running}


@pytest.mark.slow
def test_an_interrupted_run_saves_says_how_to_resume_and_the_hint_works(interrupted_run, tmp_path):
    """Ctrl-C (SIGINT; SIGTERM: test_a_sigterm_in_any_phase_...) between steps: exit 130, ckpt.pt
    saved, and the command that continues it, which works as given."""
    run_dir, result = interrupted_run["run_dir"], interrupted_run["result"]
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr
    hint = result.stdout.split("continue with: ")[1].split()
    assert hint == ["python", "train.py", f"train.resume={run_dir}"]
    step = checkpoint.load(run_dir).step
    assert step >= 3

    # the hint alone (run in this process), with a longer run allowed: the saved config comes back
    # (1 layer, lr 5e-3)
    resumed = run_in_process(*hint[1:], f"train.max_iters={step + 2}",
                             f"hydra.run.dir={tmp_path / 'resumed'}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    ckpt = checkpoint.load(tmp_path / "resumed")
    assert ckpt.step == step + 2 and ckpt.model_config.n_layer == 1 and ckpt.config["train"]["lr"] == 5e-3
    assert "changed here: train.max_iters" in resumed.stdout
    # an override that changes the model is refused by name
    other = run_in_process(*hint[1:], "model.n_layer=2", f"hydra.run.dir={tmp_path / 'other'}")
    assert_one_line_error(other, f"train.resume={run_dir}: its model has model.n_layer=1 but this run "
                                 f"asks for 2")


@pytest.mark.parametrize("script, after_s", [("train.py", 0.5), ("train.py", 2.5), ("generate.py", 1.5)])
def test_ctrl_c_during_start_up_ends_quietly(tiny_ckpt, tmp_path, script, after_s):
    """Ctrl-C while the imports load, Hydra composes or the data is read: exit 130, no traceback."""
    args = {"train.py": [f"hydra.run.dir={tmp_path}"],
            "generate.py": [f"ckpt={tiny_ckpt}", "max_new_tokens=100000"]}
    proc = subprocess.Popen([sys.executable, script, *args[script]], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env(), preexec_fn=default_sigint)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]


@pytest.mark.slow
def test_a_run_dir_holding_a_run_or_in_use_is_refused_and_left_as_it_was(tiny_run, interrupted_run):
    """A run asked into the run dir of one training there (interrupted_run's, while it trained) is
    refused; and into it once that run has ended (its ckpt.pt and .hydra/ there): every file stays."""
    run_dir, first = interrupted_run["run_dir"], interrupted_run["result"]
    assert interrupted_run["running"], first.stderr[-2000:]
    assert_one_line_error(interrupted_run["in_use"],
                          f"hydra.run.dir={run_dir} is in use: another process is training there")

    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert run_dir / "ckpt.pt" in before and any(p.parent.name == ".hydra" for p in before)
    third = run_in_process("train.py", *tiny_run, f"hydra.run.dir={run_dir}")
    assert_one_line_error(third, f"hydra.run.dir={run_dir} already holds a run (ckpt.pt), which this one "
                                 f"would overwrite: continue it with train.resume={run_dir}")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # .hydra/ too


def test_a_full_disk_is_one_line_and_leaves_no_temp_file(tiny_run, tmp_path):
    """`python train.py` (in this process) where writes past 60 kB fail (disk_full_after): the first
    checkpoint (~130 kB) cannot be written. No process of STARTED_EARLY starts meanwhile (EARLY_STARTS):
    it would inherit the limit."""
    with EARLY_STARTS, disk_full_after(60_000):
        result = run_in_process("train.py", *tiny_run, f"hydra.run.dir={tmp_path}")
    assert_one_line_error(result, f"error: hydra.run.dir: cannot write checkpoint {tmp_path}/ckpt.pt: "
                                  f"File too large")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".best.pt", ".ckpt.pt"))]


def test_wandb_offline_writes_the_run(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    train_checked(compose(*tiny_run, "wandb.mode=offline", "wandb.name=tiny"), tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # The run file is wandb's record log; values are stored as JSON text inside it.
    record_log = runs[0].read_bytes()
    last_eval = [m for m in read_metrics(tmp_path) if "val_loss" in m][-1]
    assert b"val_loss" in record_log and json.dumps(last_eval["val_loss"]).encode() in record_log
    assert b"tokens_per_s" in record_log and b"n_kv_head" in record_log  # metrics and config


def test_a_timing_run_saves_no_checkpoint(tiny_run, tmp_path):
    """train.checkpoints=false: no best.pt or ckpt.pt at evaluations or the end (their writes would
    count in the time to a loss), the same losses, and the run says so."""
    result = run_in_process("train.py", *tiny_run, "train.checkpoints=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert not list(tmp_path.glob("*.pt")) and "checkpoint: none (checkpoints=false)" in result.stdout
    assert [m["step"] for m in read_metrics(tmp_path) if "val_loss" in m] == [0, 6, 12]


@pytest.mark.slow
def test_multirun_sweeps_the_three_variants(tiny_run, tmp_path):
    result = run_in_process("train.py", "-m", "attention=mha,gqa,mqa", *tiny_run, "train.max_iters=2",
                            f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    runs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert len(runs) == 3 and all(any(v in r for r in runs) for v in ("mha", "gqa", "mqa"))
    kv_heads = {checkpoint.load(tmp_path / r).model_config.n_kv_head for r in runs}
    assert kv_heads == {4, 2, 1}
    again = run_in_process("train.py", "-m", "attention=mha,gqa", *tiny_run, f"hydra.sweep.dir={tmp_path}")
    assert_one_line_error(again, f"hydra.sweep.dir={tmp_path} already holds runs")


# The tests that wait for a process of STARTED_EARLY, in its order.
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["evaluation", "sample"])
def test_a_sigterm_in_any_phase_ends_the_run_within_seconds(early_run, phase):
    """Not only between steps: a SIGTERM during an evaluation ends it within a batch, records nothing
    of it and saves ckpt.pt to resume from; one during the sample at the end ends the sample there,
    the run complete. Either way exit code 143, seconds after the signal (STARTED_EARLY's process)."""
    early, run_dir = early_run
    result, seen, after_signal = early.result()
    out, err = result.stdout, result.stderr
    assert result.returncode == 143 and "Traceback" not in err, seen + out + err[-2000:]
    assert after_signal < 10
    if phase == "evaluation":  # saved, with the hint to resume that test_an_interrupted_run_... follows
        assert "SIGTERM: saved" in out and checkpoint.load(run_dir).step == 0
        assert out.split("continue with: ")[1].split() == ["python", "train.py", f"train.resume={run_dir}"]
        assert not (run_dir / "metrics.jsonl").exists()  # its losses, partial, are nobody's
    else:
        assert "\n--- stopped by SIGTERM ---\n" in out and "best val loss" in out


@pytest.mark.slow
def test_ddp_two_processes_match_one(tiny_run, tmp_path, early_run):
    """torchrun with 2 processes of batch 4 (STARTED_EARLY), and one process of batch 8."""
    one = run_in_process("train.py", *tiny_run, "train.batch_size=8", "train.full_val=true",
                         f"hydra.run.dir={tmp_path}")
    assert one.returncode == 0, one.stderr
    two, early_dir = early_run
    two, two_dir = two.result(), early_dir / "two"
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = read_metrics(tmp_path), read_metrics(two_dir)
    assert [m["step"] for m in a] == [m["step"] for m in b]  # rank 0 alone wrote metrics
    for x, y in zip(a, b):
        for key in ("loss", "val_loss", "val_loss_full"):  # (each rank evaluated its half)
            if key in x:
                assert abs(x[key] - y[key]) < 1e-4, (x, y)
    # Each rank saved its own RNG state, seeded apart (its own dropout masks), and a run saved by
    # two processes resumes in one, as in two (DDP_RUNS).
    processes = checkpoint.load(two_dir).rng["processes"]
    assert len(processes) == 2 and not torch.equal(processes[0]["torch"], processes[1]["torch"])
    resumed = run_in_process("train.py", f"train.resume={two_dir}", "train.max_iters=14",
                             f"hydra.run.dir={tmp_path / 'resumed'}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    steps = [m["step"] for m in read_metrics(tmp_path / "resumed")]
    assert steps[-1] == 14 and steps == [m["step"] for m in read_metrics(early_dir / "resumed")]


def test_an_error_under_torchrun_is_one_line_from_the_first_process(early_run):
    """Every process checks the same options and exits 1; the first alone says what is wrong (here
    train.device=mps: no MPS on this machine, or, on one with MPS, no torchrun for it)."""
    result = early_run[0].result()
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1 and "device=mps" in errors[0], result.stderr[-2000:]
    assert not (early_run[1] / "run").exists()


def test_an_allocation_that_fails_is_one_line_naming_the_batch_size(early_run):
    """A batch of 80,000 x 32 tokens (~9 GiB a step, by check_fits's count) in 2 GiB of address space
    (small_memory): the allocator's failure, which check_fits cannot foresee under a limit below the
    machine's memory, is one line saying what to lower (on a machine of less than ~9 GiB, check_fits's
    own line says it first)."""
    result = early_run[0].result()
    assert_one_line_error(result, "lower train.batch_size")


def test_wandb_is_not_imported_when_disabled(early_run):
    """A run in a new process (STARTED_EARLY) says whether wandb is among its modules."""
    result = early_run[0].result()
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
