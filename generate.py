"""Sample from a trained checkpoint, with or without the KV cache.

    python generate.py                              # the latest run in outputs/
    python generate.py ckpt=outputs/... prompt="ROMEO:" max_new_tokens=500 num_samples=3
    python generate.py ckpt=... kv_cache=false      # the uncached reference path
    python generate.py ckpt=... benchmark=true      # tokens/s with and without the cache
    python generate.py ckpt=... attn_plot=attn.png  # the prompt's attention heatmaps
    python generate.py ckpt=... inspect=decode.html # a page: the cache and attention, step by step
    python generate.py ckpt=<HF folder or .gguf> chat="What is the capital of France?"  # its chat format
    python generate.py ckpt=<HF folder or .gguf> chat=- # a chat on standard input, its KV cache kept

`GenerateConfig` is the schema of configs/generate.yaml; `sample(cfg)` does the work and is
callable from Python; `main` is the Hydra wrapper.
"""

import dataclasses
import gc
import os
import signal
import sys
import time

if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))  # Ctrl-C while importing: quiet

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore

from cli.configs import CONFIGS, composed_jobs, config_object, quote_literal_options
from cli.errors import exit_on_user_error, naming
from cli.page import write_inspect_page
from cli.report import meta_cache, print_benchmark, save_attention_plot
from cli.samples import CHAT_CELLS, chat, first_messages, print_samples
from data.chat import chat_ids
from data.prepare import read_text_files
from data.tokenizer import check_utf8, tokenizer_from_meta
from model.checkpoint import latest_run
from model.config import check_integer, check_integer_fields
from model.decode_step import CompiledDecodeStep
from model.device import Precision, check_device, memory_bytes, pick_device
from model.generation import Decoding, left_pad, stream
from model.loading import load_model
from model.recorder import MAX_WEIGHTS, DecodeRecorder, weights_to_record
from model.sampling import Sampling

# New tokens a sample may ask for: more than any book-length text, and past it a sample would not end in
# any time one waits for (with num_samples > 1, nothing is printed until every sample is done).
MAX_NEW_TOKENS = 1_000_000


