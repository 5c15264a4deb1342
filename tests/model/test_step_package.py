"""model/step_package.py: the compiled step's files on disk. A package is verified before it is
loaded (damaged, cut short, emptied: removed, or one line naming the file), serves every length of
sample, and the older ones are pruned; a folder a compile cannot write to is one line naming it and
TORCHINDUCTOR_CACHE_DIR, before compiling or when a write is refused, with nothing cut short left."""

import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch

from model.checkpoint import Checkpoint, save
from model.decode_step import CompiledDecodeStep, dynamic_cells, int8_weights
from model.generation import generate
from model.quantize import quantize_int8
from model.step_package import (
    PACKAGES_KEPT,
    announce_compile,
    inductor_folder,
    load_package,
    mark_compiled,
    package_key,
    prune,
    remove_stale,
    writable_folder,
)
from tests.helpers import ROOT, clean_env, int8_main_job, tiny_model


def test_one_package_serves_every_length_of_sample(int8_package, capfd):
    """Steps over caches of 4, 8 and 14 cells (sample lengths generate.py rounds to, the model's
    whole block) load the one package built for 8, build nothing, and give the eager step's greedy
    tokens; the build left no folder of its own behind."""
    folder, package, key = int8_package
    model, prompts = int8_main_job(), [[1, 2, 3], [4, 5]]
    for max_len in (4, 8, 14):
        step = CompiledDecodeStep(model, batch_size=2, kv_dtype=torch.int8, max_len=max_len)
        compiled, eager = (generate(model, prompts, max_len - 2, temperature=0, decode_step=d,
                                    kv_dtype=torch.int8) for d in (step, None))
        assert [t.tolist() for t in compiled] == [t.tolist() for t in eager], max_len
    assert "compiling" not in capfd.readouterr().err
    assert list(folder.glob(f"{key}.*")) == [package] and not list(folder.glob(".build-*"))


