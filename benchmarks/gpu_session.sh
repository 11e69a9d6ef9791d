#!/usr/bin/env bash
# The checks and benchmarks that need a GPU, in one session, each step under its own time limit
# so that a slow one cannot starve the rest; timing steps run alone on the machine.
#
#   DATA=<folder with medmnist/> OUT=<results folder> [STEPS="tests overhead profile fixmatch table"] \
#       [SESSION_SECONDS=420] bash benchmarks/gpu_session.sh
#
# Steps (STEPS picks some, in this order):
#   tests     tests/test_gpu.py (solver, callback, cache, resume, 32/16/bf16 precision, the sync-free
#             path and the solver as a CUDA graph against the eager solve)         -> test_gpu.log
#   overhead  step and amortized-epoch ratios with their floors and peak memory: plain, default
#             path, sync-free, captured; ResNet-18 28 px, batch 128, ratio 0.3     -> step_overhead.log
#   profile   kernel launches and synchronisations per step, default / sync-free / captured
#                                                                                 -> profile.log
#   fixmatch  a FixMatch step (WRN-28-2, 32 px, batch 64, mu 7) against plain FixMatch
#                                                                                 -> fixmatch_step.log
#   table     time to the baseline's accuracy on BreastMNIST and PneumoniaMNIST, 3 seeds, in the
#             time left of SESSION_SECONDS (runs side by side)   -> table.log, table_runs.tgz
# env.txt records the machine, the versions and each step's exit status and seconds.
set -u
OUT=${OUT:-runs/gpu}
DATA=${DATA:-../shared/data}
PY=${PYTHON:-python3}
STEPS=${STEPS:-tests overhead profile fixmatch table}
SESSION_SECONDS=${SESSION_SECONDS:-420}
ACCEL=${ACCEL:-gpu}  # cpu: a dry run of the wiring (slow; no timing meaning)
EPOCHS=${EPOCHS:-12}  # of the cached overhead runs
TESTS=${TESTS:-tests/test_gpu.py}  # the tests to run (node ids of tests/test_gpu.py select some)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  $PY -c "import torch, lightning, torchmetrics, torchvision, medmnist; print('torch', torch.__version__, 'lightning',
lightning.__version__, 'torchmetrics', torchmetrics.__version__, 'torchvision', torchvision.__version__)"
  $PY -c "import lpa3_lightning" || { echo "lpa3_lightning does not import: stopping"; exit 1; }
} > "$OUT/env.txt" 2>&1 || exit 1

step() {  # step NAME LIMIT_SECONDS LOG command...: run one step under its limit, record status and time
  local name=$1 limit=$2 log=$3; shift 3
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local start=$SECONDS
  echo "### $*" >> "$OUT/$log"  # several steps may share a log (at most 8 files come back)
  timeout "$limit" "$@" >> "$OUT/$log" 2>&1
  echo "$name ($log): exit $? in $(( SECONDS - start )) s (limit $limit)" >> "$OUT/env.txt"
}

step tests 70 test_gpu.log $PY -m pytest -q -p no:cacheprovider -rs $TESTS
# 3 epochs (epoch 0 warms up), the cached runs 12: epochs 1..11 give them one whole K=10 window
step overhead 170 step_overhead.log $PY benchmarks/step_overhead.py --accelerator "$ACCEL" --epochs 3 \
    --cached-epochs "$EPOCHS" --ratio 0.3 --configs baseline lpa3 lpa3_eager lpa3_graphs lpa3_cached
step fixmatch 90 fixmatch_step.log $PY benchmarks/fixmatch_step.py --accelerator "$ACCEL" --setting wrn28_2_32px \
    --epochs 3 --configs fixmatch fixmatch_lpa3_all fixmatch_lpa3
# (the eager path: 31 s on an H100; the report of the sync-free one's profile took longer than 35 s)
step profile 50 profile.log $PY benchmarks/profile_step.py --accelerator "$ACCEL" --sync-free true --steps 2
step profile 50 profile.log $PY benchmarks/profile_step.py --accelerator "$ACCEL" --sync-free true --cuda-graphs --steps 2
step profile 45 profile.log $PY benchmarks/profile_step.py --accelerator "$ACCEL" --sync-free false --steps 2

# the table in the time left: 3 seeds x {baseline, lpa3} per data set, all twelve runs side by side
# (their wall times include that contention, equally for both methods); runs still going at the
# deadline stop after their epoch and are left out
case " $STEPS " in *" table "*)
  LEFT=$(( SESSION_SECONDS - SECONDS - 20 ))
  if [ "$LEFT" -lt 60 ]; then echo "table: no time left ($LEFT s)" >> "$OUT/env.txt"; exit 0; fi
  echo "table: $LEFT s" >> "$OUT/env.txt"
  RUNS=$(mktemp -d)
  COMMON=(--seeds 0 1 2 --accelerator "$ACCEL" --threads 1 --deadline "$LEFT" --root "$DATA/medmnist"
          --methods baseline lpa3)
  timeout $(( LEFT + 15 )) $PY benchmarks/medmnist_table.py --flags breastmnist --epochs 30 --jobs 6 \
      --out "$RUNS/breastmnist" "${COMMON[@]}" >> "$OUT/table.log" 2>&1 &
  sleep 1  # the two tables' lines interleave in table.log; each line names its run
  timeout $(( LEFT + 15 )) $PY benchmarks/medmnist_table.py --flags pneumoniamnist --epochs 8 --jobs 6 \
      --out "$RUNS/pneumoniamnist" "${COMMON[@]}" >> "$OUT/table.log" 2>&1 &
  wait
  tar czf "$OUT/table_runs.tgz" -C "$RUNS" .
  echo "table: done at $SECONDS s" >> "$OUT/env.txt" ;;
esac
echo "session: $SECONDS s" >> "$OUT/env.txt"
