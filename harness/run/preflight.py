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
 7. `memory_plan`: weights, gradients and AdamW state of the float32 policy, the rollout engine sized by
    need, the PRM, the refiner's server share, the update's activations and temporaries, by phase of the
    step, for one process (under torchrun: what FSDP2 shards divided by the world size), from the model configs (a local folder, the hub cache, or the known sizes of the aliases below)
    and constants traced from our own code (`python -m tools.bench_memory`). Printed at start; on a GPU
    that cannot hold it the run stops with the plan and the flags that would make it fit. `--dry-run`
    prints it (per card size, in the GiB cards report) and the resolved Args, then exits: it needs
    neither network nor GPU (what it could not check is listed as notes).
The memory plan is traced on the CPU's kernels and not yet checked on a GPU (docs/memory.md).
"""
import json
import os
import socket
import sys
import urllib.parse
from dataclasses import asdict

from harness.engines import lora
from harness.engines.refiner import MODES_WITH_REFINER   # ("scope", "replace"): the modes that repair
from harness.run import cli, trackers
from harness.run.runs import (CONFIG_RECORDS, Done, find_checkpoint, holds_run, lock_holder, read_changes, run_folder,
                              run_of, run_settings, stop, unwritable)

GIB = 2 ** 30
MODEL_ALIASES = {name: f"Qwen/{name}" for name in (
    "Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-3B", "Qwen2.5-7B", "Qwen2.5-0.5B-Instruct", "Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B-Instruct", "Qwen2.5-7B-Instruct", "Qwen2.5-32B-Instruct", "Qwen2.5-Math-1.5B", "Qwen2.5-Math-7B",
    "Qwen2.5-Math-1.5B-Instruct", "Qwen2.5-Math-7B-Instruct", "Qwen2.5-Math-PRM-7B")}
MODES_WITH_PRM = MODES_WITH_REFINER + ("prm-reward",)
PROMPT_TOKENS = 256       # assumed prompt length (system prompt + a MATH question) for the plan
COMMAND_ONLY = ("resume", "overwrite", "dry_run", "change_config", "run_name", "config")   # how this process was started
BOOKKEEPING = ("steps", "eval_every", "save_every", "memory_check", "report_to", "dist_timeout", "grader",
               "log_detail")   # not the training
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}

# The published config.json fields the plan needs, for the aliases (so --dry-run works offline).
_QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True)
_QWEN_7B = dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False)
KNOWN_CONFIGS = {
    "Qwen2.5-0.5B": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    "Qwen2.5-1.5B": _QWEN_1_5B, "Qwen2.5-Math-1.5B": _QWEN_1_5B,
    "Qwen2.5-3B": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, intermediate_size=11008, tie_word_embeddings=True),
    "Qwen2.5-7B": _QWEN_7B, "Qwen2.5-Math-7B": _QWEN_7B,
    "Qwen2.5-32B": dict(vocab_size=152064, hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, intermediate_size=27648, tie_word_embeddings=False),
    "Qwen2.5-Math-PRM-7B": {**_QWEN_7B, "head": "prm"},   # the 7B backbone + a 2-layer scoring head, no LM head
    # HuggingFaceH4's: Qwen2.5-Math-1.5B-Instruct trained with TRL's PRMTrainer, Qwen2ForTokenClassification
    "Qwen2.5-Math-1.5B-Instruct-PRM-0.2": {**_QWEN_1_5B, "head": "token-classification"},
}
TRL_PRM = "HuggingFaceH4/Qwen2.5-Math-1.5B-Instruct-PRM-0.2"   # the 1.5B PRM a 24 GB card holds beside the policy


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
def model_config(name: str) -> dict | None:
    """The config fields of a model: its local config.json, the hub cache's, or the known sizes of an alias."""
    path = MODEL_ALIASES.get(name, name)
    local = os.path.join(path, "config.json")
    if not os.path.isfile(local) and not os.path.exists(path) and "/" in path:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            local = cached if isinstance(cached, str) else local
        except Exception:
            pass
    if os.path.isfile(local):
        try:
            with open(local, encoding="utf-8") as f:
                config = json.load(f)
            config = config.get("text_config", config)   # multimodal wrappers keep the LM fields one level down
            if not all(k in config for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "intermediate_size", "vocab_size")):
                return None   # not a Qwen2/Llama-style config: no estimate rather than a wrong one
            if any("ProcessReward" in a for a in config.get("architectures") or []):
                config["head"] = "prm"
            elif any(a.endswith("ForTokenClassification") for a in config.get("architectures") or []):
                config["head"] = "token-classification"
            return config
        except (OSError, ValueError):
            return None
    return KNOWN_CONFIGS.get(path.split("/")[-1].removesuffix("-Instruct"))


