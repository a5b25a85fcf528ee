"""The machinery SCOPE runs in, kept out of the method's files so that the top level reads as the paper.

Four wings by job, each importing only from itself and the wings below it (tests/test_walls.py holds it):

    run/      the command line, the pre-flight, the run folder, logs, trackers, export: what a run is
    plan/     the memory and step-time models: what a run will need
    engines/  generation, the training step, torchrun, LoRA, the PRM's and the refiner's engines: what runs
    data/     problems, the prompt, the grader and its maths, the toy world: what is asked and how it is graded

Nothing here imports the five top-level files; they hand the engine what it needs (scope.paper()).
"""
