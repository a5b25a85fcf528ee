"""bench/ — measurements of our own code: memory (the memory plan's constants, traced on fake tensors) and step
(one toy GRPO step beside TRL's)."""
