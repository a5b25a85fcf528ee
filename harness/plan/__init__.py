"""plan/ — what a run will need before it starts: the memory model of a step and its per-phase check, the
step-time model. Imports data/ and engines/."""
