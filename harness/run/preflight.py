"""preflight.py — everything scope.py checks before a model loads or a run folder is written.

Not part of the paper. A real run costs hours of GPU time; a typo should cost seconds. In this order:

 1. `check_args`: every flag's range and the flags' coherence. A refusal is one line naming the flag, its
    value and what is valid, exit code 2 (runs.stop).
 2. `check_resume`: a resume keeps the run's record. A typed flag that changes how the run trains (anything
    but `--steps` and the bookkeeping flags in BOOKKEEPING) is refused unless `--change-config` confirms
    it (then it is recorded in changes.jsonl, runs.py rule 6); a finished run says so and exits 0.
 3. `choose_device`: the GPU (or `--device cpu`) and the rollout engine, before any data is read.
 4. `check_hub`: when a model or data set must come from the Hugging Face hub, a 3-second probe; when the
    hub is unreachable the hub libraries are put in offline mode (no screens of retries) and a model that
    is in neither a local folder nor the local cache stops the run with one line saying what to do.
    Then `check_prm_weights`: a Qwen2.5-Math-PRM checkpoint on disk has the weight names and shapes that
    harness/engines/prm_checkpoint.py loads (read from the file headers).
 5. `load_data`: training and evaluation problems loaded and checked non-empty (toy questions with --toy).
 6. `check_run_dir`: a new run's folder holds no other run (else `--overwrite`); a resumed folder has a
    complete checkpoint (else `--overwrite` restarts it) at a step not above `--steps`; no live process
    holds its lock.
 7. `check_memory`: the memory plan (harness/plan/memory.py). Printed at start; on a GPU that cannot hold it
    the run stops with the plan and the flags that would make it fit. `--dry-run` prints it (per card size, in
    the GiB cards report) and the resolved Args, then exits: it needs neither network nor GPU (what it could not
    check is listed as notes).
"""
import json
import os
import socket
import sys
import urllib.parse
from dataclasses import asdict

from harness.engines import lora
from harness.plan.memory import (FIT_SHARE, GIB, MODEL_ALIASES, MODES_WITH_PRM, fixes, format_plan, memory_plan,
                                 plan_total, refiner_fallback_refusal, world_size)
from harness.engines.refiner import MODES_WITH_REFINER   # ("scope", "replace"): the modes that repair
from harness.run import cli, trackers
from harness.run.runs import (CONFIG_RECORDS, Done, find_checkpoint, holds_run, lock_holder, read_changes, run_folder,
                              run_of, run_settings, stop, unwritable)

COMMAND_ONLY = ("resume", "overwrite", "dry_run", "change_config", "run_name", "config")   # how this process was started
BOOKKEEPING = ("steps", "eval_every", "save_every", "memory_check", "report_to", "dist_timeout", "grader",
               "log_detail")   # not the training
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


# ---------------------------------------------------------------------------------------------------------- 1. flags
# flags that act only where failures are repaired (MODES_WITH_REFINER), and the one of --mode prm-reward alone
REPAIR_FLAGS = ("refiner", "refiner_url", "merge", "refine_attempts", "refine_prompt", "refiner_max_tokens",
                "rectify_groups", "select_tiebreak", "repair_advantage", "offpolicy_credit", "shaping_gamma")


def ignored_flags(args) -> list[str]:
    """The flags set away from their defaults that this --mode never reads (--merge append with --mode grpo).
    --refiner is left out with --toy, whose default (toy-oracle) differs from the dataclass's."""
    defaults = type(args)()
    repairs = args.mode in MODES_WITH_REFINER
    names = [] if repairs else [n for n in REPAIR_FLAGS if not (args.toy and n == "refiner")]
    names += ["prm_reward_coef"] if args.mode != "prm-reward" else []
    return [n for n in names if hasattr(defaults, n) and getattr(args, n) != getattr(defaults, n)]


