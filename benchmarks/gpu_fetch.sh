#!/usr/bin/env bash
# Run once here, where PyPI answers: what the GPU machine lacks for the plan in benchmarks/README.md
# ("Measuring on a rented GPU"), into .gpu/ (ignored by git), which every command of the plan carries:
#   .gpu/wheels   Hydra, OmegaConf and antlr (Hydra's parser), pinned, pure Python (any Python 3)
#   .gpu/data     the built-in char corpus, prepared: found there, it needs no `datasets`
#   .gpu/nanoGPT  with a nanoGPT checkout given (a folder, or a bare git directory), a copy of it with
#                 its char data prepared by its own prepare.py from our corpus (the same bytes as its
#                 download): gpu.py --section coldstart runs its train.py beside ours
#   bash benchmarks/gpu_fetch.sh [NANOGPT]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/wheels
python -m pip download -q --no-deps --only-binary=:all: --platform any --python-version 3.12 \
  -d .gpu/wheels hydra-core==1.3.8 omegaconf==2.3.1
python -m pip wheel -q --no-deps -w .gpu/wheels antlr4-python3-runtime==4.9.3  # published as source only
KVGPT_CACHE=.gpu/data python -m cli.prepare data=shakespeare_char
if [ $# -ge 1 ]; then
  rm -rf .gpu/nanoGPT && mkdir -p .gpu/nanoGPT
  if [ -f "$1/train.py" ]; then
    (cd "$1" && tar -c --exclude=.git --exclude='out*' .) | tar -x -C .gpu/nanoGPT
  else
    git --git-dir="$1" archive HEAD | tar -x -C .gpu/nanoGPT
  fi
  cp data/assets/tinyshakespeare.txt .gpu/nanoGPT/data/shakespeare_char/input.txt  # no download
  (cd .gpu/nanoGPT && python data/shakespeare_char/prepare.py >/dev/null)
fi
ls .gpu/wheels .gpu/nanoGPT/data/shakespeare_char 2>/dev/null
