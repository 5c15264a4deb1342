"""What shrinking the KV cache costs a real model, in one command: a pretrained Llama-family model
(a Hugging Face folder, a GGUF file, or a run of ours with RoPE) scored as it is and through each
way of shrinking its cache, training-free and uptrained, on the same held-out text.

    python benchmarks/real_study.py --ckpt path/to/SmolLM2-135M-Instruct         # ~19 min on 2 CPU cores
    python benchmarks/real_study.py --ckpt path/to/SmolLM2-135M-Instruct --steps 1000 --device cuda

The text is TinyShakespeare's (or --text FILE's) last 10%, in the model's own tokenizer, cut into
consecutive sequences of --context tokens; every token of it is predicted once, and each row's loss
is the mean over all of them. Rows (each also decoded: tokens/s of one-token steps, batch 1, at the
end of a --context-long cache):

- the model as it is, with a float32 cache (the baseline: the uncached model's numbers), a bfloat16
  cache, our int8 cache, and an int4 cache whose last --int4-recent positions stay float32 (KIVI's
  and transformers' QuantizedCache's recipe): every row teacher-forced through its cache, which is
  what decoding through it reads;
- sliding windows (--windows), without and with StreamingLLM's --sinks first positions kept;
- GQA -> MQA (the K/V heads mean-pooled), MHA2MLA's MLA retrofit (partial RoPE on the --rope-pairs
  frequency pairs of each K/V head that contribute most, the rest of the keys and the values
  factorised by one truncated SVD into a latent of each --latent width) and cross-layer sharing
  (kv_share=2, each pair of layers' K/V projections averaged), training-free and, with --steps > 0,
  uptrained; the baseline uptrained by the same recipe, which every uptrained row is compared with.

KV bytes per token are the bytes a cache holds for one sequence of --context positions divided by
them (a window holds only its window and sinks; the int4 cache's float32 window is counted), by
the formula (`kv_bytes_formula`, from the shapes) and as measured (the cache's own tensors).

Writes real_study.md, real_study.json, pareto.png (loss against KV bytes per token) and
loss_by_position.png (the windows) into --out. Each row is appended to rows.jsonl as it ends: a
run stopped part-way and started again with the same settings keeps the rows done.
"""

import copy
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the GPU machine runs it from a checkout, not an install

from cli.errors import ArgumentParser, exit_on_user_error, naming  # noqa: E402
from data.prepare import TINYSHAKESPEARE_PATH, read_text_files  # noqa: E402
from data.tokenizer import tokenizer_from_meta  # noqa: E402
from model.checkpoint import write_atomically  # noqa: E402
from model.config import check_integer  # noqa: E402
from model.device import Precision, pick_device  # noqa: E402
from model.loading import load_model  # noqa: E402
from model.retrofit import (  # noqa: E402
    check_latent_sizes,
    check_retrofit,
    mla_retrofit,
    pool_kv_heads,
    rebuilt,
    rope_pair_scores,
    share_kv,
)
from model.timing import decode_tokens_per_s  # noqa: E402
from training.evaluation import target_windows  # noqa: E402
from training.plots import pyplot, save_figure  # noqa: E402

VAL_FRACTION = 0.1  # the held-out end of the text, as data/prepare.py splits a corpus
STORAGE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}  # bytes a number of the cache takes
SCORE_ROWS = 4  # sequences scored at once
DECODE_STEPS = 8  # timed one-token steps per decode measurement (after as many warm-up steps)
CALIBRATION_ROWS = 8  # training sequences the RoPE pairs are chosen on (MHA2MLA's 2-norm)
POSITION_BUCKET = 16  # positions averaged into one point of the loss-by-position curve
# The options the rows' numbers depend on, besides the model and the text: a run with others starts over.
SETTINGS = ("context", "windows", "sinks", "int4_recent", "int4_group", "latent", "rope_pairs", "steps",
            "batch", "train_context", "lr")
