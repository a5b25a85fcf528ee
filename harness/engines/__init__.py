"""engines/ — what runs: generation (HF, vLLM, a served model), the training step under grpo.update, torchrun,
LoRA, π_old's overlapped pass, the refiner's and the PRM's engines and the served PRM. Imports data/ only."""
