"""generate.py — generation backends shared by the policy and the refiner.

(Module docstring to be completed.)
"""
# ==== imports ====

# ==== 1. prompts and the Completion record ====

# ==== 2. Hugging Face generate backend ====

# ==== 3. in-process vLLM backend (owned by the vLLM work, issue 8) ====

# ==== 4. OpenAI-compatible completions endpoint ====
