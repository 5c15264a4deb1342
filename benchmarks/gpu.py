"""The GPU measurements, in sections that each fit one command of a GPU rental (10 minutes at most),
every result written to --out the moment it is measured. The plan (the commands in order, with their
estimates) is in benchmarks/README.md, "Measuring on a rented GPU".

    python benchmarks/gpu.py --section probe                  # what the machine has, and what we get
    python benchmarks/gpu.py --section train --levers speed   # a group of levers, names, or overrides
    python benchmarks/gpu.py --smoke                          # every section at toy sizes on the CPU

probe      versions (PyTorch, CUDA, cuDNN, the GPU and the peak its name gives), the measured ceilings
           (bf16 matrix product, device copy), whether torch.compile and CUDA graphs work, the SDPA
           kernel of every attention call of a training step and of the decode step, per variant,
           and whether the prepared corpus is found without importing `datasets`.
train      one `python train.py` run per lever, the GPU recipe then one change at a time, saving no
           checkpoints: wall time to val <= 1.4697 (nanoGPT's), the training steps' share of it
           (the rest is compiling and evaluating), tokens/s, MFU, the whole val split's loss.
optimizer  one step of AdamW (fused, for-each) and of Muon (PyTorch's, ours batched by shape) on
           the recipe's model.
decode     batch-1 decode of the char model (6/6/384) and GPT-2 124M's shape (random weights): our
           compiled step (a CUDA graph over the static cache) against our eager step and
           transformers' generate with its static cache, and the compiled step with the naive
           backend's attention; tokens equal to the eager and uncached paths; the CUDA graphs
           launched per token (counted by the profiler).
variants   MHA, GQA, MQA and MLA at GPT-2 small width, block 1024: the one-token step at a full
           cache at batch 1, 16, 64 and 256 (replayed as a CUDA graph): tokens/s, peak memory and
           the SDPA kernel, plotted.
inductor   the compiled decode step built under sets of inductor's options (`--levers`, one set a
           process): batch-1 tokens/s, build time, GPU busy time, kernels a token and the greedy
           tokens of each decode shape, and the batch-256 split-KV step of MQA and MHA.
profile    where a step's time goes: wall time against the GPU's busy time (the kernels' summed
           time, from the profiler) for the recipe's compiled training step and batch-1 decoding;
           each profile's top operations in profile_*.txt.

Each measurement is one row of --out/results.jsonl, appended and flushed when it ends (a command
stopped by its time limit keeps every row it finished), and tables.md is rewritten from the rows.
A measurement that fails is a row with its one-line error, and the next one runs. --smoke runs the
same code at toy sizes on the CPU, so the script is known to work before a GPU runs it; its numbers
mean nothing.
"""

import contextlib
import copy
import faulthandler
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the GPU machine runs it from a checkout, not an install

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from cli.errors import ArgumentParser  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.checkpoint import write_atomically  # noqa: E402
from model.decode_step import CompiledDecodeStep, decode_backends  # noqa: E402
from model.device import Precision, synchronized_clock  # noqa: E402
from model.generation import generate  # noqa: E402
from model.kernels import SplitKV  # noqa: E402
from model.loading import for_decoding  # noqa: E402
from training.evaluation import target_windows  # noqa: E402
from training.optimizer import BatchedMuon, configure_optimizer  # noqa: E402
from training.run_dir import append_line  # noqa: E402
from training.throughput import peak_tflops  # noqa: E402

TARGET = 1.4697  # nanoGPT's val loss with its GPU recipe (5000 iterations; ~3 minutes on an A100)
RECIPE = ["experiment=shakespeare_char_gpu", "train.checkpoints=false"]  # timing runs: no checkpoint writes
LEVERS = {  # name: the overrides that change one thing from the recipe
    "recipe": [],
    "float32, no bf16 autocast": ["train.dtype=float32"],
    "compiled (torch.compile)": ["train.compile=true"],
    "no CUDA graph": ["train.cuda_graph=false"],
    "math attention, no flash SDPA": ["model.attn_backend=naive"],
    "corpus in host memory": ["data.on_device=false"],
    "nanoGPT's evaluation (200 batches every 250 steps)": ["train.eval_iters=200"],
    "learned positions, no RoPE": ["model.pos_emb=learned"],
    "RMSNorm": ["model.norm=rmsnorm"],
    "SwiGLU": ["model.mlp=swiglu"],
    "QK-norm": ["model.qk_norm=true"],
    "lr 1e-3 (nanoGPT's)": ["train.lr=1e-3"],
    "batch 128, 1000 iterations": ["train.batch_size=128", "train.max_iters=1000", "train.eval_interval=125"],
    "dropout 0.1": ["model.dropout=0.1"],
    "Muon": ["train.optimizer=muon"],
}
LEVER_GROUPS = {  # the plan runs speed in one command, model and tuning in another; together every lever
    "speed": ["recipe", "float32, no bf16 autocast", "compiled (torch.compile)", "no CUDA graph",
              "math attention, no flash SDPA", "corpus in host memory",
              "nanoGPT's evaluation (200 batches every 250 steps)"],
    "model": ["learned positions, no RoPE", "RMSNorm", "SwiGLU", "QK-norm"],
    "tuning": ["lr 1e-3 (nanoGPT's)", "batch 128, 1000 iterations", "dropout 0.1", "Muon"],
}
SMOKE_LEVERS = ["recipe", "math attention, no flash SDPA"]
SMOKE_MODEL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32"]
SMOKE_TRAIN = [*SMOKE_MODEL, "train.device=cpu", "train.batch_size=4", "train.max_iters=8",
               "train.eval_interval=4", "train.eval_iters=2", "train.log_interval=2", "train.sample_tokens=0",
               "train.full_val=false"]
DECODE_SHAPES = {  # name: (vocab, block, n_layer, n_head, n_embd)
    "char 6/6/384": (65, 256, 6, 6, 384),
    "GPT-2 124M": (50257, 1024, 12, 12, 768),
}
VARIANTS = {  # at GPT-2 small width (12 heads of 64): K/V heads, or MLA's latent and RoPE key widths
    "MHA": {"n_kv_head": 12},
    "GQA": {"n_kv_head": 4},
    "MQA": {"n_kv_head": 1},
    "MLA": {"mla_latent_dim": 256, "mla_rope_dim": 32},  # DeepSeek-V2's 4x and 0.5x the head width
}
BATCHES = [1, 16, 64, 256]
SECTIONS = ["probe", "train", "optimizer", "decode", "variants", "inductor", "profile", "coldstart",
            "exactness"]


# ----------------------------------------------------------------------------- results, as they come

