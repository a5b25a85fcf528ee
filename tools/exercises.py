"""python -m tools.exercises: the course's command line (tools/course/ holds the course; its docstring lists the
commands)."""
import sys

from tools.course.cli import main

if __name__ == "__main__":
    sys.exit(main())
