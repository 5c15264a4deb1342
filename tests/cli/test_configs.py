"""configs/: every group mirrors its dataclass schema, every recipe composes, and bad values fail
at config time with a message that names the field."""

import dataclasses
import functools
import itertools
import math
import subprocess
import typing

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from benchmarks.attention_study import StudyConfig
from cli.configs import config_object
from cli.options import model_config, with_default_experiment
from data.prepare import DataConfig
from generate import GenerateConfig
from model import GPTConfig
from model.device import memory_bytes
from tests.helpers import ROOT, assert_one_line_error, compose, run_in_process
from training.options import TrainConfig, check_fits, training_step_bytes

EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))
ATTENTION_YAMLS = sorted((ROOT / "configs" / "attention").glob("*.yaml"))
ATTENTIONS = [p.stem for p in ATTENTION_YAMLS]
SCHEMAS = [  # (a YAML file, the node in it, the dataclass it mirrors)
    ("model/base.yaml", None, GPTConfig),
    ("train/default.yaml", None, TrainConfig),
    ("data/shakespeare_char.yaml", None, DataConfig),
    ("generate.yaml", None, GenerateConfig),
    ("study.yaml", "study", StudyConfig),
]


@pytest.mark.parametrize("path,node,schema", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_yaml_mirrors_its_schema(path, node, schema):
    """Same field names; the same defaults wherever the YAML gives a plain value."""
    values = yaml.safe_load((ROOT / "configs" / path).read_text())
    values = values[node] if node else {k: v for k, v in values.items() if k not in ("defaults", "hydra")}
    fields = {f.name: f for f in dataclasses.fields(schema)}
    assert values.keys() == fields.keys()
    for name, value in values.items():
        if isinstance(value, str) and value.startswith("${") or name == "vocab_size":
            continue  # taken from the environment, another key or the data
        field = fields[name]
        factory = field.default_factory
        default = factory() if factory is not dataclasses.MISSING else field.default
        assert value == default, name


def test_model_presets_only_set_gpt_config_fields():
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    for preset in (ROOT / "configs/model").glob("*.yaml"):
        assert set(yaml.safe_load(preset.read_text())) - {"defaults"} <= fields, preset


def test_no_experiment_sets_what_the_attention_group_sets():
    """The attention group's keys are its own: no experiment sets one or overrides the group, so
    each experiment composes with every attention option as with the one it is tested with below."""
    attention_keys = set().union(*(yaml.safe_load(p.read_text()) for p in ATTENTION_YAMLS))
    assert {"n_kv_head", "mla_latent_dim", "kv_share"} <= attention_keys
    assert len(EXPERIMENTS) >= len(ATTENTIONS)  # below, each option composes with an experiment
    for name in EXPERIMENTS:
        recipe = yaml.safe_load((ROOT / "configs" / "experiment" / f"{name}.yaml").read_text())
        assert not attention_keys & set(recipe.get("model", {})), name
        assert not any("attention" in str(entry) for entry in recipe.get("defaults", [])), name


@pytest.mark.parametrize("experiment, attention", list(zip(EXPERIMENTS, itertools.cycle(ATTENTIONS))))
def test_every_experiment_and_attention_option_composes(experiment, attention):
    cfg = compose(f"experiment={experiment}", f"attention={attention}")
    config = model_config(cfg.model, vocab_size=65)
    expected = {"mha": (config.n_head, None, 1), "gqa": (2, None, 1), "mqa": (1, None, 1),
                "mla": (config.n_head, 64, 1), "mqa_cla2": (1, None, 2)}[attention]
    assert (config.n_kv_head, config.mla_latent_dim, config.kv_share) == expected
    assert isinstance(OmegaConf.to_object(cfg.train), TrainConfig)
    assert isinstance(OmegaConf.to_object(cfg.data), DataConfig)


def test_nanogpt_recipes():
    gpu = compose("experiment=shakespeare_char")
    assert (gpu.model.n_layer, gpu.model.n_head, gpu.model.n_embd, gpu.model.block_size) == (6, 6, 384, 256)
    assert (gpu.train.batch_size, gpu.train.max_iters) == (64, 5000)
    assert (gpu.model.dropout, gpu.train.beta2, gpu.train.lr, gpu.train.min_lr) == (0.2, 0.99, 1e-3, 1e-4)
    cpu = compose("experiment=shakespeare_char_cpu")
    assert (cpu.model.n_layer, cpu.model.n_head, cpu.model.n_embd, cpu.model.block_size) == (4, 4, 128, 64)
    assert (cpu.train.batch_size, cpu.train.max_iters, cpu.model.dropout) == (12, 2000, 0.0)


def test_the_gpu_recipe_is_nanogpts_model_with_rope_a_cuda_graph_step_and_a_bounded_evaluation():
    gpu, nanogpt = compose("experiment=shakespeare_char_gpu"), compose("experiment=shakespeare_char")
    assert {**gpu.model, "pos_emb": "learned"} == {**nanogpt.model} and gpu.model.pos_emb == "rope"
    assert (gpu.train.lr, gpu.train.max_iters, gpu.train.lr_decay_iters) == (3e-3, 1000, 1000)
    assert (gpu.train.dtype, gpu.train.compile, gpu.train.cuda_graph) == ("auto", False, "auto")
    assert gpu.data.on_device
    evaluated = lambda cfg: cfg.train.max_iters // cfg.train.eval_interval * cfg.train.eval_iters
    assert evaluated(gpu) * 8 <= evaluated(nanogpt)


@pytest.mark.parametrize("argv,cuda,recipe", [
    ([], True, "shakespeare_char_gpu"),
    ([], False, "shakespeare_char_cpu_fast"),
    (["train.device=cpu"], True, "shakespeare_char_cpu_fast"),  # not the GPU recipe run on the CPU
    (["train.device='cpu'"], True, "shakespeare_char_cpu_fast"),
    (["train.device=cuda:1"], False, "shakespeare_char_gpu"),    # CUDA asked for: its error comes later
    (["train.device=auto"], True, "shakespeare_char_gpu"),
    (["train.device=mps"], True, "shakespeare_char_cpu_fast"),   # Apple's GPU: the small model
])
def test_the_default_recipe_follows_the_training_device(argv, cuda, recipe, capsys):
    assert with_default_experiment(argv, cuda_available=cuda) == [*argv, f"experiment={recipe}"]
    assert f"recipe: experiment={recipe}" in capsys.readouterr().out
    assert with_default_experiment(["experiment=shakespeare_char", *argv], cuda) == \
        ["experiment=shakespeare_char", *argv]  # a recipe typed is kept


@pytest.mark.parametrize("override,field", [
    ("train.grad_accum=0", "train.grad_accum"), ("train.eval_interval=0", "train.eval_interval"),
    ("train.eval_iters=0", "train.eval_iters"), ("train.batch_size=0", "train.batch_size"),
    ("train.max_iters=-5", "train.max_iters"), ("train.min_lr=-1", "train.min_lr"),
    ("train.lr=0", "train.lr"), ("train.beta2=1.0", "train.beta2"), ("train.dtype=float16", "train.dtype"),
    ("train.compile=maybe", "train.compile"), ("train.compile=1", "train.compile"),
    ("train.cuda_graph=blocks", "train.cuda_graph"),
    ("train.cuda_graph=true train.optimizer=muon", "train.cuda_graph"),
    ("data.val_fraction=1.5", "data.val_fraction"), ("train.min_lr=0.5", "train.min_lr"),
    ("train.lr=nan", "train.lr"), ("train.device=tpu", "train.device"),
    ("train.peak_tflops=1e-320", "train.peak_tflops"), ("train.peak_tflops=0", "train.peak_tflops"),
    ("train.peak_tflops=1e300", "train.peak_tflops"),
    ("train.device=cuda:x", "train.device"),
    ("data.tokenizer=words", "data.tokenizer"), ("train.optimizer=sgd", "train.optimizer"),
])
def test_out_of_range_values_name_the_field(override, field):
    cfg = compose("experiment=shakespeare_char_cpu", *override.split())
    group = field.split(".")[0]
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        OmegaConf.to_object(cfg[group])


@pytest.mark.parametrize("override,field", [
    ("top_k=0", "top_k"), ("top_p=1.5", "top_p"), ("temperature=-1", "temperature"),
    ("max_new_tokens=-1", "max_new_tokens"), ("num_samples=0", "num_samples"), ("dtype=float16", "dtype"),
    ("quantize=int4", "quantize"), ("ckpt=''", "ckpt"), ("prompt=''", "prompt"), ("device=tpu", "device"),
    ("temperature=nan", "temperature"), ("attn_plot=/nonexistent/a.png", "attn_plot"),
    ("compile=fast", "compile"),
])
def test_out_of_range_generate_options_name_the_option(override, field):
    with pytest.raises((ValueError, OSError), match=field):
        OmegaConf.to_object(compose("ckpt=run", override, config_name="generate"))


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
@pytest.mark.parametrize("script,option", [("train.py", "train.device=mps"), ("generate.py", "device=mps")])
def test_mps_where_pytorch_has_none_is_one_line(script, option, tiny_ckpt):
    args = ("model=tiny",) if script == "train.py" else (f"ckpt={tiny_ckpt}",)
    assert_one_line_error(run_in_process(script, option, *args),
                          f"{option.split('=')[0]}=mps but PyTorch's MPS backend is not available here")


@pytest.mark.parametrize("args", [("train.py", "experiment=shakespeare_char_cpu", "train.lr=fast"),
                                  ("train.py", "experiment=shakespeare_char_cpu", "train.batch_size=1.5"),
                                  ("train.py", "experiment=shakespeare_char_cpu", "model.qk_norm=maybe"),
                                  ("train.py", "experiment=shakespeare_char_cpu", "model.dropout=abc"),
                                  ("generate.py", "ckpt=run", "max_new_tokens=abc")])
def test_hydra_rejects_the_wrong_type_before_anything_runs_in_one_line(args):
    assert_one_line_error(run_in_process(*args), f"Error merging override {args[-1]}: Value")


@pytest.mark.parametrize("args, message", [
    (["train.py", "model.n_layr=3"], "Could not override 'model.n_layr': Key 'n_layr' not in 'GPTConfig'"),
    (["train.py", "experiment=nope"], "Could not find 'experiment/nope' (options in 'experiment': "
                                      "shakespeare_bpe, shakespeare_char, shakespeare_char_cpu,"),
    (["train.py", "attention=mha,gqa"], "attention=mha,gqa is a list of values: for a list, attention=[...]; "
                                        "for a sweep, --multirun; for text, quote the value"),
    (["train.py", "data.path=[a,b"], "no viable alternative at input '[a,b'"),
    (["-m", "cli.prepare", "data=nope"], "Could not find 'data/nope'"),
    (["benchmarks/attention_study.py", "study.uptrain_iters=x"], "Error merging override study.uptrain"),
])
def test_what_hydra_rejects_is_one_line_too(args, message):
    assert_one_line_error(run_in_process(*args), message)


@pytest.mark.parametrize("value", ["it's (x).txt", 'a "b" (x).txt', "a b,c.txt", "a'b,c", "x${y}.txt",
                                   "x${y}(.txt", "a!b(.txt", "back\\slash(.txt", "$HOME(`x`)\\"])
def test_the_hint_to_quote_a_value_for_hydra_works_as_given(value, tmp_path):
    """A value Hydra's grammar refuses, a comma makes a list or `${` an interpolation is refused
    with the override to type instead; typed in a real shell (sh), it hands train.py the value as
    text: data.path is that file (missing here, which the message says with the path as given)."""
    run = lambda *args: run_in_process("train.py", "experiment=shakespeare_char_cpu", "data=text_files",
                                       *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    hinted = run(f"data.path={value}")
    assert_one_line_error(hinted, "quote the value for Hydra, in a shell ")
    typed = hinted.stderr.strip().split("in a shell ", 1)[1]
    argv = subprocess.run(["sh", "-c", f"printf '%s\\0' {typed}"], capture_output=True, text=True,
                          check=True).stdout.split("\0")[:-1]
    assert len(argv) == 1 and argv[0].startswith("data.path=")
    assert_one_line_error(run(*argv), f"data.path: no such file: {value}")


def test_range_error_on_the_command_line_is_one_line(tmp_path):
    result = run_in_process("train.py", "experiment=shakespeare_char_cpu", "train.grad_accum=0",
                            f"hydra.run.dir={tmp_path}")
    assert_one_line_error(result, "train.grad_accum must be >= 1, got 0")


@pytest.mark.parametrize("overrides,config_name,group,message", [
    (["+train.foo=1"], "train", "train", "train.foo is not a field of TrainConfig"),
    (["+data.pth=x"], "train", "data", "data.pth is not a field of DataConfig"),
    (["ckpt=run", "+tmperature=1"], "generate", None, "tmperature is not a field of GenerateConfig"),
])
def test_keys_appended_with_plus_must_be_schema_fields(overrides, config_name, group, message):
    """Hydra's own error for a typo suggests `+key=...`; that must not be silently dropped."""
    cfg = compose(*overrides, config_name=config_name)
    with pytest.raises(ValueError, match=message):
        config_object(cfg[group] if group else cfg, f"{group}." if group else "")


@pytest.mark.parametrize("override,message", [
    ("model.n_kv_head=3", "model.n_kv_head=3 must divide n_head"), ("model.dropout=1.5", "model.dropout"),
    ("model.mlp=relu", "model.mlp='relu' is not one of"), ("model.n_layer=0", "model.n_layer"),
])
def test_model_range_errors_name_the_option_as_typed(override, message):
    with pytest.raises(ValueError, match=rf"^{message}"):
        model_config(compose("experiment=shakespeare_char_cpu", override).model, vocab_size=65)


def test_study_options_name_themselves():
    for kwargs, message in [({"uptrain_lr": 0.0}, "study.uptrain_lr"),
                            ({"uptrain_iters": -1}, "study.uptrain_iters"),
                            ({"variants": []}, "study.variants is empty"),
                            ({"uptrain_to": "alibi"}, "study.uptrain_to: alibi"),
                            ({"variants": ["mha", "nope"]}, "study.variants: nope"),
                            ({"uptrain_to": "mla"}, "study.uptrain_to=mla: mean-pooling"),
                            ({"seeds": []}, "study.seeds"),
                            ({"decode_batch_sizes": [0]}, "study.decode_batch_sizes")]:
        with pytest.raises(ValueError, match=message):
            StudyConfig(**kwargs)


GROUPS = [("train", "model.", GPTConfig), ("train", "train.", TrainConfig), ("train", "data.", DataConfig),
          ("generate", "", GenerateConfig), ("study", "study.", StudyConfig)]  # (config, prefix, schema)
FLOAT_OPTIONS = [(config, prefix, f.name) for config, prefix, schema in GROUPS
                 for f in dataclasses.fields(schema) if float in (f.type, *typing.get_args(f.type))]


@functools.cache
def composed(config: str):
    return compose(*(["ckpt=run"] if config == "generate" else []), config_name=config)


@pytest.mark.parametrize("config,prefix,field", FLOAT_OPTIONS, ids=[f"{p}{f}" for _, p, f in FLOAT_OPTIONS])
def test_every_float_option_must_be_finite(config, prefix, field):
    """inf, -inf and nan are refused at config time, by name, however the range check reads."""
    for value in (math.inf, -math.inf, math.nan):
        node = composed(config).copy()
        node = node[prefix.rstrip(".")] if prefix else node
        node[field] = value
        with pytest.raises(ValueError, match=rf"^{prefix}{field}\b.*{repr(value).lstrip('-')}"):
            model_config(node, vocab_size=65) if prefix == "model." else config_object(node, prefix)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_inf_and_nan_typed_on_the_command_line_reach_the_check(value):
    with pytest.raises(ValueError, match=rf"^train.lr\b.*{value.lstrip('-')}"):
        config_object(compose(f"train.lr={value}").train, "train.")


def test_unknown_model_field_names_itself():
    with pytest.raises(ValueError, match="model.n_layr is not a field of GPTConfig"):
        model_config(compose("+model.n_layr=2").model, vocab_size=65)


INT_TYPES = {f.name: f.type for _, _, schema in GROUPS for f in dataclasses.fields(schema)}  # (names: unique)
INT_OPTIONS = [(config, prefix, f.name) for config, prefix, schema in GROUPS
               for f in dataclasses.fields(schema)
               if int in (f.type, *typing.get_args(f.type)) or f.type == list[int]]


@pytest.mark.parametrize("config,prefix,field", INT_OPTIONS, ids=[f"{p}{f}" for _, p, f in INT_OPTIONS])
def test_every_integer_option_past_64_bits_is_refused_by_name(config, prefix, field):
    """Hydra holds any Python int; torch does not: 2**63 and -2**63 - 1 are refused at config time,
    by name, before they overflow where they are used (a seed, a size, a count)."""
    for value in (2**63, -(2**63) - 1):
        node = composed(config).copy()
        node = node[prefix.rstrip(".")] if prefix else node
        node[field] = [value] if INT_TYPES[field] == list[int] else value
        with pytest.raises(ValueError, match=rf"^{prefix}{field}\b"):
            model_config(node, vocab_size=65) if prefix == "model." else config_object(node, prefix)


@pytest.mark.parametrize("override", [f"train.batch_size={2**63 - 1}", f"model.n_layer={2**63 - 1}",
                                      f"model.n_embd={2**62}", f"model.vocab_size={2**63 - 1}",
                                      "model.n_layer=100000 model.n_embd=2048"])
def test_a_model_or_batch_past_the_devices_memory_is_refused_before_the_run(override, tmp_path):
    """At the top of their range, sizes are refused by what training them would take, before a run
    dir exists, not by the allocator (a traceback) or the OOM killer (no word) once running."""
    result = run_in_process("train.py", "experiment=shakespeare_char_cpu", *override.split(),
                            f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(result, "GiB of cpu: lower train.batch_size or the model's size")
    assert not (tmp_path / "run").exists()


# A real training step's peak RSS on a CPU, less the memory before it, plus the weights that were
# there already (float32, eager, one thread, vocabulary 65): (model fields, batch, bytes).
CPU_RECIPE = dict(block_size=64, n_layer=4, n_head=4, n_embd=128, bias=False, mlp="gelu_exact")
MAIN_JOB = dict(block_size=256, n_layer=4, n_head=4, n_embd=128, bias=False, pos_emb="rope", norm="rmsnorm",
                mlp="swiglu")
MEASURED_STEPS = [
    (dict(block_size=256, n_layer=4, n_head=4, n_embd=128), 16, 183_823_872),
    (dict(block_size=256, n_layer=4, n_head=4, n_embd=128), 32, 351_723_008),
    (dict(block_size=256, n_layer=4, n_head=4, n_embd=128, vocab_size=16_000), 32, 2_435_492_864),
    (CPU_RECIPE, 512, 1_361_875_968),
    (MAIN_JOB, 128, 1_768_207_360),
]


@pytest.mark.parametrize("fields, batch, measured", MEASURED_STEPS)
def test_the_memory_check_counts_what_a_training_step_holds(fields, batch, measured):
    """What check_fits counts is what a step takes, within 25% below and 7% above: not the tenth of it
    the check once counted (the logits and one number per layer and position)."""
    state, activations = training_step_bytes(GPTConfig(**{"vocab_size": 65} | fields), batch)
    assert 0.75 * measured <= state + activations <= 1.07 * measured


def test_a_batch_past_the_memory_is_refused_and_one_within_it_is_not():
    """The CPU recipe at 1.1 times the batch the machine's memory holds, as measured, is refused by
    name (the OOM killer's, once running, without the check, which let 15 times this batch through);
    at 0.8 times it, not. (How the refusal reads on the command line: the test above.)"""
    model, cpu = GPTConfig(**{"vocab_size": 65} | CPU_RECIPE), torch.device("cpu")
    per_row = MEASURED_STEPS[3][2] / MEASURED_STEPS[3][1]
    fits = memory_bytes(cpu) / per_row
    with pytest.raises(ValueError, match=r"x 64 tokens\), more than the .* lower train.batch_size"):
        check_fits(model, math.ceil(1.1 * fits), cpu)
    check_fits(model, int(0.8 * fits), cpu)



# Every count that costs time or memory as it grows, with the fields it needs beside it and its largest
# value: past it a run would not end, or not fit, once started (issue 54's counts accepted up to 2**63 - 1).
COUNTS = [("train", "train.", "grad_accum", {}, 1024), ("train", "train.", "eval_iters", {}, 10_000),
          ("train", "train.", "sample_tokens", {}, 10_000), ("generate", "", "max_new_tokens", {}, 1_000_000),
          ("train", "model.", "mla_latent_dim", {"mla_rope_dim": 16}, 8 * 128),  # 8 x n_embd (128)
          ("train", "model.", "mla_rope_dim", {"mla_latent_dim": 64}, 8 * 128),
          ("train", "model.", "attn_sinks", {"attn_window": 8}, 64),              # block_size
          ("study", "study.", "decode_context", {}, 65_536),
          ("study", "study.", "decode_batch_sizes", {}, 1024)]


def checked_node(node, prefix: str):
    """A config node made into its dataclass, as the command line checks it."""
    return model_config(node, vocab_size=65) if prefix == "model." else config_object(node, prefix)


@pytest.mark.parametrize("config,prefix,field,beside,most", COUNTS, ids=[f"{c[1]}{c[2]}" for c in COUNTS])
def test_every_count_has_a_bound_a_user_could_mean(config, prefix, field, beside, most):
    """Its largest value is taken; one more, and 2**63 - 1, are refused at config time in one line
    naming the option and its bound, before any work."""
    for value, taken in ((most, True), (most + 1, False), (2**63 - 1, False)):
        node = composed(config).copy()
        node = node[prefix.rstrip(".")] if prefix else node
        for name, other in beside.items():
            node[name] = other
        node[field] = [value] if INT_TYPES[field] == list[int] else value
        if taken:
            checked_node(node, prefix)
            continue
        with pytest.raises(ValueError, match=rf"^{prefix}{field}\b.*({most:,}|{most})\b") as error:
            checked_node(node, prefix)
        assert "\n" not in str(error.value)
