#!/usr/bin/env bash
# The checks and benchmarks that need a GPU, in one call of at most 8 minutes: each part under its
# own time limit, so that a slow one cannot starve the rest (timing parts run alone on the
# machine); it prints each part's start, status and last lines as it goes, and ends with ONE
# JSON of the machine, each part's exit status and seconds, and every figure (gpu_summary.py).
#
#   DATA=<folder with medmnist/> OUT=<results folder> [STEPS="tests overhead fixmatch profile host"] \
#       [SUMMARY=docs/gpu/<YYYY-MM-DD>.json] [SESSION_SECONDS=480] bash benchmarks/gpu_session.sh
#
# Parts (STEPS picks some; they run in this order), with their time limits in seconds:
#   (env)       always: the machine (name, memory, driver) and the versions (torch, Lightning,
#               CUDA, ...) as the first record of this call in session.jsonl                       25
#   tests       tests/test_gpu.py, its CUDA cases (TEST_SELECT="not cpu": the CPU cases run in the
#               ordinary suite)                                                   -> test_gpu.log   70
#   overhead    step_cost.py ratios: step and amortized-epoch ratios with their floors and peak
#               memory: plain, LP-A3, the controls augment='null' and 'noise' (at LP-A3's input
#               distance), cached (12 epochs, last: a failure there keeps the others); ResNet-18
#               28 px, batch 128, ratio 0.3                                       -> step_cost.log  140
#   fixmatch    fixmatch_step.py: a FixMatch step (WRN-28-2, 32 px, batch 64, mu 7) against plain
#               FixMatch, with every selected row solved (the authors' cost); the default
#               configuration (fixmatch_lpa3) is left out: on random tensors few rows pass its
#               confidence threshold, and with it the part overran 90 s on the H100 -> fixmatch_step.log 65
#   profile     step_cost.py profile, 2 steps: kernel launches, synchronisations, GPU busy per step,
#               operators by self CPU and self CUDA time                         -> profile.log    45
#   host        step_cost.py profile --stack: 20 steady LP-A3 steps with the host side visible (self
#               CPU time by operator and by Python function, the top five places; launches,
#               cudaMalloc/cudaFree, synchronisations, H2D/D2H copies and bytes, GPU busy, peak
#               memory per step)                                                  -> profile.log    60
#   (summary)   always: gpu_summary.py merges session.jsonl and the logs into $SUMMARY            15
# The default STEPS: 25 + 70 + 140 + 65 + 45 + 60 + 15 = 420 s <= 480 s (SESSION_SECONDS); a part
# that ignores the TERM at its limit is killed 2 s later (at most 6 x 2 s more: 432 s).
# Not in the default STEPS, as it does not fit in 480 s beside the rest:
#   table       time to the baseline's accuracy on BreastMNIST and PneumoniaMNIST (DATA), 3 seeds,
#               all runs side by side, in the time left of SESSION_SECONDS less the summary's
#               (about 430 s when alone: STEPS=table); PneumoniaMNIST needs DATA/medmnist on the
#               machine (on a lent one, inside the repository: ../shared does not travel)
#                                                                   -> table.log, table_runs.tgz
#
# Rerun what failed: STEPS="profile host" with the same OUT appends to the same files; the
# summary takes each part's last run, so it merges the calls. On a lent machine whose OUT starts
# empty, run the summary where both calls' folders are: gpu_summary.py OUT1 OUT2 [--summary ...].
# Files in OUT (at most 8): session.jsonl (the records: env, each part's status, each script's
# --json result), test_gpu.log, step_cost.log, fixmatch_step.log, profile.log, [table.log,
# table_runs.tgz], and the summary when SUMMARY is inside OUT (SUMMARY=$OUT/summary.json).
# A dry run of the wiring on the CPU (no timing meaning): ACCEL=cpu STEPS="profile host" HOST_STEPS=2
# PROFILE_ARGS="--arch small_cnn --batch 8 --warm-steps 1" OUT=/tmp/gpu SUMMARY=/tmp/gpu/summary.json bash ...
set -u
OUT=${OUT:-runs/gpu}
DATA=${DATA:-../shared/data}
PY=${PYTHON:-python3}
STEPS=${STEPS:-tests overhead fixmatch profile host}
SESSION_SECONDS=${SESSION_SECONDS:-480}
ACCEL=${ACCEL:-gpu}  # cpu: a dry run of the wiring (slow at full size; no timing meaning)
EPOCHS=${EPOCHS:-12}  # of the cached overhead run
TESTS=${TESTS:-tests/test_gpu.py}  # the tests to run (node ids of tests/test_gpu.py select some)
TEST_SELECT=${TEST_SELECT-not cpu}  # pytest -k: the CUDA cases (TEST_SELECT="" runs all)
HOST_STEPS=${HOST_STEPS:-20}  # steady steps the host part profiles
PROFILE_ARGS=${PROFILE_ARGS:-}  # more step_cost.py profile arguments, of both profile parts (the dry run's sizes)
SUMMARY=${SUMMARY:-docs/gpu/$(date -u +%F).json}
SUMMARY_LIMIT=15
CALL=$(date -u +%Y%m%dT%H%M%SZ)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
SCRATCH=$(mktemp -d)  # the scripts' --json files, copied into session.jsonl as each part ends
trap 'rm -rf "$SCRATCH"' EXIT

echo "== env (limit 25 s), call $CALL, STEPS: $STEPS"
if ! timeout 25 $PY benchmarks/gpu_summary.py --env --call "$CALL" > "$SCRATCH/env.json" \
        || ! grep -q '^{' "$SCRATCH/env.json"; then
    echo "the machine record failed: stopping"; cat "$SCRATCH/env.json"; exit 1
