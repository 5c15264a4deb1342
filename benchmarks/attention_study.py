"""The attention study in one command: MHA, GQA, MQA, MLA and MQA with cross-layer sharing, each
also through an int8 KV cache, with a sliding window, with local and global layers, and with
attention sinks; and the loss at each position of sequences longer than the block.

    python benchmarks/attention_study.py                            # CPU default, ~20 minutes on 2 cores
    python benchmarks/attention_study.py experiment=shakespeare_char # the GPU preset

Trains each attention variant with everything else identical (data, steps, batch, width, and the
same seeds: each seed fixes the init RNG and the batch order), once per seed in `study.seeds`. Each
run is scored by its loss over the whole val split (every token predicted once), and the study
reports mean ± std over seeds. A difference between two variants counts as larger than the seed
noise when their mean ± std ranges do not overlap (|difference| > std_a + std_b). Then it
measures KV-cache bytes per token, parameters, training tokens/s, and cached decode tokens/s at
several batch sizes at a long context (`study.decode_context`). Writes study.md, study.json,
loss_by_position.json and four PNG plots into the study's run dir (Hydra's output dir).

More ways to shrink the cache get rows of their own. Each trained model of `study.int8_cache`
is scored again through an int8 cache, with no retraining: its whole-val-split loss teacher-forced
through the cache, against the float32 cache on the same weights. Each variant of `study.window`
is trained again with a sliding window (`model.attn_window`, a quarter of block_size unless
`study.window_size`), whose cache holds only the window; each of `study.local_global` with that
window on the layers `study.window_pattern` marks S and the whole context on those it marks L
(Gemma, gpt-oss); each of `study.sinks` with the window and `study.sink_count` attention sinks, the
first positions, which every windowed layer keeps seeing (StreamingLLM). So that every row is on
one scale, the Pareto plot's x-axis is KV bytes per sequence at block_size (a ring counts as its
slots).

Loss by position (`study.position_blocks`): each windowed model and its full-attention row, scored
at every position of val sequences position_blocks x block_size long (a model with a position limit,
learned positions or a global layer, up to block_size), shows what a window forgets and what sinks
keep. So does the StreamingLLM experiment: each `study.sinks` variant's full-attention weights, run
with the window at inference, with and without the sinks.

MHA -> GQA/MQA conversion (mean-pooling K/V heads) is measured too: each seed's MHA model is
converted to `study.uptrain_to` and uptrained for `study.uptrain_iters` steps. MHA -> MLA (MHA2MLA's
partial RoPE and SVD), and what every conversion costs a pretrained model: benchmarks/real_study.py.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from functools import partial
from itertools import combinations
from pathlib import Path
from statistics import mean, stdev

import hydra
import torch
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from cli.configs import composed_jobs, config_object
from cli.errors import exit_on_user_error, naming
from cli.options import check_options, model_config, train_run
from data.prepare import load_prepared
from model import GPT
from model.checkpoint import write_atomically
from model.config import check_integer_fields
from model.convert import convert_checkpoint
from model.device import Precision, pick_device
from model.loading import load_model
from model.timing import decode_tokens_per_s
from training.evaluation import split_loss
from training.plots import pyplot, save_figure
from training.run_dir import read_metrics

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DECODE_STEPS = 8  # timed one-token steps per decode measurement (after as many warm-up steps)
# The decode measurement's cache, at most: rows x positions a study could mean (GPT-2's block is 1,024).
MAX_DECODE_BATCH, MAX_DECODE_CONTEXT = 1024, 65_536


def attention_option(name: str) -> dict:
    """The model fields that `attention=<name>` sets."""
    return OmegaConf.to_container(OmegaConf.load(CONFIGS / "attention" / f"{name}.yaml"))


@dataclass
class StudyConfig:
    """The `study` node of configs/study.yaml."""

    variants: list[str] = field(default_factory=lambda: ["mha", "gqa", "mqa", "mla", "mqa_cla2"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # each variant trains once per seed
    decode_context: int = 1024  # cached positions when decode speed is measured
    decode_batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    uptrain_iters: int = 100  # > 0: also convert each trained MHA model to uptrain_to and uptrain it
    uptrain_to: str = "gqa"
    uptrain_lr: float = 1e-3
    int8_cache: list[str] = field(default_factory=lambda: ["mha", "gqa", "mqa", "mla"])  # those trained
    window: list[str] = field(default_factory=lambda: ["mha"])  # also trained with a sliding window
    window_size: int | None = None  # model.attn_window of those; None: a quarter of block_size
    local_global: list[str] = field(default_factory=lambda: ["mha"])  # also trained with window_pattern
    window_pattern: str = "SL"  # of those: per layer S (the window) or L (the whole context), tiled
    sinks: list[str] = field(default_factory=lambda: ["mha"])  # also trained windowed with sinks
    sink_count: int = 4  # model.attn_sinks of those
    position_blocks: int = 4  # loss by position over val sequences this many blocks long; 0: none
    position_bucket: int = 8  # positions averaged into one point of that curve

    def __post_init__(self):
        check_integer_fields(self, "study.")
        options = sorted(p.stem for p in (CONFIGS / "attention").glob("*.yaml"))
        for name, values in (("variants", self.variants), ("uptrain_to", [self.uptrain_to]),
                             ("int8_cache", self.int8_cache), ("window", self.window),
                             ("local_global", self.local_global), ("sinks", self.sinks)):
            if unknown := [v for v in values if v not in options]:
                raise ValueError(f"study.{name}: {', '.join(unknown)} is not an option of the attention "
                                 f"group ({', '.join(options)})")
        if not self.variants:
            raise ValueError("study.variants is empty: name at least one attention option")
        if self.window_size is not None and self.window_size < 1:
            raise ValueError(f"study.window_size must be >= 1 or null, got {self.window_size}")
        if not isinstance(self.window_pattern, str) or set(self.window_pattern) != {"S", "L"}:
            raise ValueError(f"study.window_pattern must be letters S (a layer within the window) and L "
                             f"(a layer over the whole context), both, e.g. SL or SSSL; got "
                             f"{self.window_pattern!r}")
        for name in ("sink_count", "position_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"study.{name} must be >= 1, got {getattr(self, name)}")
        if self.position_blocks < 0:
            raise ValueError(f"study.position_blocks must be >= 0 (0: no loss by position), "
                             f"got {self.position_blocks}")
        target = attention_option(self.uptrain_to)
        if target["mla_latent_dim"] is not None or target["kv_share"] != 1:
            raise ValueError(f"study.uptrain_to={self.uptrain_to}: mean-pooling converts MHA to fewer "
                             f"K/V heads only (mha, gqa, mqa)")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"study.seeds must be distinct seeds >= 0, at least one, got {self.seeds}")
        batches = self.decode_batch_sizes
        if not batches or not all(1 <= b <= MAX_DECODE_BATCH for b in batches):
            raise ValueError(f"study.decode_batch_sizes must be in 1..{MAX_DECODE_BATCH:,} each (rows of a "
                             f"cache of decode_context positions), got {self.decode_batch_sizes}")
        if not 2 * DECODE_STEPS <= self.decode_context <= MAX_DECODE_CONTEXT:
            raise ValueError(f"study.decode_context must be in {2 * DECODE_STEPS}..{MAX_DECODE_CONTEXT:,} "
                             f"(the positions of each row's cache), got {self.decode_context:,}")
        if self.uptrain_iters < 0:
            raise ValueError(f"study.uptrain_iters must be >= 0, got {self.uptrain_iters}")
        if self.uptrain_lr <= 0:
            raise ValueError(f"study.uptrain_lr must be > 0, got {self.uptrain_lr}")


ConfigStore.instance().store(name="study_schema", package="study", node=StudyConfig)


def variant_config(cfg: DictConfig, variant: str, seed: int, model_fields: dict | None = None) -> DictConfig:
    """cfg with the attention group's option `variant` applied, as `attention=<variant>` would,
    the seed set, and the whole-val-split loss on; `model_fields` (a window, ...) set over them."""
    out = cfg.copy()
    out.model = OmegaConf.merge(out.model, attention_option(variant), model_fields or {})
    out.train.seed = seed
    out.train.full_val = True
    return out


def window_size(cfg: DictConfig) -> int:
    """The study's sliding window: study.window_size, or a quarter of block_size."""
    return cfg.study.window_size or max(1, cfg.model.block_size // 4)


def windowed_rows(cfg: DictConfig, study) -> list[tuple[str, str, str, dict]]:
    """(row name, its directory, its variant, the model fields it sets) of every row trained with
    the window: alone (study.window), on the S layers of study.window_pattern (study.local_global),
    with study.sink_count sinks (study.sinks)."""
    w, pattern, n = window_size(cfg), study.window_pattern, study.sink_count
    return ([(f"{v}, window {w}", f"{v}_window", v, {"attn_window": w}) for v in study.window]
            + [(f"{v}, window {w} / global ({pattern})", f"{v}_window_global", v,
                {"attn_window": w, "window_pattern": pattern}) for v in study.local_global]
            + [(f"{v}, window {w} + {n} sinks", f"{v}_window_sinks", v, {"attn_window": w, "attn_sinks": n})
               for v in study.sinks])


def uptrain_config(cfg: DictConfig, seed: int, converted: Path | None = None) -> DictConfig:
    """The config that uptrains the MHA model `converted` to the target variant for
    study.uptrain_iters steps (without `converted`: the options it will have, to check them)."""
    target = variant_config(cfg, cfg.study.uptrain_to, seed)
    target.init_from = str(converted) if converted else None
    target.train.max_iters = cfg.study.uptrain_iters
    target.train.lr = cfg.study.uptrain_lr
    target.train.warmup_iters = min(cfg.train.warmup_iters, cfg.study.uptrain_iters // 10)
    target.train.eval_interval = max(1, cfg.study.uptrain_iters // 4)
    return target


def decode_speeds(config, study, device, kv_dtype=None) -> dict:
    """{batch size: tokens/s} of cached one-token steps at study.decode_context positions, for a
    model of `config`'s shape with random weights (speed does not depend on them)."""
    torch.manual_seed(0)
    model = GPT(decode_config(config, study)).to(device).eval()
    return {b: decode_tokens_per_s(model, b, study.decode_context, kv_dtype, DECODE_STEPS)
            for b in study.decode_batch_sizes}


def decode_config(config, study):
    """The model decode speed is measured on: `config`'s shape with a block of study.decode_context
    positions (all its cache holds), no dropout; refused, naming the study's option, where that block
    is too short for the model (a window or sinks past it)."""
    with naming("study.decode_context", "block_size"), naming("model", "GPTConfig"):
        return dataclasses.replace(config, block_size=study.decode_context, dropout=0.0)


def run_record(run_dir: Path, summary: dict) -> dict:
    """What one training run gives the study: its whole-val-split loss, its sampled val curve and
    its median training speed."""
    if summary.get("interrupted"):  # train() saved ckpt.pt and said how to continue that run
        raise KeyboardInterrupt
    records = read_metrics(run_dir)
    speeds = sorted(r["tokens_per_s"] for r in records if "tokens_per_s" in r)
    return {"val_loss": summary["val_loss_full"],
            "val_curve": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r],
            "train_tokens_per_s": speeds[len(speeds) // 2]}


def int8_record(run_dir: Path, run, device) -> dict:
    """What scoring a trained run through an int8 cache gives the study: the whole-val-split loss
    of its last weights (ckpt.pt, those of its own score) through an int8 cache and through a
    float32 one, teacher-forced. Not trained: no curve, no training speed."""
    model, _ = load_model(run_dir / "ckpt.pt", device, Precision("float32", None))
    val, batch = torch.from_numpy(load_prepared(run.data_dir)[2].astype("int64")), run.train.batch_size
    return {"val_loss": split_loss(model, val, windows_per_batch=batch, kv_dtype=torch.int8),
            "float32_cache_loss": split_loss(model, val, windows_per_batch=batch, kv_dtype=torch.float32),
            "val_curve": [], "train_tokens_per_s": None}


def summarize(runs: list[dict], run_dir: Path, device, study, kv_dtype=None) -> dict:
    """One row of the table: the variant's model facts, its cache's size (in kv_dtype, default
    float32), and its runs' mean and spread."""
    model, _ = load_model(run_dir / "best.pt", device, Precision("float32", None))
    config, cache = model.config, model.new_kv_cache(1, dtype=kv_dtype)
    losses = [r["val_loss"] for r in runs]
    speeds = [r["train_tokens_per_s"] for r in runs if r["train_tokens_per_s"] is not None]
    return {
        "n_kv_head": config.n_kv_head, "mla_latent_dim": config.mla_latent_dim,
        "mla_rope_dim": config.mla_rope_dim, "kv_share": config.kv_share, "attn_window": config.attn_window,
        "window_pattern": config.window_pattern, "attn_sinks": config.attn_sinks,
        "kv_dtype": str(cache.dtype).removeprefix("torch."), "params": model.num_params(),
        "kv_formula": config.kv_cache_formula() + (" (int8) + a scale per head" if cache.quantized else ""),
        "kv_bytes_per_token": cache.bytes_per_token,
        "kv_bytes_per_sequence": cache.nbytes,  # at block_size: a window model holds its window
        "val_loss_mean": mean(losses), "val_loss_std": stdev(losses) if len(losses) > 1 else 0.0,
        "val_losses": losses, "seeds": list(study.seeds),
        "float32_cache_losses": [r["float32_cache_loss"] for r in runs if "float32_cache_loss" in r],
        "val_curve": mean_curve([r["val_curve"] for r in runs]),
        "train_tokens_per_s": mean(speeds) if speeds else None,
        "decode": decode_speeds(config, study, device, kv_dtype),
    }


def mean_curve(curves: list[list]) -> list:
    """The seeds' sampled val curves averaged step by step (every run evaluates at the same steps)."""
    return [(steps[0][0], mean(loss for _, loss in steps)) for steps in zip(*curves)]


def beyond_noise(a: dict, b: dict) -> bool:
    """Whether two rows' mean val losses differ by more than the seeds' spread: their
    mean ± std ranges do not overlap. Needs at least two seeds."""
    if len(a["val_losses"]) < 2 or len(b["val_losses"]) < 2:
        return False
    return abs(a["val_loss_mean"] - b["val_loss_mean"]) > a["val_loss_std"] + b["val_loss_std"]


def write_table(rows: dict, path: Path, study) -> str:
    """study.md: the table, then every pair of rows whose difference exceeds the seed noise."""
    names = list(rows)
    base = rows[names[0]]
    batches = study.decode_batch_sizes
    head = (f"| variant | KV cache per token | KV bytes/token | params | val loss (whole split, "
            f"{len(study.seeds)} seeds) | vs {names[0]} | beyond seed noise? | "
            + " | ".join(f"decode tok/s, batch {b}" for b in batches) + " | train tok/s |")
    head = head.replace(" | params |", " | KV bytes/sequence | params |")
    lines = [head, "|" + " --- |" * (9 + len(batches))]
    for name, r in rows.items():
        delta = r["val_loss_mean"] - base["val_loss_mean"]
        noise = "—" if r is base else ("**yes**" if beyond_noise(r, base) else "no")
        decode = " | ".join(f"{r['decode'][b]:,.0f}" for b in batches)
        train_speed = "—" if r["train_tokens_per_s"] is None else f"{r['train_tokens_per_s']:,.0f}"
        lines.append(f"| {name} | {r['kv_formula']} | {r['kv_bytes_per_token']:,} | "
                     f"{r['kv_bytes_per_sequence']:,} | {r['params']:,} | "
                     f"{r['val_loss_mean']:.4f} ± {r['val_loss_std']:.4f} | {delta:+.4f} | {noise} | "
                     f"{decode} | {train_speed} |")
    costs = {name: [a - b for a, b in zip(r["val_losses"], r["float32_cache_losses"])]
             for name, r in rows.items() if r["float32_cache_losses"]}
    precision = [f"- {name}: {mean(c):+.5f} (seeds: {', '.join(f'{d:+.5f}' for d in c)})"
                 for name, c in costs.items()]
    pairs = [f"- {a} {'<' if rows[a]['val_loss_mean'] < rows[b]['val_loss_mean'] else '>'} {b}: "
             f"{rows[a]['val_loss_mean'] - rows[b]['val_loss_mean']:+.4f}"
             for a, b in combinations(names, 2) if beyond_noise(rows[a], rows[b])]
    text = "\n".join(lines) + (
        f"\n\nDecode: cached one-token steps at context {study.decode_context}, float32 weights, eager, "
        f"the cache in its row's dtype (float32 unless int8). KV bytes per token: what one cached "
        f"position holds (with local and global layers, the average over block_size). KV bytes per "
        f"sequence: one sequence of block_size positions (a windowed layer holds its window and sinks). "
        f"A difference is beyond seed noise when the mean ± std ranges do not overlap.\n\n"
        f"Pairs whose val loss differs by more than the seed noise:\n"
        + ("\n".join(pairs) if pairs else "- none") + "\n"
        + ("\nWhat the int8 cache costs: val loss through it minus through a float32 cache, the same "
           "weights (each run's last):\n" + "\n".join(precision) + "\n" if precision else ""))
    write_report(path, text)
    return text


def write_report(path: Path, text: str) -> None:
    """A file of the study's report, complete or not at all (an earlier one stays if the write fails)."""
    with naming("hydra.run.dir"):  # the study's folder: a full disk names it
        write_atomically(path, lambda f: f.write(text.encode()), "report")


def pareto_front(rows: dict) -> list[str]:
    """The rows no other row beats on both KV bytes per sequence and mean val loss, by bytes."""
    def point(r):
        return r["kv_bytes_per_sequence"], r["val_loss_mean"]

    def beats(a, b):  # a is no worse on both axes, and better on one
        return a != b and a[0] <= b[0] and a[1] <= b[1]

    front = [n for n, r in rows.items() if not any(beats(point(o), point(r)) for o in rows.values())]
    return sorted(front, key=lambda n: rows[n]["kv_bytes_per_sequence"])


def plot(rows: dict, out_dir: Path, study) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rows.items():
        if r["val_curve"]:  # rows scored through another cache were not trained
            ax.plot(*zip(*r["val_curve"]), marker="o", label=name)
    ax.set(xlabel="step", ylabel=f"val loss (sampled, mean of {len(study.seeds)} seeds)",
           title="Validation loss")
    ax.legend(fontsize=8)
    save_figure(fig, out_dir / "val_loss.png")

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    front = pareto_front(rows)
    ax.plot([rows[n]["kv_bytes_per_sequence"] for n in front], [rows[n]["val_loss_mean"] for n in front],
            color="0.7", zorder=0, label="Pareto front")
    for name, r in rows.items():
        ax.errorbar(r["kv_bytes_per_sequence"], r["val_loss_mean"], yerr=r["val_loss_std"], fmt="o",
                    capsize=4)
        ax.annotate(name, (r["kv_bytes_per_sequence"], r["val_loss_mean"]), xytext=(6, 4),
                    textcoords="offset points", fontsize=8)
    ax.set_xscale("log")
    ax.set(xlabel="KV cache bytes per sequence of block_size positions (log scale)",
           ylabel=f"val loss, whole split (mean ± std, {len(study.seeds)} seeds)",
           title="Loss vs KV cache size")
    ax.legend(fontsize=8)
    save_figure(fig, out_dir / "val_vs_kv_bytes.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rows.items():
        ax.plot(study.decode_batch_sizes, [r["decode"][b] for b in study.decode_batch_sizes], marker="o",
                label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="batch size", ylabel="decode tokens/s (KV cache)",
           title=f"Decode speed at context {study.decode_context}")
    ax.legend(fontsize=8)
    save_figure(fig, out_dir / "decode_by_batch.png")


POSITION_BATCH = 16  # sequences per forward pass of the loss by position


def position_models(cfg: DictConfig, study, out_dir: Path) -> list[tuple[str, Path, dict]]:
    """(label, row directory, model fields changed at inference) of each model whose loss by position
    the study measures: every windowed row (a sinks row also run without its sinks), the
    full-attention row of its variant, and each study.sinks variant's full-attention weights run with
    the window, without and with the sinks (StreamingLLM's experiment); none without a windowed row."""
    windowed = windowed_rows(cfg, study)
    if not windowed:
        return []
    w, n = window_size(cfg), study.sink_count
    full = [v for v in dict.fromkeys(v for _, _, v, _ in windowed) if v in study.variants]
    models = [(v, out_dir / v, {}) for v in full]
    for name, directory, _, fields in windowed:
        models.append((name, out_dir / directory, {}))
        if fields.get("attn_sinks"):
            models.append((f"{name}, run without them", out_dir / directory, {"attn_sinks": 0}))
    for v in (v for v in study.sinks if v in study.variants):
        models += [(f"{v} weights, run with window {w}", out_dir / v, {"attn_window": w}),
                   (f"{v} weights, run with window {w} + {n} sinks", out_dir / v,
                    {"attn_window": w, "attn_sinks": n})]
    return models


def position_sequences(run, study) -> torch.Tensor:
    """Sequences of study.position_blocks x block_size tokens of the val split and the token each
    predicts next, one starting every block_size tokens: (N, length + 1). So every block of positions
    (0 .. block_size - 1, block_size .. 2 block_size - 1, ...) covers the same text, but for a few
    blocks at the split's ends: what differs between them is the position alone."""
    length = study.position_blocks * run.model.block_size
    val = torch.from_numpy(load_prepared(run.data_dir)[2].astype("int64"))
    if len(val) < length + 1:
        raise ValueError(f"study.position_blocks={study.position_blocks}: a sequence of {length} tokens "
                         f"needs a val split of {length + 1} tokens or more, this one has {len(val)} "
                         f"(0: no loss by position)")
    return val.unfold(0, length + 1, run.model.block_size)              # (N, length + 1)


@torch.no_grad()
def position_losses(model, sequences: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy at each position t of `sequences` (N, L + 1), predicting token t + 1 from
    tokens 0 .. t with the uncached forward: (L,), or (block_size,) for a model with a position
    limit (learned positions, a layer over the whole context)."""
    device = next(model.parameters()).device
    n = min(sequences.size(1) - 1, model.config.max_positions or sequences.size(1))
    total = torch.zeros(n, dtype=torch.float64)
    for batch in sequences.split(POSITION_BATCH):
        batch = batch.to(device)
        logits = model(batch[:, :n])                                     # (b, n, vocab_size)
        losses = F.cross_entropy(logits.transpose(1, 2).float(), batch[:, 1:n + 1],
                                 reduction="none")                       # (b, n)
        total += losses.sum(dim=0).double().cpu()
    return total / len(sequences)


def inference_model(run_dir: Path, device, fields: dict) -> GPT:
    """A run's last weights (ckpt.pt, those of its score), in a model with `fields` of its config
    changed (a window given at inference), in eval mode."""
    model, _ = load_model(run_dir / "ckpt.pt", device, Precision("float32", None))
    if not fields:
        return model
    changed = GPT(dataclasses.replace(model.config, **fields)).to(device)
    changed.load_state_dict(model.state_dict())
    return changed.eval()


def position_curve(per_seed: list[torch.Tensor], bucket: int, bounds: list[int], trained: bool) -> dict:
    """The seeds' losses by position (each (n,)) as one curve: mean and std over the seeds of each
    bucket of `bucket` positions, and of each range between consecutive `bounds` the curve reaches."""
    def spread(values: list[float]) -> tuple[float, float]:
        return mean(values), stdev(values) if len(values) > 1 else 0.0

    n = len(per_seed[0])
    buckets = [spread([c[i:i + bucket].mean().item() for c in per_seed]) for i in range(0, n, bucket)]
    ranges = {f"{a}-{b - 1}": spread([c[a:b].mean().item() for c in per_seed])
              for a, b in zip(bounds, bounds[1:]) if b <= n}
    return {"trained": trained, "positions": n,
            "bucket_centres": [(i + min(i + bucket, n) - 1) / 2 for i in range(0, n, bucket)],
            "loss_mean": [m for m, _ in buckets], "loss_std": [s for _, s in buckets], "ranges": ranges}


def plot_positions(curves: dict, path: Path, window: int, block_size: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, c in curves.items():
        ax.plot(c["bucket_centres"], c["loss_mean"], label=label, linestyle="-" if c["trained"] else "--")
    for x, text in ((window, f"window {window}"), (block_size, f"block_size {block_size}")):
        ax.axvline(x, color="0.6", linestyle=":")
        ax.annotate(text, (x, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="0.4")
    ax.set(xlabel="position in the sequence", ylabel="val loss at that position (mean of seeds)",
           title="Loss by position (dashed: window or sinks changed at inference)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def position_table(curves: dict, bounds: list[int]) -> list[str]:
    """The markdown table of each curve's mean ± std over seeds in each range of positions."""
    spans = [f"{a}-{b - 1}" for a, b in zip(bounds, bounds[1:])]
    lines = ["| model | " + " | ".join(f"positions {s}" for s in spans) + " |",
             "|" + " --- |" * (len(spans) + 1)]
    for label, c in curves.items():
        cells = [f"{c['ranges'][s][0]:.4f} ± {c['ranges'][s][1]:.4f}" if s in c["ranges"] else "—"
                 for s in spans]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def write_positions(cfg: DictConfig, models: list, sequences: torch.Tensor, out_dir: Path, device,
                    study, table: str) -> str:
    """Measure each model's loss by position on every seed; write loss_by_position.json and .png,
    the table of its ranges after study.md's `table`, and return that table."""
    window, block_size, length = window_size(cfg), cfg.model.block_size, sequences.size(1) - 1
    bounds = sorted({0, window, length} | set(range(block_size, length, block_size)))
    curves = {}
    for label, row_dir, fields in models:
        print(f"=== loss by position: {label} ===", flush=True)
        per_seed = [position_losses(inference_model(row_dir / f"seed{s}", device, fields), sequences)
                    for s in study.seeds]
        curves[label] = position_curve(per_seed, study.position_bucket, bounds, trained=not fields)
    text = (f"\nLoss by position: the cross-entropy at each position of {len(sequences)} val sequences of "
            f"{length} tokens, one starting every {block_size} (each block of positions covers the same "
            f"text), uncached, averaged over each range of positions; mean ± std over {len(study.seeds)} "
            f"seeds (—: past the model's block_size). \"run with\", \"run without\": the trained weights, "
            f"their window or sinks changed at inference.\n\n"
            + "\n".join(position_table(curves, bounds)) + "\n")
    write_report(out_dir / "study.md", table + text)  # study.md written again, whole: never half appended
    write_report(out_dir / "loss_by_position.json", json.dumps(
        {"sequences": len(sequences), "length": length, "stride": block_size, "bucket": study.position_bucket,
         "curves": curves},
        indent=1))
    with naming("hydra.run.dir"):
        plot_positions(curves, out_dir / "loss_by_position.png", window, block_size)
    return text


ATTENTION_FIELDS = ("n_kv_head", "mla_latent_dim", "mla_rope_dim", "kv_share", "attn_window",
                    "window_pattern", "attn_sinks", "attn_sink_logit")


def checked_row(row_cfg: DictConfig, variant: str):
    """The checked options of one run of a row, whose model must be the variant the row names: what
    its config asks for in every attention field. init_from would give it the architecture of the
    checkpoint instead (every row the same model), which no row of a study may be."""
    run = check_options(row_cfg)
    asked = model_config(row_cfg.model, run.model.vocab_size)
    for name in ATTENTION_FIELDS:
        got, want = getattr(run.model, name), getattr(asked, name)
        if got != want:
            raise ValueError(f"study: the {variant} row would train a model with {name}={got}, not {want}: "
                             f"init_from={row_cfg.init_from} gives every row its own architecture; a study "
                             f"row must be the variant it names (leave init_from out, or study only the "
                             f"variants it is)")
    return run


def uptrained(cfg: DictConfig, out_dir: Path, seed: int):
    """Convert seed's trained MHA model to study.uptrain_to by mean-pooling its K/V heads (Ainslie
    et al. 2023); the checked options that uptrain it."""
    n_kv_head = OmegaConf.to_container(uptrain_config(cfg, seed).model, resolve=True)["n_kv_head"]
    converted = out_dir / f"mha_to_{cfg.study.uptrain_to}_seed{seed}.pt"
    with naming("hydra.run.dir"):  # both checkpoints are in the study's folder
        convert_checkpoint(out_dir / "mha" / f"seed{seed}", n_kv_head, converted)
    return check_options(uptrain_config(cfg, seed, converted))


def train_row(label: str, row_dir: Path, options_for_seed, device, study) -> dict:
    """Train once per seed into row_dir/seed<seed>, with the checked options that
    `options_for_seed(seed)` returns, and summarize the runs as one row of the table."""
    runs = []
    for seed in study.seeds:
        print(f"=== {label}, seed {seed} ===", flush=True)
        run_dir = row_dir / f"seed{seed}"
        runs.append(run_record(run_dir, train_run(options_for_seed(seed), run_dir)))
    return summarize(runs, run_dir, device, study)


def checked_runs(cfg: DictConfig, study) -> dict:
    """{(row name, seed): checked options} of every run that trains a row (each variant's, then each
    windowed row's), the uptraining's checked too: nothing trains before all are."""
    checked = {(variant, seed): checked_row(variant_config(cfg, variant, seed), variant)
               for variant in study.variants for seed in study.seeds}
    with (naming("study.window_pattern", "model.window_pattern"),  # what those rows set, as the study
          naming("study.sink_count", "model.attn_sinks")):             # names it
        checked |= {(name, seed): checked_row(variant_config(cfg, variant, seed, fields), variant)
                    for name, _, variant, fields in windowed_rows(cfg, study) for seed in study.seeds}
    if study.uptrain_iters and "mha" in study.variants:
        for seed in study.seeds:
            check_options(uptrain_config(cfg, seed))
    for run in checked.values():  # each row's decode speed, measured once it has trained
        decode_config(run.model, study)
    return checked


def run_study(cfg: DictConfig, out_dir: Path) -> dict:
    """Train every variant once per seed into out_dir/<variant>/seed<seed>, measure them, write
    study.md, study.json, loss_by_position.json and the plots. Every run's options (and the val
    split's length for the loss by position) are checked before the first trains."""
    out_dir = Path(out_dir)
    study = config_object(cfg.study, "study.")
    with naming("train.device", "device"):
        device = pick_device(cfg.train.device)
    if cfg.train.resume:
        raise ValueError(f"train.resume={cfg.train.resume}: a study trains every row from scratch, each "
                         f"seed its own run; it resumes none (leave train.resume out)")
    checked = checked_runs(cfg, study)
    models = position_models(cfg, study, out_dir) if study.position_blocks else []
    sequences = position_sequences(next(iter(checked.values())), study) if models else None
    rows = {}
    for variant in study.variants:
        rows[variant] = train_row(f"training {variant}", out_dir / variant,
                                  lambda seed, v=variant: checked[v, seed], device, study)
    for name, directory, _, _ in windowed_rows(cfg, study):
        rows[name] = train_row(f"training {name}", out_dir / directory,
                               lambda seed, n=name: checked[n, seed], device, study)
    if study.uptrain_iters and "mha" in study.variants:
        name = f"{study.uptrain_to} uptrained from mha ({study.uptrain_iters} steps)"
        rows[name] = train_row(name, out_dir / "uptrained", partial(uptrained, cfg, out_dir), device, study)
    for variant in (v for v in study.int8_cache if v in study.variants):
        print(f"=== {variant}: scoring each seed through an int8 cache ===", flush=True)
        runs = [int8_record(out_dir / variant / f"seed{seed}", checked[variant, seed], device)
                for seed in study.seeds]
        rows[f"{variant}, int8 cache"] = summarize(runs, out_dir / variant / f"seed{study.seeds[-1]}", device,
                                                   study, kv_dtype=torch.int8)
    table = write_table(rows, out_dir / "study.md", study)
    write_report(out_dir / "study.json", json.dumps(rows, indent=1))
    with naming("hydra.run.dir"):
        plot(rows, out_dir, study)
    if models:
        table += write_positions(cfg, models, sequences, out_dir, device, study, table)
    print(table + f"\nwritten to {out_dir}: study.md, study.json, val_loss.png, val_vs_kv_bytes.png, "
          f"decode_by_batch.png" + (", loss_by_position.json, loss_by_position.png" if models else ""))
    return rows


@hydra.main(config_path="../configs", config_name="study", version_base="1.3")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(run_study, cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    composed_jobs(Path(__file__).parents[1] / "configs", "study", sys.argv[1:])  # Hydra's errors: one line
    main()
