"""Builders the tests share: the one tiny model config, the attention variants, the real Hydra
config, the ways to run a command line (a real process, awaited now or later, or in this one),
the metrics of a run dir, and a disk that fills up."""

import contextlib
import functools
import io
import json
import logging
import os
import resource
import runpy
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from model import GPT, GPTConfig
from training.run_dir import read_metrics  # noqa: F401  (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"mha": 4, "gqa": 2, "mqa": 1}  # n_kv_head of each attention variant, for n_head = 4
# Every kind of attention as tiny_config overrides (head dim 4): the n_kv_head variants, multi-head
# latent attention, and cross-layer K/V sharing, also over a layer count it does not divide.
ATTENTION = {
    "mha": {}, "gqa": {"n_kv_head": 2}, "mqa": {"n_kv_head": 1},
    "mla": {"mla_latent_dim": 6, "mla_rope_dim": 2},
    "mqa_cla2": {"n_kv_head": 1, "kv_share": 2},
    "gqa_cla2_3_layers": {"n_kv_head": 2, "kv_share": 2, "n_layer": 3},
    "mla_cla2_3_layers": {"mla_latent_dim": 6, "mla_rope_dim": 2, "kv_share": 2, "n_layer": 3},
}
# Every cache kind, as tiny_model overrides with RoPE. The endless ones have a window in every layer
# (their reference is the whole sequence, however long); a layer over the whole context refills its
# cache past block_size, where the reference slides instead, so those are compared within it.
ENDLESS = {
    "window": {"attn_window": 6},
    "window, sinks": {"attn_window": 6, "attn_sinks": 2},
    "window = block, sinks": {"attn_window": 24, "attn_sinks": 2},  # the ring is longer than block_size
    "gqa window, sinks, sink logit": {"n_kv_head": 2, "attn_window": 6, "attn_sinks": 3,
                                      "attn_sink_logit": True},
    "mla window, sinks": ATTENTION["mla"] | {"attn_window": 5, "attn_sinks": 1},
    "shared window, sinks": ATTENTION["gqa_cla2_3_layers"] | {"attn_window": 6, "attn_sinks": 2},
}
BOUNDED = {
    "full": {}, "mla": ATTENTION["mla"], "shared": ATTENTION["mqa_cla2"],
    "local/global": {"n_layer": 4, "attn_window": 5, "window_pattern": "SSL"},
    "local/global, sinks, sink logit": {"n_layer": 2, "n_kv_head": 1, "attn_window": 4,
                                        "window_pattern": "LS", "attn_sinks": 2, "attn_sink_logit": True},
}
# Text whose characters take 2 to 4 bytes of UTF-8 (GPT-2's BPE cuts ’ and “ into two tokens).
MULTI_BYTE = "A’’’’ “quoted” — naïve café, 日本語 🎭 done\n"
# The user's environment must not change what a test sees (an offline flag, a wandb key, ...).
FOREIGN_ENV = ("HF_", "WANDB_", "HYDRA_", "TIKTOKEN_", "KVGPT_")


def step_losses(run_dir) -> dict:
    """{step: training loss} from a run's metrics.jsonl."""
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def tiny_config(**overrides) -> GPTConfig:
    """A few-thousand-parameter GPT: vocab 37, block 24, 2 layers, 4 heads, 16 wide."""
    return GPTConfig(**{"vocab_size": 37, "block_size": 24, "n_layer": 2, "n_head": 4, "n_embd": 16}
                     | overrides)