fi
grep '^{' "$SCRATCH/env.json" | tail -n 1 >> "$OUT/session.jsonl"
tail -n 1 "$SCRATCH/env.json"
if grep -q '"lpa3_lightning": "does not import' "$SCRATCH/env.json"; then echo "lpa3_lightning does not import: stopping"; exit 1; fi

record() {  # record KIND NAME FIELDS-JSON: one line of session.jsonl
  printf '{"kind": "%s", "name": "%s", "call": "%s", %s}\n' "$1" "$2" "$CALL" "$3" >> "$OUT/session.jsonl"
}

part() {  # part NAME LIMIT LOG JSON command...: one run of a part under its limit; its status and
          # the JSON its script wrote ("$SCRATCH/JSON", "-" for none) into session.jsonl
  local name=$1 limit=$2 log=$3 json=$4; shift 4
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local start=$SECONDS
  echo "== $name (limit $limit s, at $SECONDS s): $*"
  echo "### $name $CALL: $*" >> "$OUT/$log"  # several parts share a log (at most 8 files come back)
  timeout -k 2 "$limit" "$@" >> "$OUT/$log" 2>&1
  local rc=$? seconds=$(( SECONDS - start ))
  record part "$name" "\"exit\": $rc, \"seconds\": $seconds, \"limit\": $limit, \"log\": \"$log\""
  if [ "$json" != "-" ] && [ -s "$SCRATCH/$json" ]; then
    $PY -c 'import json, sys; print(json.dumps({"kind": "result", "name": sys.argv[1], "call": sys.argv[2],
"result": json.load(open(sys.argv[3]))}))' "$name" "$CALL" "$SCRATCH/$json" >> "$OUT/session.jsonl"
  fi
  echo "   $name: exit $rc in $seconds s (limit $limit)"
  tail -n 3 "$OUT/$log" | cut -c1-300 | sed 's/^/   | /'
}

part tests 70 test_gpu.log - $PY -m pytest -q -p no:cacheprovider -rfEs -k "$TEST_SELECT" $TESTS
# 3 epochs (epoch 0 warms up), the cached run 12: epochs 1..11 give it one whole K=10 window
part overhead 140 step_cost.log overhead.json $PY benchmarks/step_cost.py ratios --accelerator "$ACCEL" \
    --epochs 3 --cached-epochs "$EPOCHS" --ratio 0.3 --configs baseline lpa3 lpa3_null lpa3_noise lpa3_cached \
    --json "$SCRATCH/overhead.json"
part fixmatch 65 fixmatch_step.log fixmatch.json $PY benchmarks/fixmatch_step.py --accelerator "$ACCEL" \
    --setting wrn28_2_32px --epochs 3 --configs fixmatch fixmatch_lpa3_all --json "$SCRATCH/fixmatch.json"
part profile 45 profile.log profile.json $PY benchmarks/step_cost.py profile --accelerator "$ACCEL" --steps 2 \
    $PROFILE_ARGS --json "$SCRATCH/profile.json"
part host 60 profile.log host.json $PY benchmarks/step_cost.py profile --accelerator "$ACCEL" --stack \
    --steps "$HOST_STEPS" --warm-steps 3 $PROFILE_ARGS --json "$SCRATCH/host.json"

# the table in the time left: 3 seeds x {baseline, lpa3} per data set, all twelve runs side by side
# (their wall times include that contention, equally for both methods); runs still going at the
# deadline stop after their epoch and are left out
case " $STEPS " in *" table "*)
  LEFT=$(( SESSION_SECONDS - SECONDS - SUMMARY_LIMIT - 25 ))
  if [ "$LEFT" -lt 60 ]; then
    echo "table: no time left ($LEFT s)"
    record part table "\"exit\": null, \"seconds\": 0, \"limit\": $LEFT, \"log\": \"table.log\", \"skipped\": \"no time left\""
  else
    echo "== table (deadline $LEFT s, at $SECONDS s)"
    echo "### table $CALL: medmnist_table.py breastmnist + pneumoniamnist, deadline $LEFT s" >> "$OUT/table.log"
    START=$SECONDS
    RUNS=$(mktemp -d)
    COMMON=(--seeds 0 1 2 --accelerator "$ACCEL" --threads 1 --deadline "$LEFT" --root "$DATA/medmnist"
            --methods baseline lpa3)
    timeout -k 5 $(( LEFT + 15 )) $PY benchmarks/medmnist_table.py --flags breastmnist --epochs 30 --jobs 6 \
        --out "$RUNS/breastmnist" "${COMMON[@]}" >> "$OUT/table.log" 2>&1 &
    sleep 1  # the two tables' lines interleave in table.log; each line names its run
    timeout -k 5 $(( LEFT + 15 )) $PY benchmarks/medmnist_table.py --flags pneumoniamnist --epochs 8 --jobs 6 \
        --out "$RUNS/pneumoniamnist" "${COMMON[@]}" >> "$OUT/table.log" 2>&1 &
    FAILED=0
    for job in $(jobs -p); do wait "$job" || FAILED=$?; done
    tar czf "$OUT/table_runs.tgz" -C "$RUNS" .
    record part table "\"exit\": $FAILED, \"seconds\": $(( SECONDS - START )), \"limit\": $(( LEFT + 15 )), \"log\": \"table.log\""
    echo "   table: exit $FAILED in $(( SECONDS - START )) s"
  fi ;;
esac

echo "== summary (limit $SUMMARY_LIMIT s, at $SECONDS s) -> $SUMMARY"
timeout -k 2 "$SUMMARY_LIMIT" $PY benchmarks/gpu_summary.py "$OUT" --summary "$SUMMARY"
echo "session: $SECONDS s"
