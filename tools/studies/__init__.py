"""studies/ — the toy-world studies, one module per question; `python -m tools.studies` is their command line
(the grid study, and `--stage regime | diversity | because`). Bottom to top: common (a run as a job, the workers,
paired intervals, tables); where_it_helps (the grid: GRPO vs the SCOPE cells over seeds); when_it_helps (the
regime map over starting policies, and diverse solutions); why_it_helps (the controls of the paper's two causal
claims); content_or_mean_shift (the repair's content or only its group's mean); prefix_or_suffix (which part of
a repair teaches)."""