def check_args(args, notes=()) -> list[str]:
    """Every flag's range and coherence; one line and exit 2 on the first problem. Then the notes, each one line on
    stderr and returned: `notes` (what parse_args chose untyped, config.notes_of), the flags the mode ignores, a
    warm-up longer than the run."""
    from dataclasses import fields

    for f in fields(args):   # argparse checks choices; an Args built in code is checked here
        choices = f.metadata.get("choices")
        if choices and getattr(args, f.name) not in choices:
            stop(f"--{f.name.replace('_', '-')} {getattr(args, f.name)!r}: choose from {', '.join(choices)}")

    from harness.data.toy import STYLES   # the toy world's step styles (scope.py has imported it already)
    groups = args.prompts_per_step // world_size()   # this process's groups (torchrun: each rank's share)
    refusal = cli.out_of_range(args, (   # (flag, test of its value, what it must be), checked in this order
        *((flag, lambda v: v >= 1, "an integer >= 1") for flag in (
            "steps", "prompts-per-step", "max-new-tokens", "refine-attempts", "micro-batch-size", "save-every",
            "eval-n", "gen-batch-size", "eval-max-new-tokens", "refiner-max-tokens")),
        ("group-size", lambda v: v >= 2, ">= 2 (advantages are centred within a group: one rollout per prompt gives "
                                         "zero loss and zero gradient)"),
        *((flag, lambda v: v >= 0, "an integer >= 0") for flag in ("eval-every", "eval-size", "seed")),
        ("lr", lambda v: v > 0 and v < 1, "> 0 and < 1"),
        ("warmup-steps", lambda v: v >= 0, ">= 0 (0: a constant learning rate)"),
        ("max-grad-norm", lambda v: v > 0, "> 0 (inf: no clip)"),
        ("tau", lambda v: 0 < v <= 1, "in (0, 1] (a PRM score is a probability; tau > 1 flags every step)"),
        ("toy-prm-noise", lambda v: 0 <= v <= 1, "a probability in [0, 1]"),
        ("toy-styles", lambda v: 1 <= v <= len(STYLES), f"an integer in 1..{len(STYLES)} (the toy world's step "
                                                        f"styles, harness/data/toy.py choice 10)"),
        ("temperature", lambda v: v > 0, "> 0"),
        ("clip-eps", lambda v: v > 0, "> 0 (inf: no clip)"),
        ("updates-per-batch", lambda v: 1 <= v <= groups, f"an integer in 1..{groups} (each optimizer step takes "
         f"whole groups, and each process holds {groups} of --prompts-per-step {args.prompts_per_step})"),
        ("shaping-gamma", lambda v: v > 0, "> 0"),
        ("kl-coef", lambda v: v >= 0, ">= 0"),
        ("entropy-coef", lambda v: v >= 0, ">= 0"),
        ("prm-reward-coef", lambda v: abs(v) < float("inf"), "a finite number"),
        ("refiner-mem", lambda v: 0 < v < 1, "a share of the GPU's memory in (0, 1)"),
        ("refiner-timeout", lambda v: v > 0, "> 0 seconds"),
        ("tis-cap", lambda v: v == 0 or 1 <= v < float("inf"),
         "0 (off) or a finite cap >= 1 (a cap below 1 would scale every policy token down)")))
    if refusal:
        stop(refusal)
    if not args.toy:
        if args.toy_prm_noise != 0:
            stop(f"--toy-prm-noise {args.toy_prm_noise!r}: only with --toy (the real PRM has no noise knob)")
        if args.toy_styles != 1:
            stop(f"--toy-styles {args.toy_styles!r}: only with --toy (real solutions have their own styles)")
        for flag in ("model", "prm", "refiner"):
            if getattr(args, flag) in ("toy", "toy-oracle", "toy-model"):
                stop(f"--{flag} {getattr(args, flag)}: only with --toy")
    elif not args.refiner_url and args.refiner not in ("toy", "toy-oracle", "toy-model", "policy"):
        stop(f"--refiner {args.refiner!r} with --toy: choose toy-oracle, toy-model or policy "
             f"(or serve a model and pass --refiner-url)")
    package = TRACKER_PACKAGES.get(args.report_to)
    if package is not None:
        import importlib.util

        if importlib.util.find_spec(package) is None:
            stop(f"--report-to {args.report_to}: the {package} package is not installed ({trackers.INSTALL[package]})")
    if args.mode in MODES_WITH_PRM and args.prm == "none":
        stop(f"--prm none: --mode {args.mode} needs a PRM (--prm none only suits --mode grpo)")
    if args.refiner_quantization != "none" and (args.mode not in MODES_WITH_REFINER or args.toy or args.refiner_url
                                                or args.refiner == "policy" or args.backend == "hf"):
        stop(f"--refiner-quantization {args.refiner_quantization}: only for a refiner on its own `vllm serve` "
             f"(--mode scope or replace, a separate --refiner, no --refiner-url, --toy or --backend hf)")
    if args.prm_quantization != "none" and (args.prm == "none" or args.toy or args.backend == "hf"):
        stop(f"--prm-quantization {args.prm_quantization}: only for a PRM on its own `vllm serve --runner pooling` "
             f"(a --prm, no --toy or --backend hf)")
    if args.prm_format != "auto" and (args.prm in ("none", "toy") or args.toy):
        stop(f"--prm-format {args.prm_format}: the input layout of a PRM checkpoint; --prm {args.prm} reads none")
    if args.overlap_old_logp == "on" and args.updates_per_batch == 1:
        stop("--overlap-old-logp on: with --updates-per-batch 1 there is no π_old pass to overlap")
    if args.overlap_old_logp == "on" and args.fsdp:
        stop("--overlap-old-logp on: not with --fsdp (a sharded forward is a collective, which the worker thread "
             "must not run beside the step's own)")
    if args.refiner_url and args.refiner in ("policy", "toy", "toy-oracle", "toy-model"):
        stop(f"--refiner-url {args.refiner_url!r}: needs --refiner NAME of the served model, not {args.refiner!r}")
    check_lora(args)   # --lora-rank, --lora-alpha, --lora-targets
    notes = list(notes)
    ignored = ignored_flags(args)
    if ignored:
        notes.append(f"--mode {args.mode} ignores " + ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)}"
                                                              for n in ignored))
    if args.warmup_steps > args.steps:   # the learning rate never reaches --lr
        notes.append(f"--warmup-steps {args.warmup_steps} is longer than the run (--steps {args.steps}): the learning "
                     f"rate rises only to {args.steps / args.warmup_steps:.0%} of --lr {args.lr:g}")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return notes