def n_params(cfg: dict) -> int:
    """Parameters of a Qwen2/Llama-style decoder from its config: embeddings, attention (q/k/v with bias, o),
    SwiGLU MLP, norms, and an untied LM head (or the PRM's hidden→hidden→2 scoring head, or a token classifier's
    hidden→2 one)."""
    h, layers, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    per_layer = (h * heads * hd + heads * hd) + 2 * (h * kv * hd + kv * hd) + heads * hd * h \
        + 3 * h * cfg["intermediate_size"] + 2 * h
    head = {"prm": h * h + h + 2 * h + 2, "token-classification": 2 * h + 2}.get(
        cfg.get("head"), 0 if cfg.get("tie_word_embeddings") else v * h)
    return v * h + layers * per_layer + h + head


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """KV cache per token: 2 (K and V) · layers · kv_heads · head_dim · bytes."""
    heads = cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv * hd * dtype_bytes


# What cards report (torch.cuda.get_device_properties().total_memory) for their nominal size: RTX 4090 /
# A10-class 24 GB, A6000 / L40S-class 48 GB (the L40S reports 44.5), A100 / H100 80 GB, H200 141 GB.
CARD_GIB = {24: 23.6, 48: 47.5, 80: 79.2, 141: 139.8}
FIT_SHARE = 0.9           # a plan fits when it needs at most this share of the card (allocator fragmentation)
PROMPT_MAX = 1024         # prompt tokens the rollout engine's context allows on top of --max-new-tokens
CUDA_CONTEXT_GIB = 1.5    # CUDA context, cuBLAS workspaces, allocator rounding: not tensors, so not traced

# The update's activations and temporaries beyond fp32 weights, AdamW state and gradients (16 bytes per
# parameter), per micro-batch of n = micro_batch_size × (PROMPT_TOKENS + max_new_tokens) tokens, C = --logprob-chunk:
#     bytes = n · (a_h · h · L + a_i · I · L + a_v · V) + a_c · C · V + a_p · P
# (h hidden size, I MLP width, L layers, V vocabulary, P parameters). Fitted by `fit_constants` in
# tools/bench_memory.py to the traced peaks of `python -m tools.bench_memory --fit --full` (FakeTensorMode +
# MemTracker on our grpo micro-batch step: bf16 autocast, C = 512, two micro-batches, clip, AdamW.step): six
# small Qwen2 shapes and, with checkpointing, Qwen2.5-1.5B at 4 x 1,280 tokens (traced peak 30.13 GiB, planned
# 30.13). Largest error over the fitted traces: 1.7 % with checkpointing, 0.2 % without. With checkpointing
# a_h ≈ 11 is the saved fp32 input of each layer, a_v ≈ 4.5 the bf16 logits and their gradient, a_c ≈ 12
# the chunk's float32 log-softmax and its backward; a_p holds autocast's cached bf16 weight copies and AdamW's
# step temporaries. The no-checkpointing constants come from the small shapes only.
UPDATE_FIT = {   # checkpointing: (a_h, a_i, a_v, a_c, a_p)
    False: (38.773, 8.32, 7.181, 6.007, 1.773),
    True: (11.377, -0.187, 4.482, 12.396, 0.609),
}
# The PRM's bf16 no-grad scoring forward beyond its weights, per micro-batch of n tokens (prm_checkpoint's
# Qwen2ProcessRewardModel: decoder in bf16, score head in float32): bytes = n · (p_h · h + p_i · I). Fitted by
# least squares to `python -m tools.bench_memory --fit --only prm` (the six small shapes above; the vocabulary
# and the depth do not change the peak, which is one layer's working set: p_i ≈ 6 is three bf16 (n × I) tensors
# of the SwiGLU MLP, p_h the bf16 residual stream, its norms and the head's float32 input). Checked at full size
# by `python -m tools.bench_memory --only prm`: Qwen2.5-Math-PRM-7B scoring 4 x 1,280 tokens traced 13.90 GiB
# (weights 13.22, activations 0.69), planned 13.93 (activations 0.74).
PRM_FIT = (9.442, 6.36)


# One rank of an FSDP2 update (--fsdp on GPUs: dist.shard with dist.mixed_precision, bf16 compute, no autocast,
# fp32 reduce-scatter every micro-batch, fused AdamW), beyond its fp32 shards (16 bytes per parameter / world),
# with gradient checkpointing, per micro-batch of n tokens: bytes = r · R + n · (f_h · h · L + f_v · V), R the
# root unit's parameters (embeddings, untied lm_head, final norm). At the traced peak the root is gathered in
# bf16 (2 R) beside 4 R of fp32 temporaries for its gradient, and every layer's checkpointed bf16 input is held
# (f_h = 2); f_v is the logits' share (their bf16 gradient, the chunked log-softmax).
# Fitted to two FSDPMemTracker traces on a fake process group (tools/bench_memory.py trace_fsdp_update;
# `python -m tools.bench_memory --model Qwen2.5-Math-7B --fsdp --world 8 --only update`): Qwen2.5-Math-7B at
# world 8, 4 x 1,280 tokens, 28 layers (traced 23.11 GiB, planned 23.12) and with 4 layers (traced 11.88,
# planned 11.88). Without checkpointing there is no FSDP2 trace: the one-GPU constants (UPDATE_FIT) stand in.
FSDP_FIT = (6.0, 2.0, 2.6)   # (r, f_h, f_v)


