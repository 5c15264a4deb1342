"""CPU training side by side: nanoGPT itself, our run of its exact config, and our CPU main job.

    python benchmarks/train_cpu.py --nanogpt ~/src/nanoGPT      # ~10 minutes on 2 cores

`--nanogpt` is a checkout of karpathy/nanoGPT. It is copied to a temp folder, its own
data/shakespeare_char/prepare.py is run once there on our TinyShakespeare (data/assets, the same
bytes as nanoGPT's download), and its train.py runs its CPU recipe (the command in its README,
with eval_iters=20 and no dropout). Then ours, each as a user runs it (`python train.py ...`):

    nanoGPT's exact config   experiment=shakespeare_char_cpu (4/4/128, block 64, batch 12, exact
                             GELU, learned positions, LayerNorm, no biases, AdamW, 2000 iterations)
    the CPU main job         python train.py with nothing else
    ... with AdamW           the main job's model and schedule with AdamW instead of Muon, at the
                             iterations AdamW needs for the same loss (1300): does Muon pay?
    threads                  the main job's first 200 iterations at 1 thread and at PyTorch's default

Every time is whole-process wall time, measured here; ms/iteration is the median of what each
trainer logs (training steps only). Whole processes run one after another, and this machine's
speed drifts by 20% between them, so the per-iteration ratios are also measured in one process:
nanoGPT's model.py and optimizer against ours, the same batches, interleaved round by round. The
main job's quality is the loss over the whole val split at its end; "reaches 1.88" is the first
periodic evaluation at or below it, timed from the process start. Printed: a table and the
ratios the project's targets are stated in.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cli.errors import ArgumentParser
from model import GPT, checkpoint
from training.optimizer import configure_optimizer
from training.run_dir import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "assets" / "tinyshakespeare.txt"
NANOGPT_CPU = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
               "--log_interval=10", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
               "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
OURS = {"ours, nanoGPT's exact config": ["experiment=shakespeare_char_cpu"],
        "ours, CPU main job (python train.py)": [],
        "ours, CPU main job with AdamW": ["train.optimizer=adamw", "train.max_iters=1300"]}
TARGET = 1.88


def timed(cmd: list[str], cwd: Path, env: dict | None = None) -> tuple[float, str]:
    """(wall seconds, stdout) of a command that must succeed; env: variables to add."""
    t0 = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if result.returncode:
        sys.exit(f"error: {' '.join(cmd)} failed in {cwd}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return wall, result.stdout


def run_nanogpt(checkout: Path, tmp: Path) -> dict:
    copy = tmp / "nanoGPT"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", "out*"))
    shutil.copyfile(CORPUS, copy / "data/shakespeare_char/input.txt")  # prepare.py skips its download
    timed([sys.executable, "data/shakespeare_char/prepare.py"], copy)
    wall, out = timed([sys.executable, "train.py", *NANOGPT_CPU], copy)
    ms = [float(t) for t in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", out, re.M)]
    evals = [(int(s), float(v)) for s, v in re.findall(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)",
                                                          out, re.M)]
    return {"wall_s": wall, "ms_per_iter": median(ms[1:]), "final_val": evals[-1][1],
            "final_kind": "sampled, 20 batches", "to_target_s": None,
            "to_target": next((step for step, val in evals if val <= TARGET), None), "iters": evals[-1][0]}


def run_ours(overrides: list[str], run_dir: Path, env: dict | None = None) -> dict:
    wall, _ = timed([sys.executable, "train.py", *overrides, "train.device=cpu", "train.sample_tokens=0",
                     f"hydra.run.dir={run_dir}"], ROOT, env)
    records = read_metrics(run_dir)
    ckpt = checkpoint.load(run_dir / "ckpt.pt")
    config = ckpt.config
    train, model = config["train"], config["model"]
    tokens_per_step = train["batch_size"] * train["grad_accum"] * model["block_size"]
    ms = [1e3 * tokens_per_step / r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    evals = [r for r in records if "val_loss" in r]
    end = records[-1]["elapsed_s"]  # seconds since the loop began, at the last record
    reached = next((r for r in evals if r["val_loss"] <= TARGET), None)
    return {"wall_s": wall, "ms_per_iter": median(ms), "final_val": records[-1].get("val_loss_full"),
            "model": ckpt.model_config, "optimizer": train["optimizer"],
            "final_kind": "whole val split", "to_target": reached and reached["step"],
            # the process's wall time up to that evaluation: all of it minus what came after
            "to_target_s": reached and wall - (end - reached["elapsed_s"]), "iters": evals[-1]["step"]}


def per_iteration(checkout: Path, ours: dict, rounds: int = 7, steps: int = 10) -> dict:
    """ms per training iteration (forward, backward, clipping, optimizer step) at batch 12, block 64,
    of nanoGPT's model and AdamW and of each of `ours` (name: a whole run's result, whose model and
    optimizer it rebuilds), in one process, interleaved, the median of `rounds`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nanogpt_model", checkout / "model.py")
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    torch.manual_seed(0)
    nano_model = nano.GPT(nano.GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128,
                                         dropout=0.0, bias=False))  # train.py's defaults, the recipe's sizes
    trainers = {"nanoGPT": (nano_model, nano_model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu"))}
    for name, result in ours.items():
        model = GPT(result["model"])
        trainers[name] = (model, configure_optimizer(model, result["optimizer"], 1e-3, (0.9, 0.99), 0.1))
    x, y = torch.randint(0, 65, (2, 12, 64))

    def step(model, optimizer):
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = {name: [] for name in trainers}
    for r in range(rounds + 1):  # the first round warms up
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step(*trainer)
            if r:
                times[name].append(1e3 * (time.perf_counter() - t0) / steps)
    return {name: median(t) for name, t in times.items()}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", required=True, type=Path, help="a checkout of karpathy/nanoGPT")
    args = p.parse_args()
    checkout = args.nanogpt.expanduser().resolve()
    if not (checkout / "train.py").is_file() or not (checkout / "data/shakespeare_char/prepare.py").is_file():
        p.error(f"--nanogpt {checkout} is not a nanoGPT checkout (train.py, data/shakespeare_char/)")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        short = ["train.max_iters=200", "train.eval_interval=1000", "train.full_val=false"]
        threads = {n: run_ours(short, Path(tmp) / f"threads{n}", {"OMP_NUM_THREADS": str(n)})["ms_per_iter"]
                   for n in sorted({1, os.cpu_count() or 1})}
        rows["nanoGPT (its train.py, CPU recipe)"] = run_nanogpt(checkout, Path(tmp))
        for i, (name, overrides) in enumerate(OURS.items()):
            rows[name] = run_ours(overrides, Path(tmp) / f"ours{i}")
        in_process = per_iteration(checkout, {name: rows[name] for name in OURS})

    print("| run | iterations | wall s | ms/iter (median) | final val | first eval <= 1.88 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        reached = "not reached" if r["to_target"] is None else f"step {r['to_target']}" + (
            f", {r['to_target_s']:.0f} s" if r["to_target_s"] else "")
        print(f"| {name} | {r['iters']} | {r['wall_s']:.0f} | {r['ms_per_iter']:.1f} | "
              f"{r['final_val']:.4f} ({r['final_kind']}) | {reached} |")
    nano, same, main_job, adamw = rows.values()
    print(f"\nper iteration, whole processes (their logs): ours at nanoGPT's exact config "
          f"{nano['ms_per_iter'] / same['ms_per_iter']:.2f}x nanoGPT's iterations/s, the main job's model "
          f"with AdamW {nano['ms_per_iter'] / adamw['ms_per_iter']:.2f}x, with Muon "
          f"{nano['ms_per_iter'] / main_job['ms_per_iter']:.2f}x")
    print("per iteration, one process, interleaved (batch 12, block 64; target >= 1.2x nanoGPT's it/s):")
    for name, ms in in_process.items():
        print(f"  {name}: {ms:.1f} ms, {in_process['nanoGPT'] / ms:.2f}x nanoGPT's iterations/s")
    print(f"Muon against AdamW in the main job: {main_job['iters']} against {adamw['iters']} iterations, "
          f"{main_job['wall_s']:.0f} s against {adamw['wall_s']:.0f} s, to {main_job['final_val']:.4f} "
          f"against {adamw['final_val']:.4f}")
    print("main job ms/iteration by thread count (first 200 iterations): "
          + ", ".join(f"{n}: {ms:.1f}" for n, ms in threads.items()))
    if main_job["to_target_s"]:
        print(f"main job: val <= {TARGET} after {main_job['to_target_s'] / nano['wall_s']:.2f}x nanoGPT's "
              f"wall time (target <= 0.4x)")
    print(f"main job: final val {main_job['final_val']:.4f} (whole val split; target <= 1.75) after "
          f"{main_job['wall_s'] / nano['wall_s']:.2f}x nanoGPT's wall time (target <= 0.6x)")


if __name__ == "__main__":
    main()
