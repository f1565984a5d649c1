#!/bin/bash
# What a lent GPU's clock, power and voltage do under sustained tensor-core work, read from nvidia-smi
# (the board's settings left as they are): idle, then a bf16 GEMM loop, then an fp8 one, each sampled
# after it settles. The figures behind the power model's choice of law (docs/devices.md, "Power").
#     OUT=outputs/power bash bench/gpu_power.sh
set -u
OUT=${OUT:-outputs/power}; mkdir -p "$OUT"; PY=${PY:-python3}
q() { nvidia-smi -q -d VOLTAGE,CLOCK,POWER,PERFORMANCE,TEMPERATURE > "$OUT/$1.txt" 2>&1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,power.default_limit,power.min_limit,power.max_limit --format=csv > "$OUT/facts.csv" 2>&1
q idle
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 250 > "$OUT/samples.csv" 2>&1 &
SAMPLER=$!
$PY - "$OUT" <<'PY' > "$OUT/gemm.txt" 2>&1
import subprocess, sys, time, torch
out = sys.argv[1]
def loop(name, fn, flops, seconds=9.0):
    fn(); torch.cuda.synchronize()
    start, calls, sampled = time.time(), 0, False
    while time.time() - start < seconds:
        for _ in range(20):
            fn()
        torch.cuda.synchronize(); calls += 20
        if not sampled and time.time() - start > seconds - 3:
            subprocess.run(f"nvidia-smi -q -d VOLTAGE,CLOCK,POWER,PERFORMANCE > {out}/{name}.txt 2>&1", shell=True)
            sampled = True
    print(name, f"{calls * flops / (time.time() - start) / 1e12:.1f} TFLOP/s", time.strftime("%T"), flush=True)
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16); b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
loop("bf16", lambda: a @ b, 2 * n ** 3)
try:
    a8 = a.to(torch.float8_e4m3fn); b8 = b.t().contiguous().t().to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    loop("fp8", lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), 2 * n ** 3)
except Exception as e:
    print("fp8 failed", e)
x = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
loop("copy", lambda: x.clone(), 2 * (1 << 30), seconds=6.0)  # "TFLOP/s" here is TB/s moved
PY
kill $SAMPLER
tar -czf "$OUT/power.tar.gz" -C "$OUT" --exclude=power.tar.gz .
cat "$OUT/facts.csv" "$OUT/gemm.txt"; grep -iE "graphics|voltage|SW Power|HW Slowdown|Power Draw|Current Power Limit|^ +SM " "$OUT/idle.txt" "$OUT/bf16.txt" | head -40