class Results:
    """--out/results.jsonl, one row per measurement appended and synced as it ends (whole or not at
    all), and tables.md rewritten atomically from the rows after each (so what a killed command
    measured is on disk)."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.path = out, out / "results.jsonl"

    def add(self, row: dict) -> dict:
        append_line(self.path, json.dumps(row), sync=True)
        tables = render_tables(self.rows()).encode()
        write_atomically(self.out / "tables.md", lambda f: f.write(tables), "tables")
        return row

    def rows(self, section: str | None = None) -> list[dict]:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line cut short when a process was killed writing it
                continue
        return [r for r in rows if section in (None, r["section"])]


def measure(results: Results, section: str, name: str, fn) -> dict:
    """fn() -> a dict of numbers, recorded as one row; an exception is recorded as a failed row
    with its one-line reason (the traceback goes to stderr) and the plan goes on."""
    print(f"=== {section}: {name}", flush=True)
    t0 = time.perf_counter()
    try:
        row = {"section": section, "name": name, **fn()}
    except (Exception, SystemExit) as e:  # noqa: BLE001  one failed measurement never ends the others
        traceback.print_exc()
        reason = (str(e).strip().splitlines() or [""])[0]
        row = {"section": section, "name": name, "error": f"{type(e).__name__}: {reason}"[:300]}
        print(f"FAILED {section}: {name}: {row['error']}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return results.add(row)


def render_tables(rows: list[dict]) -> str:
    """Markdown: the probe's rows as lists, every other section as a table of its rows' keys."""
    text = []
    for section in dict.fromkeys(r["section"] for r in rows):
        mine = [r for r in rows if r["section"] == section]
        text.append(f"### {section}\n")
        if section == "probe":
            text += [f"- **{r['name']}**: " + ", ".join(f"{k} {cell(v)}" for k, v in r.items()
                                                        if k not in ("section", "name")) for r in mine]
        else:
            keys = list(dict.fromkeys(k for r in mine for k in r if k != "section"))
            text += ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
            text += ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in mine]
        text.append("")
    return "\n".join(text)


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)


# ----------------------------------------------------------------------------- what SDPA runs

class SDPACalls(TorchFunctionMode):
    """Inside it, every F.scaled_dot_product_attention call is made as usual and recorded in
    `made` as (q, k, v, keyword arguments), with `kernels` the SDPA kernel PyTorch picks for it
    under the sdpa_kernel settings in force (torch._fused_sdp_choice: what the call runs)."""

    def __init__(self):
        super().__init__()
        self.made, self.kernels = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            self.made.append((q, k, v, kwargs))
            self.kernels.append(sdpa_kernel_name(q, k, v, kwargs))
        return func(*args, **kwargs)


def sdpa_kernel_name(q, k, v, kwargs: dict) -> str:
    """The SDPA kernel (flash, efficient, cudnn, math) PyTorch picks for this call, now."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0),
                                         kwargs.get("is_causal", False), scale=kwargs.get("scale"),
                                         enable_gqa=kwargs.get("enable_gqa", False))
    except RuntimeError:  # none of the enabled kernels takes it
        return "none"
    return SDPBackend(choice).name.removesuffix("_ATTENTION").lower()


