"""Decode speed and quality side by side: ours against Hugging Face transformers' `generate` on the
very same weights, batch 1, for two models, and the val loss each decode precision costs.

    python benchmarks/decode.py [--ckpt outputs/<a run of python train.py>] [--new 500]

1. The char model's shape (6 layers, 6 heads, 384 wide, vocab 65; nanoGPT's GPU recipe, with
   the block long enough for the sample), random weights: a transformers GPT-2 saved with
   `save_pretrained`, loaded into ours with `GPT.from_pretrained`.
2. The CPU main job's model (4/4/128, RoPE, RMSNorm, SwiGLU), trained: `--ckpt` (by default the
   latest run in outputs/), handed to transformers as a Llama (`model.convert.llama_weights`).

Each row samples `--new` tokens as `python generate.py` does (temperature 0.8, top_k 200):
"sample s" is one whole sample timed from a freshly loaded model, so it includes every warm-up
a user waits for (compilation too); "tokens/s" is the steady speed: the median of 5 rounds in which
every row samples once more, interleaved (each after a collection of the whole heap), and each
ratio the median of its rounds'. "default" is generate.py with no speed flags (dtype=auto
quantize=auto); then with compile=true; "fastest flags" are the README's, compile=true
quantize=int8 dtype=bfloat16.
Greedy fp32 tokens are checked identical to transformers' first. Then the main job's
checkpoint is evaluated on its whole val split in each precision.

   Where a token's time goes (`--sections anatomy`): for no flags, `compile=true` and the fastest
   flags on both models, µs a token in the one-token step, sampling, refills, the prompt's prefill
   and the rest (the stream itself), timed by wrapping those functions where `stream` calls them.
3. Compile paid once (`--sections compile [--before <checkout>]`): `python generate.py ckpt=<the
   main job> compile=true benchmark=true`, and the same with the fastest flags, each run twice, each
   a fresh process, over one empty inductor cache: the first compiles, the second finds the code on
   disk. Each prints the time the step took to build and the whole process's; with --before,
   another checkout's too, in turn.
4. generate.py's flags (`--sections flags [--before <checkout>]`): decode tokens/s after the warm-up
   with no flags, `compile=true`, and `compile=true quantize=int8 dtype=bfloat16`, on the char
   model's shape, the main job's (block 64, so it refills), the main job's at block 1024 (batch 1
   and 64); random weights, each a fresh process, interleaved rounds, medians; with --before, the
   same from another checkout side by side: the guard that shows a decode regression in one run.
5. Thread counts (`--sections threads`): the default sample of both models at 1 and 2 threads,
   side by side, with the aten operations one decoded token costs (counted under a dispatch mode).
6. The KV cache's precision (`--sections kv [--before <checkout>]`): cached one-token steps of the
   main job's and the char model's shapes at 1024 positions, batch 1 and 64, with the cache in
   float32, bfloat16 and int8 (float32 weights), each a fresh process, round after round, medians;
   with --before, the same from another checkout side by side (before and after a change).
7. A long prompt (`--sections long`): 30,000 tokens and 5 new ones on the CPU main job's shape
   (4/4/128, RoPE, block 64), with full attention (which crops the prompt to the block) and with a
   window of 16 (which runs its receptive field, 4 x 15 + 1 tokens), cached and uncached: seconds
   and peak memory, each in a fresh process.
8. The step by attention variant (`--sections variants`): MHA, GQA (4 K/V heads), MQA and MLA at
   GPT-2 small width (12/12/768, RoPE), 1024 cached positions, batch 1 and 16: the eager step
   (reads the written cells, no mask) and the compiled step's formulation (every cell under a mask,
   through the kernels the compiled step allows, `decode_backends`; here eagerly), tokens/s. Each
   variant in a fresh process that imports the model from `--code` (default: this checkout), so the same
   script measures two checkouts side by side (before and after a change).
9. Many samples of one prompt (`--sections samples`): num_samples=8 rows of one 200-token prompt,
   50 new tokens each, on the char model's shape (block 256), every row prefilled (before) and the
   prompt prefilled once and copied into the rows (after), interleaved rounds, medians: time to the
   first token and decode tokens/s.
10. What RMSNorm costs (`--sections norm`): the main job's eager one-token step as it runs, against
   the same step with one fused kernel in each nn.RMSNorm's place (LayerNorm's, of the same width and
   weight: the cost a fused RMSNorm would have, not its numbers; PyTorch's CPU RMSNorm is ~9 small
   operations a call), paired rounds in one process: what the norms cost a token beyond one kernel.
11. A real model (`--sections real [--real-ckpt <folder>]`, default SmolLM2-135M-Instruct as
   `python tests/real_model.py` fetches it; skipped in one line without it): one chat prompt, batch 1,
   200 greedy new tokens (whatever --new), transformers' float32 `generate` (its cache, no end of
   text) beside ours in float32 eagerly and compiled, and with generate.py's lossy flags; each row
   timed from its first new token to its last, 5 interleaved rounds in one process, medians; each
   row's bytes a token reads over the machine's read bandwidth, measured in the same rounds (its
   MBU), and how many tokens each keeps of the float32 answer before the first that differs.
"""

import contextlib
import copy
import functools
import gc
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

import model.generation as generation
from cli.errors import ArgumentParser, exit_on_user_error, naming
from data.prepare import DataConfig, load_prepared, prepare
from model import GPT, GPTConfig, generate
from model.checkpoint import find, latest_run
from model.config import check_integer
from model.convert import llama_weights
from model.decode_step import CompiledDecodeStep
from model.device import Precision
from model.generation import Decoding, stream
from model.kv_cache import KV_DTYPES
from model.loading import for_decoding, load_model
from model.sampling import Sampling
from model.timing import decode_tokens_per_s, timed_stream
from training.evaluation import split_loss

