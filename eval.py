"""eval.py — answers, grading, benchmarks and the paper's evaluation metrics.

(Module docstring to be completed: what it implements, paper references, how to run, departures.)
"""
# ==== imports (add yours here; keep them sorted by group) ====
import json
import math
import re

# ==== 1. answer extraction and grading (issue 2) ====

# ==== 2. problems and benchmarks (issue 2) ====

# ==== 3. metrics: pass@k, diversity, near misses (issue 6) ====

# ==== 4. evaluation, plots, trace viewer, CLI (issue 6) ====
