"""model/checkpoint.py: the file holds exactly the Checkpoint fields, weights_only loading, atomic
saves (a full disk included), the latest run, the compiled-model prefix, load_model in each
precision, init_from, and every field checked when read."""

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch

from cli.errors import naming
from model import GPT, checkpoint
from model.checkpoint import Checkpoint, latest_run, open_temp
from model.device import Precision
from model.loading import load_model
from model.quantize import Int8Linear
from tests.helpers import (
    ROOT,
    assert_one_line_error,
    disk_full_after,
    run_in_process,
    tiny_config,
    tiny_model,
)


def write(path, model: GPT, **fields) -> None:
    checkpoint.save(path, Checkpoint(model=model.state_dict(), model_config=model.config,
                                     data_meta={"tokenizer": "char", "vocab": None}, **fields))


def test_the_file_holds_exactly_the_checkpoint_fields(tmp_path):
    model = tiny_model()
    write(tmp_path / "c.pt", model, step=7, best_val=1.5)
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    assert set(raw) == {f.name for f in dataclasses.fields(Checkpoint)}
    assert raw["model_config"] == dataclasses.asdict(model.config)
    ckpt = checkpoint.load(tmp_path / "c.pt")
    assert ckpt.model_config == model.config and (ckpt.step, ckpt.best_val) == (7, 1.5)
    assert all(torch.equal(ckpt.model[k], v) for k, v in model.state_dict().items())


def test_checkpoints_load_with_weights_only(tmp_path):
    bad = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": argparse.Namespace(code="arbitrary object")}, bad)
    with pytest.raises(ValueError, match="cannot read checkpoint"):
        checkpoint.load(bad)
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read checkpoint"):
        checkpoint.load(tmp_path / "corrupt.pt")
    with pytest.raises(FileNotFoundError, match="not found"):
        checkpoint.load(tmp_path / "missing.pt")
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.load(tmp_path / "empty_run")


@pytest.mark.parametrize("content", [{"weights": {}}, [1, 2],
                                     {"model": [], "model_config": {}, "data_meta": {}},
                                     {"model": {}, "model_config": {"n_layr": 2}, "data_meta": {}}],
                         ids=["foreign keys", "not a dict", "model not a dict", "unknown config field"])
def test_a_torch_file_that_is_not_ours_is_named_as_such(tmp_path, content):
    torch.save(content, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match=r"^ckpt: .*foreign\.pt is not a kvgpt checkpoint"), naming("ckpt"):
        checkpoint.load(tmp_path / "foreign.pt")


def test_errors_named_by_the_command_line_keep_their_type_and_cause(tmp_path):
    missing = pytest.raises(FileNotFoundError, match=r"^train\.resume: checkpoint not found")
    with missing, naming("train.resume"):
        checkpoint.load(tmp_path / "missing.pt")
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"^ckpt: cannot read checkpoint") as info, naming("ckpt"):
        load_model(tmp_path / "corrupt.pt", "cpu")
    assert info.value.__cause__ is not None  # HYDRA_FULL_ERROR=1 shows what torch said
    model = tiny_model()
    state = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config) | {"n_kv_head": 3},
             "data_meta": {}}
    torch.save(state, tmp_path / "bad_config.pt")
    with pytest.raises(ValueError, match="has an invalid model config: GPTConfig.n_kv_head=3"):
        checkpoint.load(tmp_path / "bad_config.pt")


def test_saved_files_follow_the_umask_like_any_other_file(tmp_path):
    write(tmp_path / "c.pt", tiny_model())
    (tmp_path / "plain").write_text("")
    assert (tmp_path / "c.pt").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_a_run_dir_gives_the_preferred_file(tmp_path):
    write(tmp_path / "ckpt.pt", tiny_model(), step=2)
    assert checkpoint.load(tmp_path, prefer="best.pt").step == 2  # best.pt absent: ckpt.pt
    write(tmp_path / "best.pt", tiny_model(), step=1)
    assert checkpoint.load(tmp_path).step == 2
    assert checkpoint.load(tmp_path, prefer="best.pt").step == 1


def test_failed_save_leaves_the_old_file_and_no_temp_file(tmp_path):
    write(tmp_path / "ckpt.pt", tiny_model(), step=1)
    (tmp_path / "folder.pt").mkdir()
    with pytest.raises(OSError):
        write(tmp_path / "folder.pt", tiny_model())  # cannot replace a folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "folder.pt"]
    assert checkpoint.load(tmp_path / "ckpt.pt").step == 1


