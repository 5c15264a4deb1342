"""The attention study in one command: MHA, GQA, MQA, MLA and MQA with cross-layer sharing, each
also through an int8 KV cache, and with a sliding window.

    python benchmarks/attention_study.py                            # CPU default, ~16 minutes on 2 cores
    python benchmarks/attention_study.py experiment=shakespeare_char # the GPU preset

Trains each attention variant with everything else identical (data, steps, batch, width, and the
same seeds: each seed fixes the init RNG and the batch order), once per seed in `study.seeds`. Each
run is scored by its loss over the whole val split (every token predicted once), and the study
reports mean ± std over seeds. A difference between two variants counts as larger than the seed
noise when their mean ± std ranges do not overlap (|difference| > std_a + std_b). Then it
measures KV-cache bytes per token, parameters, training tokens/s, and cached decode tokens/s at
several batch sizes at a long context (`study.decode_context`). Writes study.md, study.json and
three PNG plots into the study's run dir (Hydra's output dir).

Two more ways to shrink the cache get rows of their own. Each trained model of `study.int8_cache`
is scored again through an int8 cache, with no retraining: its whole-val-split loss teacher-forced
through the cache, against the float32 cache on the same weights. Each variant of `study.window`
is trained again with a sliding window (`model.attn_window`, a quarter of block_size unless
`study.window_size`), whose cache holds only the window. So that every row is on one scale, the
Pareto plot's x-axis is KV bytes per sequence at block_size.

MHA -> GQA/MQA conversion (mean-pooling K/V heads) is measured too: each seed's MHA model is
converted to `study.uptrain_to` and uptrained for `study.uptrain_iters` steps. There is no
MHA -> MLA conversion: our MLA keeps positions only in a narrow RoPE key shared by all heads,
while an MHA with RoPE rotates every dimension of every head's key, so a low-rank factorisation of
its K/V projections (as in MHA2MLA) drops the positions and needs a partial-RoPE retraining first.
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
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from cli.configs import composed_jobs, config_object
from cli.errors import exit_on_user_error, naming
from cli.options import check_options, model_config
from data.prepare import load_prepared
from model import GPT
from model.config import check_integer_fields
from model.convert import convert_checkpoint
from model.device import Precision, pick_device
from model.generation import decode_tokens_per_s, load_model
from training.evaluation import split_loss
from training.loop import train
from training.plots import pyplot, save_figure
from training.run_dir import read_metrics

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DECODE_STEPS = 8  # timed one-token steps per decode measurement (after as many warm-up steps)


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

    def __post_init__(self):
        check_integer_fields(self, "study.")
        options = sorted(p.stem for p in (CONFIGS / "attention").glob("*.yaml"))
        for name, values in (("variants", self.variants), ("uptrain_to", [self.uptrain_to]),
                             ("int8_cache", self.int8_cache), ("window", self.window)):
            if unknown := [v for v in values if v not in options]:
                raise ValueError(f"study.{name}: {', '.join(unknown)} is not an option of the attention "
                                 f"group ({', '.join(options)})")
        if not self.variants:
            raise ValueError("study.variants is empty: name at least one attention option")
        if self.window_size is not None and self.window_size < 1:
            raise ValueError(f"study.window_size must be >= 1 or null, got {self.window_size}")
        target = attention_option(self.uptrain_to)
        if target["mla_latent_dim"] is not None or target["kv_share"] != 1:
            raise ValueError(f"study.uptrain_to={self.uptrain_to}: mean-pooling converts MHA to fewer "
                             f"K/V heads only (mha, gqa, mqa)")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"study.seeds must be distinct seeds >= 0, at least one, got {self.seeds}")
        if not self.decode_batch_sizes or min(self.decode_batch_sizes) < 1:
            raise ValueError(f"study.decode_batch_sizes must be >= 1 each, got {self.decode_batch_sizes}")
        if self.decode_context < 2 * DECODE_STEPS:
            raise ValueError(f"study.decode_context must be >= {2 * DECODE_STEPS}, got {self.decode_context}")
        if self.uptrain_iters < 0:
            raise ValueError(f"study.uptrain_iters must be >= 0, got {self.uptrain_iters}")
        if self.uptrain_lr <= 0:
            raise ValueError(f"study.uptrain_lr must be > 0, got {self.uptrain_lr}")


ConfigStore.instance().store(name="study_schema", package="study", node=StudyConfig)


def variant_config(cfg: DictConfig, variant: str, seed: int, windowed: bool = False) -> DictConfig:
    """cfg with the attention group's option `variant` applied, as `attention=<variant>` would,
    the seed set, and the whole-val-split loss on; `windowed`: with the study's sliding window."""
    out = cfg.copy()
    out.model = OmegaConf.merge(out.model, attention_option(variant))
    if windowed:
        out.model.attn_window = cfg.study.window_size or max(1, cfg.model.block_size // 4)
    out.train.seed = seed
    out.train.full_val = True
    return out


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
    model = GPT(dataclasses.replace(config, block_size=study.decode_context, dropout=0.0)).to(device).eval()
    return {b: decode_tokens_per_s(model, b, study.decode_context, kv_dtype, DECODE_STEPS)
            for b in study.decode_batch_sizes}


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
        f"the cache in its row's dtype (float32 unless int8). KV bytes per sequence: one sequence of "
        f"block_size positions (a window model holds its window). "
        f"A difference is beyond seed noise when the mean ± std ranges do not overlap.\n\n"
        f"Pairs whose val loss differs by more than the seed noise:\n"
        + ("\n".join(pairs) if pairs else "- none") + "\n"
        + ("\nWhat the int8 cache costs: val loss through it minus through a float32 cache, the same "
           "weights (each run's last):\n" + "\n".join(precision) + "\n" if precision else ""))
    path.write_text(text)
    return text


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


