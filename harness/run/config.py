"""config.py — the engine's flags and the command line: `EngineArgs`, which scope.py's `Args` extends, and
`parse_args`.

scope.py's `Args` holds the paper's knobs (group size, τ, γ, ε, ...); the flags here run it (vLLM, memory,
torchrun, trackers, offload, evaluation budgets, paths, the toy world). Each field's help text is its
`--help` line; `--help` lists both, grouped. Precedence and resume: `parse_args`.
"""
import argparse
import contextlib
import functools
import io
import os
import sys
import textwrap
import weakref
from dataclasses import asdict, dataclass, field, fields

from tqdm import tqdm

from harness.engines import lora, prm_families
from harness.run import cli, preflight
from harness.run.runs import (Done, read_changes, refusals_raised, release_lock, resume_hint, run_settings,
                              stop)


def arg(default, help, choices=None):
    """A dataclass field whose help text (and choices) become its --flag."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineArgs:
    # --- models and engines
    refiner_url: str = arg("", "OpenAI-compatible server (e.g. `vllm serve` of --refiner) to refine through")
    refiner_mem: float = arg(0.25, "GPU memory share of the refiner's own `vllm serve` (started when vLLM is "
                             "installed and --refiner is a separate model without --refiner-url)")
    refiner_quantization: str = arg("none", "weights of the refiner's own `vllm serve`: none = its bf16 (the paper's "
                                    "numerics); fp8 = `--quantization fp8` (W8A8 on Hopper: faster decode, other "
                                    "samples; docs/choices.md)", ("none", "fp8"))
    prm_quantization: str = arg("none", "weights of the PRM's own `vllm serve --runner pooling`: none = bf16 (the "
                                "paper's numerics); fp8 = FP8 decoder layers, the score head as it is (vLLM's online "
                                "quantization: faster scoring, other step scores)",
                                ("none", "fp8"))
    prm_format: str = arg("auto", "the PRM's family: its input layout and where P(step correct) is read (one per "
                          "kind of PRM: harness/engines/prm_families.py; docs/choices.md, rows \"3 PRM\"); auto = "
                          "from the checkpoint's architecture and tokenizer", ("auto", *prm_families.NAMES))
    refiner_timeout: float = arg(600.0, "seconds one served-refiner request may take (2 retries; then the step "
                                 "goes on without rectification)")
    backend: str = arg("auto", "rollout engine; auto = vLLM when importable and CUDA present", ("auto", "vllm", "hf"))
    device: str = arg("auto", "auto = cuda when present; 'cpu' runs a real model on the CPU (slow)")
    system_prompt: str = arg(*cli.DATA_FLAGS["system_prompt"])   # shared with eval.py (harness/run/cli.py)
    question_field: str = arg(*cli.DATA_FLAGS["question_field"])
    answer_field: str = arg(*cli.DATA_FLAGS["answer_field"])
    # --- evaluation
    eval_dataset: str = arg("math500", "held-out problems for the periodic evaluation")
    eval_size: int = arg(500, "number of evaluation problems (0 = all)")
    eval_n: int = arg(1, "samples per evaluation problem (accuracy = avg@n at temperature 0.6)")
    eval_max_new_tokens: int = arg(3000, "response budget of the periodic evaluation (clamped to the model context)")
    grader: str = arg("ours", "who grades the periodic evaluation (the accuracy of the closing summary and the model "
                      "card): our grader or Math-Verify, the paper's tables' convention (pip install "
                      "math-verify==0.9.0); rewards are always ours (docs/grader.md)", ("ours", "math-verify"))
    eval_every: int = arg(50, "evaluate every N steps (and before the first and after the last); 0 = never")
    # --- the update's engine
    micro_batch_size: int = arg(4, "sequences per forward/backward pass of the update")
    gen_batch_size: int = arg(64, "sequences per HF generate call (rollouts, evaluation, an in-process refiner)")
    overlap_old_logp: str = arg("auto", "compute π_old (the no-grad pass of --updates-per-batch > 1) on a worker "
                                "thread while the PRM scores and the refiner decodes, instead of at the start of the "
                                "update; it saves time only when the GPU runs both at once (CUDA MPS for served "
                                "models; docs/scaling.md); auto = on with CUDA, --updates-per-batch > 1, no --fsdp "
                                "and room in the memory plan for its working set",
                                ("auto", "on", "off"))
    tis_cap: float = arg(2.0, "truncated importance sampling on the policy's tokens with vLLM rollouts: weight "
                         "min(π_train/π_vLLM, C) with this C (>= 1); 0 = off; no weight with HF generate")
    # --- memory (docs/memory.md)
    gradient_checkpointing: bool = arg(True, "recompute each decoder layer in the backward pass (non-reentrant) "
                                       "instead of keeping its activations; off in the toy world")
    logprob_chunk: int = arg(512, "tokens per chunk of the update's float32 log-softmax (recomputed in the backward); "
                             "0 = one chunk, no recomputation (the toy world)")
    fused_adamw: bool = arg(True, "torch's fused AdamW kernel on CUDA (the same update, fewer kernels and temporaries)")
    rollout_sleep: bool = arg(True, "put the policy's vLLM engine to sleep during the update (level 2: weights and "
                              "KV cache freed); its weights are woken for the push, its KV cache for the next rollout")
    lora_rank: int = arg(0, "train a LoRA adapter of this rank instead of the whole policy (PEFT; --use_peft = rank "
                         "16, not TRL's targets: below; TRL's --lora_r): AdamW holds the adapter alone, the base "
                         "stays frozen in bf16 on a GPU, the loss "
                         "is the same; 0 = the full fine-tune, the paper's (docs/choices.md)")
    lora_alpha: float = arg(0.0, "LoRA's α: the adapter's output is scaled by α / rank; 0 = 2 × --lora-rank")
    lora_targets: str = arg(lora.TARGETS, "the layers that get an adapter: some of the decoder's projections "
                            "(comma-separated) or all-linear (all seven); the embedding and the head are refused")
    prm_offload: str = arg("auto", "move the PRM to CPU memory between its uses; auto = when the memory plan with "
                           "the PRM resident does not fit the GPU", ("auto", "on", "off"))
    # --- the run folder (docs/running.md)
    save_every: int = arg(100, "checkpoint every N steps (and after the last)")
    run_name: str = arg("", "logs go to runs/<run_name> (an absolute path: that folder); default "
                        "<mode>-<model>-s<seed>")
    config: str = arg("", "a YAML file of flags (keys: these flag names, with dashes or underscores); flags typed on "
                      "the command line override it; its values are recorded in config.json like typed ones")
    resume: str = arg("", "continue the run in this folder (runs/<name>) from its checkpoint, with its settings")
    change_config: bool = arg(False, "with --resume: accept typed flags that change how the run trains (recorded "
                              "with their step in runs/<name>/changes.jsonl; config.json keeps the start)")
    report_to: str = arg("none", "also log the metrics to TensorBoard (runs/<name>/tensorboard) or Weights & Biases "
                         "(offline without network)", ("none", "tensorboard", "wandb"))
    overwrite: bool = arg(False, "allow starting from step 1 in a folder holding a run (a new run under a used "
                          "--run-name, or --resume of a folder without checkpoint): its logs are replaced")
    memory_check: bool = arg(True, "stop before loading when the memory plan (an estimate) exceeds the GPU; "
                             "--no-memory-check starts anyway")
    log_detail: bool = arg(False, "the step line also names the phases' seconds, the loss, the all-failed groups' "
                           "repairs and their keep ratio, and the checkpoint's seconds (metrics.jsonl holds every "
                           "field either way; docs/metrics.md)")
    dry_run: bool = arg(False, "run the pre-flight (flags, folder, data, memory plan), print the resolved Args, exit")
    # --- the toy world (harness/data/toy.py)
    toy: bool = arg(False, "the CPU toy world: tiny char-level Qwen2, rule-based PRM, oracle refiner")
    toy_prm_noise: float = arg(0.0, "toy world: probability that the toy PRM flips a step score")
    toy_styles: int = arg(1, "toy world: the warm start writes its solutions in this many styles (1-3, "
                          "harness/data/toy.py choice 10); > 1 also logs the styles of the correct rollouts")
    toy_refiner_style: str = arg("prefix", "toy world: the oracle refiner continues in the style of the kept "
                                 "prefix, or always writes style k (a foreign voice for a one-style policy)",
                                 ("prefix", "0", "1", "2"))
    # --- several GPUs (torchrun; docs/scaling.md)
    fsdp: bool = arg(False, "under torchrun: shard the policy, its gradients and AdamW state over the processes "
                     "(FSDP2) instead of a full copy per GPU (DDP)")
    dist_timeout: float = arg(1800.0, "under torchrun: seconds a process waits for the others before the run "
                              "stops with an error")


# Applied with --toy unless the flag is typed. 30 steps take ~0.5 s each on 2 CPU cores once the warm start is cached.
TOY_DEFAULTS = dict(model="toy", prm="toy", refiner="toy-oracle", dataset="toy", eval_dataset="toy", eval_size=200,
                    backend="hf", device="cpu", steps=30, prompts_per_step=8, group_size=8, max_new_tokens=128,
                    lr=1e-4, micro_batch_size=64, eval_every=10, save_every=10, eval_max_new_tokens=128,
                    gradient_checkpointing=False, logprob_chunk=0, updates_per_batch=1)
LORA_LR_SCALE = 10   # with --lora-rank and no --lr typed: the default --lr times this (PEFT's practice; said at start)
USE_PEFT_LINE = (f"--use_peft here is --lora-rank {cli.USE_PEFT_RANK} on all seven projections ({lora.TARGETS}) without "
                 f"dropout; TRL's resolves to q_proj,v_proj with dropout 0.05 for Qwen2 (--lora_target_modules q_proj "
                 f"v_proj gives those targets; dropout stays 0: docs/choices.md, the LoRA row).")


def lora_lr(lr: float) -> float:
    return float(f"{lr * LORA_LR_SCALE:.6g}")   # 1e-05, not 9.999999999999999e-06


class NoHyphenBreaks(argparse.HelpFormatter):
    """--help wrapped at spaces only: a flag such as --eval-max-new-tokens stays whole, so it can be copied."""

    def _split_lines(self, text, width):
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def parse_args(args_class, argv=None, description: str = ""):
    """`args_class` (scope.Args) from the command line. Precedence: flags typed > the resumed run's settings
    (config.json with the accepted changes of changes.jsonl) > --toy defaults > the dataclass defaults; a new
    --mode grpo run off the toy world gets --prm none unless --prm is typed, and a new --lora-rank run gets
    LORA_LR_SCALE × the default --lr unless --lr is typed. On a resume, a typed flag that changes training is refused by
    the pre-flight unless --change-config confirms it. A mistyped flag is one line naming the closest flag."""
    toy_line = " ".join(cli.flag_words(k, v) for k, v in TOY_DEFAULTS.items())
    parser = cli.OneLineErrors(
        prog="scope.py", description=description, allow_abbrev=False, formatter_class=NoHyphenBreaks,
        epilog=f"--toy also sets, unless typed: {toy_line}. --lora-rank R (--use_peft) sets --lr "
               f"to {LORA_LR_SCALE:g} × its default unless typed ({lora_lr(args_class().lr):g}; with "
               f"--toy {lora_lr(TOY_DEFAULTS['lr']):g}; TRL keeps learning_rate as given), and the "
               f"run says so. {USE_PEFT_LINE} TRL's names that mean what ours mean are taken as "
               f"ours (--learning_rate, --num_generations, ...); the others are refused naming "
               f"ours (docs/running.md)")
    engine = {f.name for f in fields(EngineArgs)}
    groups = {False: parser.add_argument_group("the method (scope.py Args)"),
              True: parser.add_argument_group("the engine (harness/run/config.py EngineArgs)")}
    flags = ["--help"]
    for f in sorted(fields(args_class), key=lambda f: f.name in engine):   # the method's flags first
        kind = dict(action=argparse.BooleanOptionalAction) if isinstance(f.default, bool) else dict(type=type(f.default))
        flags += groups[f.name in engine].add_argument(
            "--" + f.name.replace("_", "-"), help=f"{f.metadata['help']} (default: {f.default!r})",
            choices=f.metadata["choices"], default=argparse.SUPPRESS, **kind).option_strings
    argv = cli.expand_config(list(sys.argv[1:] if argv is None else argv), asdict(args_class()))   # --config's flags first
    argv = cli.trl_names(argv)   # TRL's names that mean ours (--learning_rate, --use_peft, --lora_r, ...): ours
    booleans = {"--" + f.name.replace("_", "-") for f in fields(args_class) if isinstance(f.default, bool)}
    argv = cli.normalise(argv, flags, booleans)   # --group_size → --group-size, --lr -1e-4 → --lr=-1e-4, --toy true
    known, unknown = parser.parse_known_args(argv)
    if unknown:   # TRL's name for one of our flags gets ours (harness/run/cli.py)
        parser.error(cli.trl_hint(unknown[0]) or cli.unknown_argument(unknown[0], flags))
    typed = vars(known)   # only the flags on the command line (the rest are SUPPRESSed)
    values = asdict(args_class())
    if typed.get("resume"):   # a checked config: missing folder/file, bad JSON or foreign keys stop in one line
        config = preflight.read_run_config(typed["resume"], set(values))   # flags it predates: as the run had them
        values.update(run_settings(config, read_changes(typed["resume"])))
        values.update(overwrite=False, dry_run=False, change_config=False)   # never inherited from the resumed run
    elif typed.get("toy"):
        values.update(TOY_DEFAULTS)
    own_name = values["run_name"] or os.path.basename(typed.get("resume", "").rstrip("/"))
    if typed.get("resume") and typed.get("run_name", own_name) not in (own_name, typed["resume"]):
        stop(f"--run-name {typed['run_name']} with --resume {typed['resume']}: a resumed run continues in its own "
             f"folder under its own name ({own_name}); drop --run-name (to branch the run, copy its folder and "
             f"resume the copy)")
    values.update(typed)
    notes = []
    if values["lora_rank"] and "lr" not in typed and not typed.get("resume"):
        values["lr"] = lora_lr(values["lr"])   # an adapter's usual learning rate (docs/choices.md: the LoRA row)
        notes.append(f"--lora-rank {values['lora_rank']}: --lr {values['lr']:g}, {LORA_LR_SCALE:g} × the default "
                     f"(an adapter's usual rate; TRL keeps learning_rate as given): type --lr to choose it")
    if values["mode"] == "grpo" and "prm" not in typed and not typed.get("resume") and not values["toy"]:
        values["prm"] = "none"   # GRPO uses no PRM: the 7B one for the near-miss metrics alone is asked for by name
    resolved = args_class(**values)
    _RESOLVED[id(resolved)] = notes   # as_args takes it as it is (an Args built in code is resolved like a dict)
    weakref.finalize(resolved, _RESOLVED.pop, id(resolved), None)
    return resolved


_RESOLVED: dict[int, list[str]] = {}   # the ids of the Args parse_args returned, while they live → their notes


def resolved(args) -> bool:
    """True for an Args that parse_args returned (the command line's, or a dict's resolved by as_args)."""
    return id(args) in _RESOLVED


def notes_of(args) -> list[str]:
    """What parse_args chose for `args` that was not typed and that the run says in its first lines (a LoRA run's
    --lr); [] for an Args it did not return."""
    return list(_RESOLVED.get(id(args), []))


def as_args(args_class, args):
    """`args` as an `args_class` (scope.Args), resolved exactly as the same flags typed on the command line
    (--toy defaults, a resumed run's settings, checks): a dict {flag name: value} (dashes or underscores), or an
    Args built in code, whose fields away from the dataclass defaults count as typed (so `Args(toy=True)` gets
    the toy's defaults, as {"toy": True} does). An Args from parse_args is taken as it is."""
    if isinstance(args, args_class):
        if resolved(args):
            return args
        defaults = args_class()
        args = {f.name: getattr(args, f.name) for f in fields(args_class)
                if getattr(args, f.name) != getattr(defaults, f.name)}
    if not isinstance(args, dict):
        raise TypeError(f"main: expected {args_class.__name__} or a dict of flags, got {type(args).__name__}")
    return parse_args(args_class, cli.flags_argv(args, asdict(args_class()), "main"))


def library_call(args_class_of):
    """scope.main as a Python call (a notebook): `main(dict or Args)` resolves its argument with `as_args`; a
    refusal raises runs.Refused, a ValueError whose message names the dict's keys (`run_name=x`, not
    `--run-name x`); a finished run returns {"run_dir", "finished_step"} (runs.Done). A dry run prints nothing on
    stdout and returns its plan: the resolved args, every note (the warnings the command line prints among them),
    the memory plan, and "text", what the command line would print. An Args from parse_args is the command line's:
    one-line refusals, exit 2, a dry run prints its plan and exits 0. `args_class_of()` gives the Args class
    (defined below main in scope.py)."""
    def wrap(main):
        @functools.wraps(main)
        def call(args):
            args_class = args_class_of()
            if isinstance(args, args_class) and resolved(args):
                return main(args)
            booleans = frozenset(f.name for f in fields(args_class) if isinstance(f.default, bool))
            with refusals_raised(functools.partial(cli.as_keys, booleans=booleans)):
                args = as_args(args_class, args)
                printed = io.StringIO()
                try:
                    with run_interrupt(args, python=True), \
                            contextlib.redirect_stdout(printed) if args.dry_run else contextlib.nullcontext():
                        return main(args)
                except Done as done:
                    if not args.dry_run:
                        return done.result
                    text = printed.getvalue()
                    notes = done.result["notes"] + [line[len("note: "):] for line in text.splitlines()
                                                    if line.startswith("note: ")]
                    return {**done.result, "notes": list(dict.fromkeys(notes)), "text": text}
                finally:   # done, refused or failed: the process's next call on this run must not find it locked
                    with contextlib.suppress(ValueError, SystemExit):   # a run name refused: no folder, no lock
                        release_lock(os.path.join(preflight.run_dir_of(args), "lock"))
        return call
    return wrap


def run_interrupt(args, python: bool = False):
    """A run's calm interrupt (cli.calm_interrupt): one line naming the last complete checkpoint and the exact
    --resume command (before the first checkpoint: that nothing was saved yet, and the command that starts the run
    again), exit 130; the lock is released (also by the exit handler open_run registered), and a save cut short is
    recovered by the resume (runs.py rule 4). `python`: scope.main called from Python (a notebook): the line gives
    the main(...) call that resumes, and the KeyboardInterrupt goes on to the caller."""
    def say(err):
        run_dir = preflight.run_dir_of(args)
        release_lock(os.path.join(run_dir, "lock"))   # only if this process holds it
        if os.environ.get("RANK", "0") == "0":   # under torchrun every rank gets the signal; rank 0 speaks
            hint = resume_hint(run_dir, None if python else sys.argv[1:], min(args.save_every, args.steps))
            tqdm.write(f"\ninterrupted: {hint}", file=sys.stderr)

    return cli.calm_interrupt(say, python)
