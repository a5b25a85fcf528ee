"""run/ — what a run is: the command line and its flags, the pre-flight, the run folder (lock, checkpoints, logs),
progress, trackers, curves, the export, and the wiring `scope.main` calls. The top wing: it imports all below."""