def test_a_full_disk_keeps_the_last_good_checkpoint_and_leaves_no_temp_file(tmp_path):
    write(tmp_path / "ckpt.pt", tiny_model(), step=1)
    size = (tmp_path / "ckpt.pt").stat().st_size
    message = r"^cannot write checkpoint .*ckpt\.pt: File too large; the previous one is intact"
    with disk_full_after(size // 2), pytest.raises(OSError, match=message):
        write(tmp_path / "ckpt.pt", tiny_model(seed=1), step=2)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert checkpoint.load(tmp_path / "ckpt.pt").step == 1


# A process writing 16 MB through write_atomically, then waiting to be killed.
KILLED_WRITER = """import sys, time
from model.checkpoint import write_atomically
def write(f):
    f.write(bytes(16 << 20))
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
write_atomically(sys.argv[1], write, "checkpoint")
"""


@pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="unnamed files are Linux's (O_TMPFILE)")
def test_a_process_killed_while_writing_leaves_nothing_in_the_folder(tmp_path):
    """SIGKILL mid-write (no handler runs): its file had no name yet, so the folder holds what it held."""
    (tmp_path / "ckpt.pt").write_bytes(b"earlier")
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path / "ckpt.pt")], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
    finally:
        writer.kill()
        writer.wait()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert (tmp_path / "ckpt.pt").read_bytes() == b"earlier"


def test_where_files_cannot_be_unnamed_the_temp_file_is_named_and_follows_the_umask(tmp_path):
    """The fallback (no O_TMPFILE: another OS or file system) writes `.<name>.XXXXXXXX`, which a run
    dir's next run removes (training/run_dir.py), with the permissions open() gives."""
    (tmp_path / "plain").write_text("")
    fd, name = open_temp(tmp_path / "ckpt.pt", unnamed=False)
    os.close(fd)
    assert os.path.dirname(name) == str(tmp_path) and os.path.basename(name).startswith(".ckpt.pt.")
    assert os.stat(name).st_mode == (tmp_path / "plain").stat().st_mode