@dataclass
class GenerateConfig:
    """configs/generate.yaml: what to sample from, how, and what to print."""

    ckpt: str | None = None        # a run dir (its best.pt, else ckpt.pt), a checkpoint file, or a
                                   # Hugging Face model folder; None: the latest run in outputs/
    prompt: str | None = None      # None: a newline (unless prompt_file gives the prompts)
    prompt_file: str | None = None  # one prompt per line, all in one batch
    num_samples: int = 1           # per prompt
    max_new_tokens: int = 500
    temperature: float = 0.8       # 0 = greedy
    top_k: int | None = 200
    top_p: float | None = None
    stop: str | None = None        # a string that ends a sample
    ignore_eos: bool = False       # go on past the model's end-of-text tokens (tokenizer.eos_ids)
    chat: str | None = None        # a user's message in the model's chat template; -: a chat on stdin
    system: str | None = None      # the chat's system message
    show_cache: bool = False       # a chat prints each turn's tokens reused from the cache and prefilled
    seed: int = 1337               # sample j of each prompt draws from seed + j
    kv_cache: bool = True
    kv_dtype: str | None = None    # float32 | bfloat16 | int8 (per-position scales); None: the decode dtype
    prefill_chunk: int | None = None  # the prompt enters the cache this many tokens at a time; None: at once
    compile: Any = "auto"          # the one-token step: auto (on CUDA captured as a CUDA graph, no
                                   # code generated; elsewhere eager) | true (inductor) | false (eager)
    dtype: str = "auto"            # auto | float32 | bfloat16 (auto: see model.device.Precision)
    quantize: str | None = "auto"  # auto | int8 (weight-only int8 Linear layers) | null
    device: str = "auto"
    benchmark: bool = False        # print prefill/decode tokens/s and the cache size instead
    attn_plot: str | None = None   # a .png path: the prompt's attention weights
    attn_layer: int = 0
    inspect: str | None = None     # an .html path: a page of the decode's cache and attention, step by step

    def __post_init__(self):
        check_integer_fields(self, "")
        if self.ckpt == "":
            raise ValueError("ckpt is empty: give a run dir or a checkpoint file, or leave it out for "
                             "the latest run in outputs/")
        if self.prompt_file is not None and not self.prompt_file.strip():
            raise ValueError("prompt_file is empty: give a file of prompts, one per line, or leave it out")
        if self.prompt is not None and self.prompt_file is not None:
            raise ValueError(f"prompt and prompt_file={self.prompt_file} both give the prompts: give one")
        if self.prompt == "":
            raise ValueError("the prompt is empty: give at least one character, e.g. prompt='\\n'")
        self.check_chat()
        if self.prompt is None and self.prompt_file is None and self.chat is None:
            self.prompt = "\n"
        if self.stop == "":
            raise ValueError("stop is empty: give the text that ends a sample, or leave stop out")
        check_integer(self.num_samples, "num_samples", 1)
        check_integer(self.seed, "seed", 0)
        check_integer(self.attn_layer, "attn_layer", 0)
        # The library's own objects, made (and so checked) once, here: the run hands them on (the
        # decode step and the tokenizer's vocab_size join the Decoding once made).
        self.sampling = Sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be at most {MAX_NEW_TOKENS:,} (a sample that long takes "
                             f"hours, and several print only when all are done), got {self.max_new_tokens:,}")
        self.precision = Precision(self.dtype, self.quantize)
        self.decoding = Decoding(self.kv_cache, self.kv_dtype, self.prefill_chunk)  # kv_dtype: a torch dtype
        check_device(self.device)
        if not (self.compile == "auto" or isinstance(self.compile, bool)):
            raise ValueError(f"compile must be one of auto, true, false, got {self.compile!r}")
        if self.attn_plot is not None:
            check_output_file(self.attn_plot, "attn_plot")
        if self.inspect is not None:
            self.check_inspect()

    def check_chat(self) -> None:
        """chat=<message> gives the prompt in the model's chat template (with `system`); chat=- reads
        a chat's turns from standard input: one row, no benchmark or page."""
        given = [name for name in ("prompt", "prompt_file") if getattr(self, name) is not None]
        if self.chat is None:
            if self.system is not None or self.show_cache:
                option = "system" if self.system is not None else "show_cache"
                raise ValueError(f"{option} is for a chat: give chat=<message> (or chat=- for a chat on "
                                 f"standard input) too")
            return
        if not self.chat.strip() or self.system is not None and not self.system.strip():
            raise ValueError(f"{'chat' if not self.chat.strip() else 'system'} is empty: give the message")
        if given:
            raise ValueError(f"chat and {given[0]} both give the prompt: give one")
        if self.chat == "-":
            for clash, what in ((self.num_samples > 1, "num_samples=1"), (self.benchmark, "benchmark=false"),
                                (self.inspect, "inspect out"), (self.attn_plot, "attn_plot out"),
                                (not self.kv_cache, "kv_cache=true (it keeps the cache from turn to turn)")):
                if clash:
                    raise ValueError(f"chat=- is a chat on standard input: leave {what}")
        elif self.show_cache:
            raise ValueError("show_cache is for a chat on standard input: give chat=-")

    def check_inspect(self) -> None:
        """inspect=<file.html> records one eager decode: a writable .html file, one sample."""
        check_output_file(self.inspect, "inspect")
        if Path(self.inspect).suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"inspect={self.inspect}: give an .html file name, e.g. inspect=decode.html")
        for clash, why in ((self.num_samples > 1, "shows one sample: leave num_samples=1"),
                           (self.max_new_tokens == 0, "shows new tokens: give max_new_tokens >= 1"),
                           (self.compile is True, "records the eager decode step: leave compile=false"),
                           (self.benchmark, "records a decode, not a benchmark: leave benchmark=false")):
            if clash:
                raise ValueError(f"inspect={self.inspect} {why}")


    def step_backend(self, device) -> str | None:
        """How the one-token step is built (CompiledDecodeStep's backend), or None for the eager step.
        auto captures it as a CUDA graph on CUDA (it pays for itself within a sample: captured in a
        fraction of a second, then one launch a token), unless a page records the eager decode."""
        if not self.kv_cache or self.compile is False:
            return None
        if self.compile is True:
            return "inductor"
        return "cuda_graph" if device.type == "cuda" and not self.inspect else None


ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)

# Free text: taken as typed, not parsed by Hydra's grammar.
LITERAL_OPTIONS = ("prompt", "stop", "chat", "system")


def check_output_file(path: str, option: str) -> None:
    """A file the run will write: named, its folder existing and writable, and it not a folder."""
    if not path.strip():
        raise ValueError(f"{option} is empty: give a file name, or leave {option} out")
    folder = Path(path).expanduser().parent
    if not folder.is_dir():
        raise FileNotFoundError(f"{option}={path}: the folder {folder} does not exist")
    if Path(path).expanduser().is_dir():
        raise IsADirectoryError(f"{option}={path} is a folder: give a file name, e.g. {option}=attn.png")
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"{option}={path}: the folder {folder} is not writable")


