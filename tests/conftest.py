"""Fixtures: a hermetic environment, the shipped data prepared, a tiny training run and its checkpoint.
Builders live in tests/helpers.py."""

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import FOREIGN_ENV, compose, data_config

torch.set_num_threads(1)  # the suite runs on 2 cores; subprocess tests use the other one
# A compile here, or in a command the suite runs, compiles in its own process: inductor's pool of
# worker processes (one a core, each importing torch) costs more seconds on 2 cores than it saves.
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true",
                     help="run only the CUDA checks (tests/test_gpu.py), on this machine's GPU")


def pytest_configure(config):
    """The suite is about the CPU: it runs with CUDA hidden (this process and the commands it
    starts), so a machine with a GPU passes it as one without. `pytest --gpu` runs the `gpu`-marked
    checks instead, with the GPU visible."""
    config.addinivalue_line("markers", "gpu: needs a CUDA device; runs with --gpu only")
    if not config.getoption("--gpu"):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    """Marks the CUDA checks to skip (or, with --gpu, the others), and runs last the modules of the tests
    that wait for what started_with_the_session runs beside the suite: by then it has had the suite's
    time (whole modules, so that their fixtures are made once)."""
    waiting = {item.module for item in items if {"started_run", "int8_package"} & set(item.fixturenames)}
    items.sort(key=lambda item: item.module in waiting)  # (a stable sort: each keeps its order)
    gpu = config.getoption("--gpu")
    reason = "CPU tests run without --gpu" if gpu else "a CUDA check: pytest --gpu tests/test_gpu.py on a GPU"
    for item in items:
        if ("gpu" in item.keywords) != gpu:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif gpu and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="--gpu: this machine has no CUDA device"))


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
def hf_folders(tmp_path_factory) -> dict:
    """{family: (folder, transformers' model)}: a small random model of each Llama family with its
    tokenizer.json, as transformers writes it (tests.helpers.hf_folder), written once."""
    pytest.importorskip("transformers")
    from tests.helpers import HF_FAMILIES, hf_folder

    root = tmp_path_factory.mktemp("hf")
    return {family: (root / family, hf_folder(root / family, family)) for family in HF_FAMILIES}


@pytest.fixture(scope="session")
def smollm2() -> tuple[Path, Path]:
    """(folder, GGUF file) of the real model, SmolLM2-135M-Instruct (tests/real_model.py): made once,
    kept between runs under tests/.models/; where they are missing and cannot be downloaded (offline),
    the test skips saying so."""
    from tests import real_model

    if not real_model.made():
        try:
            real_model.make()
        except Exception as e:  # noqa: BLE001  no network, no PyPI: say it in one line
            pytest.skip(f"no SmolLM2-135M-Instruct and it could not be downloaded ({type(e).__name__}): "
                        f"`{real_model.MAKE}` makes it")
    return real_model.FOLDER, real_model.GGUF_FILE


INT8_STEP = ("import torch; from model.decode_step import CompiledDecodeStep; "
             "from tests.helpers import int8_main_job; "
             "CompiledDecodeStep(int8_main_job(), batch_size=2, kv_dtype=torch.int8, max_len=8)")


def build_int8_package(tmp_path):
    """The int8 decode step of tests.helpers.int8_main_job built into inductor's cache folder (or
    found there, from an earlier session), in a process of its own: returned as the function that
    runs it, which conftest starts with the session, beside the suite (its build takes ~30 s)."""
    import subprocess
    import sys

    from tests.helpers import ROOT, clean_env

    env = clean_env()
    return lambda: subprocess.run([sys.executable, "-c", INT8_STEP], cwd=ROOT, env=env, check=True,
                                  capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def int8_package(started_with_the_session) -> tuple:
    """(the folder, the package, its key) of the int8 decode step of tests.helpers.int8_main_job
    (build_int8_package), for the tests of the package and test_quantize's decode modes, which load it."""
    from model.decode_step import dynamic_cells
    from model.step_package import inductor_folder, package_key
    from tests.helpers import int8_main_job

    started_with_the_session["int8 package"].result()
    model = int8_main_job()
    cache = model.new_kv_cache(2, 8, dtype=torch.int8)
    key = package_key(model, cache, dynamic_cells(cache))
    folder = inductor_folder() / "kvgpt"
    (package,) = folder.glob(f"{key}.*.pt2")
    return folder, package, key


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
def started_with_the_session(request, hermetic_env, tmp_path_factory):
    """The tests that run many commands (every README and docs command; every command of the GPU
    plan; a compile on a full disk; the int8 step's package) start them when the session starts, one
    after another in a background thread, beside the rest of the suite (on the core the in-process
    tests leave idle: more at a time would slow those); each test waits for its own. Yields {test
    name: the future of its run} for the tests selected."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.model.test_step_package import run_a_compile_on_a_full_disk
    from tests.test_gpu_plan import run_the_plan
    from tests.test_readme import run_every_command

    starts = {"int8 package": build_int8_package,  # (for the tests that use the int8_package fixture)
              "test_a_write_refused_while_compiling_is_one_line_and_leaves_nothing_cut_short":
                  run_a_compile_on_a_full_disk,
              "test_every_command_of_the_plan_runs_on_the_cpu_without_datasets": run_the_plan,
              "test_every_command_of_the_readme_and_docs_runs_as_written": run_every_command}  # (in the
    # order the suite reaches their tests)
    selected = set() if request.config.getoption("--gpu") else {item.name for item in request.session.items}
    if selected and any("int8_package" in item.fixturenames for item in request.session.items):
        selected.add("int8 package")
    wanted = {name: start for name, start in starts.items() if name in selected}
    if run_the_plan in wanted.values():
        request.getfixturevalue("char_data")  # the corpus the plan's commands find prepared
    # Each is set up here, in this thread (its environment, what it imports), and only runs in its own.
    runs = {name: start(tmp_path_factory.mktemp("commands")) for name, start in wanted.items()}
    with ThreadPoolExecutor(max_workers=1) as pool:  # one after another, on the core the suite leaves
        futures = {name: pool.submit(run) for name, run in runs.items()}
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.fixture
def started_run(request, started_with_the_session):
    """The future of this test's commands, started with the session."""
    return started_with_the_session[request.node.name]
