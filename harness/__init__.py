"""The machinery SCOPE runs in, kept out of the method's files so that the top level reads as the paper.

Four wings by job, each importing only from itself and the wings below it (tests/test_walls.py holds it):

    run/      flags, command line, pre-flight, run folder, progress, trackers, curves, export, wiring: what a run is
    plan/     the memory and step-time models: what a run will need
    engines/  generation, the training step, torchrun, LoRA, π_old's overlap, the PRM and refiner engines: what runs
    data/     problems, the prompt, the grader, its maths, Math-Verify, the toy world: what is asked, how it is graded

Nothing here imports the five top-level files; they hand the engine what it needs (scope.paper()).
"""
