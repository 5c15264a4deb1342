"""`python -m cli.prepare data=shakespeare_char` (or data=shakespeare_bpe, data=text_files ...):
prepare a corpus's token arrays once (data.prepare) and say where they are."""

import sys

import hydra

from cli.configs import CONFIGS, composed_jobs, config_object
from cli.errors import exit_on_user_error
from data.prepare import load_prepared, prepare


def report(cfg) -> None:
    """Prepare cfg.data and say what is where."""
    out_dir = prepare(config_object(cfg.data, "data."))
    meta = load_prepared(out_dir)[0]
    print(f"{out_dir}: {meta['tokenizer']} vocab {meta['vocab_size']}, "
          f"{meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens")


@hydra.main(config_path="../configs", config_name="prepare", version_base="1.3")
def main(cfg) -> None:
    exit_on_user_error(report, cfg)


if __name__ == "__main__":
    composed_jobs(CONFIGS, "prepare", sys.argv[1:])  # Hydra's errors: one line
    main()