def decode_step_kernels(model: GPT, batch: int, split_kv: bool = False) -> list[str]:
    """The SDPA kernels of the compiled decode step's attention calls (its inputs, its backend
    priority), one per layer, from an eager run of the same computation; with split_kv, those of
    the calls split-KV attention leaves to SDPA (none where it takes them all)."""
    device = model.wte.weight.device
    cache = model.new_kv_cache(batch)
    cache.advance(cache.max_len // 2)
    token, pad = torch.zeros(batch, 1, dtype=torch.long, device=device), torch.zeros(batch, dtype=torch.long,
                                                                                       device=device)
    priority = sdpa_kernel(decode_backends(device), set_priority=True)
    with torch.no_grad(), SDPACalls() as calls, priority, SplitKV() if split_kv else contextlib.nullcontext():
        model.logits_at(token, torch.tensor([cache.length], device=device), cache, pad)
    return calls.kernels


def training_kernels(model: GPT, batch: int) -> list[str]:
    """The SDPA kernels of a training forward (T = block_size), one per layer."""
    device = model.wte.weight.device
    idx = torch.zeros(batch, model.config.block_size, dtype=torch.long, device=device)
    with torch.no_grad(), SDPACalls() as calls:
        model(idx)
    return calls.kernels


def kernels_text(kernels: list[str]) -> str:
    """['efficient', 'efficient'] -> 'efficient x2'."""
    return ", ".join(f"{k} x{kernels.count(k)}" for k in dict.fromkeys(kernels)) or "no SDPA call"


# ----------------------------------------------------------------------------- probe

def probe_section(results: Results, device: torch.device, smoke: bool) -> None:
    measure(results, "probe", "versions", lambda: versions(device))
    measure(results, "probe", "ceilings", lambda: ceilings(device, smoke))
    measure(results, "probe", "prepared corpus", prepared_corpus)
    measure(results, "probe", "torch.compile", lambda: compile_works(device, smoke))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for name, fields in VARIANTS.items():
        model = lambda fields=fields, block=1024: variant_model(fields, device, dtype, smoke, block)
        measure(results, "probe", f"SDPA kernels, {name}", lambda model=model: {
            "training step": kernels_text(training_kernels(model(block=256), 2)),
            **{f"decode step, batch {b}": kernels_text(decode_step_kernels(model(), b)) for b in (1, 64)}})


def versions(device: torch.device) -> dict:
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    row = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props, name = torch.cuda.get_device_properties(device), torch.cuda.get_device_name(device)
        row |= {"CUDA": torch.version.cuda, "cuDNN": torch.backends.cudnn.version(), "GPU": name,
                "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
                "SMs": props.multi_processor_count, "memory GB": round(props.total_memory / 1e9, 1),
                "peak bf16 TFLOP/s (from its name)": peak_tflops(name)}
    # `datasets` is looked for, never imported: the plan's runs must not need it.
    packages = ("triton", "transformers", "tiktoken", "matplotlib", "pytest", "hydra-core", "omegaconf",
                "datasets")
    return row | {p: version(p) for p in packages}


def ceilings(device: torch.device, smoke: bool) -> dict:
    """The two ceilings: a large bf16 matrix product (TFLOP/s) and a device copy (GB/s, bytes read
    plus written), each the mean of 10 after 3 warm-ups, on random data."""
    n, size = (256, 2**20) if smoke else (8192, 2**30)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    src = torch.randn(size // 4, device=device)
    dst = torch.empty_like(src)
    return {"matmul TFLOP/s": 2 * n**3 / timed_ms(lambda: a @ b, device, 10) / 1e9,
            "copy GB/s": 2 * size / timed_ms(lambda: dst.copy_(src), device, 10) / 1e6}


def prepared_corpus() -> dict:
    """The char corpus's prepared folder (data.cache_dir: KVGPT_CACHE), and whether finding it
    imported `datasets` (it must not: the GPU machine has none)."""
    from cli.configs import composed_jobs, config_object
    from data.prepare import prepare

    [(cfg, _)] = composed_jobs(ROOT / "configs", "prepare", ["data=shakespeare_char"])  # the recipe's data
    data_cfg = config_object(cfg.data, "data.")
    found = any(Path(os.path.expanduser(data_cfg.cache_dir)).glob("shakespeare-char-*/meta.json"))
    folder = prepare(data_cfg)
    imported = sys.modules.get("datasets") is not None  # (None: made unimportable, as in the suite)
    return {"cache": str(folder), "was prepared": found, "datasets imported": imported}


def compile_works(device: torch.device, smoke: bool) -> dict:
    """torch.compile of a small GPT's training step and of its decode step (CUDA graphs on CUDA):
    seconds each, and the graphs launched per decoded token. A smoke run compiles the training step
    without inductor and leaves the decode step to the decode section (inductor's compiles take
    most of a smoke run's CPU)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64)).to(device)
    idx = torch.randint(0, 65, (4, 64), device=device)
    t0 = time.perf_counter()
    _, loss = torch.compile(model, backend="aot_eager" if smoke else "inductor")(idx, idx)
    loss.backward()
    row = {"training step compiled s": time.perf_counter() - t0}
    if smoke:
        return row
    model.eval()
    t0 = time.perf_counter()
    step = CompiledDecodeStep(model)
    generate(model, idx[:1, :3], 8, temperature=0, decode_step=step)
    return row | {"decode step compiled s": time.perf_counter() - t0,
                  "CUDA graphs launched per token": graph_launches_per_token(model, step)}


def graph_launches_per_token(model: GPT, step: CompiledDecodeStep, new: int = 16) -> float:
    """cudaGraphLaunch calls per token of a generate call with `step`, counted by the profiler:
    about 1 when the step runs as a captured CUDA graph, 0 when it does not."""
    prompt = torch.zeros(1, 1, dtype=torch.long, device=model.wte.weight.device)
    generate(model, prompt, new, temperature=0, decode_step=step)  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        generate(model, prompt, new, temperature=0, decode_step=step)
    return sum(e.name == "cudaGraphLaunch" for e in prof.events()) / (new - 1)


def timed_ms(fn, device: torch.device, repeat: int, warmup: int = 3) -> float:
    """Milliseconds per call of fn, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    clock = synchronized_clock(device)
    t0 = clock()
    for _ in range(repeat):
        fn()
    return 1e3 * (clock() - t0) / repeat


# ----------------------------------------------------------------------------- train

def lever_overrides(names: list[str]) -> dict[str, list[str]]:
    """{lever: overrides} for --levers: group names, lever names, or a lever of your own as
    overrides in one argument ("train.lr=3e-3 model.dropout=0")."""
    levers = {}
    for name in names:
        if name in LEVER_GROUPS:
            levers |= {n: LEVERS[n] for n in LEVER_GROUPS[name]}
        elif name in LEVERS:
            levers[name] = LEVERS[name]
        elif "=" in name:
            levers[name] = name.split()
        else:
            raise SystemExit(f"error: --levers: {name!r} is not a group ({', '.join(LEVER_GROUPS)}), "
                             f"a lever ({', '.join(LEVERS)}) or overrides (key=value)")
    return levers


def train_section(results: Results, levers: dict[str, list[str]], smoke: bool) -> None:
    for name, overrides in levers.items():
        argv = [*RECIPE, *overrides, *(SMOKE_TRAIN if smoke else [])]
        measure(results, "train", name, lambda argv=argv: train_lever(argv))


def train_lever(argv: list[str]) -> dict:
    """One training run as `python train.py <argv>` runs it, in this process, in a temporary run dir."""
    from cli.configs import composed_jobs
    from cli.options import check_options
    from training.loop import train  # (imports Hydra, which the other sections do without)
    from training.run_dir import read_metrics

    print(f"python train.py {' '.join(argv)}", flush=True)
    jobs = composed_jobs(ROOT / "configs", "train", argv)
    if not jobs:
        raise ValueError(f"not a train.py command line: {' '.join(argv)}")
    [(cfg, overrides)] = jobs
    if "torch._dynamo" in sys.modules:  # (not imported: nothing was compiled)
        torch.compiler.reset()  # each lever compiles afresh, as its own process would, and none
        # meets dynamo's recompile limit on GPT.forward, which the levers' models would share
    run = check_options(cfg, overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        result = train(run, Path(run_dir) / "run")
        records = read_metrics(Path(run_dir) / "run")
    median = lambda key: statistics.median(r[key] for r in records if key in r) if any(
        key in r for r in records) else None
    tokens_per_s = median("tokens_per_s")
    reached = next((r for r in records if r.get("val_loss", 99) <= TARGET), None)
    steps_s = reached and tokens_per_s and reached["step"] * run.tokens_per_step(1) / tokens_per_s
    return {f"to val {TARGET} s": reached and reached["elapsed_s"], "of it training steps s": steps_s,
            "rest (compile, evaluation) s": steps_s and reached["elapsed_s"] - steps_s,
            "tokens/s": tokens_per_s, "MFU": median("mfu"), "best val (estimate)": result["best_val"],
            "val (whole split)": result["val_loss_full"], "overrides": " ".join(argv[len(RECIPE):])}


# ----------------------------------------------------------------------------- optimizer

def recipe_config(smoke: bool, **fields) -> GPTConfig:
    """The GPU recipe's model shape (6/6/384, block 256, vocab 65), or a toy one with smoke."""
    return GPTConfig(vocab_size=65, block_size=32 if smoke else 256, n_layer=1 if smoke else 6,
                     n_head=2 if smoke else 6, n_embd=32 if smoke else 384, **fields)


def optimizer_section(results: Results, device: torch.device, smoke: bool) -> None:
    """One step over the recipe model's parameters: AdamW fused and for-each; Muon (on the blocks'
    matrices) as PyTorch's (a Newton-Schulz iteration per matrix) and ours (batched by shape)."""
    model = GPT(recipe_config(smoke)).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
    muon = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    optimizers = {"AdamW, fused": lambda: configure_optimizer(model, "adamw", 1e-3, (0.9, 0.99), 0.1),
                  "AdamW, for-each": lambda: configure_optimizer(model, "adamw", 1e-3, (0.9, 0.99), 0.1,
                                                                 fused=False),
                  "Muon, torch.optim.Muon (blocks' matrices)": lambda: torch.optim.Muon(matrices, **muon),
                  "Muon, BatchedMuon (blocks' matrices)": lambda: BatchedMuon(matrices, **muon)}
    for name, make in optimizers.items():
        measure(results, "optimizer", name, lambda make=make: {"step ms": timed_ms(make().step, device, 20)})


# ----------------------------------------------------------------------------- decode

def decode_models(shape: tuple, device: torch.device):
    """transformers' GPT-2 with random weights and ours with the same weights, both on device."""
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, block, n_layer, n_head, n_embd = shape
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=block, n_layer=n_layer, n_head=n_head,
                                    n_embd=n_embd, bos_token_id=0, eos_token_id=0)).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = GPT.from_pretrained(d).eval()
    return hf.to(device), ours.to(device)


def same_tokens(model, step: CompiledDecodeStep, new: int) -> bool:
    """Whether the compiled step, the eager step and no cache give the same tokens, greedy and
    seeded, over several calls with prompts of several lengths."""
    device = model.wte.weight.device
    for kw in ({"temperature": 0}, {"temperature": 1.0, "top_k": 50}):
        for length in (1, 7, 19):
            prompt = torch.arange(1, length + 1, device=device)[None]               # (1, length)
            outs = [generate(model, prompt, new, kv_cache=cache, decode_step=decode_step, **kw,
                             generator=torch.Generator(device).manual_seed(length))
                    for cache, decode_step in ((True, step), (True, None), (False, None))]
            if not all(torch.equal(out, outs[0]) for out in outs[1:]):
                return False
    return True


def decode_row(shape: tuple, device: torch.device, smoke: bool) -> dict:
    """One model shape: each path's batch-1 tokens/s in the decoding dtype, printed as measured: our
    compiled step (split-KV attention, the token drawn inside its CUDA graph), the same with SDPA's
    attention (the step before split-KV), the CUDA-graph step (generate.py's default on CUDA) with
    split-KV attention (compiled, that kernel alone), the eager step, and transformers' static
    cache, which its `generate` compiles on CUDA (counted: dynamo's graphs made during its warm-up).
    Then the compiled step's profile (GPU busy time, kernels and the largest ones per token) and
    whether the paths agree (float32). (A smoke run compiles the step without inductor's code
    generation: most of its CPU time otherwise.)"""
    from torch._dynamo.utils import counters  # (slow to import: only where it is read)

    backend = "aot_eager" if smoke else "inductor"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf, ours = decode_models(shape, device)
    new = 16 if smoke else min(500, shape[1] - 2)
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    hf_bf16, ours_bf16 = copy.deepcopy(hf).to(dtype), decoding(copy.deepcopy(ours), device, dtype)
    steps = {"ours, compiled step": dict(backend=backend),
             "ours, compiled step, SDPA attention": dict(backend=backend, split_kv=False)}
    if device.type == "cuda":
        steps["ours, CUDA-graph step, split-KV compiled"] = dict(backend="cuda_graph", split_kv=True)
    steps["ours, eager step"] = None
    tokens_per_s, row = {}, {}
    for name, kw in steps.items():
        step = None if kw is None else CompiledDecodeStep(ours_bf16, **kw)  # (run once when built)
        sample = lambda step=step: generate(ours_bf16, prompt, new, temperature=0, decode_step=step)  # noqa: E731
        tokens_per_s[name] = new / (timed_ms(sample, device, repeat=2, warmup=1) / 1e3)
        print(f"  {name}: {tokens_per_s[name]:,.0f} tokens/s", flush=True)
        if name == "ours, compiled step":
            row["CUDA graphs launched per token"] = graph_launches_per_token(ours_bf16, step)
            busy_ms, kernels, top = profiled(sample, None, "", device)
            row |= {"GPU busy ms/token": busy_ms / new, "kernels/token": kernels / new,
                    "largest kernels (us a token)": top_text(top, new)}
    graphs = counters["stats"]["unique_graphs"]
    try:  # transformers' own failure (its version there) is this cell's, not the row's
        tokens_per_s["transformers, static cache"] = new / (timed_ms(lambda: hf_bf16.generate(
            prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
            cache_implementation="static"), device, repeat=2) / 1e3)
        ratio = tokens_per_s["ours, compiled step"] / tokens_per_s["transformers, static cache"]
        print(f"  transformers: {tokens_per_s['transformers, static cache']:,.0f} tokens/s", flush=True)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        ratio = f"transformers failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:200]
    row["transformers compiled (dynamo graphs)"] = counters["stats"]["unique_graphs"] - graphs
    # The check runs in float32 (in bf16 the paths round differently, and a random model's near-ties
    # may then break either way), with float32 matmuls, not TF32; the step captured uncompiled on
    # CUDA: the same split-KV attention and in-graph draw as the compiled step, whose own tokens
    # tests/test_gpu.py checks, an inductor compile less per shape.
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    static_step = CompiledDecodeStep(ours, backend="aot_eager" if smoke else "cuda_graph", split_kv=True)
    identical = same_tokens(ours, static_step, 20)
    torch.set_float32_matmul_precision(precision)
    return {**{f"{k} tok/s": v for k, v in tokens_per_s.items()}, "ours / transformers": ratio,
            "same tokens (static step, eager, uncached)": identical, **row, "dtype": str(dtype),
            "new tokens": new}


def decode_section(results: Results, device: torch.device, smoke: bool, shapes: list[str]) -> None:
    for name, shape in ((name, DECODE_SHAPES[name]) for name in shapes):
        measure(results, "decode", name,
                lambda shape=shape: decode_row(decode_shape(shape, smoke), device, smoke))


def decode_shape(shape: tuple, smoke: bool) -> tuple:
    """A DECODE_SHAPES entry, or with smoke a toy one of the same vocabulary (block 64, 2/2/32)."""
    return (shape[0], 64, 2, 2, 32) if smoke else shape


# ----------------------------------------------------------------------------- variants

def variant_model(fields: dict, device, dtype, smoke: bool, block_size: int = 1024,
                  pad_head: bool = True) -> GPT:
    """A GPT-2-small-width model (toy with smoke) with the variant's attention fields, RoPE, made
    ready to decode as generate.py makes it (`decoding`)."""
    width = dict(n_layer=2, n_head=6, n_embd=96, block_size=64) if smoke else \
        dict(n_layer=12, n_head=12, n_embd=768, block_size=block_size)
    fields = {**fields, "n_kv_head": max(1, fields.get("n_kv_head", 12) * width["n_head"] // 12)}
    if smoke and "mla_latent_dim" in fields:
        fields |= {"mla_latent_dim": 32, "mla_rope_dim": 8}
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: seconds less a model on a GPU
        model = GPT(GPTConfig(vocab_size=50257, pos_emb="rope", **width, **fields))
    return decoding(model, device, dtype, pad_head)


def decoding(model: GPT, device: torch.device, dtype: torch.dtype, pad_head: bool = True) -> GPT:
    """The model in `dtype` as for_decoding makes it (on CUDA its head's rows padded to a multiple of
    64), or with pad_head=False the same but the head as trained (the lever's control)."""
    if not pad_head:
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return for_decoding(model, device, Precision(str(dtype).removeprefix("torch."), None))


def variant_row(fields: dict, batch: int, device: torch.device, smoke: bool, split_kv: bool,
                copy_gbs: float, backend: str = "cuda_graph", pad_head: bool = True) -> dict:
    """tokens/s and peak memory of the one-token step at the last cell of a full cache (filled
    with random values: a prefill would cost far more than the measurement), which reads every
    cell as the compiled step does, its attention split-KV (split_kv) or SDPA's. On CUDA it is the
    CompiledDecodeStep of `backend`: the eager step captured as a CUDA graph (no compile of the
    step: 32 of them would take minutes; split-KV's kernel is compiled, once per shape), or
    inductor's, and its graph replayed; on the CPU it runs eagerly. Against the floor: the time its
    weights and cache take to read once at copy_gbs (a device copy's rate)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    held_before = 0
    if device.type == "cuda":  # the earlier rows' models, caches and graphs freed first: on the first
        gc.collect()           # H200 run, without this, each variant's peak carried ~0.1 GB of the last's
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        held_before = torch.cuda.memory_allocated(device)
    model = variant_model(fields, device, dtype, smoke, pad_head=pad_head)
    if device.type == "cuda":
        decode = CompiledDecodeStep(model, batch, backend=backend, split_kv=split_kv)
        cache, step = decode.cache, decode.graph.replay
        decode.input_pos.fill_(cache.max_len - 1)
    else:
        cache = model.new_kv_cache(batch)
        token = torch.zeros(batch, 1, dtype=torch.long)
        pad, input_pos = torch.zeros(batch, dtype=torch.long), torch.tensor([cache.max_len - 1])
        split = SplitKV() if split_kv else contextlib.nullcontext()

        def step():
            with torch.no_grad(), sdpa_kernel(decode_backends(device), set_priority=True), split:
                return model.logits_at(token, input_pos, cache, pad)
    for t in cache.buffers:
        t.normal_()
    steps = 4 if smoke else 32
    ms = timed_ms(lambda: [step() for _ in range(steps)], device, repeat=2) / steps
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        cache.nbytes + sum(p.nbytes for p in model.parameters())
    floor_ms = (cache.nbytes + sum(p.nbytes for p in model.parameters())) / (copy_gbs * 1e6)
    _, _, top = profiled(step, None, "", device)
    return {"tokens/s": batch / (ms / 1e3), "step ms": ms, "floor ms (weights + cache read once)": floor_ms,
            "x floor": ms / floor_ms, "peak GB": peak / 1e9, "held before GB": held_before / 1e9,
            "KV cache per token": model.config.kv_cache_formula(),
            "attention": kernels_text(decode_step_kernels(model, batch, split_kv)).replace(
                "no SDPA call", "split-KV (FlexAttention)"),
            "largest kernels (us a step)": top_text(top, 1), "dtype": str(dtype)}


def variants_section(results: Results, device: torch.device, smoke: bool) -> None:
    copy_gbs = ceilings(device, smoke)["copy GB/s"]
    for name, fields in VARIANTS.items():
        for batch in ([1, 4] if smoke else BATCHES):
            for split_kv in (True, False):
                label = f"{name}, batch {batch}, {'split-KV' if split_kv else 'SDPA'}"
                measure(results, "variants", label,
                        lambda fields=fields, batch=batch, split_kv=split_kv, name=name: {
                            "variant": name, "batch": batch, **variant_row(fields, batch, device, smoke,
                                                                           split_kv, copy_gbs)})
    plot_variants([r for r in results.rows("variants") if "tokens/s" in r], results.out / "variants.png")


def plot_variants(rows: list[dict], path: Path) -> None:
    """Tokens/s against peak memory, one line per variant through its batch sizes: split-KV
    attention solid, SDPA's dashed in the same colour."""
    from training.plots import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(6, 4))
    for i, name in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        for split_kv in (True, False):
            mine = [r for r in rows
                    if r["variant"] == name and r["attention"].startswith("split") == split_kv]
            if not mine:
                continue
            ax.plot([r["peak GB"] for r in mine], [r["tokens/s"] for r in mine], "o-" if split_kv else "x--",
                    color=f"C{i}", label=name if split_kv else f"{name}, SDPA")
            for r in mine:
                ax.annotate(f"{r['batch']}", (r["peak GB"], r["tokens/s"]), fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="peak memory (GB)", ylabel="decode tokens/s",
           title="Decode by batch size (labels), full cache")
    ax.legend(fontsize=7)
    save_figure(fig, path)


# ----------------------------------------------------------------------------- inductor

UNPADDED_HEAD = "unpadded-head"
INDUCTOR_OPTIONS = {  # name: torch._inductor.config settings the compiled step is built under
    "default": {},
    # Programmatic dependent launch: each Triton kernel starts while the one before it ends (Hopper)
    "pdl": {"triton.enable_pdl": True},
    # Each Triton kernel's block sizes and warps tuned by timing its neighbours (gpt-fast's setting)
    "coordinate-descent+pdl": {"coordinate_descent_tuning": True, "triton.enable_pdl": True},
    # Matrix products (and FlexAttention's decoding kernel) chosen by timing Triton's templates
    # against cuBLAS, with what follows a product fused into it where that times faster. With
    # PyTorch 2.11 (2026-11-27, H200) the step failed to compile (its decoding kernel's timing run)
    "max-autotune+coordinate-descent+pdl": {"max_autotune": True, "coordinate_descent_tuning": True,
                                            "triton.enable_pdl": True},
    # The matrix products alone chosen so (FlexAttention's kernel keeps the configuration the step
    # gives it: model.kernels.decode_kernel_options): Triton's templates with a bias, GELU or
    # residual fused in, against cuBLAS, at batch 1 and at 256
    "max-autotune-gemm": {"max_autotune_gemm": True},
    "max-autotune-gemm+coordinate-descent": {"max_autotune_gemm": True, "coordinate_descent_tuning": True},
    # inductor's defaults with the head's rows as trained (GPT-2's 50,257): the control of the
    # padding for_decoding gives a model on CUDA (GPT.pad_head_rows), which every other set has
    UNPADDED_HEAD: {},
}
INDUCTOR_VARIANTS = ["MQA", "GQA", "MLA", "MHA"]  # batch 256, split-KV where it takes the heads


def inductor_section(results: Results, device: torch.device, smoke: bool, names: list[str]) -> None:
    """The compiled step built under each set of inductor's options (`--levers`, INDUCTOR_OPTIONS):
    batch-1 decode of each shape (tokens/s, seconds to build, GPU busy time, kernels a token, the
    greedy tokens) and the batch-256 split-KV step of INDUCTOR_VARIANTS, compiled under the options
    too (its FlexAttention kernel in decode_kernel_options' configuration; until 2026-11-27's second
    rental these rows were the eager step captured). UNPADDED_HEAD builds them with the head's rows
    as trained, not padded as for_decoding pads them on CUDA. One set per process is the fair comparison:
    inductor keeps what it tuned for the process's life. (2026-11-27, H200: PDL and coordinate
    descent changed nothing; max-autotune failed to compile the step.)"""
    import torch._inductor.config as inductor_config  # (slow to import: only where it is used)

    copy_gbs = ceilings(device, smoke)["copy GB/s"]
    for lever in names:
        options, pad_head = INDUCTOR_OPTIONS[lever], lever != UNPADDED_HEAD
        for name, shape in DECODE_SHAPES.items():
            label = f"{lever}: {name}"
            measure(results, "inductor", label, lambda label=label, shape=shape, options=options,
                    pad_head=pad_head: {"options": options, **profile_decode(
                        results.out, f"inductor {label}", shape, device, smoke, options, pad_head)})
        for variant in INDUCTOR_VARIANTS:
            def row(variant=variant, options=options, pad_head=pad_head):
                with inductor_config.patch(options):
                    batch = 4 if smoke else 256
                    return {"options": options, "batch": batch, **variant_row(
                        VARIANTS[variant], batch, device, smoke, True, copy_gbs, backend="inductor",
                        pad_head=pad_head)}
            measure(results, "inductor", f"{lever}: {variant}, batch 256", row)


# ----------------------------------------------------------------------------- profile

def profile_section(results: Results, device: torch.device, smoke: bool) -> None:
    """Where a step's time goes: wall time per step against the GPU's busy time (the kernels'
    summed device time, from the profiler) for the recipe's training step, eager and compiled, and for
    batch-1 decoding with the compiled step; each profile's top operations go to profile_*.txt."""
    for mode in ("eager", "default", "reduce-overhead"):  # the recipe's step, compiled, and as CUDA graphs
        measure(results, "profile", f"training step (the recipe's, bf16, {mode})",
                lambda mode=mode: profile_training(results.out, device, smoke, mode))
    for name, shape in DECODE_SHAPES.items():
        measure(results, "profile", f"decode, {name}", lambda name=name, shape=shape: profile_decode(
            results.out, f"decode {name}", shape, device, smoke))


def profiled(fn, out: Path | None, label: str, device: torch.device) -> tuple[float, int, dict]:
    """Runs fn under the profiler; writes its top operations to out/profile_<label>.txt (with an out)
    and returns (the kernels' summed device ms, the number of kernels, {kernel: its summed device
    us} for the 4 largest)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    averages = prof.key_averages()
    first = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    text = (averages.table(sort_by=first, row_limit=25) + "\n\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=25))
    if out is not None:
        write_atomically(out / f"profile_{label}.txt", lambda f: f.write(text.encode()), "profile")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time
    top = dict(sorted(by_name.items(), key=lambda item: -item[1])[:4])
    return sum(e.device_time for e in kernels) / 1e3, len(kernels), top


def top_text(top: dict, per: int) -> str:
    """profiled's largest kernels as 'name 12.3; ...', their us per call of `per` (a token, a step)."""
    return "; ".join(f"{name[:60]} {us / per:.1f}" for name, us in top.items()) or "none (CPU)"


def profile_training(out: Path, device: torch.device, smoke: bool, mode: str = "default") -> dict:
    """The recipe's step (6/6/384 with RoPE, block 256, batch 64, dropout 0.2) as the loop takes it:
    bf16 autocast forward and backward of the model, eager (mode "eager") or compiled (torch.compile's
    `mode`), clipping, fused AdamW."""
    torch.manual_seed(0)
    config = recipe_config(smoke, dropout=0.2, pos_emb="rope")
    model = GPT(config).to(device)
    optimizer = configure_optimizer(model, "adamw", 1e-3, (0.9, 0.99), 0.1)
    if mode == "eager":  # the GPU recipe's (its CUDA graph replays these kernels)
        compiled = model
    else:
        compiled = torch.compile(model, backend="aot_eager") if smoke else torch.compile(model, mode=mode)
    batch = 4 if smoke else 64
    x = torch.randint(0, 65, (batch, config.block_size), device=device)
    amp = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")

    def steps(n):
        for _ in range(n):
            with amp:
                _, loss = compiled(x, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    n = 2 if smoke else 20
    ms = timed_ms(lambda: steps(n), device, repeat=2) / n
    gpu_ms, kernels, _ = profiled(lambda: steps(n), out, f"training_{mode.replace('-', '_')}", device)
    return {"wall ms/step": ms, "GPU busy ms/step": gpu_ms / n, "kernels/step": kernels / n,
            "TFLOP/s": 6 * model.num_params() * batch * config.block_size / ms / 1e9}


def profile_decode(out: Path, label: str, shape: tuple, device: torch.device, smoke: bool,
                   options: dict | None = None, pad_head: bool = True) -> dict:
    """Batch-1 greedy decoding with the compiled step (bf16 on CUDA), as the decode section times it,
    the model as for_decoding makes it (pad_head=False: its head as trained), the step built under
    inductor's `options` (INDUCTOR_OPTIONS): tokens/s, the seconds the step
    took to build (compiling, tuning, capturing) and its first sample, the profile (its kernels in
    out/profile_<label>.txt), and a digest of its greedy tokens (equal across options when every
    kernel rounds alike) and whether they equal the eager step's."""
    import torch._inductor.config as inductor_config  # (slow to import: only where it is used)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _, ours = decode_models(decode_shape(shape, smoke), device)
    ours = decoding(ours, device, dtype, pad_head)
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    new = 16 if smoke else min(500, shape[1] - 2)
    clock = synchronized_clock(device)
    t0 = clock()
    with inductor_config.patch(options or {}):
        step = CompiledDecodeStep(ours, backend="aot_eager" if smoke else "inductor")
        tokens = generate(ours, prompt, new, temperature=0, decode_step=step)  # (1, 1 + new)
    build_s = clock() - t0
    generate_new = lambda: generate(ours, prompt, new, temperature=0, decode_step=step)  # noqa: E731
    ms = timed_ms(generate_new, device, repeat=3, warmup=1) / new
    gpu_ms, kernels, top = profiled(generate_new, out, re.sub(r"[^a-z0-9]+", "_", label.lower()), device)
    digest = hashlib.sha1(str(tokens.tolist()).encode()).hexdigest()[:10]
    eager = generate(ours, prompt, new, temperature=0)
    return {"tokens/s": 1e3 / ms, "wall ms/token": ms, "build s": build_s, "GPU busy ms/token": gpu_ms / new,
            "kernels/token": kernels / new, "largest kernels (us a token)": top_text(top, new),
            "greedy tokens (sha1)": digest,
            "same greedy tokens as the eager step": torch.equal(tokens, eager),
            "dtype": str(dtype), "new tokens": new}


# ----------------------------------------------------------------------------- coldstart

NANOGPT = ROOT / ".gpu" / "nanoGPT"  # bash benchmarks/gpu_fetch.sh <nanoGPT checkout> puts it there
# nanoGPT's char recipe as its README runs it, stopped at 2,500 of its 5,000 steps: its schedule
# (lr_decay_iters=5000) is unchanged, so the run is the same up to there, and its best val comes
# at ~1,750 (it overfits after): the time to its best is the same, a minute of GPU time less.
NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--max_iters=2500"]
SMOKE_NANOGPT = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--max_iters=4",
                 "--eval_interval=2", "--eval_iters=2", "--log_interval=1", "--n_layer=1", "--n_head=2",
                 "--n_embd=32", "--block_size=32", "--batch_size=4", "--dtype=float32"]
COLD_LEVERS = {  # name: overrides of `python train.py` (the GPU recipe, as a user runs it)
    "recipe": [],
    "no compile, no CUDA graph": ["train.compile=false", "train.cuda_graph=false"],
    "CUDA graph, no compile": ["train.compile=false", "train.cuda_graph=true"],
    "compiled model, no CUDA graph": ["train.compile=true", "train.cuda_graph=false"],
    "compiled model in a CUDA graph": ["train.compile=true", "train.cuda_graph=true"],
    "compiled blocks, no CUDA graph": ["train.compile=blocks", "train.cuda_graph=false"],
    "compiled blocks in a CUDA graph": ["train.compile=blocks", "train.cuda_graph=true"],
    "1250 steps, lr 2e-3": ["train.max_iters=1250", "train.lr=2e-3"],
    "1000 steps, lr 2e-3": ["train.max_iters=1000", "train.lr=2e-3"],
    "900 steps, lr 2e-3": ["train.max_iters=900", "train.lr=2e-3"],
    "no biases": ["model.bias=false"],
    "no biases, RMSNorm": ["model.bias=false", "model.norm=rmsnorm"],
    "batch 128, 600 steps": ["train.batch_size=128", "train.max_iters=600", "train.eval_interval=200"],
    "no checkpoint writes": ["train.checkpoints=false"],
}
COLD_GROUPS = {  # the plan's commands (first, second: the first rental; schedule, layers: the second)
    "first": ["CUDA graph, no compile", "compiled blocks in a CUDA graph", "no compile, no CUDA graph",
              "compiled model in a CUDA graph", "compiled blocks, no CUDA graph"],
    "second": ["recipe", "recipe, warm caches", "1000 steps, lr 2e-3", "batch 128, 600 steps",
               "no checkpoint writes", "compiled model, no CUDA graph"],
    "schedule": ["1250 steps, lr 2e-3", "1000 steps, lr 2e-3", "900 steps, lr 2e-3", "recipe"],
    "layers": ["recipe", "recipe, warm caches", "no biases", "no biases, RMSNorm"],
}
SMOKE_COLD = ["no compile, no CUDA graph", "recipe", "recipe, warm caches"]
SMOKE_RUNS = 2  # a smoke run's levers differ only in overrides it turns off: two show the script works
SMOKE_OFF = {"train.compile=true": "train.compile=false", "train.compile=blocks": "train.compile=false",
             "train.cuda_graph=true": "train.cuda_graph=false"}  # a smoke run compiles and captures nothing
STEP_LINE = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)", re.M)
WHOLE_VAL = re.compile(r"val loss ([\d.]+) over the whole val split")


def run_whole(cmd: list[str], cwd: Path, env: dict, log: Path, timeout: float) -> tuple[float, list]:
    """A whole process, timed from before it starts to its exit: (wall seconds, [(seconds since the
    start, text)] of its output, stdout and stderr together, as it came), its output appended to
    `log`. A process past `timeout` is killed (its row says so)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    chunks = []
    while data := os.read(proc.stdout.fileno(), 1 << 16):
        chunks.append((time.perf_counter() - t0, data.decode(errors="replace")))
    code = proc.wait()
    wall = time.perf_counter() - t0
    timer.cancel()
    append_line(log, f"\n$ {' '.join(cmd)}  (in {cwd}; exit {code}; {wall:.1f} s)\n"
                     + "".join(c for _, c in chunks))
    if code:
        tail = "".join(c for _, c in chunks).strip().splitlines()[-3:]
        raise RuntimeError(f"exit {code} after {wall:.0f} s: {' | '.join(tail)}"[:300])
    return wall, chunks


def line_times(chunks: list) -> list[tuple[float, str]]:
    """[(the time its last piece arrived, line)] of a process's output."""
    lines, pending = [], ""
    for t, text in chunks:
        *done, pending = (pending + text).split("\n")
        lines += [(t, line) for line in done]
    return lines + ([(chunks[-1][0], pending)] if pending else [])


def evaluations(chunks: list) -> list[tuple[float, int, float]]:
    """[(seconds since the start, step, val loss)] of the `step N: train loss a, val loss b` lines
    that nanoGPT and we both print."""
    return [(t, int(m[1]), float(m[2])) for t, line in line_times(chunks) if (m := STEP_LINE.match(line))]


def cold_env(caches: Path) -> dict:
    """The environment of a process whose compile caches (inductor's, Triton's) are in `caches`: an
    empty folder for a cold start, the previous run's for a warm one."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
            "TRITON_CACHE_DIR": str(caches / "triton")}


def floor_row(tmp: Path, log: Path, smoke: bool) -> dict:
    """The floor every whole process stands on: importing torch and starting CUDA."""
    code = f"import torch; torch.zeros(1, device={'cpu' if smoke else 'cuda'!r})"
    wall, _ = run_whole([sys.executable, "-c", code], ROOT, cold_env(tmp / "floor"), log, 120)
    return {"whole process s": wall, "command": f"python -c \"{code}\""}


def nanogpt_row(tmp: Path, log: Path, smoke: bool) -> dict:
    """nanoGPT's own train.py with its char recipe, cold: when each evaluation came, its best val
    and when, and its best checkpoint's loss over the whole val split (our split_loss's windows)."""
    if not (NANOGPT / "data/shakespeare_char/val.bin").is_file():
        raise FileNotFoundError(f"{NANOGPT}: no prepared nanoGPT: bash benchmarks/gpu_fetch.sh <checkout>")
    out_dir = tmp / "nanogpt_out"
    args = [*(SMOKE_NANOGPT if smoke else NANOGPT_ARGS), f"--out_dir={out_dir}"]
    wall, chunks = run_whole([sys.executable, "train.py", *args], NANOGPT, cold_env(tmp / "nanogpt"), log,
                             200)
    evals = evaluations(chunks)
    t, step, best = min(evals[1:] or evals, key=lambda e: e[2])
    reached = next((e for e in evals if e[2] <= TARGET), None)
    return {"whole process s": wall, "step 0 at s": evals[0][0], "best val (estimate)": best,
            "best at step": step, "best at s": t, f"to val {TARGET} s": reached and reached[0],
            "val (whole split, best checkpoint)": nanogpt_split_loss(out_dir / "ckpt.pt", smoke),
            "command": f"python train.py {' '.join(args[:-1])}"}


@torch.no_grad()
def nanogpt_split_loss(ckpt_path: Path, smoke: bool) -> float:
    """nanoGPT's checkpoint scored as split_loss scores ours: every target of its val.bin once, in
    windows of block_size, in bf16 autocast on CUDA as our runs end."""
    import numpy as np
    spec = importlib.util.spec_from_file_location("nanogpt_model", NANOGPT / "model.py")
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)  # (its own format: pickled args)
    model = nano.GPT(nano.GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    device = torch.device("cpu" if smoke else "cuda")
    model.to(device).eval()
    val = np.fromfile(NANOGPT / "data/shakespeare_char/val.bin", dtype=np.uint16)
    val = torch.from_numpy(val.astype(np.int64))
    x, y = target_windows(val, model.config.block_size)                # split_loss's windows
    total = 0.0
    for xb, yb in zip(x.split(64), y.split(64)):
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            _, loss = model(xb.to(device), yb.to(device))  # the mean over the batch's real targets
        total += loss.float().item() * int((yb >= 0).sum())
    return total / (len(val) - 1)


def ours_row(overrides: list[str], caches: Path, run_dir: Path, log: Path, against: tuple | None) -> dict:
    """`python train.py <overrides>` as a whole process with the compile caches in `caches`: when
    step 0's evaluation came, when val first reached 1.4697 and nanoGPT's best (`against`: its val
    and the seconds it took), the whole process, the whole val split's loss."""
    wall, chunks = run_whole([sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"], ROOT,
                             cold_env(caches), log, 180)
    evals, text = evaluations(chunks), "".join(c for _, c in chunks)
    whole = WHOLE_VAL.search(text)
    reached = next((e for e in evals if e[2] <= TARGET), None)
    at = lambda prefix: next((t for t, line in line_times(chunks) if line.startswith(prefix)), None)  # noqa: E731
    row = {"built at s": at("model: "), "step 0 at s": evals[0][0] if evals else None,
           "last evaluation at s": evals[-1][0] if evals else None,
           "whole val at s": evals and at(f"step {evals[-1][1]}: val loss"),
           "sample at s": at("--- end of sample ---"), "whole process s": wall,
           f"to val {TARGET} s": reached and reached[0], "val (whole split)": whole and float(whole[1]),
           "best val (estimate)": min(e[2] for e in evals), "overrides": " ".join(overrides)}
    if against:
        beat = next((e for e in evals if e[2] <= against[0]), None)
        row |= {"to nanoGPT's best s": beat and beat[0],
                "x nanoGPT's time to its best": beat and beat[0] / against[1]}
    return row


def generate_row(cmd: list[str], prompt: str, new: int, log: Path, caches: Path, floor: float | None) -> dict:
    """A sampling command as a whole process: when its first new character came (after `prompt`),
    its characters per second from there (one token each: the char model), the whole process, and
    how much more than the floor that is."""
    wall, chunks = run_whole(cmd, ROOT, cold_env(caches), log, 150)
    text, first = "", None
    for t, piece in chunks:
        text += piece
        if first is None and len(text) > len(prompt):
            first = t
    last = chunks[-1][0]
    return {"whole process s": wall, "first new token at s": first,
            "tokens/s from the first": (new - 1) / (last - first) if last > first else None,
            "over the floor s": floor and wall - floor, "command": " ".join(cmd[1:])}


def coldstart_section(results: Results, names: list[str], smoke: bool, against: tuple | None,
                      sampling: str = "all") -> None:
    """Whole processes from a cold compile cache, one after another: the floor (import torch, start
    CUDA), nanoGPT's train.py (unless `against` gives its best val and seconds already), ours per
    lever (COLD_LEVERS; 'X, warm caches' runs X again with X's caches), then sampling 500 tokens
    from the first of our runs' checkpoint: `python generate.py` (default, eager, inductor) and
    transformers' generate (its static cache) on the same weights. Each process's output goes to
    coldstart.log."""
    log = results.out / "coldstart.log"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        floor = measure(results, "coldstart", "floor", lambda: floor_row(tmp, log, smoke))
        if against is None and smoke and not NANOGPT.is_dir():
            results.add({"section": "coldstart", "name": "nanoGPT", "skipped": f"no {NANOGPT} (a smoke run)"})
        elif against is None:
            nano = measure(results, "coldstart", "nanoGPT", lambda: nanogpt_row(tmp, log, smoke))
            against = (nano["best val (estimate)"], nano["best at s"]) if "best at s" in nano else None
        runs = {}
        for i, name in enumerate(names[:SMOKE_RUNS] if smoke else names):
            lever = name.removesuffix(", warm caches")
            caches = runs[lever][0] if lever != name and lever in runs else tmp / f"caches{i}"
            overrides = COLD_LEVERS[lever]
            if smoke:  # the GPU recipe's architecture (a GPT-NeoX holds it), toy-sized, on the CPU
                overrides = ["experiment=shakespeare_char_gpu", *(SMOKE_OFF.get(o, o) for o in overrides),
                             *SMOKE_TRAIN]
            runs.setdefault(lever, (caches, tmp / f"run{i}"))
            measure(results, "coldstart", f"python train.py: {name}",
                    lambda o=overrides, c=caches, r=tmp / f"run{i}": ours_row(o, c, r, log, against))
        ckpt = next((r / "best.pt" for _, r in runs.values() if (r / "best.pt").is_file()), None)
        if ckpt is not None and sampling != "none":
            sampling_rows(results, ckpt, tmp, log, floor.get("whole process s"), smoke, sampling == "all")


def sampling_rows(results: Results, ckpt: Path, tmp: Path, log: Path, floor: float | None, smoke: bool,
                  every: bool = True):
    """500 tokens from `ckpt` (the char model), whole processes: generate.py three ways (or only its
    default), where its time goes, then transformers (benchmarks/hf_generate.py)."""
    new, device = (20 if smoke else 500), ("cpu" if smoke else "auto")
    ours = [sys.executable, "generate.py", f"ckpt={ckpt}", f"max_new_tokens={new}", f"device={device}"]
    for name, extra in {"default": [], "compile=false (eager)": ["compile=false"],
                        "compile=true (inductor)": ["compile=true"]}.items():
        if name != "default" and not every or (smoke and "inductor" in name):  # (a smoke compiles nothing)
            continue
        measure(results, "coldstart", f"python generate.py: {name}", lambda e=extra, n=name: generate_row(
            [*ours, *e], "\n", new, log, tmp / f"gen_{n.split()[0]}", floor))
    measure(results, "coldstart", "python generate.py's phases, in this process",
            lambda: generate_phases(ckpt, new, torch.device("cpu" if smoke else "cuda"), results.out))
    if not every:
        return
    hf = [sys.executable, "benchmarks/hf_generate.py", str(ckpt), "--max-new-tokens", str(new), "--device",
          device]
    measure(results, "coldstart", "transformers generate (static cache)",
            lambda: generate_row(hf, "\n", new, log, tmp / "gen_hf", floor))


def generate_phases(ckpt: Path, new: int, device: torch.device, out: Path) -> dict:
    """Where a `python generate.py` sample's time goes after the imports, timed in this process
    (CUDA already started): loading the checkpoint, building the default decode step, the prefill
    to the first token, the rest; then the step's GPU busy time per token against its wall time."""
    from model.device import Precision
    from model.generation import Decoding, stream
    from model.loading import load_model
    from model.sampling import Sampling

    clock = synchronized_clock(device)
    t0 = clock()
    model, _ = load_model(ckpt, device, Precision())
    t1 = clock()
    step = CompiledDecodeStep(model, backend="cuda_graph") if device.type == "cuda" else None
    t2 = clock()
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    sampling = Sampling(new, temperature=0.8, top_k=200)
    generator = torch.Generator(device).manual_seed(0)
    tokens = stream(model, prompt, sampling, Decoding(decode_step=step), generator=generator)
    next(tokens)
    t3 = clock()
    for token in tokens:
        token.tolist()  # as print_samples reads each step
    t4 = clock()
    sample = lambda: [t.tolist() for t in stream(model, prompt, sampling, Decoding(decode_step=step))]  # noqa: E731
    gpu_ms, kernels, _ = profiled(sample, out, "generate_default", device)
    return {"load s": t1 - t0, "build step s": t2 - t1, "to the first token s": t3 - t2,
            "the rest s": t4 - t3, "tokens/s": (new - 1) / (t4 - t3), "GPU busy ms/token": gpu_ms / new,
            "kernels/token": kernels / new, "wall ms/token": 1e3 * (t4 - t3) / (new - 1)}


# ----------------------------------------------------------------------------- exactness

def exactness_section(results: Results, device: torch.device) -> None:
    """Where the cached and uncached paths on CUDA may part (float32, no TF32; the CUDA check's tiny
    models): per variant, the SDPA kernel each path's attention calls run, the largest logit
    difference along the cached path's tokens (teacher-forced), and for seeded sampling the first
    token that differs, with how close its draw was (the gap between the k-th and (k+1)-th logit
    that top-k cuts at, and the probabilities of the two tokens)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for name, fields in {"mha": {}, "gqa": {"n_kv_head": 2}, "mqa": {"n_kv_head": 1},
                             "mqa_cla2": {"n_kv_head": 1, "kv_share": 2}}.items():
            measure(results, "exactness", name, lambda f=fields: exactness_row(f, device))
    finally:
        torch.set_float32_matmul_precision(precision)


@torch.no_grad()
def exactness_row(fields: dict, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, block_size=24, n_layer=2, n_head=4, n_embd=16, pos_emb="rope",
                          **fields)).to(device).eval()
    row = {}
    for length in (1, 7):
        prompt = torch.arange(1, length + 1, device=device)[None]                   # (1, length)
        seeded = lambda length=length: dict(temperature=1.0, top_k=20,  # noqa: E731
                                            generator=torch.Generator(device).manual_seed(length))
        cached, uncached = (generate(model, prompt, 17, kv_cache=kv, **seeded()) for kv in (True, False))
        cache = model.new_kv_cache(1)
        n, backends = cached.size(1), decode_backends(device)
        with sdpa_kernel(backends, set_priority=True), SDPACalls() as calls:
            stepwise = [model(cached[:, :length], kv_cache=cache)[:, -1]]
            stepwise += [model(cached[:, t - 1:t], kv_cache=cache)[:, -1] for t in range(length + 1, n)]
        with sdpa_kernel(backends, set_priority=True), SDPACalls() as whole:
            reference = [model(cached[:, :t])[:, -1] for t in range(length, n)]
        diffs = [float((a - b).abs().max()) for a, b in zip(stepwise, reference)]
        differs = (cached != uncached).nonzero()
        row |= {f"prompt {length}: max |logit diff|": max(diffs),
                f"prompt {length}: cached kernels": kernels_text(calls.kernels),
                f"prompt {length}: uncached kernels": kernels_text(whole.kernels)}
        if len(differs):
            t = int(differs[0, 1])
            logits = reference[t - length][0].sort(descending=True).values
            probs = torch.softmax(reference[t - length][0], -1)
            row |= {f"prompt {length}: first differing position": t,
                    f"prompt {length}: top-k gap at it": float(logits[19] - logits[20]),
                    f"prompt {length}: p(cached token), p(uncached token)":
                        f"{float(probs[cached[0, t]]):.6f}, {float(probs[uncached[0, t]]):.6f}"}
    return row


# ----------------------------------------------------------------------------- main

def cold_lever_names(names: list[str]) -> list[str]:
    """--levers for coldstart: groups (COLD_GROUPS) or lever names (COLD_LEVERS, each also as
    '<name>, warm caches'), in order."""
    out = []
    for name in names:
        if name in COLD_GROUPS:
            out += COLD_GROUPS[name]
        elif name.removesuffix(", warm caches") in COLD_LEVERS:
            out.append(name)
        else:
            raise SystemExit(f"error: --levers: {name!r} is not a coldstart group ({', '.join(COLD_GROUPS)}) "
                             f"or lever ({', '.join(COLD_LEVERS)})")
    return out


def main(argv=None) -> list[dict]:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the script")
    parser.add_argument("--section", nargs="+", choices=SECTIONS, default=SECTIONS)
    parser.add_argument("--levers", nargs="+", default=None,
                        help=f"train: groups ({', '.join(LEVER_GROUPS)}), lever names, or 'key=value ...'; "
                             f"coldstart: groups ({', '.join(COLD_GROUPS)}) or lever names; inductor: "
                             f"sets of options ({', '.join(INDUCTOR_OPTIONS)})")
    parser.add_argument("--sampling", choices=["all", "default", "none"], default="all",
                        help="coldstart: the sampling rows after training (default: generate.py's "
                             "default alone)")
    parser.add_argument("--against", nargs=2, type=float, metavar=("VAL", "SECONDS"),
                        help="coldstart: nanoGPT's best val and its seconds to it, measured by an earlier "
                             "command (its run is then skipped)")
    parser.add_argument("--shapes", nargs="+", choices=list(DECODE_SHAPES), default=list(DECODE_SHAPES),
                        help="decode: the model shapes (default: all)")
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu") / time.strftime("%Y-%m-%d_%H-%M-%S"))
    args = parser.parse_args(argv)
    faulthandler.enable(sys.__stderr__)  # a crash in a compiler or driver prints where it was (one
    # rental's did not); to the process's own stderr, which a test capturing sys.stderr leaves alone
    if args.against and not (all(map(math.isfinite, args.against)) and args.against[1] > 0):
        parser.error(f"--against VAL SECONDS: nanoGPT's best val loss and the seconds it took, finite and "
                     f"SECONDS > 0; got {' '.join(map(str, args.against))}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: give a folder (results.jsonl and tables.md go in it)")
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA device: run it on a GPU, or with --smoke")
    if sum(s in args.section for s in ("train", "coldstart", "inductor")) > 1 and args.levers:
        sys.exit("error: --levers: run the train, coldstart and inductor sections in separate commands")
    levers = "train" in args.section and lever_overrides(
        args.levers or (SMOKE_LEVERS if args.smoke else list(LEVERS)))
    cold = "coldstart" in args.section and cold_lever_names(
        args.levers or (SMOKE_COLD if args.smoke else ["first"]))
    inductor = "inductor" in args.section and (args.levers or list(INDUCTOR_OPTIONS))
    if inductor and (unknown := [n for n in inductor if n not in INDUCTOR_OPTIONS]):
        sys.exit(f"error: --levers: {unknown[0]!r} is not a set of inductor's options "
                 f"({', '.join(INDUCTOR_OPTIONS)})")
    results = Results(args.out)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke: the numbers mean nothing)"
    bytecode = (Path(torch.__file__).parent / "__pycache__").is_dir(), not sys.dont_write_bytecode
    print(f"{name}, PyTorch {torch.__version__} (torch's bytecode cached: {bytecode[0]}; Python writes "
          f"bytecode: {bytecode[1]}); results in {args.out}: results.jsonl, tables.md", flush=True)
    start = len(results.rows())
    for section in args.section:
        {"probe": lambda: probe_section(results, device, args.smoke),
         "train": lambda: train_section(results, levers, args.smoke),
         "optimizer": lambda: optimizer_section(results, device, args.smoke),
         "decode": lambda: decode_section(results, device, args.smoke, args.shapes),
         "variants": lambda: variants_section(results, device, args.smoke),
         "inductor": lambda: inductor_section(results, device, args.smoke, inductor),
         "profile": lambda: profile_section(results, device, args.smoke),
         "coldstart": lambda: coldstart_section(results, cold, args.smoke, args.against, args.sampling),
         "exactness": lambda: exactness_section(results, device)}[section]()
    rows = results.rows()[start:]
    print("\n" + render_tables(rows), flush=True)
    failed = [r for r in rows if "error" in r or r.get("same tokens (static step, eager, uncached)") is False]
    if failed:
        sys.exit(f"error: {len(failed)} of {len(rows)} measurements failed: "
                 + "; ".join(f"{r['section']}: {r['name']}" for r in failed))
    return rows


if __name__ == "__main__":
    main()