def main_job_config(**overrides) -> GPTConfig:
    """The CPU main job's model (configs/experiment/shakespeare_char_cpu_fast.yaml, char vocab)."""
    return GPTConfig(**{"vocab_size": 65, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128,
                        "pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False} | overrides)


def int8_main_job() -> GPT:
    """One layer of the CPU main job's model (block 14) from seed 0, as generate.py decodes a large
    model on a CPU: int8 weights, bfloat16 activations (test_quantize loads this one from a checkpoint)."""
    from model.device import Precision
    from model.loading import for_decoding

    torch.manual_seed(0)
    return for_decoding(GPT(main_job_config(n_layer=1, block_size=14)), "cpu", Precision("bfloat16", "int8"))


def split_kv_wide(overrides: dict) -> dict:
    """tiny_model overrides with heads split-KV attention takes (model.kernels.splits_kv): 16 wide,
    and MLA's absorbed keys 12 + 4."""
    mla = {"mla_latent_dim": 12, "mla_rope_dim": 4} if "mla_latent_dim" in overrides else {}
    return overrides | {"n_embd": 64} | mla


def tiny_model(seed: int = 0, **overrides) -> GPT:
    """tiny_config(**overrides) as a GPT in eval mode, its weights drawn from `seed`."""
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


def cache_kind_model(overrides):
    model = tiny_model(**{"pos_emb": "rope"} | overrides)
    for block in model.blocks:  # learned sinks, not their zero init: a head may attend to nothing
        if block.attn.sink_logit is not None:
            block.attn.sink_logit.data.normal_(0, 2)
    return model


def stream_logits(model, prompts, max_new_tokens: int, **kwargs) -> tuple[list, list]:
    """Each row's tokens, as `generate` returns them for a list of prompts, and the logits each new
    token was drawn from (the model's last forward before it): (rows, [(B, vocab)] per token)."""
    from model.generation import Decoding, left_pad, stream
    from model.sampling import Sampling

    sampling = Sampling(max_new_tokens, kwargs.pop("temperature", 0), kwargs.pop("top_k", None))
    generator = kwargs.pop("generator", None)
    idx, pad = left_pad(prompts, model.wte.weight.device)
    outputs = []
    hook = model.register_forward_hook(lambda module, args, out: outputs.append(out[:, -1]))
    try:
        tokens = stream(model, idx, sampling, Decoding(**kwargs), generator=generator, pad=pad)
        steps = [(token, outputs[-1]) for token in tokens]
    finally:
        hook.remove()
    new = torch.stack([token for token, _ in steps], dim=1)                  # (B, max_new_tokens)
    pads = [0] * len(prompts) if pad is None else pad.tolist()
    rows = [torch.cat([row[p:], n]) for row, p, n in zip(idx, pads, new)]
    return rows, [logits for _, logits in steps]


def hf_gpt2(path, **overrides):
    """A small random GPT-2 written to `path` by transformers' save_pretrained."""
    import transformers

    torch.manual_seed(0)
    kw = dict(vocab_size=97, n_positions=48, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
              eos_token_id=0, layer_norm_epsilon=1e-5)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**(kw | overrides))).eval()
    model.save_pretrained(path)
    return model


# A small random model of each Llama family that exercises every field model.pretrained reads: GQA,
# head_dim 16 where hidden_size / heads is 12 (Mistral's config.json has none: 12), a RoPE base
# other than 10,000, Llama 3's scaling (wavelengths kept, blended and stretched at these sizes) and
# its tokenizer's BOS, Qwen3's QK-norm and layer types, Mistral's window, Qwen2's q/k/v biases, its
# tied head and more token ids than its tokenizer has (as Qwen's 151,936 for 151,669).
HF_FAMILIES = {
    "llama": {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 48}},
    "qwen3": {"rope_theta": 1e6, "use_sliding_window": True, "sliding_window": 6,
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "mistral": {"rope_theta": 1e6, "sliding_window": 6, "head_dim": None},
    "qwen2": {"rope_theta": 1e6, "tie_word_embeddings": True, "vocab_size": 320},
}
HF_CLASSES = {"llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral", "qwen2": "Qwen2"}


