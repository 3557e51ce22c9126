#!/usr/bin/env bash
# The GPU checks of the blocked issues, as one script for a lent GPU machine (the `device` tool), in under 8 minutes:
#   1. CUDA IPC weight handoff, 2.43 GB (OPT-1.3B) between two processes on one GPU (bench_gpu_handoff.py);
#   2. the handoff's byte-exact test and the EMA averaged on the GPU (tests/gpu -k "ipc_handoff or ema");
#   3. `rlhf-ray rehearse` of the OPT-1.3B single-GPU PPO shape (benchmarks/gpu/opt-1.3b-ppo.yaml): every role on
#      one GPU, HF engine, weights by CUDA IPC; each role's CUDA allocator peak beside the plan, the time split
#      (orchestration share) and the sync bandwidth.
# Prepare here: bash ../shared/gpu/make_site.sh (-> .gpu/site.tar.xz) and an .gpu/extra.tar.xz of small pure wheels
# the image may lack (rich, tqdm, pyyaml, psutil, ...: only used where the image has none). Then
#   run(command="bash benchmarks/gpu/run_checks.sh", carry=[".gpu"], timeout_s=540)
# Everything it measures lands in $OUT (logs, rehearsal.json, the run's metrics, nvidia-smi samples).
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
start=$(date +%s); left() { echo $(( ${BUDGET_S:-500} - ($(date +%s) - start) )); }
mkdir -p /tmp/site /tmp/extra
tar -xJf .gpu/site.tar.xz -C /tmp/site && { [ ! -f .gpu/extra.tar.xz ] || tar -xJf .gpu/extra.tar.xz -C /tmp/extra; }
export PYTHONPATH=/tmp/site:$PWD:/tmp/extra RLHF_RAY_LOG_LEVEL=INFO PYTHONUNBUFFERED=1
echo "unpacked in $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 250 > "$OUT/smi.csv" 2>/dev/null & smi=$!
python3 -c "import torch, ray, deepspeed, pydantic, transformers, rich, yaml, psutil, tqdm; print('imports ok', torch.__version__, ray.__version__, deepspeed.__version__, transformers.__version__, 'TORCH_CUDA_ARCH_LIST=' + __import__('os').environ.get('TORCH_CUDA_ARCH_LIST', ''))" 2>&1 | tee -a "$OUT/env.txt"

if [ -z "${SKIP_HANDOFF:-}" ]; then  # SKIP_HANDOFF=1: a rerun that needs only the job
  echo "== 1. handoff bench ($(left) s left)"
  cp docs/benchmarks.md "$OUT/benchmarks.before.md"
  timeout 120 python3 benchmarks/bench_gpu_handoff.py --write docs/benchmarks.md > "$OUT/handoff.txt" 2>&1
  echo "rc $?" >> "$OUT/handoff.txt"; tail -25 "$OUT/handoff.txt"; cp docs/benchmarks.md "$OUT/benchmarks.after.md"
fi

echo "== 2. the handoff and EMA tests ($(left) s left)"
timeout 90 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider -k "ipc_handoff or ema" > "$OUT/pytest_ipc.txt" 2>&1; echo "rc $?" >> "$OUT/pytest_ipc.txt"
tail -5 "$OUT/pytest_ipc.txt"

echo "== 3. rehearse ($(left) s left)"
rehearse() {
  timeout $(( $(left) - 15 )) python3 -m rlhf_ray.cli rehearse benchmarks/gpu/opt-1.3b-ppo.yaml --iterations 6 \
    --out /tmp/reh --set cluster.dashboard=false --set logging.progress=false --set logging.tensorboard=false \
    > "$OUT/rehearse$1.txt" 2>&1; echo "rc $?" >> "$OUT/rehearse$1.txt"
}
rehearse ""
if grep -q "invalid literal for int" "$OUT/rehearse.txt" && [ "$(left)" -gt 150 ]; then
  echo "arch-suffix failure: again with TORCH_CUDA_ARCH_LIST=9.0"; rm -rf /tmp/reh; TORCH_CUDA_ARCH_LIST=9.0 rehearse "-arch90"
fi
tail -30 "$OUT"/rehearse*.txt
cp /tmp/reh/rehearsal.json "$OUT/" 2>/dev/null
cp /tmp/reh/run/metrics.jsonl /tmp/reh/run/summary.json "$OUT/" 2>/dev/null  # few files: a run returns only so many
kill $smi 2>/dev/null; ray stop --force >/dev/null 2>&1
echo "done in $(( $(date +%s) - start )) s"
