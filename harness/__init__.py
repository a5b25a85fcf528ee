"""The machinery SCOPE runs in, kept out of the method's files so that the top level reads as the paper.

grader.py (the verifier) and latex.py (its maths), problems.py (benchmarks and data), generate.py (HF,
vLLM and served generation), toy.py (the CPU toy world), preflight.py (every check before a model loads),
runs.py (run folders, locks, checkpoints). Plain modules: import what you need, e.g.
`from harness.grader import grade`.
"""
