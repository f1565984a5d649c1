#!/bin/bash
# Everything this project measures on a lent GPU, in one go, each step under its own time limit so
# that one failure keeps the rest: the GPU's facts, `profile --on cuda` (GPT-2, the step op by op),
# real eager steps of bench/steps.py's cases with one torch.profiler trace (bench/gpu_steps.py), and
# `calibrate --on cuda` (the kernel CSVs and the refitted profile), GPT-2 eager and compiled with
# a minute of sustained GEMMs (bench/gpu_stacks.py). Results are packed into $OUT/results.tar.gz
# after every step. ONLY picks steps; wheels in .whl/ (HolisticTraceAnalysis, which `profile --on
# cuda` reads its trace with, and what it needs) are installed first where the GPU's Python lacks them;
# fetch them where pip reaches PyPI (the lent machines reach nothing):
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 -d .whl holistictraceanalysis==0.5.0 pydot==4.0.1 plotly==7.1.0
#
#     OUT=outputs/on-gpu bash bench/on_gpu.sh          # PY=python3, ONLY=all steps by default
set -u
OUT=${OUT:-outputs/on-gpu}
PY=${PY:-python3}
ONLY=${ONLY:-"profile-gpt2 steps calibrate stacks"}
R=$OUT/r
mkdir -p "$R"
export FXWORKLOAD_CACHE_DIR=$R/cache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

pack() { tar -czf "$OUT/results.tar.gz" -C "$R" . ; }
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    [[ " $ONLY " == *" $name "* ]] || return 0
    echo "== $(date +%T) $name"
    timeout "$limit" "$@" >"$R/$name.log" 2>&1
    echo "   rc=$? ($(date +%T))"; tail -n 4 "$R/$name.log"
    pack
}

{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit,memory.total --format=csv
  $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(),
torch.cuda.get_device_properties(0))"; } >"$R/gpu.txt" 2>&1
cat "$R/gpu.txt"
step profile-gpt2 120 $PY -m fxworkload profile gpt2 --on cuda --batch 8 --seq 1024 --dtype bf16 --out "$R/gpt2-measured"
step steps 120 $PY bench/gpu_steps.py "$R/steps"
step calibrate 200 $PY -m fxworkload calibrate --on cuda --name lent-gpu
step stacks 200 $PY bench/gpu_stacks.py "$R/stacks"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$R/gpu.txt" 2>&1
pack
ls -la "$OUT"