ATTENTION_FIELDS = ("n_kv_head", "mla_latent_dim", "mla_rope_dim", "kv_share", "attn_window")


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
    convert_checkpoint(out_dir / "mha" / f"seed{seed}", n_kv_head, converted)
    return check_options(uptrain_config(cfg, seed, converted))


def train_row(label: str, row_dir: Path, options_for_seed, device, study) -> dict:
    """Train once per seed into row_dir/seed<seed>, with the checked options that
    `options_for_seed(seed)` returns, and summarize the runs as one row of the table."""
    runs = []
    for seed in study.seeds:
        print(f"=== {label}, seed {seed} ===", flush=True)
        run_dir = row_dir / f"seed{seed}"
        runs.append(run_record(run_dir, train(options_for_seed(seed), run_dir)))
    return summarize(runs, run_dir, device, study)


def run_study(cfg: DictConfig, out_dir: Path) -> dict:
    """Train every variant once per seed into out_dir/<variant>/seed<seed>, measure them, write
    study.md, study.json and the plots. Every run's options are checked before the first trains."""
    out_dir = Path(out_dir)
    study = config_object(cfg.study, "study.")
    with naming("train.device", "device"):
        device = pick_device(cfg.train.device)
    if cfg.train.resume:
        raise ValueError(f"train.resume={cfg.train.resume}: a study trains every row from scratch, each "
                         f"seed its own run; it resumes none (leave train.resume out)")
    checked = {(variant, seed): checked_row(variant_config(cfg, variant, seed), variant)
               for variant in study.variants for seed in study.seeds}
    windowed = {(variant, seed): checked_row(variant_config(cfg, variant, seed, windowed=True), variant)
                for variant in study.window for seed in study.seeds}
    uptrain = study.uptrain_iters and "mha" in study.variants
    if uptrain:
        for seed in study.seeds:
            check_options(uptrain_config(cfg, seed))
    rows = {}
    for variant in study.variants:
        rows[variant] = train_row(f"training {variant}", out_dir / variant,
                                  lambda seed, v=variant: checked[v, seed], device, study)
    for variant in study.window:
        name = f"{variant}, window {windowed[variant, study.seeds[0]].model.attn_window}"
        rows[name] = train_row(f"training {name}", out_dir / f"{variant}_window",
                               lambda seed, v=variant: windowed[v, seed], device, study)
    if uptrain:
        name = f"{study.uptrain_to} uptrained from mha ({study.uptrain_iters} steps)"
        rows[name] = train_row(name, out_dir / "uptrained", partial(uptrained, cfg, out_dir), device, study)
    for variant in (v for v in study.int8_cache if v in study.variants):
        print(f"=== {variant}: scoring each seed through an int8 cache ===", flush=True)
        runs = [int8_record(out_dir / variant / f"seed{seed}", checked[variant, seed], device)
                for seed in study.seeds]
        rows[f"{variant}, int8 cache"] = summarize(runs, out_dir / variant / f"seed{study.seeds[-1]}", device,
                                                   study, kv_dtype=torch.int8)
    table = write_table(rows, out_dir / "study.md", study)
    (out_dir / "study.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out_dir, study)
    print(table + f"\nwritten to {out_dir}: study.md, study.json, val_loss.png, val_vs_kv_bytes.png, "
          f"decode_by_batch.png")
    return rows


@hydra.main(config_path="../configs", config_name="study", version_base="1.3")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(run_study, cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    composed_jobs(Path(__file__).parents[1] / "configs", "study", sys.argv[1:])  # Hydra's errors: one line
    main()
