"""python -m tools.studies: the command line of the grid study and its stages (where_it_helps.py's docstring)."""
from tools.studies.where_it_helps import main

main()