def test_the_latest_run_is_the_one_written_last(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ckpt is not set and .*outputs/ holds no run"):
        latest_run(tmp_path / "outputs")
    for i, name in enumerate(["2026-01-02/10-00-00", "2026-01-01/09-00-00", "multirun_like/0_x"]):
        (tmp_path / "outputs" / name).mkdir(parents=True)
        write(tmp_path / "outputs" / name / "best.pt", tiny_model())
        os.utime(tmp_path / "outputs" / name / "best.pt", (1_000_000 + i, 1_000_000 + i))
    assert latest_run(tmp_path / "outputs") == tmp_path / "outputs" / "multirun_like/0_x"


def test_compiled_checkpoint_loads_uncompiled_and_back(tmp_path):
    config = tiny_config()
    compiled = torch.compile(GPT(config), backend="eager")
    # a state dict as a compiled module writes it, with the _orig_mod. prefix
    checkpoint.save(tmp_path / "c.pt", Checkpoint(model=compiled.state_dict(), model_config=config,
                                                  data_meta={}))
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    assert not any(k.startswith("_orig_mod.") for k in raw["model"])  # save writes plain names
    torch.save(raw | {"model": compiled.state_dict()}, tmp_path / "c.pt")  # a file with the prefix
    plain = GPT(config)
    checkpoint.load_weights(plain, checkpoint.load(tmp_path / "c.pt").model)
    idx = torch.randint(0, 37, (1, 8))
    assert torch.equal(plain(idx), compiled(idx))
    again = torch.compile(GPT(config), backend="eager")
    checkpoint.load_weights(again, plain.state_dict())
    assert torch.equal(again(idx), plain(idx))


def test_a_checkpoint_naming_the_sink_logit_attn_sinks_loads(tmp_path):
    """Written before gpt-oss's learned sink logit was named apart from the sink positions, a
    checkpoint calls it `attn.sinks`: it loads under today's name, the same numbers."""
    config = tiny_config(attn_sink_logit=True)
    model = GPT(config)
    with torch.no_grad():
        model.blocks[1].attn.sink_logit.normal_()
    old = {k.replace(".attn.sink_logit", ".attn.sinks"): v for k, v in model.state_dict().items()}
    assert "blocks.1.attn.sinks" in old
    torch.save({"model": old, "model_config": dataclasses.asdict(config), "data_meta": {}}, tmp_path / "c.pt")
    loaded = GPT(config)
    checkpoint.load_weights(loaded, checkpoint.load(tmp_path / "c.pt").model)
    idx = torch.randint(0, 37, (1, 8))
    assert torch.equal(loaded(idx), model(idx))


def test_mismatched_weights_name_the_tensor(tmp_path):
    model = tiny_model()
    write(tmp_path / "c.pt", model)
    ckpt = torch.load(tmp_path / "c.pt", weights_only=True)
    ckpt["model_config"]["n_kv_head"] = 2  # the K/V projections no longer fit the config
    torch.save(ckpt, tmp_path / "mismatched.pt")
    with pytest.raises(ValueError, match=r"weights do not match .*qkv\.bias: shape \(48,\) in the"):
        load_model(tmp_path / "mismatched.pt", "cpu")


def test_load_model_in_each_dtype_and_int8(tmp_path):
    model = tiny_model()
    write(tmp_path / "best.pt", model)
    idx = torch.randint(0, 37, (2, 9))
    fp32, ckpt = load_model(tmp_path, "cpu")  # auto: a model this small decodes fastest in float32
    assert not fp32.training and torch.equal(fp32(idx), model(idx)) and ckpt.data_meta["tokenizer"] == "char"
    bf16, _ = load_model(tmp_path, "cpu", Precision("bfloat16"))
    assert bf16.wte.weight.dtype == torch.bfloat16
    int8, _ = load_model(tmp_path, "cpu", Precision(quantize="int8"))
    assert isinstance(int8.lm_head, Int8Linear) and int8.wte.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16"):
        Precision("float16")
    with pytest.raises(ValueError, match="quantize must be null, auto or int8"):
        Precision(quantize="int4")


def test_a_model_loaded_to_decode_has_no_dropout_and_no_gradients(tmp_path):
    model = tiny_model(dropout=0.2)  # trained with dropout; in eval mode it drops nothing
    write(tmp_path / "best.pt", model)
    loaded, ckpt = load_model(tmp_path, "cpu")
    idx = torch.randint(0, 37, (2, 9))
    assert ckpt.model_config.dropout == 0.2 and torch.equal(loaded(idx), model(idx))
    assert not any(isinstance(m, torch.nn.Dropout) for m in loaded.modules())
    assert any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    assert not any(p.requires_grad for p in loaded.parameters())


def test_init_from_one_of_our_checkpoints(tmp_path):
    model = tiny_model(n_kv_head=2)
    write(tmp_path / "best.pt", model)
    source = checkpoint.init_from(tmp_path)
    assert source.model_config == model.config and source.model.keys() == model.state_dict().keys()


def nan_weight(raw: dict) -> dict:
    raw["model"]["blocks.0.mlp.fc.weight"][0, 0] = float("nan")
    return raw


@pytest.mark.parametrize("edit,message", [
    (lambda raw: raw | {"data_meta": {}}, "ckpt: its data meta names no tokenizer (tokenizer: None"),
    (lambda raw: raw | {"data_meta": {"tokenizer": "char", "vocab": "abc"}}, "char vocabulary is not a list"),
    (lambda raw: raw | {"data_meta": [1]}, "is not a kvgpt checkpoint: its data_meta is [1]"),
    (lambda raw: raw | {"step": "7"}, "is not a kvgpt checkpoint: its step is '7'"),
    (lambda raw: raw | {"step": -1}, "its step is -1"),
    (lambda raw: raw | {"best_val": None}, "its best_val is None"),
    (lambda raw: raw | {"model": raw["model"] | {"wte.weight": [0.0]}}, "its model holds values that"),
    (nan_weight, "ckpt: its weights hold NaN or inf (blocks.0.mlp.fc.weight)"),
], ids=["empty data meta", "char vocabulary", "data meta type", "step type", "negative step", "best_val",
        "not a tensor", "NaN weight"])
def test_every_field_of_a_checkpoint_is_checked_when_read(tiny_ckpt, tmp_path, edit, message):
    """A checkpoint edited by hand, or damaged: one line naming the option, before anything runs."""
    torch.save(edit(torch.load(tiny_ckpt / "best.pt", weights_only=True)), tmp_path / "edited.pt")
    result = run_in_process("generate.py", f"ckpt={tmp_path / 'edited.pt'}", "max_new_tokens=3")
    assert_one_line_error(result, message)


def test_a_checkpoint_to_start_from_is_checked_as_one_to_sample(tiny_ckpt, tiny_run, tmp_path):
    raw = torch.load(tiny_ckpt / "best.pt", weights_only=True)
    torch.save(raw | {"data_meta": {}}, tmp_path / "edited.pt")
    result = run_in_process("train.py", *tiny_run, f"init_from={tmp_path / 'edited.pt'}",
                            f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(result, f"init_from={tmp_path / 'edited.pt'}: its data meta names no tokenizer")
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_saved_under_two_names_is_one_file_until_one_is_replaced(tmp_path):
    """best.pt beside ckpt.pt when val improved: one write, a second name (a hard link); the next
    ckpt.pt replaces that name only, and best.pt keeps the checkpoint it named."""
    write(tmp_path / "ckpt.pt", tiny_model(), step=1)  # (an older ckpt.pt, replaced below)
    model = tiny_model(seed=1)
    ckpt = Checkpoint(model=model.state_dict(), model_config=model.config, data_meta={"tokenizer": "char",
                      "vocab": None}, step=2)
    checkpoint.save(tmp_path / "ckpt.pt", ckpt, also=[tmp_path / "best.pt"])
    assert os.path.samefile(tmp_path / "ckpt.pt", tmp_path / "best.pt")
    write(tmp_path / "ckpt.pt", tiny_model(), step=3)
    assert checkpoint.load(tmp_path / "best.pt").step == 2 and checkpoint.load(tmp_path / "ckpt.pt").step == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "ckpt.pt"]  # no temp file left


# Hugging Face folders among our checkpoints (is_pretrained, find, pretrained_checkpoint).

def test_a_file_of_a_hugging_face_folder_is_refused_naming_the_folder(hf_folders, tmp_path):
    """ckpt=/init_from= naming model.safetensors, a shard, config.json or tokenizer.json: give the
    folder, in one line (not torch.load's error, nor a list of the tensors)."""
    path, hf = hf_folders["qwen2"]
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    files = [path / "model.safetensors", path / "config.json", path / "tokenizer.json",
             next((tmp_path / "sharded").glob("model-*.safetensors")),
             tmp_path / "sharded" / "model.safetensors.index.json"]
    for file in files:
        for load in (lambda p: load_model(p, "cpu"), checkpoint.init_from):
            with pytest.raises(ValueError) as error:
                load(file)
            message = f"{file} is one file of a Hugging Face model folder: give the folder, {file.parent}"
            assert str(error.value) == message


def test_a_run_dir_holding_a_config_json_is_ours(hf_folders, tmp_path):
    """A folder with best.pt (or ckpt.pt) is a run of ours, whatever else it holds (here a whole
    Hugging Face folder's files); a config.json without weights is no Hugging Face folder, which
    the error says."""
    shutil.copytree(hf_folders["llama"][0], tmp_path / "run")
    write(tmp_path / "run" / "best.pt", tiny_model())
    assert not checkpoint.is_pretrained(tmp_path / "run") and checkpoint.is_pretrained(hf_folders["llama"][0])
    model, ckpt = load_model(tmp_path / "run", "cpu")
    assert model.config == tiny_model().config and ckpt.data_meta["tokenizer"] == "char"
    assert checkpoint.init_from(tmp_path / "run").model_config == tiny_model().config
    (tmp_path / "run" / "best.pt").unlink()
    (tmp_path / "run" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="nor is it a Hugging Face model folder: it has a "
                                                "config.json but no weights"):
        load_model(tmp_path / "run", "cpu")


def test_a_gpt2_folder_samples_with_its_own_tokenizer(tmp_path):
    """A GPT-2 folder's tokenizer.json is its tokenizer (here a BPE of 300 tokens): generate.py's
    text is transformers' greedy tokens decoded by it. Without one, GPT-2's shipped BPE."""
    pytest.importorskip("transformers")
    from data.tokenizer import HFTokenizer
    from tests.helpers import hf_gpt2, shakespeare_tokenizer

    hf = hf_gpt2(tmp_path / "plain", vocab_size=300, n_positions=64)
    assert checkpoint.init_from(tmp_path / "plain").data_meta == checkpoint.GPT2_DATA_META
    shutil.copytree(tmp_path / "plain", tmp_path / "own")
    (tmp_path / "own" / "tokenizer.json").write_text(shakespeare_tokenizer())
    own = checkpoint.init_from(tmp_path / "own").data_meta
    assert own["tokenizer"] == "hf" and own["path"] == str(tmp_path / "own" / "tokenizer.json")
    tokenizer = HFTokenizer(tmp_path / "own" / "tokenizer.json")
    prompt = tokenizer.encode("ROMEO: thou art")
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           pad_token_id=0)
    result = run_in_process("generate.py", f"ckpt={tmp_path / 'own'}", "prompt=ROMEO: thou art",
                            "max_new_tokens=12", "temperature=0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ROMEO: thou art" + tokenizer.decode(expected[0, len(prompt):].tolist()) + "\n"