def read_prompts(cfg: GenerateConfig) -> list[str]:
    """The prompts: prompt, or each line of prompt_file; with chat, none printed ("": the chat
    template gives its tokens)."""
    if cfg.chat is not None:
        prompts = [""]
        for option in ("chat", "system"):
            if getattr(cfg, option) is not None:
                check_utf8(getattr(cfg, option), option)
    elif cfg.prompt_file is not None:
        path = Path(cfg.prompt_file).expanduser()
        if path.is_dir():
            raise IsADirectoryError(f"prompt_file={path} is a folder: give a file of prompts, one per line")
        if not path.is_file():
            raise FileNotFoundError(f"prompt_file not found: {path}")
        with naming("prompt_file"):
            prompts = [line for line in read_text_files([path]).decode().splitlines() if line]
        if not prompts:
            raise ValueError(f"prompt_file {path} has no prompts")
    else:
        prompts = [cfg.prompt]
        check_utf8(cfg.prompt, "prompt")  # (prompt_file's bytes are read as UTF-8, and said so)
    return prompts


def encode_prompts(tokenizer, prompts: list[str], cfg: GenerateConfig) -> list[list[int]]:
    """Each prompt's token ids, one or more (chat=<message>: the conversation's, in the model's chat
    template): a prompt the tokenizer cannot take (a character a char model lacks; a newline, the
    prompt when none is given, included) names its option."""
    if cfg.chat is not None:
        with naming("chat"):
            return [chat_ids(tokenizer, first_messages(cfg.system, cfg.chat))]
    option, encoded = "prompt" if cfg.prompt_file is None else "prompt_file", []
    for prompt in prompts:
        try:
            ids = tokenizer.encode(prompt)
        except ValueError as e:
            default = " (a newline is the prompt when none is given)" if prompt == "\n" else ""
            fix = "give prompt=... in the characters it has" if option == "prompt" else "edit the prompts"
            raise ValueError(f"{option}: {e}{default}: {fix}") from e
        if not ids:
            raise ValueError(f"{option}: {prompt!r} encodes to no token with this model's tokenizer: "
                             f"give other text")
        encoded.append(ids)
    return encoded


def cache_positions(config, longest: int, max_new_tokens: int) -> int:
    """The positions a sample's KV cache holds: the longest prompt and its new tokens (2 at least,
    as the benchmark decodes), at most block_size, rounded up to a power of two so that a few sizes
    of compiled step (each kept on disk) serve every length of sample. (A real model's block_size
    runs to 131,072 positions: a cache of them all would take gigabytes, read every token on CUDA.)"""
    need = min(config.block_size, longest + max(2, max_new_tokens))
    return min(config.block_size, 1 << (need - 1).bit_length())


def check_batch_fits(model, rows: int, positions: int, cfg: GenerateConfig) -> None:
    """`rows` sequences fit in the device's memory by a lower bound of what decoding them takes:
    each row's KV cache of `positions` (with kv_cache) and one residual stream of as many, so that
    num_samples is refused before anything is allocated, not by the allocator or the OOM killer."""
    c, device = model.config, model.wte.weight.device
    cache = meta_cache(c, model.wte.weight.dtype, cfg.decoding.kv_dtype, positions)
    need = rows * (cache.nbytes * cfg.kv_cache + 4 * positions * c.n_embd)
    if need > (have := memory_bytes(device)):
        raise ValueError(f"num_samples={cfg.num_samples}: {rows:,} rows take at least "
                         f"{need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB of {device}: "
                         f"lower num_samples")