ROOT = Path(__file__).resolve().parents[1]
# --new's most: each section samples that many tokens several times, the char model's block holds them
MAX_NEW = 100_000

PRECISIONS = {  # name: (dtype, quantize, compile)
    "fp32 (exact)": ("float32", None, False),
    "bf16": ("bfloat16", None, False),
    "int8 weights + bf16": ("bfloat16", "int8", False),
    "default (no flags)": ("auto", "auto", False),
    "default + compile=true": ("auto", "auto", True),
    "fastest flags: compile=true quantize=int8 dtype=bfloat16": ("bfloat16", "int8", True),
}


def sample_seconds(model, prompt, new: int, decode_step=None) -> float:
    generator = torch.Generator().manual_seed(1337)
    sampling, decoding = Sampling(new, temperature=0.8, top_k=200), Decoding(decode_step=decode_step)
    t0 = time.perf_counter()
    for _ in stream(model, prompt, sampling, decoding, generator=generator):
        pass
    return time.perf_counter() - t0


def hf_sample_seconds(hf, prompt, new: int) -> float:
    torch.manual_seed(1337)
    t0 = time.perf_counter()
    hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=True,
                temperature=0.8, top_k=200, pad_token_id=0)
    return time.perf_counter() - t0


def collected_first(sample) -> float:
    """sample(), after a collection of the whole heap: a row then pays for the collections its own
    objects cause (transformers' generate makes many), never for the garbage of the rows before it
    (one of two identical rows of a round ran 1.4x slower for that)."""
    gc.collect()
    return sample()


def compare(title: str, hf, load, new: int, rounds: int = 5) -> None:
    """One table: transformers, then each of our precisions, each loaded fresh by `load` and timed
    on its first sample; then `rounds` rounds of one more sample of each, one after another, whose
    medians are the steady speeds (each `collected_first`). The ratio is the median over rounds of
    transformers' time in a round over ours in that round: both measured within seconds of each
    other, so a slower spell of the machine (this one's speed drifts by up to 2x) slows both sides
    of a ratio alike."""
    prompt = torch.zeros(1, 1, dtype=torch.long)
    # No end-of-text token (ours never stops early; min_new_tokens would forbid token 0, "\n" in the
    # char vocabulary), and an attention mask, else transformers takes the prompt's 0 for padding.
    hf.generation_config.eos_token_id = None
    exact = load("float32", None)
    check = min(new, exact.config.block_size - 1)  # past the block, ours refills its cache, theirs goes on
    greedy_hf = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=check,
                            do_sample=False, pad_token_id=0)
    same = (greedy_hf == generate(exact, prompt, check, temperature=0)).float().mean().item()
    hf_name = "transformers generate (fp32, KV cache)"
    samplers = {hf_name: functools.partial(hf_sample_seconds, hf, prompt, new)}
    first = {hf_name: samplers[hf_name]()}
    for name, (dtype, quantize, compiled) in PRECISIONS.items():
        model = load(dtype, quantize)
        t0 = time.perf_counter()
        step = CompiledDecodeStep(model) if compiled else None  # (compiled when made: timed with the sample)
        first[f"ours, {name}"] = time.perf_counter() - t0 + sample_seconds(model, prompt, new, step)
        samplers[f"ours, {name}"] = functools.partial(sample_seconds, model, prompt, new, step)
    times = {name: [] for name in samplers}
    for _ in range(rounds):
        for name, sample in samplers.items():
            times[name].append(collected_first(sample))
    print(f"\n### {title}: batch 1, {new} new tokens, {torch.get_num_threads()} threads; "
          f"greedy fp32 tokens equal to transformers' at {same:.1%} of the first {check}\n")
    print(f"| decode | sample s (from load, warm-up included) | tokens/s (median of {rounds} interleaved "
          f"repeats) | vs transformers (first sample / repeats) |")
    print("| --- | --- | --- | --- |")
    for name, t in times.items():
        ratio = statistics.median(h / o for h, o in zip(times[hf_name], t))
        print(f"| {name} | {first[name]:.2f} | {new / statistics.median(t):,.0f} | "
              f"{first[hf_name] / first[name]:.2f}x / {ratio:.2f}x |")


def char_shape(new: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # Block 512, not 256: transformers' GPT-2 cannot sample past its position table, and a
    # 500-token sample should be one cache fill in both (ours would refill it, theirs fail).
    block = max(256, new + 1)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=65, n_positions=block, n_embd=384, n_layer=6, n_head=6,
                                    bos_token_id=0, eos_token_id=0)).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        loaded = GPT.from_pretrained(d)
    load = functools.partial(decoding_copy, loaded.config, loaded.state_dict())
    compare(f"6/6/384 char shape, block {block} (random weights), vs transformers GPT-2", hf, load, new)


def decoding_copy(config: GPTConfig, weights: dict, dtype: str, quantize: str | None) -> GPT:
    """A new GPT of `config` holding `weights`, ready to decode in that precision (int8 replaces
    a model's Linears in place: each precision gets a model of its own)."""
    model = GPT(config)
    model.load_state_dict(weights)
    return for_decoding(model, "cpu", Precision(dtype, quantize))