MINIMUM = {"context": 2 * DECODE_STEPS, "batch": 1, "train_context": 2, "int4_group": 2}  # of each option


@dataclass
class Row:
    """One row of the study: how its model is made from the pretrained one (`build`, None: as it
    is), the cache it decodes through (`storage`: float32, bfloat16, int8 or int4), and whether it
    is uptrained first."""

    name: str
    method: str  # what it does to the cache, for the table's grouping: precision, window, ...
    build: object = None
    storage: str = "float32"
    uptrained: bool = False


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a Llama-family Hugging Face folder, a .gguf file, our run")
    p.add_argument("--text", help="a UTF-8 text file: trained on its first 90%%, scored on the rest "
                                  "(default: TinyShakespeare)")
    p.add_argument("--context", type=int, default=512, help="tokens per scored sequence")
    p.add_argument("--eval-tokens", type=int, help="score only the first N held-out tokens (default: all)")
    p.add_argument("--windows", type=int, nargs="+", default=[64, 256], help="sliding windows tried")
    p.add_argument("--sinks", type=int, default=4, help="first positions the windowed rows with sinks keep")
    p.add_argument("--int4-recent", type=int, default=32, help="last positions int4 keeps in float32")
    p.add_argument("--int4-group", type=int, default=32, help="numbers sharing one int4 scale")
    p.add_argument("--latent", type=int, nargs="+", default=[96, 48], help="MLA retrofit latent widths d_c")
    p.add_argument("--rope-pairs", type=int, default=4, help="RoPE frequency pairs each K/V head keeps (MLA)")
    p.add_argument("--steps", type=int, default=16, help="uptraining steps per uptrained row (0: none)")
    p.add_argument("--batch", type=int, default=2, help="uptraining sequences per step")
    p.add_argument("--train-context", type=int, default=256, help="tokens per uptraining sequence")
    p.add_argument("--lr", type=float, default=3e-4, help="uptraining's peak learning rate (AdamW)")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda, cuda:1, ...")
    p.add_argument("--out", help="the output folder (default: ./outputs/real_study/<the model's name>)")
    return p.parse_args(argv)


def check_args(args) -> None:
    """Every option the study itself reads, checked before anything is loaded: one line naming it.
    (The conversions and caches check their own: the messages name the option too.)"""
    for option in ("context", "sinks", "int4_recent", "int4_group", "rope_pairs", "steps", "batch",
                   "train_context"):
        check_integer(getattr(args, option), f"--{option.replace('_', '-')}", MINIMUM.get(option, 0))
    if args.eval_tokens is not None:
        check_integer(args.eval_tokens, "--eval-tokens", 2)
    for w in args.windows:
        check_integer(w, "--windows", 1, args.context - 1)  # under the context, or it changes nothing
    for width in args.latent:
        check_integer(width, "--latent", 1)
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    if args.text is not None and not Path(args.text).is_file():
        raise FileNotFoundError(f"--text: no such file: {args.text}")


# ----------------------------------------------------------------------------- the rows

def windowed(model, window: int, sinks: int):
    """The model with every layer seeing only its last `window` positions (and the first `sinks`)."""
    return with_config(model, attn_window=window, attn_sinks=sinks)


def with_config(model, **fields):
    """A copy of the model whose config has `fields` changed (the weights as they are)."""
    return rebuilt(model, dataclasses.replace(model.config, **fields), model.state_dict())