def sample(cfg: GenerateConfig, out=None) -> list[str]:
    """Generate as cfg says; prints the samples to `out` (stdout by default; a single sample
    streams) and returns their texts."""
    out = out or sys.stdout
    lines = read_prompts(cfg)
    if cfg.inspect and len(lines) > 1:
        raise ValueError(f"inspect={cfg.inspect} shows one sample: give one prompt, not a prompt_file of "
                         f"{len(lines)}")
    source = cfg.ckpt
    if source is None:
        source = latest_run("outputs")
        print(f"ckpt: {source} (the latest run in outputs/; choose another with ckpt=...)", file=sys.stderr)
    device = pick_device(cfg.device)  # its errors name `device`, as the option is called here
    with naming("ckpt"):
        model, ckpt = load_model(source, device, cfg.precision)
        tokenizer = tokenizer_from_meta(ckpt.data_meta)
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"ckpt={source}: its model has {model.config.vocab_size} token ids, fewer than its "
                         f"{tokenizer.name} tokenizer's {tokenizer.vocab_size}: a mismatched checkpoint")
    sampling = dataclasses.replace(cfg.sampling, eos_ids=() if cfg.ignore_eos else tokenizer.eos_ids)
    if cfg.chat == "-":
        return chat_on_stdin(cfg, model, tokenizer, sampling, device, out)
    encoded = encode_prompts(tokenizer, lines, cfg)
    positions = cache_positions(model.config, max(map(len, encoded)), cfg.max_new_tokens)
    check_batch_fits(model, len(lines) * cfg.num_samples, positions, cfg)
    prompts, encoded = ([x for x in xs for _ in range(cfg.num_samples)] for xs in (lines, encoded))
    kv_dtype = cfg.decoding.kv_dtype  # (the torch dtype the cache stores in; None: the decode dtype)
    backend, t0 = cfg.step_backend(device), time.perf_counter()
    decode_step = compiled_step(model, len(prompts), kv_dtype, backend, positions)
    if cfg.benchmark:
        built_s = time.perf_counter() - t0
        decoding = Decoding(kv_dtype=kv_dtype, decode_step=decode_step)  # with and without the cache
        print_benchmark(model, encoded, cfg.max_new_tokens, decoding, out, built_s)
        if cfg.attn_plot:
            save_attention_plot(model, encoded[0], tokenizer, cfg.attn_plot, cfg.attn_layer, out)
        return []

    if cfg.inspect:
        check_inspect_fits(model, encoded[0], cfg)
    idx, pad = left_pad(encoded, device)
    # Sample j of each prompt draws from seed + j, so every sample is the one `seed=<seed + j>`
    # gives for that prompt alone, however the prompts are batched (to bf16's and int8's rounding).
    generators = [torch.Generator(device=device).manual_seed(cfg.seed + i % cfg.num_samples)
                  for i in range(len(prompts))]
    decoding = dataclasses.replace(cfg.decoding, decode_step=decode_step, vocab_size=tokenizer.vocab_size)
    tokens = stream(model, idx, sampling, decoding, generator=generators, pad=pad)
    if cfg.attn_plot:  # once the sample is checked (stream)
        save_attention_plot(model, encoded[0], tokenizer, cfg.attn_plot, cfg.attn_layer, out)
    with DecodeRecorder(model, encoded[0]) if cfg.inspect else nullcontext() as recorder:
        tokens = recorder.watch(tokens) if recorder else tokens
        texts = print_samples(prompts, tokens, tokenizer, cfg.stop, out, sampling.eos_ids)
    if recorder:
        pieces = [tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in recorder.tokens]
        with naming("inspect"):
            size = write_inspect_page(cfg.inspect, recorder.record(), pieces)
        print(f"inspect page saved to {cfg.inspect} ({len(recorder.steps)} steps, {size / 2**20:.1f} MB)",
              file=out)
    return [p + t for p, t in zip(prompts, texts)]


def check_inspect_fits(model, prompt: list[int], cfg: GenerateConfig) -> None:
    """inspect=... records a decode of at most MAX_WEIGHTS attention weights."""
    n = weights_to_record(model.config, len(prompt), cfg.max_new_tokens, cfg.kv_cache)
    if n > MAX_WEIGHTS:
        raise ValueError(f"inspect={cfg.inspect}: max_new_tokens={cfg.max_new_tokens} would record {n:,} "
                         f"attention weights (~{8 * n / 2**20:,.0f} MB of page), more than {MAX_WEIGHTS:,}: "
                         f"lower max_new_tokens")


def compiled_step(model, rows: int, kv_dtype, backend: str | None, positions: int):
    """The compiled one-token step `backend` builds for `rows` rows and a cache of `positions`, or None."""
    with naming("compile"):  # (inductor's cache folder: full, read-only, ...)
        return None if backend is None else CompiledDecodeStep(model, rows, kv_dtype, backend,
                                                               max_len=positions)


def chat_on_stdin(cfg: GenerateConfig, model, tokenizer, sampling, device, out) -> list[str]:
    """chat=-: a chat on standard input (cli.samples.chat), its cache kept from turn to turn."""
    positions = min(model.config.block_size, CHAT_CELLS)
    check_batch_fits(model, 1, positions, cfg)
    decode_step = compiled_step(model, 1, cfg.decoding.kv_dtype, cfg.step_backend(device), positions)
    decoding = dataclasses.replace(cfg.decoding, decode_step=decode_step, vocab_size=tokenizer.vocab_size)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    return chat(model, tokenizer, sampling, decoding, generator, cfg.system, cfg.stop, cfg.show_cache,
                out=out)


@hydra.main(config_path="configs", config_name="generate", version_base="1.3")
def main(cfg) -> None:
    exit_on_user_error(lambda: sample(config_object(cfg)))  # the schema's checks are guarded too


if __name__ == "__main__":
    sys.argv[1:] = quote_literal_options(sys.argv[1:], LITERAL_OPTIONS)
    composed_jobs(CONFIGS, "generate", sys.argv[1:])  # Hydra's errors: one line
    main()
    gc.freeze()  # exiting: no last collection over the objects torch made (~0.7 s on a CPU)