def check_lora(args) -> None:
    """The LoRA flags' range and coherence (check_args): one line and exit 2 on the first problem."""
    if args.lora_rank < 0:
        stop(f"--lora-rank {args.lora_rank}: must be 0 (the full fine-tune) or a rank >= 1")
    if args.resume:   # the checkpoint holds the whole policy or an adapter of one rank and set of layers
        for flag, (was, now) in resume_changes(args, args.resume.rstrip("/")).items():
            if flag.startswith("lora_"):
                stop(f"--{flag.replace('_', '-')} {now}: {args.resume} trained with {was}; a resume continues "
                     f"the model its checkpoint holds (start a new run for another)")
    if not args.lora_rank:
        for flag, value, default in (("alpha", args.lora_alpha, 0.0), ("targets", args.lora_targets, lora.TARGETS)):
            if value != default:
                stop(f"--lora-{flag} {value}: only with --lora-rank R (or --use_peft); without it the whole "
                     f"policy is trained")
        return
    if args.lora_alpha < 0:
        stop(f"--lora-alpha {args.lora_alpha}: must be > 0 (or 0: 2 × --lora-rank)")
    if not args.lora_targets.replace(",", "").strip():
        stop("--lora-targets '': name at least one linear layer (e.g. q_proj,v_proj), or all-linear")
    # the vLLM push sends each decoder projection merged (Merged) under the base's names and nothing else: an adapter
    # on the embedding (the head of a tied model) or on lm_head would train one network and sample from another
    names = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    other = [t for t in names if t not in lora.TARGETS.split(",")]
    if other and names != ["all-linear"]:
        stop(f"--lora-targets {args.lora_targets}: {', '.join(other)} is not one of the decoder's projections; "
             f"name some of {lora.TARGETS} (comma-separated) or all-linear")
    if args.fsdp:
        stop(f"--lora-rank {args.lora_rank}: not with --fsdp (it shards a full fine-tune; an adapter's gradients "
             f"and AdamW state are small: run torchrun without --fsdp, one full base per GPU)")
    import importlib.util
    if importlib.util.find_spec("peft") is None:
        stop(f"--lora-rank {args.lora_rank}: needs the peft package (pip install -r requirements.txt)")


