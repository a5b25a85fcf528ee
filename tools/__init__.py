"""Tools around the method, run from the repository root as modules, one folder per job: studies/ (the toy-world
studies, `python -m tools.studies`), course/ (the course assignment, `python -m tools.exercises`; the teacher's key,
course_key.py), bench/ (our memory and our toy GRPO step against TRL's, `python -m tools.bench.step`), gpu/ (the GPU
check's parts, run by .ci/gpu_check.sh) and report.py (curves and traces, `python -m tools.report`)."""
