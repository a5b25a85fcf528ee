"""Tools around the method, run from the repository root as modules: `python -m tools.experiment` (the toy
study), `python -m tools.exercises` (the course assignment), `python -m tools.bench_step` (a toy GRPO step
against TRL's)."""
