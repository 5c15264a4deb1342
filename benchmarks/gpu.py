"""The GPU measurements in one script, written for one H100 (issue 29): each section prints a table.

    python benchmarks/gpu.py                          # every section, on the CUDA device
    python benchmarks/gpu.py --only decode variants   # some sections (train, decode, variants)
    python benchmarks/gpu.py --levers recipe RoPE     # the train section with some levers only
    python benchmarks/gpu.py --smoke                  # every section at toy sizes on the CPU (<= 3 min)

train     python train.py's GPU recipe (experiment=shakespeare_char_gpu) and the same with one lever
          changed at a time: wall time to val <= 1.4697 (nanoGPT's), the training steps' share of
          it (the rest is compile and evaluation), tokens/s, MFU, and the loss over the whole val
          split at the end. Plus fused against for-each AdamW, one optimizer step timed apart.
decode    batch-1 decode of the char model (6/6/384) and of GPT-2 124M's shape (random weights):
          our compiled one-token step (a CUDA graph over the static cache) against our eager step
          and transformers' generate with its static cache (which transformers compiles on CUDA);
          tokens equal to the eager and uncached paths, greedy and seeded, and whether CUDA graphs
          were captured (inductor's count of graphs it skipped is 0).
variants  MHA, GQA, MQA and MLA at GPT-2 small width, block 1024: tokens/s and peak memory of the
          decode step at batch 1, 16, 64 and 256 at a full cache, plotted.

--smoke runs the same code at toy sizes, so the script is known to work before a GPU runs it; its
numbers mean nothing. Results (tables, results.json, variants.png) go to --out.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the GPU machine runs it from a checkout, not an install

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from model import GPT, GPTConfig  # noqa: E402
from model.command_line import composed_jobs  # noqa: E402
from model.device import synchronized_clock  # noqa: E402
from model.generation import CompiledDecodeStep, generate  # noqa: E402
from model.optimizer import configure_optimizer  # noqa: E402
from model.plots import pyplot, save_figure  # noqa: E402
from model.run_dir import read_metrics  # noqa: E402

TARGET = 1.4697  # nanoGPT's val loss with its GPU recipe (5000 iterations; ~3 minutes on an A100)
RECIPE = ["experiment=shakespeare_char_gpu"]
LEVERS = {  # name: the overrides that change one thing from the recipe
    "recipe": [],
    "float32, no bf16 autocast": ["train.dtype=float32"],
    "eager, no torch.compile": ["train.compile=false"],
    "math attention, no flash SDPA": ["model.attn_backend=naive"],
    "corpus in host memory": ["data.on_device=false"],
    "nanoGPT's evaluation (200 batches every 250 steps)": ["train.eval_interval=250", "train.eval_iters=200"],
    "batch 128": ["train.batch_size=128", "train.max_iters=2500"],
    "RoPE": ["model.pos_emb=rope"],
    "RMSNorm": ["model.norm=rmsnorm"],
    "SwiGLU": ["model.mlp=swiglu"],
    "QK-norm": ["model.qk_norm=true"],
    "lr 2e-3": ["train.lr=2e-3"],
    "dropout 0.1": ["model.dropout=0.1"],
    "Muon": ["train.optimizer=muon"],
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


def train_levers(names: list[str], smoke: bool, out: Path) -> list[dict]:
    """One training run per lever, in this process, as `python train.py <overrides>` runs it."""
    from train import check_options, train  # (imports Hydra, which the other sections do without)

    rows = []
    for name in names:
        run_dir = out / "train" / name.split(",")[0].replace(" ", "_")
        argv = [*RECIPE, *LEVERS[name], *(SMOKE_TRAIN if smoke else [])]
        [(cfg, overrides)] = composed_jobs(ROOT / "configs", "train", argv)
        print(f"=== {name}: python train.py {' '.join(argv)}", flush=True)
        torch.compiler.reset()  # each lever compiles afresh, as its own process would, and none
        # meets dynamo's recompile limit on GPT.forward, which the levers' models would share
        run = check_options(cfg, overrides)
        result = train(run, run_dir)
        rows.append(lever_row(name, run_dir, run, result))
    print(f"\n### Time to val <= {TARGET} (whole-run wall clock; train steps = steps x median step time)\n")
    print("| lever | to target s | of it train steps s | tokens/s | MFU | val (whole split) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        reached = "not reached" if r["to_target_s"] is None else f"{r['to_target_s']:.1f}"
        steps = "-" if r["train_steps_s"] is None else f"{r['train_steps_s']:.1f}"
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        val = "-" if r["val_loss_full"] is None else f"{r['val_loss_full']:.4f}"
        print(f"| {r['lever']} | {reached} | {steps} | {r['tokens_per_s']:,.0f} | {mfu} | {val} |")
    return rows


def lever_row(name: str, run_dir: Path, run, result: dict) -> dict:
    """What one run gives the table, from its metrics.jsonl."""
    records = read_metrics(run_dir)
    median = lambda key: statistics.median(r[key] for r in records if key in r) if any(
        key in r for r in records) else None
    tokens_per_s, tokens_per_step = median("tokens_per_s"), run.tokens_per_step(1)
    reached = next((r for r in records if r.get("val_loss", 99) <= TARGET), None)
    return {"lever": name, "tokens_per_s": tokens_per_s or 0.0, "mfu": median("mfu"),
            "to_target_s": reached and reached["elapsed_s"],
            "train_steps_s": reached and tokens_per_s and reached["step"] * tokens_per_step / tokens_per_s,
            "val_loss_full": result["val_loss_full"]}


def optimizer_step_ms(device: torch.device, smoke: bool) -> dict:
    """One AdamW step over the recipe model's parameters, fused and for-each (CUDA only fuses)."""
    config = GPTConfig(vocab_size=65, block_size=32 if smoke else 256, n_layer=1 if smoke else 6,
                       n_head=2 if smoke else 6, n_embd=32 if smoke else 384)
    model = GPT(config).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    times = {}
    for fused in ([True, False] if device.type == "cuda" else [False]):
        optimizer = configure_optimizer(model, "adamw", 1e-3, (0.9, 0.99), 0.1, fused=fused)
        times["fused" if fused else "for-each"] = timed_ms(optimizer.step, device, repeat=20)
    print("\n### AdamW step, recipe model: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))
    return times


def timed_ms(fn, device: torch.device, repeat: int) -> float:
    """Milliseconds per call of fn, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    clock = synchronized_clock(device)
    t0 = clock()
    for _ in range(repeat):
        fn()
    return 1e3 * (clock() - t0) / repeat


def decode_models(shape: tuple, device: torch.device, dtype: torch.dtype):
    """transformers' GPT-2 with random weights and ours with the same weights, both on device."""
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, block, n_layer, n_head, n_embd = shape
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=block, n_layer=n_layer, n_head=n_head,
                                    n_embd=n_embd, bos_token_id=0, eos_token_id=0)).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = GPT.from_pretrained(d).eval()
    return hf.to(device, dtype), ours.to(device, dtype)