def test_a_package_is_kept_under_its_weights_and_cache_whatever_the_length(monkeypatch, tmp_path):
    """A package holds its model's weights: its key is the same for the same weights and cache of
    any length, another for any other weight, scale or bias, however small the difference, and for
    another cache's batch or dtype; it lives in inductor's cache folder, wherever
    TORCHINDUCTOR_CACHE_DIR puts it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = quantize_int8(tiny_model(0))
    nudged = [copy.deepcopy(model) for _ in range(3)]
    nudged[0].blocks[1].mlp.fc.weight[3, 5] += 1                       # one int8 weight
    nudged[1].blocks[0].attn.qkv.scales[0] *= 1 + 2 ** -20             # one scale, its last bits
    nudged[2].norm_f.bias.data[0] += 1e-7

    def key(m, cache):
        return package_key(m, cache, dynamic_cells(cache))

    keys = [key(m, m.new_kv_cache(1)) for m in
            [model, quantize_int8(tiny_model(0)), quantize_int8(tiny_model(1)), *nudged]]
    keys += [key(model, cache) for cache in (model.new_kv_cache(2), model.new_kv_cache(1, dtype="int8"))]
    assert keys[0] == keys[1] == key(model, model.new_kv_cache(1, max_len=5)) and len(set(keys)) == 7
    assert inductor_folder() == tmp_path
    assert int8_weights(model) and not int8_weights(tiny_model(0))


@pytest.mark.parametrize("damage", ["a byte changed", "cut short", "empty"])
def test_a_damaged_package_is_never_loaded_but_removed_and_said(int8_package, tmp_path, damage, capfd):
    """A package whose bytes are not those written (its library's bytes changed would crash the
    process that loads it) is removed, with a line naming it, and not loaded: the step builds anew."""
    _, package, key = int8_package
    copy = tmp_path / package.name
    data = bytearray(package.read_bytes())
    if damage == "a byte changed":
        data[len(data) // 2] ^= 0xFF
    copy.write_bytes(data[:len(data) // 2] if damage == "cut short" else b"" if damage == "empty" else data)
    assert load_package(tmp_path, key) is None
    assert not copy.exists()
    assert f"{copy} was damaged" in capfd.readouterr().err
    shutil.copy(package, copy)  # the package as written loads, and runs the step
    assert load_package(tmp_path, key) is not None


def test_a_damaged_package_that_cannot_be_removed_names_the_file(tmp_path):
    key = "decode-step-0123"
    (tmp_path / f"{key}.beef.pt2").mkdir()  # (unlink refuses a folder, as a read-only one refuses a file)
    message = rf"{tmp_path / key}.beef.pt2 is damaged and cannot be removed.*remove it"
    with pytest.raises(OSError, match=message):
        load_package(tmp_path, key)


def test_the_most_recently_used_packages_are_kept_and_what_killed_processes_left_removed(tmp_path):
    packages = [tmp_path / f"decode-step-{i}.{i}.pt2" for i in range(PACKAGES_KEPT + 2)]
    for i, path in enumerate(packages):
        path.write_bytes(b"x")
        os.utime(path, (1000 + i, 1000 + i))  # the last written is the most recently used
    other = tmp_path / "other.txt"
    other.write_text("not ours")
    prune(tmp_path)
    assert sorted(tmp_path.iterdir()) == sorted([other, *packages[-PACKAGES_KEPT:]])
    # a build and an unpacked package of a process that no longer runs (no process has its id), and this one's
    leftovers = [tmp_path / f".{kind}-{pid}-x" for kind in ("build", "run")
                 for pid in (999999999, os.getpid())]
    for leftover in leftovers:
        leftover.mkdir()
    remove_stale(tmp_path)
    assert [leftover.exists() for leftover in leftovers] == [False, True, False, True]


def test_a_package_loaded_is_unpacked_beside_it_and_gone_when_the_process_ends(int8_package, tmp_path):
    """The package's runner unpacks it (332 MB for SmolLM2-135M) into a folder of the process's
    beside the package, not in /tmp where torch's own outlived every run: gone at the process's
    exit, or at a later load where the process was killed."""
    _, package, key = int8_package
    shutil.copy(package, tmp_path / package.name)
    script = ("import sys, os; from pathlib import Path; from model.step_package import load_package; "
              f"runner = load_package(Path({str(tmp_path)!r}), {key!r}); "
              "print(sorted(p.name.split('-')[1] for p in Path(sys.argv[1]).glob('.run-*')), os.getpid()); "
              "os._exit(0) if sys.argv[2] == 'killed' else None")
    for how in ("exits", "killed"):
        result = subprocess.run([sys.executable, "-c", script, str(tmp_path), how], cwd=ROOT, env=clean_env(),
                                capture_output=True, text=True, timeout=120)
        while_running, pid = result.stdout.split("]")
        assert while_running == f"['{pid.strip()}'", result.stderr     # its own folder, while it runs
        left = [p.name.split("-")[1] for p in tmp_path.glob(".run-*")]
        assert left == ([] if how == "exits" else [pid.strip()])       # os._exit: no exit handler ran
    remove_stale(tmp_path)  # what a later load does first
    assert not list(tmp_path.glob(".run-*"))


def test_a_long_compile_is_said_first_unless_it_was_compiled_before(tmp_path, capfd):
    marker = announce_compile(tmp_path, "decode-step-abc", n_layer=30)
    said = "compiling the decode step (inductor) the first time: up to ~81 s for 30 layers"
    assert said in capfd.readouterr().err
    mark_compiled(marker)
    for n_layer in (30, 2):  # compiled before; a few layers' compile is short
        announce_compile(tmp_path, "decode-step-abc" if n_layer == 30 else "decode-step-new", n_layer)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("kind", ["a file", "under a file", "no room"])
def test_a_folder_a_compile_cannot_write_to_is_refused_before_compiling(tmp_path, monkeypatch, kind):
    """Not a folder, one that cannot be made, one without the room a compile takes: one OSError
    naming the folder and TORCHINDUCTOR_CACHE_DIR, before anything is compiled."""
    (tmp_path / "file").write_text("")
    folder = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "sub"}.get(kind, tmp_path)
    message = rf"{folder} \(TORCHINDUCTOR_CACHE_DIR\) (is not a folder|cannot be made|has .* MiB free)"
    with pytest.raises(OSError, match=message):
        writable_folder(folder, need_bytes=2**62 if kind == "no room" else 1)
    if kind != "no room":
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
        with pytest.raises(OSError, match=message):
            CompiledDecodeStep(tiny_model(0).eval(), backend="inductor")


def run_a_compile_on_a_full_disk(tmp_path):
    """generate.py compile=true on a disk that fills while inductor compiles (files cut at 20 kB:
    RLIMIT_FSIZE, in a process of its own, as the compiler's processes inherit it), into an empty
    inductor folder: returned as the function that runs it and returns (the result, the folder),
    which conftest starts with the session, beside the suite (seconds of compiling)."""
    model = tiny_model(0)
    vocab = [chr(65 + i) for i in range(37)]
    save(tmp_path / "ckpt.pt", Checkpoint(model=model.state_dict(), model_config=model.config,
                                          data_meta={"tokenizer": "char", "vocab": vocab}))
    script = ("import resource, sys, runpy; "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY)); "
              "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    env = clean_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))

    def run():
        command = [sys.executable, "-c", script, str(ROOT / "generate.py"), f"ckpt={tmp_path / 'ckpt.pt'}",
                   "compile=true", "prompt=AB", "max_new_tokens=3"]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        return result, tmp_path / "inductor"

    return run


def test_a_write_refused_while_compiling_is_one_line_and_leaves_nothing_cut_short(started_run):
    """A disk that fills while inductor compiles: generate.py says it in one line naming
    TORCHINDUCTOR_CACHE_DIR and compile, and what it wrote into the folder is gone."""
    result, folder = started_run.result()
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: compile: cannot compile the decode step: a write was refused")
    assert "TORCHINDUCTOR_CACHE_DIR" in lines[0]
    assert not [p for p in folder.rglob("*") if p.is_file()]