def study_rows(args, config, scores) -> list[Row]:
    """Every row, in the table's order: the cache's precision, the windows, then each conversion
    training-free, then (with --steps) the baseline and each conversion uptrained."""
    rows = [Row("as is, float32 cache", "baseline"),
            Row("as is, bfloat16 cache", "precision", storage="bfloat16"),
            Row("int8 cache", "precision", storage="int8"),
            Row(f"int4 cache, last {args.int4_recent} float32", "precision", storage="int4")]
    for w in args.windows:
        rows.append(Row(f"window {w}", "window", lambda m, w=w: windowed(m, w, 0)))
        if args.sinks:
            rows.append(Row(f"window {w} + {args.sinks} sinks", "window",
                            lambda m, w=w: windowed(m, w, args.sinks)))
    convert = [Row(f"GQA {config.n_kv_head} -> MQA", "mqa", lambda m: pool_kv_heads(m, 1))]
    for width in args.latent:
        convert.append(Row(f"MLA retrofit, d_c {width}, {args.rope_pairs} RoPE pairs", "mla",
                           lambda m, width=width: retrofitted(m, width, args.rope_pairs, scores)))
    convert.append(Row("kv_share 2", "share", lambda m: share_kv(m, 2)))
    rows += convert
    if args.steps:
        rows.append(Row("as is", "baseline", copy.deepcopy, uptrained=True))
        rows += [dataclasses.replace(row, uptrained=True) for row in convert]
    return rows


def retrofitted(model, latent_dim: int, rope_pairs: int, scores):
    with naming("--latent", "latent_dim"), naming("--rope-pairs", "rope_pairs"):
        return mla_retrofit(model, latent_dim, rope_pairs, scores)


def row_model(row: Row, base, args, train_ids, device):
    """The row's model on `device`: built from the base model (a copy where it changes anything),
    uptrained when the row says so."""
    model = base if row.build is None else row.build(base)
    model = model.to(device)
    if row.uptrained:
        uptrain(model, train_ids, args, device)
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------- what is measured

def new_cache(model, rows: int, args, storage: str):
    """A cache of --context positions for `rows` sequences, stored as the row says."""
    with naming("--int4-group", "int4_group"), naming("--int4-recent", "int4_recent"):
        return model.new_kv_cache(rows, args.context, dtype=storage, **cache_options(args, storage))


def cache_options(args, storage: str) -> dict:
    return {"int4_recent": args.int4_recent, "int4_group": args.int4_group} if storage == "int4" else {}


@torch.no_grad()
def score(model, val_ids, args, storage: str, device) -> tuple[float, list[float]]:
    """(mean loss over every held-out target, mean loss at each position of a sequence): the text in
    consecutive sequences of --context tokens, each fed at once through a fresh cache stored as
    `storage`: what decoding through it reads (an MLA model attends in its absorbed form)."""
    x, y = target_windows(val_ids, args.context)                       # (n, context) each
    total = torch.zeros(args.context, dtype=torch.float64)
    count = torch.zeros(args.context, dtype=torch.float64)
    for i in tqdm(range(0, len(x), SCORE_ROWS), desc="  score", leave=False, dynamic_ncols=True):
        xb, yb = x[i:i + SCORE_ROWS].to(device), y[i:i + SCORE_ROWS].to(device)
        logits = model(xb, kv_cache=new_cache(model, len(xb), args, storage))  # (b, context, vocab)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), yb.flatten(), ignore_index=-1,
                                 reduction="none").view_as(yb)          # (b, context)
        total += losses.sum(0).double().cpu()
        count += (yb >= 0).sum(0).double().cpu()
    by_position = (total / count.clamp(min=1)).tolist()
    return (total.sum() / count.sum()).item(), by_position


def kv_bytes_formula(config, args, storage: str) -> float:
    """Bytes a cache holds for one sequence of --context positions, per position, from the shapes: per
    cached layer and position, MLA's latent and RoPE key, else K and V of each K/V head; a windowed
    layer holds its window and sinks only; int8 adds a float32 scale per position and head, int4 one
    per group of --int4-group numbers and keeps its last --int4-recent positions in float32 too."""
    n = args.context
    heads, width = (1, config.mla_latent_dim + config.mla_rope_dim) if config.mla_latent_dim else \
        (2 * config.n_kv_head, config.head_dim)                         # tensors kept per position
    cells = n if config.attn_window is None else min(n, config.attn_window + config.attn_sinks)
    if storage == "int4":
        per_position = width / 2 + 4 * width / args.int4_group
        per_sequence = cells * per_position + min(args.int4_recent, n) * 4 * width
    else:
        per_position = width * STORAGE_BYTES[storage] + (4 if storage == "int8" else 0)
        per_sequence = cells * per_position
    return config.kv_layers * heads * per_sequence / n