def same_tokens(model, step: CompiledDecodeStep, new: int) -> bool:
    """Whether the compiled step, the eager step and no cache give the same tokens, greedy and
    seeded, over calls with prompts of several lengths."""
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


def decode_row(name: str, shape: tuple, device: torch.device, dtype) -> dict:
    """One model shape: whether the paths agree, and each one's batch-1 tokens/s."""
    hf, ours = decode_models(shape, device, dtype)
    new = min(500, shape[1] - 2)
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    # The check runs in float32: in bf16 the paths round differently, and a random model's
    # near-ties may then break either way.
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # not TF32, which training set for this process
    step = CompiledDecodeStep(ours.float())
    identical = same_tokens(ours, step, 20)
    torch.set_float32_matmul_precision(precision)
    if dtype != torch.float32:
        step = CompiledDecodeStep(ours.to(dtype))
    skipped = counters["inductor"]["cudagraph_skips"]
    speed = {"ours, compiled step": lambda: generate(ours, prompt, new, temperature=0, decode_step=step),
             "ours, eager step": lambda: generate(ours, prompt, new, temperature=0),
             "transformers, static cache": lambda: hf.generate(
                 prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                 cache_implementation="static")}
    tokens_per_s = {k: new / (timed_ms(fn, device, repeat=2) / 1e3) for k, fn in speed.items()}
    graphs = device.type == "cuda" and counters["inductor"]["cudagraph_skips"] == skipped
    return {"shape": name, "new_tokens": new, "identical_tokens": identical, "cuda_graphs": graphs,
            "tokens_per_s": tokens_per_s}