def main_job(ckpt: str, new: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    fp32, saved = load_model(ckpt, "cpu", Precision("float32", None))
    config, state = llama_weights(fp32)
    hf = LlamaForCausalLM(LlamaConfig(**config)).eval()
    hf.load_state_dict(state)
    c = fp32.config
    compare(f"CPU main job's model ({c.n_layer}/{c.n_head}/{c.n_embd}, {ckpt}), vs transformers Llama",
            hf, lambda dtype, quantize: load_model(ckpt, "cpu", Precision(dtype, quantize))[0], new)

    _, _, val = load_prepared(prepare(DataConfig(**saved.config["data"])))
    val = torch.from_numpy(val.astype("int64"))
    print(f"\n### Val loss of {ckpt} over its whole val split ({len(val):,} tokens) in each precision\n")
    print("| precision | val loss | vs fp32 |\n| --- | --- | --- |")
    exact = None
    for name, (dtype, quantize, compiled) in PRECISIONS.items():
        if compiled:
            continue  # compiling changes no weights: the same model as one without
        loss = split_loss(load_model(ckpt, "cpu", Precision(dtype, quantize))[0], val)
        exact = loss if exact is None else exact
        print(f"| {name} | {loss:.4f} | {loss - exact:+.4f} |")


COMPILE_FLAGS = {"compile": "compile=true", "fastest": "compile=true quantize=int8 dtype=bfloat16"}


def compile_cost(ckpt: str, new: int, codes: dict) -> None:
    """generate.py with compile=true, and with the fastest flags, each twice in fresh processes over
    one inductor cache (empty before the first), from each checkout of `codes` ({name: checkout},
    each with a cache of its own), the checkouts in turn: the whole process and the time it took to
    build the step."""
    args = [f"ckpt={Path(ckpt).resolve()}", "benchmark=true", f"max_new_tokens={new}"]
    print(f"\n### Compile paid once: `python generate.py {' '.join(args)}` with the flags below, twice, "
          f"fresh processes, one inductor cache (empty before the first) per checkout and flags\n")
    print("| flags | checkout | run | whole process s | step built (compiling) s | decode tokens/s |\n"
          "| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as caches:
        for label, flags in COMPILE_FLAGS.items():
            for run in ("first", "second"):
                for name, code in codes.items():
                    cache = f"{caches}/{name}-{label}"  # (no space in it: the C++ compiler is handed it)
                    t0 = time.perf_counter()
                    out = subprocess.run(
                        [sys.executable, "generate.py", *args, *flags.split()], cwd=code, capture_output=True,
                        text=True, check=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}).stdout
                    wall = time.perf_counter() - t0
                    built = re.search(r"built in ([\d.]+) s", out).group(1)
                    decode = re.search(r"^\| on \| [\d,]+ \| ([\d,.]+) \|", out, re.M).group(1)
                    print(f"| {flags} | {name} | {run} | {wall:.1f} | {built} | {decode} |")


def ops_per_token(model, new: int = 32) -> float:
    """aten operations per token of a default sample after its first, as torch.profiler counts them
    (every call, nested ones included): a sample of new + 1 tokens against one of 1."""
    from torch.profiler import profile

    counts = []
    for n in (1, new + 1):
        with profile() as prof:
            sample_seconds(model, torch.zeros(1, 1, dtype=torch.long), n)
        counts.append(sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")))
    return (counts[1] - counts[0]) / new


def threads(ckpt: str, new: int, rounds: int = 3) -> None:
    torch.manual_seed(0)
    char = for_decoding(GPT(GPTConfig(vocab_size=65, block_size=512, n_layer=6, n_head=6, n_embd=384)), "cpu")
    models = {"char 6/6/384 (random weights)": char, "CPU main job": load_model(ckpt, "cpu")[0]}
    counts = sorted({1, torch.get_num_threads()})
    print(f"\n### Threads: default decoding (no flags), batch 1, {new} new tokens, tokens/s, median of "
          f"{rounds} interleaved rounds\n")
    print("| model | weights | aten ops per token | " + " | ".join(f"{n} thread(s)" for n in counts)
          + " |\n|" + " --- |" * (3 + len(counts)))
    default = torch.get_num_threads()
    for name, model in models.items():
        speeds = {n: [] for n in counts}
        for _ in range(rounds):
            for n in counts:
                torch.set_num_threads(n)
                speeds[n].append(new / sample_seconds(model, torch.zeros(1, 1, dtype=torch.long), new))
        torch.set_num_threads(default)
        cells = " | ".join(f"{sorted(v)[len(v) // 2]:,.0f}" for v in speeds.values())
        weights = "int8" if "Int8" in str(model) else str(model.wte.weight.dtype).removeprefix("torch.")
        print(f"| {name} | {weights} | {ops_per_token(model):,.0f} | {cells} |")


KV_STEPS = """import sys, torch
sys.path.insert(0, {code!r})
from model import GPT, GPTConfig
try:  # where a checkout keeps it: model/generation.py before the timing helpers left it
    from model.timing import decode_tokens_per_s
except ImportError:
    from model.generation import decode_tokens_per_s
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=65, block_size={context}, **{shape!r})).eval()
decode_tokens_per_s(model, {batch}, {context}, {dtype!r})  # warm-up: compiles what the steps compile
print(decode_tokens_per_s(model, {batch}, {context}, {dtype!r}))"""
KV_SHAPES = {"the main job's 4/4/128": dict(n_layer=4, n_head=4, n_embd=128, pos_emb="rope", norm="rmsnorm",
                                            mlp="swiglu", bias=False),
             "the char model's 6/6/384": dict(n_layer=6, n_head=6, n_embd=384)}


def interleaved_medians(scripts: dict, rounds: int) -> dict:
    """{key: median} of the number each script of `scripts` ({key: python source}) prints, each run
    in a fresh process, `rounds` times, the scripts one after another within a round, in the
    opposite order every other round (the first of a round may run on a machine in another state)."""
    runs = {key: [] for key in scripts}
    for r in range(rounds):
        for key, script in list(scripts.items())[::1 if r % 2 == 0 else -1]:
            runs[key].append(float(subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True,
                                                  capture_output=True, text=True).stdout))
    return {key: sorted(v)[rounds // 2] for key, v in runs.items()}


def cache_precisions(codes: dict, context: int = 1024, batches=(1, 64), rounds: int = 3) -> None:
    """Eager one-token steps at `context` cached positions, float32 weights, each cache dtype, each
    in a fresh process importing the model from each of `codes` ({name: checkout}), interleaved."""
    print(f"\n### KV cache precision: {context} cached positions, float32 weights, eager, "
          f"{torch.get_num_threads()} threads; tokens/s, median of {rounds} interleaved rounds, each a "
          f"fresh process; the model from {', '.join(f'{k}: {v}' for k, v in codes.items())}\n")
    print("| shape | batch | KV cache | " + " | ".join(f"{name} | vs float32" for name in codes)
          + " |\n|" + " --- |" * (3 + 2 * len(codes)))
    for shape_name, shape in KV_SHAPES.items():
        for batch in batches:
            median = interleaved_medians({(code, dtype): KV_STEPS.format(
                code=codes[code], context=context, shape=shape, batch=batch, dtype=dtype)
                for code in codes for dtype in KV_DTYPES}, rounds)
            for dtype in KV_DTYPES:
                cells = [f"{median[c, dtype]:,.0f} | {median[c, dtype] / median[c, 'float32']:.2f}x"
                         for c in codes]
                print(f"| {shape_name} | {batch} | {dtype} | " + " | ".join(cells) + " |")


FLAG_STEPS = """import statistics, sys, torch
sys.path.insert(0, {code!r})
from model import GPT, GPTConfig
from model.device import Precision
from model.generation import CompiledDecodeStep  # (every checkout has it so)
try:  # where a checkout keeps them: model/generation.py before loading, timing and Decoding left it
    from model.generation import Decoding
    from model.loading import for_decoding
    from model.timing import timed_stream
    timed = lambda step: timed_stream(model, idx, {new}, Decoding(decode_step=step))
except ImportError:
    from model.generation import for_decoding, timed_stream
    timed = lambda step: timed_stream(model, idx, {new}, True, step)
torch.manual_seed(0)
model = for_decoding(GPT(GPTConfig(vocab_size=65, **{shape!r})), "cpu", Precision({dtype!r}, {quantize!r}))
step = CompiledDecodeStep(model, {batch}) if {compiled} else None
idx = torch.zeros({batch}, 1, dtype=torch.long)
timed(step)  # warm-up
seconds = [timed(step)[1] for _ in range(3)]
print({batch} * ({new} - 1) / statistics.median(seconds))"""
FLAG_SETS = {"no flags": ("auto", "auto", False), "compile=true": ("auto", "auto", True),
             "compile=true quantize=int8 dtype=bfloat16": ("bfloat16", "int8", True)}
MAIN_SHAPE = KV_SHAPES["the main job's 4/4/128"]
FLAG_ROWS = {  # name: (model shape, batch, new tokens per row)
    "char 6/6/384, block 256": (dict(KV_SHAPES["the char model's 6/6/384"], block_size=256), 1, 250),
    "main job 4/4/128 RoPE, block 64 (refills)": (dict(MAIN_SHAPE, block_size=64), 1, 250),
    "main job's model, block 1024": (dict(MAIN_SHAPE, block_size=1024), 1, 1000),
    "main job's model, block 1024, batch 64": (dict(MAIN_SHAPE, block_size=1024), 64, 100)}


def flag_sets(codes: dict, rounds: int = 3) -> None:
    """generate.py's three speed settings (no flags, compile=true, and the fastest flags), decode
    tokens/s of a greedy sample after its warm-up (median of 3 in a process), random weights, each
    row a fresh process per checkout of `codes` ({name: checkout}), interleaved rounds, medians."""
    print(f"\n### Decode by generate.py's flags: tokens/s after the warm-up, {torch.get_num_threads()} "
          f"threads, median of {rounds} interleaved rounds, each a fresh process; the model from "
          f"{', '.join(f'{k}: {v}' for k, v in codes.items())}\n")
    versus = " | after / before" if len(codes) == 2 else ""
    print("| shape | batch x new tokens | flags | " + " | ".join(codes) + versus + " |\n|"
          + " --- |" * (3 + len(codes) + bool(versus)))
    for row, (shape, batch, new) in FLAG_ROWS.items():
        for flags, (dtype, quantize, compiled) in FLAG_SETS.items():
            median = list(interleaved_medians({code: FLAG_STEPS.format(
                code=checkout, shape=shape, dtype=dtype, quantize=quantize, compiled=compiled, batch=batch,
                new=new) for code, checkout in codes.items()}, rounds).values())
            ratio = f" | {median[1] / median[0]:.2f}x" if versus else ""
            print(f"| {row} | {batch} x {new} | {flags} | " + " | ".join(f"{m:,.0f}" for m in median)
                  + ratio + " |")


LONG_PROMPT = """import resource, time, torch
from model import GPT, GPTConfig, Sampling, generate
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, pos_emb="rope",
                      attn_window={window})).eval()
prompt = torch.randint(0, 65, (1, {length}))
t0 = time.perf_counter()
generate(model, prompt, {new}, temperature=0, kv_cache={kv_cache})
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"""


def long_prompt(length: int = 30_000, new: int = 5) -> None:
    print(f"\n### A {length:,}-token prompt, {new} new tokens: the CPU main job's shape (4/4/128, RoPE, "
          f"block 64), random weights, {torch.get_num_threads()} threads, each row a fresh process\n")
    print("| attention | kv cache | seconds | peak memory (max RSS) GB |\n| --- | --- | --- | --- |")
    for name, window in (("full (crops to the block)", None), ("window 16 (receptive field 61)", 16)):
        for kv_cache in (True, False):
            code = LONG_PROMPT.format(window=window, length=length, new=new, kv_cache=kv_cache)
            seconds, peak = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                                           text=True, check=True).stdout.split()
            print(f"| {name} | {'on' if kv_cache else 'off'} | {float(seconds):.2f} | "
                  f"{int(peak) / 1e9:.2f} |")


VARIANT_STEPS = """import sys, time, torch
sys.path.insert(0, {code!r})
from torch.nn.attention import sdpa_kernel
from model import GPT, GPTConfig
try:  # where a checkout keeps it: model/generation.py before the timing helpers left it
    from model.timing import decode_tokens_per_s
except ImportError:
    from model.generation import decode_tokens_per_s
try:  # where a checkout keeps it: model/generation.py before it was split by concern
    from model.generation import decode_backends
except ImportError:
    from model.decode_step import decode_backends
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, pos_emb="rope",
                      **{fields!r})).eval()
for batch in (1, 16):
    eager = decode_tokens_per_s(model, batch, 1024, steps=4)
    cache = model.new_kv_cache(batch)
    for t in cache.buffers:
        t.normal_()
    token, last = torch.zeros(batch, 1, dtype=torch.long), torch.tensor([1023])
    pad = torch.zeros(batch, dtype=torch.long)
    step = lambda: model.logits_at(token, last, cache, pad)
    with torch.no_grad(), sdpa_kernel(decode_backends(token.device), set_priority=True):
        step(), step()  # warm-up
        t0 = time.perf_counter()
        for _ in range(4):
            step()
    print(eager, batch * 4 / (time.perf_counter() - t0))"""
STEP_VARIANTS = {"MHA": {}, "GQA": {"n_kv_head": 4}, "MQA": {"n_kv_head": 1},
                 "MLA": {"mla_latent_dim": 256, "mla_rope_dim": 32}}


def variant_steps(code: str) -> None:
    print(f"\n### The one-token step by attention variant: GPT-2 small width, RoPE, 1024 cached positions, "
          f"{torch.get_num_threads()} threads, the model from {code}; tokens/s\n")
    print("| variant | eager, batch 1 | every cell masked, batch 1 | eager, batch 16 | every cell masked, "
          "batch 16 |\n| --- | --- | --- | --- | --- |")
    for name, fields in STEP_VARIANTS.items():
        out = subprocess.run([sys.executable, "-c", VARIANT_STEPS.format(code=code, fields=fields)], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
        print(f"| {name} | " + " | ".join(f"{float(v):,.1f}" for v in out) + " |")


PARTS = ("step", "sampling", "refill", "prefill")  # what `anatomy` times, in a stream's own functions


@contextlib.contextmanager
def parts_timed(spent: dict, model):
    """While inside, the seconds a stream of `model` spends in each of PARTS add up in `spent`: the
    one-token step (the compiled step's call, or the model's forward), `sample_next`, `make_room`
    (a refill, its forward passes included) and `prefill` (the prompt's). The functions are wrapped
    where `stream` looks them up, and put back on leaving."""
    inside = []  # the part running now: a forward inside a refill or a prefill is that part's

    def timed(part, f):
        def run(*args, **kwargs):
            if inside:
                return f(*args, **kwargs)
            inside.append(part)
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t0
                inside.pop()
        return run

    saved = generation.sample_next, generation.make_room, generation.prefill, CompiledDecodeStep.__call__
    generation.sample_next, generation.make_room, generation.prefill = (
        timed(part, f) for part, f in zip(PARTS[1:], saved))
    CompiledDecodeStep.__call__ = timed("step", saved[3])
    model.forward = timed("step", model.forward)
    try:
        yield
    finally:
        generation.sample_next, generation.make_room, generation.prefill, CompiledDecodeStep.__call__ = saved
        del model.forward


def anatomy(ckpt: str, new: int, rounds: int = 3) -> None:
    """Where a sampled token's time goes (PARTS, and the rest: `stream` itself), for generate.py's
    three speed settings on the char shape and the main job's model: µs a token, medians of
    `rounds` samples after one that warms up."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, block_size=new + 1, n_layer=6, n_head=6, n_embd=384)
    char = functools.partial(decoding_copy, config, GPT(config).state_dict())
    models = {"char 6/6/384 (random weights)": char,
              "CPU main job": lambda dtype, quantize: load_model(ckpt, "cpu", Precision(dtype, quantize))[0]}
    print(f"\n### Where a token's time goes: batch 1, {new}-token samples (temperature 0.8, top_k 200), "
          f"{torch.get_num_threads()} threads; µs a token, medians of {rounds} samples\n")
    print("| model | flags | tokens/s | step | sampling | refill | prompt prefill | the rest (stream) |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model_name, load in models.items():
        for name in ("default (no flags)", "default + compile=true",
                     "fastest flags: compile=true quantize=int8 dtype=bfloat16"):
            dtype, quantize, compiled = PRECISIONS[name]
            model = load(dtype, quantize)
            step = CompiledDecodeStep(model) if compiled else None
            runs = []
            for _ in range(rounds + 1):
                spent = dict.fromkeys(PARTS, 0.0)
                with parts_timed(spent, model):
                    total = sample_seconds(model, torch.zeros(1, 1, dtype=torch.long), new, step)
                runs.append({**spent, "rest": total - sum(spent.values()), "total": total})
            med = {k: statistics.median(r[k] for r in runs[1:]) * 1e6 / new for k in runs[0]}
            print(f"| {model_name} | {name.split(': ')[-1]} | {1e6 / med['total']:,.0f} | "
                  + " | ".join(f"{med[k]:,.0f}" for k in (*PARTS, "rest")) + " |")


def many_samples(samples: int = 8, prompt: int = 200, new: int = 50, rounds: int = 5) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)).eval()
    idx = torch.randint(0, 65, (1, prompt)).expand(samples, prompt)   # (samples, prompt): one prompt
    print(f"\n### num_samples={samples} of one {prompt}-token prompt, {new} new tokens each: the 6/6/384 "
          f"char shape, float32, eager, {torch.get_num_threads()} threads; median of {rounds} interleaved "
          f"rounds\n")
    print("| prefill | time to first token, ms | decode tokens/s (all rows) |\n| --- | --- | --- |")
    times = {share: [] for share in (False, True)}
    for _ in range(rounds + 1):  # the first round warms up
        for share in times:
            times[share].append(timed_stream(model, idx, new, Decoding(share_prefix=share)))
    for share, runs in times.items():
        first, rest = (sorted(t[i] for t in runs[1:])[rounds // 2] for i in (0, 1))
        name = "once, copied into the rows (after)" if share else f"every row, {samples} x (before)"
        print(f"| {name} | {first * 1e3:,.1f} | {samples * (new - 1) / rest:,.0f} |")


def norm_cost(model, rounds: int = 100) -> None:
    """`--sections norm` on `model` (decoding on the CPU): paired rounds, each timing the eager step
    (`decode_tokens_per_s` at batch 1, at the end of a full block) of the model and of
    `fused_norm_stand_in`'s copy, one after the other, the order swapped every round; the medians and
    the ratio's quartiles."""
    norms = sum(isinstance(m, nn.RMSNorm) for m in model.modules())
    if not norms:
        print("\n### What RMSNorm costs: this model has no RMSNorm (norm=layernorm)")
        return
    steps = model.config.block_size // 2
    models = {"nn.RMSNorm, as the model runs": model,
              "one fused kernel in its place": fused_norm_stand_in(model)}
    times = {name: [] for name in models}
    for r in range(rounds + 1):  # the first round warms up
        for name in list(models)[::1 if r % 2 else -1]:
            times[name].append(1e6 / decode_tokens_per_s(models[name], 1, 2 * steps, steps=steps))
    rms, fused = (t[1:] for t in times.values())
    ratios = [a / b for a, b in zip(rms, fused)]
    low, mid, high = statistics.quantiles(ratios, n=4)
    print(f"\n### What RMSNorm costs the eager step: {norms} calls a token, batch 1, {2 * steps} cached "
          f"positions, {torch.get_num_threads()} threads; medians of {rounds} paired rounds of {steps} "
          f"steps\n")
    print("| norm | µs a step |\n| --- | --- |")
    for name, t in zip(models, (rms, fused)):
        print(f"| {name} | {statistics.median(t):,.0f} |")
    print(f"\nRMSNorm's step / the fused stand-in's: **{mid:.3f}x** (quartiles {low:.3f}–{high:.3f})")


def fused_norm_stand_in(model):
    """A copy of `model` with each nn.RMSNorm replaced by an nn.LayerNorm of the same width, eps and
    weight (no bias): one fused CPU kernel a call, the cost a fused RMSNorm would have (LayerNorm also
    subtracts the mean: not RMSNorm's numbers, only its price)."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.RMSNorm):
                stand_in = nn.LayerNorm(child.normalized_shape, eps=child.eps, bias=False)
                stand_in.weight = child.weight
                setattr(parent, name, stand_in)
    return model


REAL_FOLDER = "tests/.models/SmolLM2-135M-Instruct"  # as `python tests/real_model.py` fetches it
# A question whose greedy answer runs past 200 tokens: SmolLM2-135M answers "What is the capital of
# France?" in 7, and every token after its end of turn would be the model talking to itself.
REAL_PROMPT = ("<|im_start|>user\nExplain how a refrigerator keeps food cold.<|im_end|>\n"
               "<|im_start|>assistant\n")
REAL_NEW = 200
REAL_ROWS = {  # generate.py's flags: (dtype, quantize, kv_dtype, compile)
    "dtype=float32 (the model's own, exact)": ("float32", None, None, False),
    "dtype=float32 compile=true": ("float32", None, None, True),
    "dtype=bfloat16": ("bfloat16", None, None, False),
    "no flags (auto)": ("auto", "auto", None, False),
    "compile=true quantize=int8 dtype=bfloat16": ("bfloat16", "int8", None, True),
    "compile=true quantize=int8 dtype=bfloat16 kv_dtype=int8": ("bfloat16", "int8", "int8", True),
}
HF_ROW, EXACT_ROW = "transformers generate (float32, its cache)", next(iter(REAL_ROWS))
PRODUCTS_ROW = "float32's matrix products alone (the eager step's, nothing else)"


class FirstTokenClock:
    """A streamer for transformers' generate (put, end): the time it hands over its first new token
    (the prompt comes first)."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self):
        pass


def hf_greedy(hf, prompt, new: int) -> tuple[float, int, list]:
    """(seconds from the first new token to the last, tokens in them, the new tokens) of one greedy
    `generate`."""
    clock = FirstTokenClock()
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                      use_cache=True, streamer=clock)
    return time.perf_counter() - clock.first, new - 1, out[0, prompt.size(1):].tolist()


def greedy(model, prompt, new: int, step=None, kv_dtype=None) -> tuple[float, int, list]:
    """hf_greedy's numbers for one greedy `stream` of ours (the cache in kv_dtype, or `step`'s)."""
    decoding = Decoding(kv_dtype=None if step else kv_dtype, decode_step=step)
    tokens = stream(model, prompt, Sampling(new, temperature=0), decoding)
    drawn = [next(tokens)]                                               # (1,) each
    t0 = time.perf_counter()
    drawn.extend(tokens)
    return time.perf_counter() - t0, new - 1, torch.cat(drawn).tolist()


@torch.inference_mode()
def products_only(model, tokens: int = 20) -> tuple[float, int, None]:
    """The seconds `tokens` one-token steps spend in their matrix products alone: each nn.Linear's
    weight times one row (F.linear, as the eager step calls it), nothing between them."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    rows = {w.size(1): torch.randn(1, w.size(1), dtype=w.dtype) for w in weights}  # (1, in)
    t0 = time.perf_counter()
    for _ in range(tokens):
        for w in weights:
            nn.functional.linear(rows[w.size(1)], w)
    return time.perf_counter() - t0, tokens, None


def bytes_a_token(model, kv_dtype=None, cells: float = 0) -> float:
    """Bytes one decoded token reads: every weight once (parameters and buffers: int8 weights and
    their scales; a tied output layer once, with the embedding; an untied embedding table is one row
    a token, left out) and `cells` positions of the KV cache stored in kv_dtype."""
    head = getattr(model.lm_head, "weight", None)
    weights = {id(t): t for t in (*model.parameters(), *model.buffers())
               if t is not model.wte.weight or t is head}
    kv = model.new_kv_cache(1, 2, kv_dtype).bytes_per_token              # K and V, every layer, scales too
    return sum(t.nbytes for t in weights.values()) + cells * kv


def real_rows(folder: str, prompt, new: int) -> tuple[dict, dict, dict]:
    """({row: a function timing one greedy sample (hf_greedy's numbers)}, {row: bytes a token reads
    at the decode's mean position}, {row: seconds its compiled step took to build}): transformers,
    REAL_ROWS (each precision loaded once) and PRODUCTS_ROW."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # all 200 tokens, as ours (which never stops early)
    exact = load_model(folder, "cpu", Precision("float32", None))[0]
    models, cells = {("float32", None): exact}, prompt.size(1) + new / 2  # the mean step reads that many
    rows = {HF_ROW: functools.partial(hf_greedy, hf, prompt, new)}
    read = {HF_ROW: bytes_a_token(exact, None, cells)}
    built = {}
    for name, (dtype, quantize, kv_dtype, compiled) in REAL_ROWS.items():
        key = Precision(dtype, quantize).on(torch.device("cpu"), exact.num_params())  # auto: what it means
        if key not in models:
            models[key] = load_model(folder, "cpu", Precision(*key))[0]
        model, step, t0 = models[key], None, time.perf_counter()
        if compiled:  # as generate.py builds it: the cache holds the prompt and the new tokens
            step = CompiledDecodeStep(model, 1, kv_dtype, "inductor", max_len=prompt.size(1) + new)
            built[name] = time.perf_counter() - t0
        rows[name] = functools.partial(greedy, model, prompt, new, step, kv_dtype)
        read[name] = bytes_a_token(model, kv_dtype, cells)
    rows[PRODUCTS_ROW], read[PRODUCTS_ROW] = functools.partial(products_only, exact), bytes_a_token(exact)
    return rows, read, built


def kept(answer, reference) -> int:
    """How many tokens of `answer` equal `reference`'s before the first that differs."""
    same = [a == b for a, b in zip(answer, reference)]
    return same.index(False) if False in same else len(same)


def timed(f) -> float:
    """The seconds f() takes."""
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def real_model(folder: str, rounds: int = 5) -> None:
    """`--sections real`: `rounds` rounds of one greedy sample of every row of `real_rows`, in the
    opposite order every other round (each `collected_first`; the compiled steps ran when built, and a
    slow first round is one of the medians' five), with 3 timings of the read bandwidth after each
    round; medians, each ratio the median of its rounds'."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = torch.tensor([tokenizer.encode(REAL_PROMPT)])               # (1, T)
    rows, read, built = real_rows(folder, prompt, REAL_NEW)
    big = torch.ones(2**28)  # 1 GiB of float32, 4x this Xeon's L3: its sum reads memory
    times, answers, reads = {name: [] for name in rows}, {}, []
    for r in range(rounds):
        for name in list(rows)[::-1 if r % 2 else 1]:
            seconds, tokens, answers[name] = collected_first(rows[name])
            times[name].append(seconds / tokens)
        reads += [timed(big.sum) for _ in range(3)]
    bandwidth = big.nbytes / statistics.median(reads)
    print(f"\n### {Path(folder).name} ({folder}): a {prompt.size(1)}-token chat prompt, {REAL_NEW} greedy "
          f"new tokens, batch 1, CPU, {torch.get_num_threads()} threads; tokens/s from the first new token "
          f"to the last, median of {rounds} interleaved rounds in one process\n")
    print("| decode | tokens/s | vs transformers | MB a token reads | MBU | tokens kept of the float32 "
          "answer |\n| --- | --- | --- | --- | --- | --- |")
    for name, t in times.items():
        per_token = statistics.median(t)
        ratio = statistics.median(h / o for h, o in zip(times[HF_ROW], t))
        same = "" if answers[name] is None else kept(answers[name], answers[EXACT_ROW])
        print(f"| {name} | {1 / per_token:,.1f} | {ratio:.2f}x | {read[name] / 1e6:,.0f} | "
              f"{read[name] / per_token / bandwidth:.0%} | {same} |")
    exact, products = (statistics.median(times[name]) for name in (EXACT_ROW, PRODUCTS_ROW))
    mb = read[EXACT_ROW] / 1e6
    print(f"\nRead bandwidth **{bandwidth / 1e9:.1f} GB/s**: the median of {len(reads)} timings of "
          f"`big.sum()` over a 1 GiB float32 tensor, 3 after each round. MB a token reads: every weight once "
          f"(a tied output layer once) and the KV cache at the decode's mean position, "
          f"{prompt.size(1) + REAL_NEW // 2}; MBU: those bytes a second over the bandwidth. At it float32's "
          f"{mb:,.0f} MB take {mb / bandwidth * 1e9:.1f} ms a token ({bandwidth / 1e6 / mb:.1f} tokens/s at "
          f"most); its eager token took {exact * 1e3:.1f} ms, its matrix products alone {products * 1e3:.1f} "
          f"({products / exact:.0%}). Compiled steps built in "
          + ", ".join(f"{seconds:.1f} s ({name})" for name, seconds in built.items())
          + f". Transformers' answer keeps {kept(answers[HF_ROW], answers[EXACT_ROW])} tokens of ours, "
          f"which begins {tokenizer.decode(answers[EXACT_ROW][:24])!r}")


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", help="a run of the CPU main job (default: the latest run in outputs/)")
    p.add_argument("--new", type=int, default=500, help="new tokens per sample")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    # Absolute: each measured process runs in this checkout, whatever folder the command ran in.
    absolute = lambda path: str(Path(path).expanduser().resolve())  # noqa: E731
    p.add_argument("--code", default=str(ROOT), type=absolute,
                   help="the checkout whose model --sections compile, flags, kv, variants run")
    p.add_argument("--before", type=absolute,
                   help="--sections compile, kv, flags: also this checkout, side by side")
    p.add_argument("--real-ckpt", help=f"--sections real: a Hugging Face folder (default: {REAL_FOLDER})")
    sections = ["char", "main", "anatomy", "compile", "threads", "flags", "kv", "long", "variants", "samples",
                "norm", "real"]
    p.add_argument("--sections", nargs="+", choices=sections, default=sections)
    args = p.parse_args()
    exit_on_user_error(run, args)


def check_args(args) -> None:
    """Every option, before any section runs: a count in range, a checkpoint that is there, and
    --code and --before checkouts of this project (each measured process imports `model` from its
    own; from a folder without one it would import this checkout's, under the other's name)."""
    check_integer(args.new, "--new", 1, MAX_NEW)
    check_integer(args.threads, "--threads", 0, os.cpu_count() or 1)
    if args.ckpt is not None:
        with naming("--ckpt"):
            find(args.ckpt, prefer="best.pt")
    if args.real_ckpt is not None and not (Path(args.real_ckpt) / "config.json").is_file():
        raise FileNotFoundError(f"--real-ckpt {args.real_ckpt} is not a Hugging Face model folder: it has "
                                f"no config.json")
    for option, code in (("--code", args.code), ("--before", args.before)):
        if code is not None and not (Path(code) / "model" / "__init__.py").is_file():
            why = "does not exist" if not Path(code).exists() else "has no model/__init__.py"
            raise FileNotFoundError(f"{option} {code} is not a checkout of this project: it {why}")


def run(args) -> None:
    check_args(args)
    needs_ckpt = {"main", "anatomy", "compile", "threads", "norm"} & set(args.sections)
    with naming("--ckpt", "ckpt"):  # found, and a model transformers' Llama takes, before any section runs
        ckpt = args.ckpt or (str(latest_run("outputs")) if needs_ckpt else None)
    if "main" in args.sections:
        llama_weights(load_model(ckpt, "cpu", Precision("float32", None))[0])  # (a second, not minutes later)
    if args.threads:
        torch.set_num_threads(args.threads)
    if "char" in args.sections:
        char_shape(args.new)
    if "main" in args.sections:
        main_job(ckpt, args.new)  # a non-Llama model: one-line error
    if "anatomy" in args.sections:
        anatomy(ckpt, args.new)
    codes = {"before": args.before, "after": args.code} if args.before else {"this": args.code}
    if "compile" in args.sections:
        compile_cost(ckpt, args.new, codes)
    if "threads" in args.sections:
        threads(ckpt, args.new)
    if "flags" in args.sections:
        flag_sets(codes)
    if "kv" in args.sections:
        cache_precisions(codes)
    if "long" in args.sections:
        long_prompt()
    if "variants" in args.sections:
        variant_steps(args.code)
    if "samples" in args.sections:
        many_samples()
    if "norm" in args.sections:
        norm_cost(load_model(ckpt, "cpu")[0])
    if "real" in args.sections:
        real = args.real_ckpt or str(ROOT / REAL_FOLDER)
        if Path(real).is_dir():
            real_model(real)
        else:  # (the default folder only: a --real-ckpt that is not there was refused before any section)
            print(f"\n### A real model: skipped, {real} is not there (python tests/real_model.py fetches it)")


if __name__ == "__main__":
    main()