# ---------------------------------------------------------------------------------------------------------- 2. folder
def run_dir_of(args) -> str:
    """The run's folder: --resume's, else runs/<--run-name> (default: <mode>-<model>-s<seed>). A relative name stays
    under runs/, where --resume, tools.report and eval.py's reports find the run (`a/b` is runs/a/b; a name that
    climbs out with '..' stops in one line); an absolute path is the run folder itself (TRL's output_dir)."""
    if args.run_name and not args.resume and ".." in args.run_name.replace(os.sep, "/").split("/"):
        stop(f"--run-name {args.run_name}: a run name stays under runs/ ('..' would leave it); to keep a run "
             f"elsewhere give its folder as an absolute path")
    name = args.run_name or f"{args.mode}-{os.path.basename(args.model.rstrip('/'))}-s{args.seed}"
    return args.resume.rstrip("/") or os.path.join("runs", name)


def check_run_dir(args, run_dir: str) -> int | None:
    """Refuse to clobber a run, resume without a checkpoint or below its step, or share a live run's folder.
    Returns the step of the checkpoint a resume starts from (None: from step 1)."""
    blocked = unwritable(run_dir)
    if blocked is not None:
        why = "not a folder" if os.path.isfile(blocked) else "not writable by this user"
        stop(f"{run_dir}: cannot write there ({blocked} is {why}); run from a folder you can write, or pass "
             f"--run-name")
    holder = lock_holder(run_dir)
    if holder is not None:
        stop(f"{run_dir} is in use by another run ({holder}); wait for it, or delete {run_dir}/lock if that "
             f"process is gone")
    if not args.resume:
        if holds_run(run_dir) and not args.overwrite:
            refusal = (f"{run_dir} already holds a run; continue it (--resume {run_dir}), pick another --run-name, "
                       f"or replace it (--overwrite)")
            if args.dry_run:   # a dry run writes nothing: it says what the run would meet
                print(f"note: the run itself would stop here: {refusal}")
                return None
            stop(refusal)
        return None
    found = find_checkpoint(run_dir)
    if found is None:
        if not args.overwrite:
            stop(f"{run_dir} has no complete checkpoint (the run stopped before its first save); restart it "
                 f"from step 1 with --resume {run_dir} --overwrite (its logs are replaced)")
        return None
    if args.steps < found[1]:
        stop(f"--steps {args.steps}: below the step of {run_dir}'s checkpoint ({found[1]}); pass --steps >= {found[1]}")
    return found[1]


def check_resume(args) -> None:
    """Refuse a typed flag that changes how a resumed run trains (unless --change-config); a finished run: one
    line, exit 0."""
    if not args.resume:
        return
    run_dir = run_dir_of(args)
    changed = [k for k in resume_changes(args, run_dir) if k not in BOOKKEEPING]
    if changed and not args.change_config:
        settings = run_settings(read_run_config(run_dir, set(asdict(args))), read_changes(run_dir))
        flags = ", ".join(f"--{k.replace('_', '-')} {getattr(args, k)} (the run has {settings.get(k)})" for k in changed)
        stop(f"--resume {run_dir}: {flags} would change how the run trains; drop the flag, start a new run "
             f"(--run-name), or confirm with --change-config (recorded with its step in {run_dir}/changes.jsonl)")
    found = find_checkpoint(run_dir)
    if found is not None and found[1] == args.steps:
        print(f"{run_dir} is finished (step {found[1]} of --steps {args.steps}): nothing to do; "
              f"--resume {run_dir} --steps N (N > {found[1]}) trains it further")
        raise Done({"run_dir": run_dir, "finished_step": found[1]})   # exit 0 (from Python: this dict)


