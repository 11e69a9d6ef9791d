#!/usr/bin/env bash
# The checks and benchmarks that need a GPU, in one session of about 9 minutes, each step
# under its own time limit so that a slow one cannot starve the rest.
#
#   DATA=<folder with medmnist/ and mnist5k/> OUT=<results folder> bash benchmarks/gpu_session.sh
#
# Writes to $OUT: env.txt, test_gpu.log, solver_speed.log, step_overhead.log, profile_*.log, table_*.log and
# table_runs.tgz (the per-run JSON files, table.md and time_to_accuracy.png).
set -u
OUT=${OUT:-runs/gpu}
DATA=${DATA:-../shared/data}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  $PY -c "import torch, lightning, torchmetrics, torchvision; print('torch', torch.__version__, 'lightning',
lightning.__version__, 'torchmetrics', torchmetrics.__version__, 'torchvision', torchvision.__version__)"
} > "$OUT/env.txt" 2>&1

# 1. the GPU tests (CUDA tensors through the solver, callback, cache, resume; 32/16/bf16 precision;
#    the solver as a CUDA graph against the eager solve)
timeout 180 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs > "$OUT/test_gpu.log" 2>&1
# 2. solver speed against the authors' loop on the GPU (with the sync-free and CUDA-graph solvers)
timeout 90 $PY benchmarks/solver_speed.py --device cuda --repeats 5 --data "$DATA" > "$OUT/solver_speed.log" 2>&1
# 3. training overhead (one process per configuration, nothing else on the GPU)
#    (lpa3 = the sync-free path, lpa3_eager = the default path, lpa3_graphs = the solver as a CUDA
#    graph: before/after in one run)
timeout 210 $PY benchmarks/step_overhead.py --accelerator gpu --epochs 5 --ratio 0.3 > "$OUT/step_overhead.log" 2>&1
# 3b. kernel launches per step, sync-free and default path
timeout 60 $PY benchmarks/profile_step.py --accelerator gpu --sync-free true > "$OUT/profile_sync_free.log" 2>&1
timeout 60 $PY benchmarks/profile_step.py --accelerator gpu --sync-free false > "$OUT/profile_eager.log" 2>&1
timeout 60 $PY benchmarks/profile_step.py --accelerator gpu --sync-free true --cuda-graphs > "$OUT/profile_graphs.log" 2>&1
# 4. the MedMNIST table, in the time left of ${SESSION_SECONDS:-540} s: BreastMNIST at 50 epochs and
#    PneumoniaMNIST at 12, 16 runs at a time (6 + 10 processes share the GPU and the 16 cores);
#    runs still going at the deadline stop after their epoch and are left out of the table
LEFT=$(( ${SESSION_SECONDS:-540} - SECONDS - 30 ))
if [ "$LEFT" -lt 60 ]; then echo "no time left for the table ($LEFT s)" >> "$OUT/env.txt"; exit 0; fi
echo "table: $LEFT s" >> "$OUT/env.txt"
RUNS=$(mktemp -d)
COMMON=(--seeds 0 1 2 --accelerator gpu --threads 1 --deadline "$LEFT" --root "$DATA/medmnist"
        --methods baseline randaugment lpa3 lpa3_maxstep1)
timeout $(( LEFT + 25 )) $PY benchmarks/medmnist_table.py --flags breastmnist --epochs 50 --jobs 6 \
    --out "$RUNS/breastmnist" "${COMMON[@]}" > "$OUT/table_breastmnist.log" 2>&1 &
timeout $(( LEFT + 25 )) $PY benchmarks/medmnist_table.py --flags pneumoniamnist --epochs 12 --jobs 10 \
    --out "$RUNS/pneumoniamnist" "${COMMON[@]}" > "$OUT/table_pneumoniamnist.log" 2>&1 &
wait
tar czf "$OUT/table_runs.tgz" -C "$RUNS" .
echo done
