# Sourced on the GPU machine, from the repository root, before each command of the plan
# (benchmarks/README.md, "Measuring on a rented GPU"):
# `source benchmarks/gpu_env.sh && python3 benchmarks/gpu.py ...`.
# Installs the wheels .gpu/ carries (bash benchmarks/gpu_fetch.sh made them) into /tmp/site, offline,
# and points Python at them and the prepared-data cache at the carried corpus. pip compiles their
# bytecode, as a user's install does (a profile there found each process compiling ~1,770 modules
# from source).
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/wheels/*.whl \
  || return 1
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" KVGPT_CACHE="$PWD/.gpu/data" PYTHONUNBUFFERED=1
