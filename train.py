"""Train a GPT on TinyShakespeare (or your own text) with Hydra configs.

    python train.py                                   # the main job: a recipe picked for this machine
    python train.py experiment=shakespeare_char attention=gqa
    python train.py -m attention=mha,gqa,mqa          # a sweep, in multirun/
    torchrun --nproc_per_node=2 train.py ...          # DDP (NCCL on GPU, gloo on CPU)

This file is the command line: every job's options are checked (cli.options.check_options) before
Hydra creates a run dir, then each is trained by training/loop.py, the loop in nanoGPT's order.
"""

import gc
import os
import signal
import sys

if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))  # Ctrl-C while importing: quiet

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from cli.configs import CONFIGS, composed_jobs
from cli.errors import exit_on_user_error
from cli.options import check_options, train_run, with_default_experiment
from training.options import RunConfig

checked_jobs: list[tuple[DictConfig, RunConfig]] = []  # the command line's jobs, checked before Hydra


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run = next((run for job, run in checked_jobs if job == cfg), None)
    run = run or exit_on_user_error(check_options, cfg, hydra_cfg.overrides.task)
    result = exit_on_user_error(train_run, run, hydra_cfg.runtime.output_dir)
    if result.get("interrupted"):
        sys.exit(128 + result["interrupted"])  # 130 for Ctrl-C, 143 for SIGTERM, as shells expect


if __name__ == "__main__":
    sys.argv[1:] = with_default_experiment(sys.argv[1:])
    if int(os.environ.get("RANK", 0)) > 0:  # under torchrun only rank 0 writes to the run dir
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    for job_cfg, overrides in composed_jobs(CONFIGS, "train", sys.argv[1:]):  # before any run dir exists
        checked_jobs.append((job_cfg, exit_on_user_error(check_options, job_cfg, overrides)))
    main()
    gc.freeze()  # exiting: no last collection over the objects torch made (~0.7 s on a CPU)
