"""data/ — what is asked and how it is graded: benchmarks and `load_problems`, the prompt's layout, the verifier
and its LaTeX maths, Math-Verify's second opinion, the CPU toy world. Imports nothing from the other wings."""
