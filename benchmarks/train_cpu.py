"""CPU training benchmark: nanoGPT's CPU recipe at the identical config, and our CPU main job.

    python benchmarks/train_cpu.py        # ~3 minutes on 2 cores

Runs each recipe as a user would (`python train.py ...`, whole-process wall time) and prints
ms/iteration, wall time and the first evaluation at val <= 1.88, next to nanoGPT's anchors measured
on this kind of machine (../shared/FACTS.md): 104 s wall, ~40 ms/iteration, best val 1.8857.
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NANOGPT = {"wall_s": 104.0, "ms_per_iter": 40.0, "best_val": 1.8857}
RECIPES = {
    "nanoGPT CPU recipe (identical config)": ["experiment=shakespeare_char_cpu"],
    "our CPU main job (python train.py)": ["experiment=shakespeare_char_cpu_fast"],
}


def run(overrides: list[str], run_dir: Path) -> dict:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "train.py", *overrides, "train.sample_tokens=0",
                    f"hydra.run.dir={run_dir}"], cwd=ROOT, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    # ms/iteration from the logged throughput: training steps only, evaluations excluded
    tokens_per_step = 12 * 64
    ms_per_iter = sorted(1e3 * tokens_per_step / r["tokens_per_s"] for r in steps)[len(steps) // 2]
    reached = next((r for r in evals if r["val_loss"] <= 1.88), None)
    return {"wall_s": wall, "ms_per_iter": ms_per_iter, "best_val": min(r["val_loss"] for r in evals),
            "to_1.88": f"step {reached['step']}, {reached['elapsed_s']:.1f} s" if reached else "not reached"}


def main() -> None:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(RECIPES.items()):
            rows[name] = run(overrides, Path(tmp) / str(i))
    print("| run | wall s | ms/iter (median) | best val | first eval at val <= 1.88 (training time) |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| nanoGPT, measured in ../shared/FACTS.md | {NANOGPT['wall_s']:.0f} | "
          f"{NANOGPT['ms_per_iter']:.0f} | {NANOGPT['best_val']:.4f} | step 2000 |")
    for name, r in rows.items():
        print(f"| {name} | {r['wall_s']:.0f} | {r['ms_per_iter']:.1f} | {r['best_val']:.4f} | "
              f"{r['to_1.88']} |")
    same = rows["nanoGPT CPU recipe (identical config)"]
    ours = rows["our CPU main job (python train.py)"]
    print(f"\niterations/s vs nanoGPT's anchor at the identical config: "
          f"{NANOGPT['ms_per_iter'] / same['ms_per_iter']:.2f}x")
    print(f"main job wall time vs nanoGPT's run: {ours['wall_s'] / NANOGPT['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
