#!/usr/bin/env bash
# Run once here, where PyPI answers: what the GPU machine lacks for the plan in docs/training.md
# ("On a GPU"), into .gpu/ (ignored by git), which every command of the plan carries:
#   .gpu/wheels  Hydra, OmegaConf and antlr (Hydra's parser), pinned, pure Python (any Python 3)
#   .gpu/data    the built-in char corpus, prepared: found there, it needs no `datasets`
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/wheels
python -m pip download -q --no-deps --only-binary=:all: --platform any --python-version 3.12 \
  -d .gpu/wheels hydra-core==1.3.8 omegaconf==2.3.1
python -m pip wheel -q --no-deps -w .gpu/wheels antlr4-python3-runtime==4.9.3  # published as source only
KVGPT_CACHE=.gpu/data python -m cli.prepare data=shakespeare_char
ls .gpu/wheels