def decode_section(device: torch.device, smoke: bool) -> list[dict]:
    """Batch-1 decode tokens/s: ours compiled and eager, transformers with its static cache."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [decode_row(name, (vocab, 64, 2, 2, 32) if smoke else (vocab, block, n_layer, n_head, n_embd),
                       device, dtype)
            for name, (vocab, block, n_layer, n_head, n_embd) in DECODE_SHAPES.items()]
    paths = list(rows[0]["tokens_per_s"])
    print(f"\n### Batch-1 decode, {dtype}, tokens/s (prompt 1 token)\n")
    print(f"| model | {' | '.join(paths)} | ours / transformers | same tokens | CUDA graphs |")
    print("| --- |" + " --- |" * (len(paths) + 3))
    for r in rows:
        speeds = r["tokens_per_s"]
        ratio = speeds["ours, compiled step"] / speeds["transformers, static cache"]
        print(f"| {r['shape']} | " + " | ".join(f"{v:,.0f}" for v in speeds.values())
              + f" | {ratio:.2f}x | {r['identical_tokens']} | {r['cuda_graphs']} |")
    return rows


def variant_speed(config: GPTConfig, batch: int, device, dtype, steps: int) -> tuple[float, int]:
    """(decode tokens/s, peak bytes) of the one-token step at the end of a full cache (filled
    with random values: a prefill would cost far more than the measurement)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = GPT(config).to(device, dtype).eval()
    # Compiled on CUDA; eager on the CPU, where 16 compiles would take the smoke run's minutes.
    step = CompiledDecodeStep(model, batch) if device.type == "cuda" else None
    cache = step.cache if step else model.new_kv_cache(batch)
    for t in cache.buffers:
        t.normal_()
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)

    def decode():
        cache.reset()
        cache.advance(config.block_size - steps)
        for _ in range(steps):
            step(token, cache) if step else model(token, kv_cache=cache)

    with torch.no_grad():
        ms = timed_ms(decode, device, repeat=2)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        cache.nbytes + sum(p.nbytes for p in model.parameters())
    return batch * steps / (ms / 1e3), peak


def variants_section(device: torch.device, smoke: bool, out: Path) -> list[dict]:
    """MHA, GQA, MQA, MLA at GPT-2 small width: decode tokens/s and peak memory by batch."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    width = dict(n_layer=2, n_head=4, n_embd=64, block_size=64) if smoke else \
        dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)
    batches, steps = ([1, 4] if smoke else BATCHES), (4 if smoke else 32)
    rows = []
    for name, fields in VARIANTS.items():
        fields = {**fields, "n_kv_head": min(fields.get("n_kv_head", width["n_head"]), width["n_head"])}
        if smoke and "mla_latent_dim" in fields:
            fields |= {"mla_latent_dim": 32, "mla_rope_dim": 8}
        config = GPTConfig(vocab_size=50257, pos_emb="rope", **width, **fields)
        for batch in batches:
            tokens_per_s, peak = variant_speed(config, batch, device, dtype, steps)
            rows.append({"variant": name, "batch": batch, "tokens_per_s": tokens_per_s, "peak_bytes": peak,
                         "kv_bytes_per_token": config.kv_cache_formula()})
    kind = "the compiled step (CUDA graphs)" if device.type == "cuda" else "the eager step"
    print(f"\n### Decode at a full cache ({width['block_size']} positions), {dtype}, {kind}, {steps} steps "
          f"timed: tokens/s counting every row of the batch, peak GB\n")
    print("| variant | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("| --- |" + " --- |" * len(batches))
    for name in VARIANTS:
        mine = [r for r in rows if r["variant"] == name]
        cells = [f"{r['tokens_per_s']:,.0f} / {r['peak_bytes'] / 1e9:.2f}" for r in mine]
        print(f"| {name} | " + " | ".join(cells) + " |")
    plot_variants(rows, out / "variants.png")
    return rows


def plot_variants(rows: list[dict], path: Path) -> None:
    """Tokens/s against peak memory, one line per variant through its batch sizes."""
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for name in VARIANTS:
        mine = [r for r in rows if r["variant"] == name]
        ax.plot([r["peak_bytes"] / 1e9 for r in mine], [r["tokens_per_s"] for r in mine], "o-", label=name)
        for r in mine:
            ax.annotate(f"{r['batch']}", (r["peak_bytes"] / 1e9, r["tokens_per_s"]), fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="peak memory (GB)", ylabel="decode tokens/s",
           title="Decode by batch size (labels), full cache")
    ax.legend()
    save_figure(fig, path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the script")
    parser.add_argument("--only", nargs="+", choices=["train", "decode", "variants"],
                        default=["train", "decode", "variants"])
    parser.add_argument("--levers", nargs="+", choices=list(LEVERS), default=None)
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu") / time.strftime("%Y-%m-%d_%H-%M-%S"))
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA device: run it on a GPU, or with --smoke")
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke: the numbers mean nothing)"
    print(f"{name}, PyTorch {torch.__version__}; results in {args.out}")
    results = {"device": str(device), "torch": torch.__version__, "smoke": args.smoke}
    if "train" in args.only:
        results["train"] = train_levers(args.levers or (SMOKE_LEVERS if args.smoke else list(LEVERS)),
                                        args.smoke, args.out)
        results["adamw_step_ms"] = optimizer_step_ms(device, args.smoke)
    if "decode" in args.only:
        results["decode"] = decode_section(device, args.smoke)
    if "variants" in args.only:
        results["variants"] = variants_section(device, args.smoke, args.out)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if not all(r["identical_tokens"] for r in results.get("decode", [])):
        sys.exit("error: the compiled step, the eager step and the uncached path gave different tokens")
    return results


if __name__ == "__main__":
    main()