def resume_changes(args, run_dir: str) -> dict[str, tuple]:
    """{flag: (the run's setting, the value now)} for every setting a resume changes (COMMAND_ONLY left out)."""
    defaults = asdict(type(args)())   # a config.json written before a flag existed ran with its default
    settings = {**defaults, **run_settings(read_run_config(run_dir, set(defaults)), read_changes(run_dir))}
    return {k: (settings[k], v) for k, v in asdict(args).items() if k not in COMMAND_ONLY and settings[k] != v}


def resume_step_of(args, run_dir: str) -> int | None:
    """The step of the checkpoint a resume would start from (None: a new run, or no checkpoint yet)."""
    found = find_checkpoint(run_dir) if args.resume else None
    return None if found is None else found[1]


# a flag whose default changed when it was added: a config.json written before it ran with this value
BEFORE_THE_FLAG = {"updates_per_batch": 1}   # one optimizer step per rollout batch


def read_run_config(run_dir: str, known: set[str]) -> dict:
    """The config.json of a run folder to resume, checked: the folder, the file, JSON, no foreign keys; a flag
    it predates gets the value the run had (`BEFORE_THE_FLAG`). The run's settings now are this with
    changes.jsonl applied (runs.run_settings)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isdir(run_dir):
        stop(f"--resume {run_dir}: no such folder")
    run = run_of(run_dir)
    if run is not None:   # TRL's resume_from_checkpoint habit: the checkpoint, not the run
        stop(f"--resume {run_dir}: the {os.path.basename(os.path.normpath(run_dir))}/ folder of run {run}; --resume "
             f"takes the run folder (it continues from that run's newest complete checkpoint): --resume {run}")
    if not os.path.isfile(path):
        stop(f"--resume {run_dir}: no config.json there (not a scope.py run folder, or it never started)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        stop(f"--resume {run_dir}: config.json is not valid JSON ({e})")
    if not isinstance(config, dict):
        stop(f"--resume {run_dir}: config.json is not an object of flags")
    config = {k: v for k, v in config.items() if k not in CONFIG_RECORDS}   # a record, not a flag
    foreign = sorted(set(config) - known)
    if foreign:
        stop(f"--resume {run_dir}: config.json has keys scope.py does not know ({', '.join(foreign[:5])}); "
             f"was it written by another program or version?")
    return {**BEFORE_THE_FLAG, **config}


# ---------------------------------------------------------------------------------------------------------- 3. device
def choose_device(args) -> tuple[str, bool, list[str]]:
    """(device, use_vllm, notes). No GPU with --device auto stops the run (a note with --dry-run)."""
    import torch

    from harness.engines.generate import vllm_importable

    notes = []
    cuda_present = torch.cuda.is_available()
    device = args.device if args.device != "auto" else ("cuda" if cuda_present else "cpu")
    if device.startswith("cuda") and not cuda_present:
        stop(f"--device {args.device}: no CUDA device is visible")
    if not device.startswith("cuda") and not args.toy:
        if args.device == "auto":
            if not args.dry_run:
                stop("no CUDA device found; pass --device cpu to train on the CPU anyway (minutes to hours per "
                     "step), or try --toy")
            notes.append("no CUDA device here: the run itself needs one (or --device cpu)")
        else:
            print(f"warning: no GPU. Training on the CPU takes minutes to hours per step "
                  f"({args.prompts_per_step}x{args.group_size} rollouts of up to {args.max_new_tokens} tokens); "
                  f"`--toy` shows the method on a CPU in minutes.", file=sys.stderr)
    use_vllm = args.backend == "vllm" or (args.backend == "auto" and device.startswith("cuda") and vllm_importable())
    if use_vllm and not vllm_importable():
        stop("--backend vllm: vllm is not installed (GPU: pip install vllm==0.33.0), or use --backend hf")
    return device, use_vllm, notes


# ---------------------------------------------------------------------------------------------------------- 4. hub
def near_path(path: str) -> str:
    """" (did you mean runs/x/model?)" for a path that does not exist beside one that does and is close; else ""."""
    import difflib

    parent = os.path.dirname(path.rstrip("/")) or "."
    if not os.path.isdir(parent):
        return ""
    near = difflib.get_close_matches(os.path.basename(path.rstrip("/")), os.listdir(parent), n=1, cutoff=0.6)
    return f" (did you mean {os.path.join(parent, near[0]) if parent != '.' else near[0]}?)" if near else ""


def hub_models(args, resume_step: int | None) -> list[str]:
    """Hub ids of the models this run loads that are not local folders."""
    names = []
    if args.toy and args.model != "toy" and resume_step is None and not os.path.isdir(args.model):
        stop(f"--model {args.model} with --toy: no such folder{near_path(args.model)}; --toy trains 'toy' (the "
             f"shipped warm start) or a folder a toy run saved (runs/NAME/checkpoint or runs/NAME/model)")
    if args.toy and args.model != "toy" and resume_step is None:
        check_model_name("--model", args.model)   # a run folder or an adapter: one line naming the model to pass
    if not args.toy:
        if resume_step is None or args.kl_coef > 0:   # a resume loads the policy from its checkpoint
            names.append(check_model_name("--model", args.model))
        if args.prm != "none":
            names.append(check_model_name("--prm", args.prm))
        if args.mode in MODES_WITH_REFINER and args.refiner != "policy":
            names.append(check_model_name("--refiner", args.refiner))
    return [n for n in names if not os.path.exists(n)]


def model_id(name: str) -> str:
    """The Hugging Face id of an alias (Qwen2.5-1.5B → Qwen/Qwen2.5-1.5B); any other name as it is. scope.py and
    eval.py resolve every model name through it."""
    return MODEL_ALIASES.get(name, name)


def check_model_name(flag: str, name: str, adapter: bool = False) -> str:
    """`name` resolved (model_id) when it can be a model folder or a hub id ("owner/name"); else one line and exit
    2: a path that does not exist (naming the closest one beside it), a word that is no alias (naming the closest
    alias), a folder without config.json, or a run folder (runs.run_folder: known by what it holds), whose models
    are its checkpoint/ and model/. A LoRA run's checkpoint/ holds an adapter, no config.json: accepted where the
    caller evaluates an adapter on its base (`adapter`, eval.py), else one line naming the run's merged model/."""
    import difflib

    path = model_id(name)
    if run_folder(path):
        inside = {d: os.path.join(path.rstrip("/"), d) for d in ("checkpoint", "model")
                  if os.path.isfile(os.path.join(path, d, "config.json"))
                  or (adapter and lora.is_adapter(os.path.join(path, d)))}
        if inside:
            what = {"checkpoint": "its last checkpoint, which --resume continues",
                    "model": "the model it wrote when it finished"}
            stop(f"{flag} {name}: a run folder, not a model; pass "
                 + " or ".join(f"{p} ({what[d]})" for d, p in inside.items()))
        stop(f"{flag} {name}: a run folder with no model yet (it stopped before its first checkpoint was saved)")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        if lora.is_adapter(path):
            if adapter:
                return path
            run = run_of(path)
            merged = (f"{os.path.join(run, 'model')} (the merged model; python -m harness.run.export {run} writes it), "
                      f"or --resume {run} to train on" if run else "the model it was merged into")
            stop(f"{flag} {name}: a LoRA adapter (no config.json), not a model; pass {merged}")
        stop(f"{flag} {name}: no config.json in that folder, so no model (a model folder holds config.json, the "
             f"weights and the tokenizer)")
    if os.path.exists(path):
        return path
    if path.startswith((".", "/", "~")) or path.count("/") != 1 or os.path.isdir(path.split("/")[0]):
        near = near_path(path)   # a path that does not exist is a typo, not a hub id ("owner/name")
        if not near and "/" not in path:
            alias = difflib.get_close_matches(path, MODEL_ALIASES, n=1, cutoff=0.6)
            near = f" (did you mean {alias[0]}?)" if alias else ""
        stop(f"{flag} '{name}': no such folder{near}, and not a Hugging Face id (owner/name) nor an alias "
             f"({', '.join(sorted(MODEL_ALIASES)[:3])}, ...)")
    return path