def hf_folder(path, family: str, **overrides):
    """A small random model of `family` written to `path` by transformers' save_pretrained, with its
    weights moved away from their initial values (norms off 1, biases off 0, logits of order 1) and
    a tokenizer.json (a byte-level BPE of 300 tokens learned from TinyShakespeare). Returns the
    transformers model."""
    import transformers

    torch.manual_seed(0)
    kw = dict(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=96,
              rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    name = HF_CLASSES[family]
    config = getattr(transformers, f"{name}Config")(**(kw | HF_FAMILIES[family] | overrides))
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    saved = json.loads(Path(path, "config.json").read_text())
    left_out = [key for key, value in HF_FAMILIES[family].items() if value is None]
    Path(path, "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k not in left_out}))
    Path(path, "tokenizer.json").write_text(shakespeare_tokenizer(bos=family == "llama"))
    return model


@functools.cache
def shakespeare_tokenizer(bos: bool = False) -> str:
    """tokenizer.json of a byte-level BPE (GPT-2's alphabet, as Llama 3's and Qwen's) of 300 tokens,
    <|endoftext|> among them, learned from the first 200,000 characters of TinyShakespeare; with
    `bos`, <|endoftext|> before every text it encodes (as Llama 3's <|begin_of_text|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = (ROOT / "data" / "assets" / "tinyshakespeare.txt").read_text()[:200_000]
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if bos:
        eot = tokenizer.token_to_id("<|endoftext|>")
        tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                 special_tokens=[("<|endoftext|>", eot)])
    return tokenizer.to_str()


# transformers' Llama names: llama.cpp's (gguf's TensorNameMap), outside the layers and in them
LLAMA_CPP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}


def permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf.py's LlamaModel.permute: a head's rows i, i + d/2 to 2i, 2i + 1."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_file(file, hf, types=None, meta=(), tensors=(), arch="llama"):
    """transformers' Llama `hf` as a GGUF file, as llama.cpp's convert_hf_to_gguf.py writes one: its
    config as llama.cpp's metadata (and `meta`'s keys: numbers, strings, lists), its weights renamed,
    q and k permuted, each matrix of the next of `types` (default F32; vectors F32); `tensors`
    replaces ({name: (array, type)}: uint8 arrays are raw blocks) or drops ({name: None}) tensors."""
    import gguf
    import numpy as np

    Q = gguf.GGMLQuantizationType
    types, c = types or (Q.F32,), hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(file), arch)
    sizes = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
             "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
             "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
             "vocab_size": c.vocab_size, "rope.dimension_count": head_dim,
             "attention.key_length": head_dim, "attention.value_length": head_dim,
             "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
             "rope.freq_base": c.rope_parameters["rope_theta"]}
    for key, value in ({f"{arch}.{key}": value for key, value in sizes.items()} | dict(meta)).items():
        kind = {int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32}.get(type(value))
        items = gguf.GGUFValueType.get_type(value[0]) if isinstance(value, list) else None
        writer.add_key_value(key, value, kind or gguf.GGUFValueType.get_type(value), sub_type=items)
    weights = {}
    for i, (name, p) in enumerate(hf.state_dict().items()):
        stem = name.removesuffix(".weight")
        if stem.startswith("model.layers."):
            _, _, layer, rest = stem.split(".", 3)
            stem = f"blk.{layer}.{LLAMA_CPP[rest]}"
        heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(stem.split(".")[-1])
        w = permute(p.numpy(), heads) if heads else p.numpy()
        weights[f"{LLAMA_CPP.get(stem, stem)}.weight"] = (w, Q.F32 if w.ndim == 1 else types[i % len(types)])
    for name, entry in (weights | dict(tensors)).items():
        if entry is not None:
            w, qtype = entry
            blocks = w if w.dtype == np.uint8 else gguf.quants.quantize(w, qtype)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file

def gguf_tokenizer_keys(chat_template: str | None = None) -> dict:
    """shakespeare_tokenizer() as a GGUF file's metadata (llama.cpp's keys): a byte-level BPE split as
    GPT-2 splits, <|endoftext|> its control token, BOS and EOS; and a chat template, if given."""
    model = json.loads(shakespeare_tokenizer())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    eot = tokens.index("<|endoftext|>")
    keys = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]],
            "tokenizer.ggml.token_type": [3 if t == "<|endoftext|>" else 1 for t in tokens],
            "tokenizer.ggml.bos_token_id": eot, "tokenizer.ggml.eos_token_id": eot}
    return keys | ({"tokenizer.chat_template": chat_template} if chat_template else {})


def compose(*overrides: str, config_name: str = "train"):
    """The real Hydra config, as the command line would build it (its schemas registered)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import benchmarks.attention_study  # noqa: F401  (registers the study's schema; imports train)
    import generate  # noqa: F401  (registers GenerateConfig)

    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides))


def train_checked(cfg, run_dir, overrides: list[str] | None = None) -> dict:
    """A training run in this process, as Python starts one: train(check_options(cfg), run_dir)."""
    from cli.options import check_options
    from training.loop import train

    return train(check_options(cfg, overrides), run_dir)


def data_config(*overrides: str):
    """The `data` group's DataConfig, composed as train.py would."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose(*overrides).data)


def clean_env(**extra: str) -> dict:
    """This process's environment (which conftest's hermetic_env has cleaned), plus `extra`; this
    tree first on PYTHONPATH, so a command imports the code under test wherever it runs (not that
    of another checkout an editable install points at); one thread for torch, as in this process
    (on 2 cores, the idle threads of a pool spinning between a tiny model's ops take the core
    another process needs: a tiny train.py took twice the CPU time with two)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ) | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"} | extra


def run_cli(*args: str, env: dict | None = None, timeout: int = 300, cwd=ROOT) -> subprocess.CompletedProcess:
    """`python <args>` (a script of the repo, or -m module), run in `cwd` (the repo root by
    default), output captured."""
    if args[0].endswith(".py"):
        args = (str(ROOT / args[0]), *args[1:])
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=clean_env(**(env or {})))


def start_cli(*args: str, env: dict | None = None, cwd=ROOT, **popen) -> subprocess.Popen:
    """run_cli's command, started and not awaited (finish() awaits it): processes that spend their
    seconds importing torch and Hydra side by side, or beside the tests in this process, use both
    cores. `popen`: more of subprocess.Popen's arguments."""
    if args[0].endswith(".py"):
        args = (str(ROOT / args[0]), *args[1:])
    return subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean_env(**(env or {})), **popen)