# The update's activations and temporaries of a LoRA policy (--lora-rank > 0: bf16 base, frozen; float32 adapters
# with their gradients and AdamW state, 16 bytes per adapter parameter) beyond 2 bytes per base parameter and those
# 16 per adapter parameter, per micro-batch of n tokens: the same terms as UPDATE_FIT, P the base's parameters.
# Fitted by `fit_constants` (tools/bench_memory.py) to `python -m tools.bench_memory --fit --only lora`: the six
# small shapes above traced with PEFT's get_peft_model (rank 16 on q, k, v, o, gate, up, down) under the same step
# (largest error 0.6 % with checkpointing, 0.02 % without). With checkpointing a_h ≈ 2 is each layer's saved bf16
# input (the frozen base keeps the residual stream in bf16, where the full update's float32 weights keep it in
# float32: a_h ≈ 11), a_v ≈ 6.4 the bf16 logits and their gradient.
LORA_UPDATE_FIT = {   # checkpointing: (a_h, a_i, a_v, a_c, a_p)
    False: (33.925, 8.718, 6.536, 7.354, -0.822),
    True: (2.284, -0.047, 6.427, 7.263, 0.382),
}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")   # all linear layers


def lora_targets(args) -> tuple[str, ...]:
    """The decoder's linear layers that --lora-targets names (comma-separated; "all-linear" = LORA_TARGETS)."""
    named = getattr(args, "lora_targets", "") or "all-linear"
    names = [n.strip() for n in (named.split(",") if isinstance(named, str) else named) if n.strip()]
    return LORA_TARGETS if names == ["all-linear"] else tuple(names)


def lora_params(cfg: dict, rank: int, targets=LORA_TARGETS) -> int:
    """Parameters of PEFT's LoRA adapters of `rank` on each decoder layer's linear layers in `targets`: lora_A
    (rank × in) and lora_B (out × rank), r · (in + out) per layer."""
    h, heads, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
    kv, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    shapes = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return cfg["num_hidden_layers"] * rank * sum(sum(shapes[t]) for t in targets if t in shapes)


def lora_update_extra_bytes(cfg: dict, tokens: int, checkpointing: bool, chunk_tokens: int = 512) -> float:
    """Traced-constant estimate of a LoRA update's activations and temporaries (LORA_UPDATE_FIT)."""
    a_h, a_i, a_v, a_c, a_p = LORA_UPDATE_FIT[bool(checkpointing)]
    h, layers, inter, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    return tokens * (a_h * h * layers + a_i * inter * layers + a_v * v) + a_c * chunk_tokens * v + a_p * n_params(cfg)


def root_params(cfg: dict) -> int:
    """Parameters of FSDP2's root unit (what no decoder layer holds): the embedding, the output layer unless it is
    tied to the embedding, and the final norm."""
    return cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg.get("tie_word_embeddings") else 2) + cfg["hidden_size"]


def fsdp_update_bytes(cfg: dict, tokens: int) -> tuple[float, float]:
    """(gathered root unit, activations) of one FSDP2 rank's update with checkpointing (FSDP_FIT), in bytes."""
    r, f_h, f_v = FSDP_FIT
    h, layers, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    return r * root_params(cfg), tokens * (f_h * h * layers + f_v * v)


def update_extra_bytes(cfg: dict, tokens: int, checkpointing: bool, chunk_tokens: int = 512) -> float:
    """Traced-constant estimate of the update's activations and temporaries (UPDATE_FIT)."""
    a_h, a_i, a_v, a_c, a_p = UPDATE_FIT[bool(checkpointing)]
    h, layers, inter, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    return tokens * (a_h * h * layers + a_i * inter * layers + a_v * v) + a_c * chunk_tokens * v + a_p * n_params(cfg)


def prm_scoring_bytes(cfg: dict, tokens: int) -> float:
    """Traced-constant estimate of the PRM's scoring activations for a micro-batch of `tokens` (PRM_FIT)."""
    p_hidden, p_inter = PRM_FIT
    return tokens * (p_hidden * cfg["hidden_size"] + p_inter * cfg["intermediate_size"])