def hub_datasets(args) -> list[str]:
    from harness.data.problems import BENCHMARKS

    sources = [args.dataset] + ([args.eval_dataset] if args.eval_every else [])
    return [s for s in sources if s in BENCHMARKS or ("/" in s and not os.path.exists(s))]


def hub_reachable(timeout: float = 3.0) -> bool:
    """A TCP connection to the hub endpoint within `timeout` seconds (behind a proxy: assumed reachable)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def go_offline() -> None:
    """Offline mode for huggingface_hub, transformers and datasets (also when they are already imported)."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


def in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:   # an id the hub library rejects (e.g. a typo'd path): not cached
        return False


def check_hub(args, resume_step: int | None) -> tuple[bool, list[str]]:
    """(offline, notes). Probes the hub only when something must come from it; offline, a model missing from
    the local cache stops the run (a note with --dry-run)."""
    models, data = hub_models(args, resume_step), hub_datasets(args)
    if not (models or data) or not offline_now():
        return False, []
    notes = []
    for name in models:
        if not in_hub_cache(name):
            message = uncached(name) + ", or try --toy"
            if not args.dry_run:
                stop(message)
            notes.append(message)
    return True, notes


def offline_now() -> bool:
    """True when the hub cannot be used (HF_HUB_OFFLINE set, or no connection within 3 s); then the hub libraries
    are put in offline mode, so nothing waits on retries. scope.py and eval.py decide it here."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") or not hub_reachable()
    if offline:
        go_offline()
    return offline


def uncached(name: str) -> str:
    """The refusal of a model needed from the hub when there is no network and it is not in the local cache."""
    return (f"no network: cannot reach the Hugging Face hub and '{name}' is neither a local folder nor in the local "
            f"cache; pass a local folder, download it where there is network (`hf download {name}`)")


def check_prm_weights(args) -> None:
    """A Qwen2.5-Math-PRM checkpoint that is a local folder, or whose weights are in the hub cache: its weight
    names and shapes against the module harness/engines/prm_checkpoint.py builds, from the safetensors headers (no tensor is read), so a
    damaged checkpoint stops the run in one line before any model loads. Other PRMs are checked as they load."""
    if args.toy or args.prm == "none":
        return
    name = MODEL_ALIASES.get(args.prm, args.prm)
    folder = name if os.path.isdir(name) else None
    if folder is None and "/" in name:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
            folder = os.path.dirname(cached) if isinstance(cached, str) else None
        except (ImportError, ValueError):
            folder = None
    if folder is None or not any(os.path.isfile(os.path.join(folder, f))
                                 for f in ("model.safetensors", "model.safetensors.index.json")):
        return   # downloaded when the PRM loads; checked there
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return   # the loader names an unreadable config
    from harness.engines import prm_checkpoint

    if prm_checkpoint.PRM_ARCHITECTURE in archs:
        try:
            prm_checkpoint.check_qwen2_prm_checkpoint(folder)
        except (OSError, ValueError) as e:
            stop(f"--prm {args.prm}: {e}")


# ---------------------------------------------------------------------------------------------------------- 5. data
def load_data(args, offline: bool, notes: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    """(train, eval) problems, loaded before any model and checked non-empty (toy questions with --toy).
    A --dry-run without network skips hub data sets and says so in `notes`."""
    from harness.data.problems import BENCHMARKS, load_problems

    def load(flag: str, source: str, **kw) -> list[dict]:
        if args.dry_run and offline and source in hub_datasets(args):
            if notes is not None:
                notes.append(f"--{flag} {source}: not checked (no network; the run needs it from the hub or its cache)")
            return []
        try:
            problems = load_problems(source, **kw)
        except (ValueError, OSError, RuntimeError) as e:
            hint = "; no network: pass a local .jsonl file or try --toy" if offline else ""
            stop(f"--{flag} {source}: cannot load problems: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                 f"{hint}")
        if not problems:
            stop(f"--{flag} {source}: no problems in it")
        if args.toy:
            from harness.data import toy
            for k, p in enumerate(problems):
                try:
                    toy.parse_question(p["question"])
                except ValueError:
                    stop(f"--{flag} {source}: problem {k + 1} is not a toy question ({p['question'][:60]!r}); "
                         f"--toy trains on 'Start at A, add B. ...' chains (its PRM and refiner know only those)")
        return problems

    fields = dict(question_field=args.question_field, answer_field=args.answer_field)
    if any(fields.values()) and (args.dataset == "toy" or args.dataset in BENCHMARKS):
        stop(f"--{'question' if args.question_field else 'answer'}-field: only for a --dataset of your own (a local "
             f"file or hub id); {args.dataset} has its fields set already")
    train = load("dataset", args.dataset, split="train", **fields)   # toy: another seed than the held-out set
    evals = load("eval-dataset", args.eval_dataset, limit=args.eval_size or None) if args.eval_every else []
    return train, evals


# ---------------------------------------------------------------------------------------------------------- 6. memory
def check_refiner_fallback(args, device: str, reason: str, log_path: str) -> None:
    """Stop (one line, exit 2) when the refiner server failed and HF generate on this GPU would not fit
    (refiner_fallback_refusal with torch.cuda.mem_get_info); on the CPU the fallback is always allowed."""
    if not device.startswith("cuda"):
        return
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    refusal = refiner_fallback_refusal(args, free / GIB, total / GIB, reason, log_path)
    if refusal:
        stop(refusal)


def check_memory(args, device: str, use_vllm: bool) -> None:
    """Print the plan (on a GPU, and with --dry-run); on a GPU that cannot hold it, stop with the plan and the flags
    that would make it fit."""
    gpu_gib = None
    if device.startswith("cuda"):
        import torch

        gpu_gib = torch.cuda.get_device_properties(torch.device(device)).total_memory / GIB
    rows, notes = memory_plan(args, gpu_gib, use_vllm or (gpu_gib is None and args.backend != "hf"))
    if args.dry_run or (gpu_gib is not None and not args.toy):
        print(format_plan(args, rows, notes, gpu_gib))
    elif not args.toy:   # a real model on the CPU: the plan is of GPU memory and says nothing here
        print(f"memory: a real model on the CPU (--device {args.device}); no GPU memory plan (--dry-run prints it)")
    if gpu_gib is not None and rows and plan_total(rows) > FIT_SHARE * gpu_gib and args.memory_check and not args.dry_run:
        ways = fixes(args, gpu_gib, use_vllm)
        stop(f"this run needs about {plan_total(rows):.0f} GiB, the GPU has {gpu_gib:.0f} GiB"
             + (f"; it would fit with: {' | '.join(ways)}" if ways else "; use a smaller model or a larger GPU")
             + " (the plan is an estimate: --no-memory-check starts anyway)")


def print_dry_run(args, run_dir: str, notes: list[str]) -> None:
    print(f"dry run: would write {run_dir}; resolved Args:")
    print(json.dumps(asdict(args), indent=1))
    for n in notes:
        print(f"note: {n}")
