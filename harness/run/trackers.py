"""trackers.py — the run's numbers in TensorBoard or Weights & Biases (`scope.py --report-to`), beside metrics.jsonl.

Not part of the paper: the trackers the field's trainers log to with one flag (TRL's `report_to`, CleanRL's
`--track`), so SCOPE runs can be compared where people compare runs. What each receives:

 1. every number of every metrics.jsonl record, under the same name and at the same step (the step-0
    evaluation included, so `eval_acc` is the evaluation curve); fields a step did not measure (None) and
    text fields (`mode`) are left out;
 2. the run's settings once per process (config.json's flags, as resolved for this process), as text in
    TensorBoard and as the run config in W&B.

`--report-to tensorboard` writes event files to runs/<name>/tensorboard (`tensorboard --logdir runs`); a resume
drops the events logged after the checkpoint, as it does for metrics.jsonl. `--report-to wandb` logs to the
project $WANDB_PROJECT (default "scope") under the run folder's name, offline into runs/<name>/wandb when
api.wandb.ai cannot be reached or $WANDB_MODE says so (`wandb sync` uploads it later). Neither package is
needed unless chosen: the pre-flight stops with one line when the chosen one is missing.
"""
import json
import os
import socket
import zlib


def scalars(record: dict) -> dict[str, float]:
    """The numbers of one metrics.jsonl record, by name (the step, text fields and unmeasured Nones left out)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and v is not None}


class TensorBoard:
    """Event files under runs/<name>/tensorboard."""

    def __init__(self, run_dir: str, config: dict, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at steps >= first_step (logged after the checkpoint a resume starts from) are dropped
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"),
                                    purge_step=first_step if first_step > 1 else None)
        print(f"tensorboard: logging to {run_dir}/tensorboard (view: tensorboard --logdir {run_dir}/tensorboard)")
        self.writer.add_text("config", "    " + json.dumps(config, indent=1).replace("\n", "\n    "), first_step - 1)

    def log(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    try:
        socket.create_connection((host, port), timeout).close()
        return True
    except OSError:
        return False


class WandB:
    """One W&B run per run folder (a resume continues it: the same id); offline without network."""

    def __init__(self, run_dir: str, config: dict):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if reachable("api.wandb.ai") else "offline")
        if mode == "offline":
            print(f"wandb: offline (no network or WANDB_MODE=offline): logging to {run_dir}/wandb; "
                  f"upload later with `wandb sync {run_dir}/wandb/offline-run-*`")
        name = os.path.basename(os.path.abspath(run_dir))
        run_id = f"{name}-{zlib.crc32(os.path.abspath(run_dir).encode()):08x}"   # stable per folder
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "scope"), name=name, id=run_id,
                              resume="allow", dir=run_dir, config=config, mode=mode)

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


# the tracker packages at the versions the README's test line installs (a hint names these, checked by a test)
INSTALL = {"tensorboard": "pip install tensorboard==2.20.0", "wandb": "pip install wandb==0.31.0"}


def open_tracker(kind: str, run_dir: str, config: dict, first_step: int):
    """The tracker of `--report-to` (None for none). first_step: the first step this process logs (1, or the
    step after the checkpoint a resume starts from)."""
    if kind == "tensorboard":
        return TensorBoard(run_dir, config, first_step)
    if kind == "wandb":
        return WandB(run_dir, config)   # a resume continues the same W&B run
    return None
