"""gpu/ — the GPU check's parts and figures (check.py), run by `bash .ci/gpu_check.sh`."""