def finish(proc: subprocess.Popen, timeout: int = 300) -> subprocess.CompletedProcess:
    """A started command's result, as run_cli gives it."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()  # a no-op once it has ended
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_in_process(*args: str, env: dict | None = None, cwd=ROOT) -> subprocess.CompletedProcess:
    """What `python <args>` (a script of the repo, or -m module) does, run in this process: for
    tests of what a command says and its exit code, without the seconds a new process takes to
    import torch and Hydra. The script runs as __main__ (runpy) with sys.argv, the working
    directory and `env` set as run_cli would; SystemExit gives the exit code (a str is printed to
    stderr with code 1, as the interpreter does). An exception that escapes is raised here, so the
    test fails (a process would have printed a traceback). Afterwards this process is as it was:
    argv, cwd, environment, signal handlers, logging, Hydra's global state and config store, and
    the run dirs the command claimed (released, as its exit would)."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    store = ConfigStore.instance()
    saved = (sys.argv, os.getcwd(), dict(os.environ), copy_tree(store.repo), logging_state(),
             {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}, dict(held_run_dirs()))
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    try:
        os.environ.update(env or {})
        os.chdir(cwd)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
                warnings.catch_warnings():
            interpreter_warnings()
            try:
                if args[0] == "-m":
                    sys.argv = ["-m", *args[2:]]  # runpy puts the module's path first, as python -m does
                    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = [str(ROOT / args[0]), *args[1:]]
                    runpy.run_path(str(ROOT / args[0]), run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) or e.code is None else 1
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
    finally:
        sys.argv, cwd_before, environ, configs, logs, handlers, held = saved
        restore_tree(store.repo, configs)  # the script registered its own copies of the schemas
        os.chdir(cwd_before)
        os.environ.clear()
        os.environ.update(environ)
        restore_logging(logs)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        GlobalHydra.instance().clear()
        release_run_dirs(held)
    return subprocess.CompletedProcess(args, code or 0, stdout.getvalue(), stderr.getvalue())


def interpreter_warnings() -> None:
    """Warnings as a new interpreter shows them, on sys.stderr (pytest's filters show more and record
    them instead); `-m` of a module this process has imported is not one to show."""
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def copy_tree(tree: dict) -> dict:
    """A copy of nested dicts (Hydra's config store), sharing the leaves."""
    return {k: copy_tree(v) if isinstance(v, dict) else v for k, v in tree.items()}


def restore_tree(tree: dict, saved: dict) -> None:
    """The leaves of `saved` put back in `tree`; what was added since stays."""
    for k, v in saved.items():
        if isinstance(v, dict) and isinstance(tree.get(k), dict):
            restore_tree(tree[k], v)
        else:
            tree[k] = v


def logging_state() -> dict:
    """Every logger's handlers, level, propagation and disabled flag (Hydra configures logging)."""
    loggers = [logging.root, *(v for v in logging.Logger.manager.loggerDict.values()
                               if isinstance(v, logging.Logger))]
    return {lg: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers}


def restore_logging(state: dict) -> None:
    """The loggers of `state` back as they were; the handlers added to them since are closed (the
    run dir's log file Hydra opened)."""
    for lg, (handlers, level, propagate, disabled) in state.items():
        for handler in set(lg.handlers) - set(handlers):
            handler.close()
        lg.handlers, lg.level, lg.propagate, lg.disabled = handlers, level, propagate, disabled


def held_run_dirs() -> dict:
    """The run dirs this process holds (their lock files' descriptors)."""
    return getattr(sys.modules.get("training.run_dir"), "held_run_dirs", {})


def release_run_dirs(before: dict) -> None:
    """Close the run dirs claimed since `before` was taken (a copy), as the process's exit would."""
    held = held_run_dirs()
    for run_dir in [d for d in held if d not in before]:
        os.close(held.pop(run_dir))


@contextlib.contextmanager
def disk_full_after(n_bytes: int):
    """In this process, writes past n_bytes of a file fail (EFBIG), as on a full disk: RLIMIT_FSIZE,
    which Python's ignored SIGXFSZ turns into an OSError instead of killing the process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def temp_files(folder) -> list[str]:
    """The names in `folder` that a write in progress uses (write_atomically's `.<name>.*`)."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("."))


def assert_one_line_error(result: subprocess.CompletedProcess, message: str) -> None:
    """The command failed with exit code 1 and exactly `error: ...message...`, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr[-2000:]