def kv_bytes_measured(model, args, storage: str) -> float:
    """The same, from a cache's own tensors: their bytes over --context positions."""
    return new_cache(model, 1, args, storage).nbytes / args.context


def decode_speed(model, args, storage: str) -> float:
    """Tokens/s of one-token steps at the end of a --context-long cache stored as the row says."""
    kv_dtype = None if storage == "float32" else storage
    return decode_tokens_per_s(model, 1, args.context, kv_dtype, DECODE_STEPS,
                               cache_options=cache_options(args, storage))


def uptrain(model, train_ids, args, device) -> None:
    """--steps of AdamW on sequences of --train-context tokens drawn from the training text, the same
    sequences in the same order for every row (seed 0): a linear warm-up over the first tenth, then
    a cosine decay to a tenth of --lr. bfloat16 autocast on CUDA."""
    model.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                  fused=True)  # (one kernel for all the weights: 12% of a CPU step)
    warmup = max(1, args.steps // 10)
    generator = torch.Generator().manual_seed(0)
    amp = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    for step in tqdm(range(args.steps), desc="  uptrain", leave=False, dynamic_ncols=True):
        progress = max(0.0, (step - warmup) / max(1, args.steps - warmup))
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(len(train_ids) - args.train_context - 1, (args.batch,), generator=generator)
        batch = torch.stack([train_ids[s:s + args.train_context + 1] for s in starts]).to(device)
        with amp:
            _, loss = model(batch[:, :-1], batch[:, 1:])                # (batch, train_context) each
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- the run

def run(args) -> None:
    check_args(args)
    with naming("--device", "device"):
        device = pick_device(args.device)
    with naming("--ckpt"):  # (on the CPU first: on CUDA, load_model would pad the output layer's rows)
        base, ckpt = load_model(args.ckpt, "cpu", Precision("float32", None))
    base = base.to(device)
    tokenizer = tokenizer_from_meta(ckpt.data_meta)
    train_ids, val_ids = split_text(args, tokenizer)
    out = Path(args.out or Path("outputs", "real_study", Path(args.ckpt).stem)).expanduser()
    done = resumed(out, settings(args, len(val_ids)))
    check_conversions(base, args)
    scores = rope_pair_scores(base, calibration(train_ids, args.context))
    rows = study_rows(args, base.config, scores)
    print(f"{len(rows)} rows on {len(val_ids):,} held-out tokens in sequences of {args.context}, "
          f"{len(done)} done before; writing to {out}", flush=True)
    for i, row in enumerate(rows, 1):
        if row_key(row) not in done:
            started = time.perf_counter()
            model = row_model(row, base, args, train_ids, device)
            done[row_key(row)] = measured(row, model, args, val_ids, device, time.perf_counter() - started)
            with open(out / "rows.jsonl", "a") as f:
                f.write(json.dumps(done[row_key(row)]) + "\n")
            del model
        print(f"[{i}/{len(rows)}] {row_line(done[row_key(row)])}", flush=True)
        write_tables(out, [done[row_key(r)] for r in rows if row_key(r) in done])
    write_plots(out, [done[row_key(r)] for r in rows])


def check_conversions(base, args) -> None:
    """What the rows will ask of the model, asked before any is scored: a model the conversions take,
    latent widths and RoPE pairs it has, and int4 groups that divide its heads."""
    with naming("--ckpt"):
        check_retrofit(base, "the MLA retrofit", absorbed=True)
    with naming("--latent", "latent_dim"), naming("--rope-pairs", "rope_pairs"):
        for width in args.latent:
            check_latent_sizes(base.config, width, args.rope_pairs)
    new_cache(base, 1, args, "int4")


def split_text(args, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(training ids, held-out ids): the text's first 90% and last 10%, each in the model's tokenizer."""
    with naming("--text"):
        text = read_text_files([Path(args.text or TINYSHAKESPEARE_PATH)]).decode()
    cut = int(len(text) * (1 - VAL_FRACTION))
    train_ids, val_ids = (torch.tensor(tokenizer.encode(part), dtype=torch.long)
                          for part in (text[:cut], text[cut:]))
    if args.eval_tokens is not None:
        val_ids = val_ids[:args.eval_tokens]
    need = {"held-out": (val_ids, 2), "training": (train_ids, args.train_context + 2 if args.steps else 2)}
    for part, (ids, n) in need.items():
        if len(ids) < n:
            raise ValueError(f"--text: its {part} part is {len(ids)} tokens, fewer than the study's {n}")
    return train_ids, val_ids


def calibration(train_ids, context: int) -> torch.Tensor:
    """CALIBRATION_ROWS sequences of the training text, evenly spaced, on which the RoPE pairs that
    contribute most are chosen: (rows, length)."""
    length = min(context, len(train_ids) // CALIBRATION_ROWS)
    starts = torch.linspace(0, len(train_ids) - length, CALIBRATION_ROWS).long()
    return torch.stack([train_ids[s:s + length] for s in starts])       # (rows, length)


def settings(args, held_out: int) -> dict:
    """What the rows' numbers depend on: a run with other settings starts over."""
    ckpt = Path(args.ckpt).expanduser().resolve()
    stat = ckpt.stat()
    return {"ckpt": str(ckpt), "ckpt_size": stat.st_size, "ckpt_mtime": stat.st_mtime_ns,
            "text": str(Path(args.text).resolve()) if args.text else "TinyShakespeare", "held_out": held_out,
            **{k: getattr(args, k) for k in SETTINGS}}


def resumed(out: Path, study: dict) -> dict:
    """{row key: its record} of the rows a run with these settings wrote to out/rows.jsonl before;
    none (and the file begun again) when the settings differ or there is none."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise type(e)(f"--out: cannot create {out}: {e.strerror or e}") from e
    file = out / "rows.jsonl"
    lines = file.read_text().splitlines() if file.is_file() else []
    if lines and json.loads(lines[0]) == {"settings": study}:
        records = [json.loads(line) for line in lines[1:] if line.strip()]
        return {record["key"]: record for record in records}
    file.write_text(json.dumps({"settings": study}) + "\n")
    return {}


def row_key(row: Row) -> str:
    return f"{row.name}{' (uptrained)' if row.uptrained else ''}"


def measured(row: Row, model, args, val_ids, device, build_s: float) -> dict:
    """The row's record: loss, loss by position, KV bytes by formula and measured, decode tokens/s."""
    started = time.perf_counter()
    loss, by_position = score(model, val_ids, args, row.storage, device)
    return {"key": row_key(row), "name": row.name, "method": row.method, "uptrained": row.uptrained,
            "storage": row.storage, "steps": args.steps if row.uptrained else 0, "loss": loss,
            "kv_bytes_formula": kv_bytes_formula(model.config, args, row.storage),
            "kv_bytes_measured": kv_bytes_measured(model, args, row.storage),
            "decode_tokens_per_s": decode_speed(model, args, row.storage),
            "kv_cache": model.config.kv_cache_formula(), "build_s": build_s,
            "score_s": time.perf_counter() - started,
            "loss_by_position": bucketed(by_position)}


def bucketed(by_position: list[float]) -> list[float]:
    """The loss at each position, averaged over buckets of POSITION_BUCKET positions."""
    return [sum(part) / len(part) for part in (by_position[i:i + POSITION_BUCKET]
                                               for i in range(0, len(by_position), POSITION_BUCKET))]


def row_line(record: dict) -> str:
    return (f"{record['key']}: loss {record['loss']:.4f}, {record['kv_bytes_measured']:,.0f} KV bytes/token, "
            f"{record['decode_tokens_per_s']:,.1f} tokens/s")


# ----------------------------------------------------------------------------- what is written

def baseline_of(record: dict, records: list[dict]) -> dict | None:
    """What a row is compared with: the model as it is, training-free or uptrained alike."""
    same = [r for r in records if r["method"] == "baseline" and r["uptrained"] == record["uptrained"]]
    return same[0] if same else None


def table(records: list[dict]) -> str:
    """The markdown table: every row's KV bytes per token (formula, measured, share of the model's),
    loss, its difference to its baseline, and decode speed; training-free rows, then uptrained."""
    lines = ["| row | KV bytes/token (formula) | measured | of the model's | loss | vs baseline "
             "| decode tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    full = next((r["kv_bytes_measured"] for r in records if r["method"] == "baseline"), None)
    for uptrained in (False, True):
        group = [r for r in records if r["uptrained"] == uptrained]
        if group and uptrained:
            lines.append(f"| **uptrained, {group[0]['steps']} steps each** | | | | | | |")
        for r in group:
            base = baseline_of(r, records)
            delta = f"{r['loss'] - base['loss']:+.4f}" if base else "—"
            share = f"{r['kv_bytes_measured'] / full:.1%}" if full else "—"
            lines.append(f"| {r['name']} | {r['kv_bytes_formula']:,.1f} | {r['kv_bytes_measured']:,.1f} "
                         f"| {share} | {r['loss']:.4f} | {delta} | {r['decode_tokens_per_s']:,.1f} |")
    return "\n".join(lines)


def write_tables(out: Path, records: list[dict]) -> None:
    """real_study.md and .json from the rows done so far, each file whole."""
    holds = "\n".join(f"- {r['key']}: {r['kv_cache']}" for r in records)
    text = (f"# What shrinking the KV cache costs this model\n\n{table(records)}\n\n"
            f"What one position holds, per row:\n\n{holds}")
    write_atomically(out / "real_study.md", lambda f: f.write((text + "\n").encode()), "study table")
    write_atomically(out / "real_study.json", lambda f: f.write(json.dumps(records, indent=1).encode()),
                     "study rows")


def write_plots(out: Path, records: list[dict]) -> None:
    """pareto.png, every row's loss against its KV bytes per token, and loss_by_position.png, the
    baseline's and the windows' loss at each position of a sequence."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 6))
    colors, names = plt.get_cmap("tab20").colors, list(dict.fromkeys(r["name"] for r in records))
    for r in records:  # one legend entry a row (labels beside the points would overlap); a method's colour
        ax.scatter(r["kv_bytes_measured"], r["loss"], color=colors[names.index(r["name"]) % len(colors)],
                   marker="s" if r["uptrained"] else "o", label=r["key"], s=40)
    ax.set(xscale="log", xlabel="KV bytes per token", ylabel="held-out loss",
           title="Loss against KV cache bytes per token (squares: uptrained)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, out / "pareto.png")
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in records:
        if not r["uptrained"] and r["method"] in ("baseline", "window"):
            x = [POSITION_BUCKET * (i + 0.5) for i in range(len(r["loss_by_position"]))]
            ax.plot(x, r["loss_by_position"], label=r["name"])
    ax.set(xlabel="position in the sequence", ylabel="held-out loss", title="Loss by position: the windows")
    ax.legend()
    save_figure(fig, out / "loss_by_position.png")


def main(argv=None) -> None:
    exit_on_user_error(run, parse_args(argv))


if __name__ == "__main__":
    main()