def world_size() -> int:
    """The number of torchrun processes (WORLD_SIZE, as dist.init reads it); 1 without torchrun."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))


def rollout_kv_need(args, world: int | None = None) -> tuple[int | None, int]:
    """(KV cache bytes, max_model_len) of the policy's vLLM engine sized by need: the sequences this process
    samples, prompts_per_step / world × group_size (under torchrun each rank's engine samples its own groups),
    of PROMPT_TOKENS + max_new_tokens; the context allows PROMPT_MAX prompt tokens and the larger of the
    training and evaluation budgets (the caller clamps it to the model's own context). (None: no config.)
    world: the torchrun processes (None: world_size())."""
    world = world_size() if world is None else world
    cfg = model_config(args.model)
    max_len = PROMPT_MAX + max(args.max_new_tokens, args.eval_max_new_tokens)   # the engine also evaluates
    if cfg is None:
        return None, max_len
    tokens = -(-args.prompts_per_step // world) * args.group_size * (PROMPT_TOKENS + args.max_new_tokens)
    return max(tokens, max_len) * kv_bytes_per_token(cfg), max_len   # vLLM needs room for one full-length request


# The in-process engine's batch limits, passed to vllm.LLM (harness/run/wiring.make_rollout_engine). Left unset, vLLM 0.33
# takes 256 sequences and 8,192 batched tokens on a card under 70 GiB, 1,024 and 16,384 on an H100 or H200
# (vllm/engine/arg_utils.py:2973-3006, EngineArgs.get_batch_defaults), and sizes its sampler and graph buffers by them.
ROLLOUT_BATCHED_TOKENS = 8192   # a prefill step's tokens: vLLM's own figure below 70 GiB, for every card
VLLM_GRAPH_TOKENS_MAX = 512     # vLLM 0.33 captures decode CUDA graphs of up to min(2 · max_num_seqs, 512) tokens
                                # (vllm/config/vllm.py:2464-2470, _set_cudagraph_sizes; 1,024 on Blackwell)


def rollout_engine_limits(args, world: int | None = None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of the in-process engine: every rollout of the rank's one generate call
    at once (prompts_per_step / world × group_size, as rollout_kv_need sizes its KV cache), and ROLLOUT_BATCHED_TOKENS
    (at least max_num_seqs: vLLM refuses fewer, vllm/config/scheduler.py:331)."""
    world = world_size() if world is None else world
    seqs = -(-args.prompts_per_step // world) * args.group_size
    return seqs, max(ROLLOUT_BATCHED_TOKENS, seqs)


def vllm_runtime_bytes(cfg: dict, max_num_seqs: int, batched_tokens: int) -> tuple[float, float]:
    """(the CUDA graph pool, the rest) bytes of vLLM 0.33's own buffers beside its weights and KV cache (Model Runner
    V2, vllm/v1/worker/gpu/; not traced). The graph pool, a forward's working set at the largest captured decode
    batch, is captured after the memory pools of sleep mode (vllm/v1/worker/gpu_worker.py:933-990), so sleep(level=2)
    keeps it. The rest lives and sleeps with the weights: the sampler is built in load_model, inside the "weights"
    pool (gpu_worker.py:594-596, gpu/model_runner.py:495), with the penalties' output_bin_counts, max_num_seqs × V
    int32 (sample/penalties.py:45-50); and in a generate call one step's bf16 logits of max_num_seqs rows with the
    sampler's float32 copy of them, which our logit_bias (the surplus ban) needs (sample/sampler.py:239-240), and a
    prefill step's working set at max_num_batched_tokens. A forward's working set is the PRM's traced one (PRM_FIT:
    one layer's bf16 no-grad activations, from our HF module; vLLM's fused kernels hold less)."""
    v = cfg["vocab_size"]
    graphs = prm_scoring_bytes(cfg, min(2 * max_num_seqs, VLLM_GRAPH_TOKENS_MAX))
    return graphs, (4 + 6) * max_num_seqs * v + prm_scoring_bytes(cfg, batched_tokens)


PRM_SERVED_KV_TOKENS = 32768   # the served PRM's KV cache: ~36 failures of 900 tokens in one prefill wave
PRM_PREFILL_TOKENS = 4096      # the served PRM's max_num_batched_tokens: one prefill step of 4,096 tokens


def prm_served(args, use_vllm: bool, gpu_gib: float | None = None, world: int | None = None) -> bool:
    """The PRM runs on its own `vllm serve --runner pooling` (harness/engines/served_prm.py): with vLLM on a GPU, for a
    PRM whose config.json names Qwen2ForProcessRewardModel (a pooling model vLLM has natively), when the plan
    with it fits the card (`gpu_gib`, None: not known yet). Otherwise the PRM runs in this process, where it
    can wait in CPU memory during the update (--prm-offload)."""
    if args.prm == "none" or args.toy or not use_vllm or getattr(args, "backend", "") == "hf":
        return False
    cfg = model_config(args.prm)
    if cfg is None or cfg.get("head") != "prm":
        return False
    rows = memory_plan(args, gpu_gib, use_vllm, prm_offload=False, world=world, prm_serve=True)[0]
    return gpu_gib is None or plan_total(rows) <= FIT_SHARE * gpu_gib


def prm_batched_tokens(args) -> int:
    """The served PRM's --max-num-batched-tokens: PRM_PREFILL_TOKENS, or the PRM's context when longer (STEP pooling
    has no chunked prefill, vllm/config/model.py:2205-2216, and then vLLM needs a whole sequence in one step,
    vllm/config/scheduler.py:318-329)."""
    cfg = model_config(args.prm) or {}
    return max(PRM_PREFILL_TOKENS, int(cfg.get("max_position_embeddings") or 0))


def prm_server_need(args) -> tuple[int, float]:
    """(KV cache bytes, GiB in all) of the served PRM: bf16 weights, a KV cache of PRM_SERVED_KV_TOKENS tokens, the
    activations of one prefill step of prm_batched_tokens (PRM_FIT, traced on our HF module: vLLM's own are smaller)
    and a CUDA context. Its `--gpu-memory-utilization` is this over the card."""
    cfg = model_config(args.prm)
    kv = PRM_SERVED_KV_TOKENS * kv_bytes_per_token(cfg)
    return kv, (2 * n_params(cfg) + kv + prm_scoring_bytes(cfg, prm_batched_tokens(args))) / GIB + CUDA_CONTEXT_GIB


def prm_offloaded(args, device: str, use_vllm: bool, gpu_gib: float | None = None, world: int | None = None) -> bool:
    """--prm-offload on/off, or auto: offload when the plan with the PRM resident does not fit the GPU (the plan
    of one process of `world`, None: world_size()). A served PRM (prm_served) is never offloaded: its memory is
    its server's."""
    if args.prm == "none" or args.toy or args.prm_offload == "off":
        return False
    if gpu_gib is None and device.startswith("cuda"):
        import torch

        gpu_gib = torch.cuda.get_device_properties(torch.device(device)).total_memory / GIB
    if prm_served(args, use_vllm, gpu_gib, world):
        return False
    if args.prm_offload == "on":
        return True
    if gpu_gib is None:
        return False
    rows = memory_plan(args, gpu_gib, use_vllm, prm_offload=False, world=world, prm_serve=False)[0]
    return plan_total(rows) > FIT_SHARE * gpu_gib


def memory_plan(args, gpu_gib: float | None = None, use_vllm: bool = True, prm_offload: bool | None = None,
                world: int | None = None, prm_serve: bool | None = None,
                ) -> tuple[list[tuple[str, float, str]], list[str]]:
    """([(row, GiB, phase)], notes): the GPU memory one process of a run with these Args needs, by phase.

    phase "all": held the whole step; "update": only during the update; "other": only outside it (rollout,
    PRM, refinement). The peak (`plan_total`) is "all" + the larger of the other two. Rows:
    policy fp32 weights 4 + AdamW m and v 8 bytes per parameter (all); gradients 4 (update); the update's
    activations and temporaries from traced constants (UPDATE_FIT); KL reference fp32 (all); with --lora-rank the
    bf16 base (2 bytes per parameter, all), the adapters' 12 (all) and gradients' 4 bytes (update) per adapter
    parameter, activations from LORA_UPDATE_FIT, and no KL reference (the base with the adapters off);
    rollout engine: vLLM's bf16 weights + the KV cache of all B·G sequences (rollout_kv_need), asleep during
    the update with --rollout-sleep; HF generate: the KV cache of one micro-batch; PRM: bf16 weights, with
    --prm-offload only outside the update, + its scoring activations (PRM_FIT), or its own `vllm serve` (prm_served:
    prm_server_need, all step); a refiner on its own
    `vllm serve`: --refiner-mem of the card (its weights and KV cache when no card is known); CUDA context.
    Under torchrun (world: the processes, None = world_size(); each process owns one GPU) the rollout engine
    holds the KV cache of the rank's own groups; with --fsdp the policy's weights, AdamW state and gradients are
    sharded (÷ world), and with checkpointing the update's other terms are FSDP2's own, traced (FSDP_FIT: the
    root unit gathered in bf16 and reduce-scattered from fp32, bf16 activations); without checkpointing the
    root unit and two decoder layers gathered and one GPU's activations stand in (not traced). DDP holds its
    gradient buckets (fp32, one more copy of the gradients) all step (arithmetic, not traced). The rest is per
    process as on one GPU."""
    world = world_size() if world is None else world
    if args.toy:
        return [("toy world (CPU)", 0.1, "all")], []
    notes, rows = [], []
    cfg = model_config(args.model)
    if cfg is None:
        return [], [f"no config for '{args.model}' (not local, not cached, not an alias): no memory plan"]
    p, T = n_params(cfg), PROMPT_TOKENS + args.max_new_tokens
    if prm_serve is None:
        prm_serve = prm_served(args, use_vllm, gpu_gib, world)
    if prm_offload is None:
        prm_offload = not prm_serve and prm_offloaded(args, "cpu", use_vllm, gpu_gib, world)
    ckpt = bool(getattr(args, "gradient_checkpointing", False))
    shards = world if getattr(args, "fsdp", False) and world > 1 else 1
    sharded = f", sharded over {shards} processes (FSDP2)" if shards > 1 else ""
    rank = getattr(args, "lora_rank", 0)
    tokens = args.micro_batch_size * T
    if rank:   # LoRA: the bf16 base frozen (no gradient, no AdamW state); the adapters fp32 with their state
        a = lora_params(cfg, rank, lora_targets(args))
        rows.append((f"policy {p / 1e9:.2f} B params: bf16 base weights, frozen (LoRA)", 2 * p / GIB, "all"))
        rows.append((f"LoRA adapters {a / 1e6:.1f} M params (rank {rank}): fp32 weights + AdamW m, v", 12 * a / GIB,
                     "all"))
        rows.append(("LoRA adapter gradients (fp32)", 4 * a / GIB, "update"))
        rows.append((f"update activations + temporaries ({args.micro_batch_size} x {T} tokens, LoRA, checkpointing "
                     f"{'on' if ckpt else 'off'}; traced)",
                     lora_update_extra_bytes(cfg, tokens, ckpt, getattr(args, "logprob_chunk", 512)) / GIB, "update"))
        if shards > 1:
            notes.append("--fsdp with LoRA: planned as one GPU's LoRA update (not traced under FSDP2)")
    else:
        rows.append((f"policy {p / 1e9:.2f} B params: fp32 weights + AdamW m, v (12 B/param){sharded}",
                     12 * p / shards / GIB, "all"))
        rows.append((f"policy gradients (fp32){sharded}", 4 * p / shards / GIB, "update"))
    if not rank and shards > 1 and ckpt:   # traced with FSDPMemTracker (FSDP_FIT)
        gathered, activations = fsdp_update_bytes(cfg, tokens)
        rows.append(("FSDP2 root unit in the update: bf16 gathered + fp32 reduce-scatter input (traced)",
                     gathered / GIB, "update"))
        rows.append((f"update activations ({args.micro_batch_size} x {T} tokens, bf16, checkpointing on; "
                     f"FSDP2 traced)", activations / GIB, "update"))
    elif not rank:
        if shards > 1:   # no FSDP2 trace without checkpointing: the root + 2 layers gathered, and one GPU's terms
            root = root_params(cfg)
            layer = (p - root) / cfg["num_hidden_layers"]
            rows.append(("FSDP2 gathered in the update: root unit + 2 decoder layers, bf16 weights and fp32 "
                         "gradients (not traced)", 6 * (root + 2 * layer) / GIB, "update"))
        elif world > 1:
            rows.append(("DDP gradient buckets (fp32, not traced)", 4 * p / GIB, "all"))
        rows.append((f"update activations + temporaries ({args.micro_batch_size} x {T} tokens, checkpointing "
                     f"{'on' if ckpt else 'off'}; traced)",
                     update_extra_bytes(cfg, tokens, ckpt, getattr(args, "logprob_chunk", 512)) / GIB, "update"))
    if args.kl_coef > 0 and not rank:   # with LoRA the reference is the base with its adapters off: no weights
        rows.append(("KL reference (fp32)", 4 * p / GIB, "all"))
    if args.kl_coef > 0:   # the reference's no-grad pass over each micro-batch, inside the update
        chunk = min(getattr(args, "logprob_chunk", 512) or tokens, tokens)
        rows.append((f"KL reference's pass: bf16 logits of {args.micro_batch_size} x {T} tokens + a float32 "
                     f"log-softmax chunk (not traced)", (2 * tokens + 8 * chunk) * cfg["vocab_size"] / GIB, "update"))
    if use_vllm:
        kv, _ = rollout_kv_need(args, world)
        sleep = bool(getattr(args, "rollout_sleep", False))
        rows.append((f"rollout engine: vLLM bf16 weights + KV of {-(-args.prompts_per_step // world)}x{args.group_size} x {T} "
                     f"tokens{' (asleep in the update)' if sleep else ''}", (2 * p + kv) / GIB,
                     "other" if sleep else "all"))
        seqs, batched = rollout_engine_limits(args, world)
        graphs, awake = vllm_runtime_bytes(cfg, seqs, batched)
        rows.append(("vLLM runtime (not traced): the CUDA graph pool (held through sleep)", graphs / GIB, "all"))
        rows.append((f"vLLM runtime (not traced): output_bin_counts, logits and the sampler's float32 copy of {seqs} "
                     f"sequences, one prefill step of {batched} tokens{' (asleep in the update)' if sleep else ''}",
                     awake / GIB, "other" if sleep else "all"))
    else:
        # HF generate holds the KV cache of --gen-batch-size rows, in the rollouts and in the evaluation
        new = max(args.max_new_tokens, args.eval_max_new_tokens if getattr(args, "eval_every", 0) else 0)
        what = "rollouts" if new == args.max_new_tokens else f"evaluation, --eval-max-new-tokens {new}"
        rows.append((f"rollout KV cache (HF generate, {args.gen_batch_size} sequences x {PROMPT_TOKENS + new} tokens: "
                     f"{what})", args.gen_batch_size * (PROMPT_TOKENS + new) * kv_bytes_per_token(cfg) / GIB, "other"))
    if prm_serve:
        rows.append((f"PRM: its own vllm serve (pooling runner, bf16 weights, KV of {PRM_SERVED_KV_TOKENS} tokens, "
                     f"one prefill's activations, its CUDA context)", prm_server_need(args)[1], "all"))
    elif args.prm != "none":
        prm_cfg = model_config(args.prm)
        if prm_cfg is None:
            notes.append(f"no config for PRM '{args.prm}': left out of the plan")
        else:
            rows.append((f"PRM {n_params(prm_cfg) / 1e9:.2f} B params (bf16){', in CPU memory in the update' if prm_offload else ''}",
                         2 * n_params(prm_cfg) / GIB, "other" if prm_offload else "all"))
            rows.append((f"PRM scoring ({4} x {T} tokens; traced)", prm_scoring_bytes(prm_cfg, 4 * T) / GIB, "other"))
    if args.mode in MODES_WITH_REFINER and args.refiner != "policy" and not args.refiner_url:
        ref_cfg = model_config(args.refiner)
        if gpu_gib:
            rows.append((f"refiner: its own vllm serve, --refiner-mem {args.refiner_mem:.0%} of the card",
                         args.refiner_mem * gpu_gib, "all"))
        elif ref_cfg is None:
            notes.append(f"no config for refiner '{args.refiner}': left out of the plan")
        else:
            # HF generate holds one --gen-batch-size batch; beside vLLM it is served, KV of a micro-batch assumed
            batch = args.micro_batch_size if use_vllm else args.gen_batch_size
            rows.append((f"refiner {n_params(ref_cfg) / 1e9:.2f} B params (bf16) + KV cache (--refiner-mem of a card "
                         f"once one is known)", refiner_gib(args, ref_cfg, batch), "all"))
    rows.append(("CUDA context, workspaces (not traced)", CUDA_CONTEXT_GIB, "all"))
    chunk = min(getattr(args, "logprob_chunk", 512) or tokens, tokens)
    # autocast caches a bf16 copy of every float32 weight (they require grad) until the pass leaves its autocast
    pass_row = (f"{OLD_LOGP_ROW} (--overlap-old-logp): autocast's bf16 weight copies + bf16 logits of "
                f"{args.micro_batch_size} x {T} tokens + a float32 log-softmax chunk (not traced)",
                ((0 if rank else 2 * p) + (2 * tokens + 8 * chunk) * cfg["vocab_size"]) / GIB, "other")
    if old_logp_beside(args, rows + [pass_row], gpu_gib):
        rows.insert(-1, pass_row)
    return rows, notes


OLD_LOGP_ROW = "π_old pass beside the PRM and refiner"


def old_logp_beside(args, rows_with_it, gpu_gib: float | None) -> bool:
    """--overlap-old-logp on a GPU: on, off, or auto = where the pass exists (overlap.enabled) and the plan with
    its working set held beside the rollout, PRM and refiner phases fits the card (its lowest priority)."""
    from harness.engines import overlap   # torch: imported here, not when --help parses the flags

    if args.overlap_old_logp != "auto":
        return args.overlap_old_logp == "on"
    return overlap.enabled(args, "cuda") and (gpu_gib is None or plan_total(rows_with_it) <= FIT_SHARE * gpu_gib)


def old_logp_overlapped(args, device: str, use_vllm: bool) -> bool:
    """Whether this run computes π_old beside the PRM and refiner: on the CPU overlap.enabled (auto: off), on a GPU
    as its memory plan has it (old_logp_beside)."""
    from harness.engines import overlap

    if not device.startswith("cuda") or args.overlap_old_logp != "auto":
        return overlap.enabled(args, device)
    import torch

    gpu_gib = torch.cuda.get_device_properties(torch.device(device)).total_memory / GIB
    return any(name.startswith(OLD_LOGP_ROW) for name, _, _ in memory_plan(args, gpu_gib, use_vllm)[0])


def refiner_gib(args, cfg: dict, batch: int) -> float:
    """GiB of a refiner: bf16 weights + the KV cache of `batch` sequences of PROMPT_TOKENS + max_new_tokens tokens
    (HF generate in this process: batch = --gen-batch-size)."""
    T = PROMPT_TOKENS + args.max_new_tokens
    return (2 * n_params(cfg) + batch * T * kv_bytes_per_token(cfg)) / GIB


def refiner_fallback_refusal(args, free_gib: float, total_gib: float, reason: str, log_path: str) -> str | None:
    """The refiner's own `vllm serve` did not start: None when HF generate may hold the refiner instead (the
    plan's refiner row, `refiner_gib`, plus 1 GiB fits in `free_gib`, the GPU memory free now), else the one
    line that stops the run, naming the flags that fit: a --refiner-mem share that the free memory holds and
    that holds the bf16 weights with 2 GiB of KV cache (when there is one), --refiner-url, --refiner policy."""
    cfg = model_config(args.refiner)
    need = None if cfg is None else refiner_gib(args, cfg, args.gen_batch_size) + 1.0
    if need is not None and need <= free_gib:
        return None
    ways = []
    if cfg is not None and total_gib > 0:
        low, high = (2 * n_params(cfg) / GIB + 2.0) / total_gib, (free_gib - 0.5) / total_gib
        share = int(high * 100) / 100   # rounded down: vLLM checks at start that its share is free
        if share >= low and share != args.refiner_mem:
            ways.append(f"--refiner-mem {share:.2f}")
    ways += ["--refiner-url http://HOST:8000/v1 (vllm serve the refiner elsewhere)", "--refiner policy"]
    why = "for lack of GPU memory" if "memory" in reason.lower() else "(see its log)"
    held = "an unknown size" if need is None else f"about {need:.0f} GiB"
    return (f"the refiner server (vllm serve {args.refiner}, --refiner-mem {args.refiner_mem}) did not start {why}; "
            f"log {log_path}. Refining through HF generate on this GPU would need {held} of the {free_gib:.0f} GiB "
            f"free, so the run stops instead; it fits with: {' | '.join(ways)}")


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


def plan_total(rows) -> float:
    """The peak: what is held all step plus the larger of the update's and the rest of the step's rows."""
    phase = {k: sum(gib for _, gib, ph in rows if ph == k) for k in ("all", "update", "other")}
    return phase["all"] + max(phase["update"], phase["other"])


def fixes(args, gpu_gib: float, use_vllm: bool) -> list[str]:
    """Flag changes (fewest first) under which the plan fits in FIT_SHARE of gpu_gib."""
    from dataclasses import replace

    options = [{}]
    if not args.gradient_checkpointing:
        options.append({"gradient_checkpointing": True})
    if args.prm != "none" and args.prm_offload == "off":
        options.append({"prm_offload": "on"})
    if use_vllm and not args.rollout_sleep:
        options.append({"rollout_sleep": True})
    if args.mode in MODES_WITH_REFINER and args.refiner != "policy" and not args.refiner_url:
        options += [{"refiner": "policy"}, {"refiner_url": "http://HOST:8000/v1"}]
    # a small card: LoRA, the 1.5B PRM, self-refinement (docs/memory.md, "A 24 GB card")
    lora = {} if getattr(args, "lora_rank", 0) else {"lora_rank": 16}
    small = {"prm": TRL_PRM} if args.mode in MODES_WITH_PRM and args.prm not in ("none", TRL_PRM) else {}
    if small and args.mode in MODES_WITH_REFINER and args.refiner != "policy" and not args.refiner_url:
        small["refiner"] = "policy"
    for change in (lora, small, {**lora, **small}):
        if change and change not in options:
            options.append(change)
    found = []
    for change in options:
        mb = args.micro_batch_size
        while mb >= 1:
            trial = replace(args, **change, micro_batch_size=mb)
            if plan_total(memory_plan(trial, gpu_gib, use_vllm)[0]) <= FIT_SHARE * gpu_gib:
                flags = [f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
                         for k, v in change.items()]
                flags += [f"--micro-batch-size {mb}"] if mb != args.micro_batch_size else []
                found.append(" ".join(flags) + (" (serve the refiner: vllm serve NAME)" if "refiner_url" in change else ""))
                break
            mb //= 2
    return [f for f in found if f][:3]


def format_plan(args, rows, notes, gpu_gib: float | None) -> str:
    lines = [f"memory plan (traced constants, GiB){'' if gpu_gib is None else f' on a {gpu_gib:.1f} GiB GPU'}"
             f"{'' if gpu_gib is None else '; total = the peak: all step + the larger of update / outside the update'}:"]
    where = {"all": "all step", "update": "update", "other": "outside the update"}
    lines += [f"  {gib:7.1f}  [{where[ph]}] {row}" for row, gib, ph in rows]
    total = plan_total(rows)
    if gpu_gib is not None:   # the refiner's share depends on the card: a total only for a known one
        lines.append(f"  {total:7.1f}  total")
    if gpu_gib is None and not args.toy and rows:
        for size, gib in CARD_GIB.items():
            need = plan_total(memory_plan(args, gib, args.backend != "hf")[0])
            fits = need <= FIT_SHARE * gib
            ways = [] if fits else fixes(args, gib, args.backend != "hf")
            lines.append(f"  on a {size} GB GPU ({gib:.1f} GiB reported): {need:.1f} GiB, " + (
                "fits" if fits else "does not fit" + (f"; fits with {' | '.join(ways)}" if ways else "")))
    lines += [f"  note: {n}" for n in notes]
    return "\n".join(lines)


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
