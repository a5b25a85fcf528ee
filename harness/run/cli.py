"""cli.py — what scope.py's and eval.py's command lines share, and the conveniences for people coming from TRL.

- `OneLineErrors`, `unknown_argument`, `out_of_range`: a refusal is one line naming the flag (and the closest one),
  a value out of range is "--flag VALUE: must be ..." from a table of (flag, test, what it must be).
- `calm_interrupt`: Ctrl-C or SIGTERM ends the command with one line and exit 130, a second Ctrl-C ignored.
- `config_argv(path, defaults)`: a YAML file of flags (`--config recipe.yaml`, as TRL's recipes are run) turned
  into the command-line words it stands for, so argparse checks its values exactly as typed ones (types,
  choices) and a flag typed on the command line after it wins. Keys are our flag names, with dashes or
  underscores (`group_size: 8` or `group-size: 8`), or TRL's names as the command line takes them; a boolean is
  `true`/`false`. One refusal names the file and every key it cannot take, each with its reason (our name when
  the key is TRL's). The values land in the run's config.json as every flag does, so `--resume` continues with them.
- `trl_names(argv)`: TRL's names that mean what ours mean taken as ours (TRL_SAME: `--learning_rate` = `--lr`,
  `--use_peft` = `--lora-rank 16`, `--lora_target_modules q_proj v_proj`, `--lora_dropout 0`), on the command
  line, in a --config file and in scope.main's dict.
- `trl_hint(word)`: the one-line refusal of a TRL name whose meaning differs here or that has no flag here
  (`--per_device_train_batch_size` → `--prompts-per-step`, what differs), or None for a word that is not one. The
  tables are TRL_SAME and TRL_NAMES (docs/running.md shows them).
- `normalise(argv, flags, booleans)`: our flags with underscores, a negative number as a value, and a boolean flag
  followed by true/false (HfArgumentParser's `--gradient_checkpointing false`) as --flag / --no-flag.
- `DATA_FLAGS`: --system-prompt, --question-field and --answer-field, defined once for scope.py's Args and
  eval.py's parser; `unused_system_prompt` names a system prompt a tokenizer without chat template cannot carry.
- `as_keys(message)`: a refusal in the spelling of scope.main's dict (`--run-name x` → `run_name=x`), for a
  Python caller (config.library_call).
"""
import argparse
import contextlib
import difflib
import os
import re
import shlex
import signal

from harness.data.prompt import DEFAULT_SYSTEM
from harness.run.runs import stop


class OneLineErrors(argparse.ArgumentParser):
    """argparse whose refusals are one line naming the culprit and `python PROG --help`, not the 40-line usage:
    runs.stop's line and exit 2 (inside runs.refusals_raised: runs.Refused)."""

    def error(self, message):
        stop(f"{message} (python {self.prog} --help lists every flag)")


def unknown_argument(word: str, flags: list[str]) -> str:
    """The refusal of a word argparse did not take: the closest flag when one is near ("--step" → "--steps")."""
    if not word.startswith("-"):
        near = difflib.get_close_matches("--" + word.replace("_", "-"), flags, n=1, cutoff=0.75)
        return f"unexpected argument '{word}'" + (f": did you mean {near[0]}?" if near else " (flags start with --)")
    flag = word.split("=", 1)[0]
    near = difflib.get_close_matches(flag.replace("_", "-"), flags, n=1, cutoff=0.6)
    return f"unknown flag {flag}" + (f": did you mean {near[0]}?" if near else "")


def out_of_range(args, ranges) -> str | None:
    """The refusal of the first flag in `ranges`, (flag, test of its value, what it must be), whose value fails its
    test: "--flag VALUE: must be ..."; None when every value passes."""
    for flag, ok, valid in ranges:
        value = getattr(args, flag.replace("-", "_"))
        if not ok(value):
            return f"--{flag} {value!r}: must be {valid}"
    return None


@contextlib.contextmanager
def calm_interrupt(say, python: bool = False):
    """Ctrl-C, or SIGTERM taken as one, ends the block with one line instead of a traceback: `say(err)` prints it
    while a second Ctrl-C or SIGTERM is ignored, then SystemExit(130); the signal handlers are put back as the block
    ends. `python` (a Python caller, as a notebook, whose process lives on): SIGTERM is left as it is and after
    `say` the KeyboardInterrupt goes on to the caller. scope.py's line: config.run_interrupt; eval.py's: eval_cli."""
    def on_term(signum, frame):
        raise KeyboardInterrupt

    handlers = None if python else (signal.signal(signal.SIGTERM, on_term), signal.getsignal(signal.SIGINT))
    try:
        yield
    except KeyboardInterrupt as err:
        if not python:
            signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C must not cut the line short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say(err)
        if python:
            raise
        raise SystemExit(130) from None
    finally:
        if handlers is not None:
            signal.signal(signal.SIGTERM, handlers[0])
            signal.signal(signal.SIGINT, handlers[1])


# TRL's names (GRPOConfig / TrainingArguments / ModelConfig / ScriptArguments) that mean what one of our flags means:
# taken as ours, on the command line, in a --config file and in scope.main's dict (config.json records our name)
TRL_SAME = {"num_generations": "group_size", "learning_rate": "lr", "model_name_or_path": "model",
            "max_completion_length": "max_new_tokens", "beta": "kl_coef", "epsilon": "clip_eps",
            "dataset_name": "dataset", "lora_r": "lora_rank", "lora_alpha": "lora_alpha",
            "lora_target_modules": "lora_targets"}
USE_PEFT_RANK = 16   # --use_peft alone: TRL's (ModelConfig) default rank

# TRL's names whose meaning differs here, or that have no flag here → (our nearest flag or None, what differs):
# each is refused in one line that says so
_ROLLOUT_STEPS = "ours counts rollout steps (each --updates-per-batch optimizer steps), not epochs or optimizer steps"
_HUB_SPLIT = ("a hub id loads its default config and the first of its test, validation, train splits "
              "(harness/data/problems.py); for another, save it as .jsonl and pass that to --dataset")
_VLLM = ("--backend vllm (auto: vLLM when installed and CUDA is present); the policy's engine runs in this process "
         "(TRL's colocate)")
_TIS = "the cap C of min(π_train/π_vLLM, C); 0 = off; on by default with vLLM rollouts"
_GEN = ("sequences per HF generate call (evaluation included); a step samples --prompts-per-step × --group-size")
TRL_NAMES = {
    "output_dir": ("--run-name", "the run folder is runs/<run-name>"),
    "per_device_train_batch_size": ("--prompts-per-step", "ours counts prompts (B); TRL's counts completions, "
                                    "B × G per device"),
    "gradient_accumulation_steps": ("--micro-batch-size", "ours sets sequences per forward/backward pass; each "
                                    "mini-batch is one optimizer step"),
    "epsilon_high": ("--clip-eps", "ours is symmetric; no separate upper ε"),
    "num_iterations": ("--updates-per-batch", "ours takes that many optimizer steps on one rollout batch, one per "
                       "mini-batch of whole groups"),
    "num_train_epochs": ("--steps", _ROLLOUT_STEPS),
    "max_steps": ("--steps", _ROLLOUT_STEPS),
    "loss_type": ("--loss-agg", "dr_grpo = constant; token-mean as DAPO's"),
    "scale_rewards": ("--adv-std", "divide advantages by the group's std (--no-adv-std: mean-centred only)"),
    "save_steps": ("--save-every", "every N rollout steps and after the last"),
    "save_strategy": ("--save-every", "every N rollout steps and after the last"),
    "eval_steps": ("--eval-every", "every N rollout steps, before the first and after the last"),
    "eval_strategy": ("--eval-every", "every N rollout steps, before the first and after the last"),
    "save_total_limit": (None, "one checkpoint is kept, swapped in whole at every save"),
    "resume_from_checkpoint": ("--resume", "takes the run folder runs/NAME"),
    "overwrite_output_dir": ("--overwrite", "a used run folder is replaced only with --overwrite"),
    "dataset_train_split": (None, _HUB_SPLIT),
    "dataset_config": (None, _HUB_SPLIT),
    "use_vllm": ("--backend", _VLLM),
    "vllm_mode": ("--backend", _VLLM),
    "vllm_gpu_memory_utilization": ("--refiner-mem", "the policy's engine is sized by need; this is the served "
                                    "refiner's share"),
    "vllm_importance_sampling_correction": ("--tis-cap", _TIS),
    "vllm_importance_sampling_cap": ("--tis-cap", _TIS),
    "generation_batch_size": ("--gen-batch-size", _GEN),
    "per_device_eval_batch_size": ("--gen-batch-size", _GEN),
    "top_entropy_quantile": (None, "no token-entropy masking here"),
    "max_prompt_length": (None, "prompts are not truncated here (a prompt past the context stops the run)"),
    **dict.fromkeys(("top_p", "top_k", "min_p", "repetition_penalty"),
                    (None, "rollouts sample the full distribution at --temperature")),
    **dict.fromkeys(("logging_steps", "log_completions"),
                    (None, "every step is logged (metrics.jsonl and one line); two rollouts per step are kept whole "
                     "in rollouts.jsonl, every repair in traces.jsonl")),
    "lr_scheduler_type": (None, "the learning rate is constant after --warmup-steps"),
    "warmup_ratio": ("--warmup-steps", "ours counts steps, not a share of them"),
    **dict.fromkeys(("weight_decay", "optim"),
                    (None, "AdamW with torch's default weight decay (0.01), fused on CUDA (--fused-adamw)")),
    "reward_funcs": (None, "the reward is the grader's 1/0 on the final \\boxed{} answer (harness/data/grader.py); "
                     "--mode prm-reward adds --prm-reward-coef × the mean PRM step score"),
    **dict.fromkeys(("bf16", "fp16", "torch_dtype", "dtype"),
                    (None, "the policy trains in float32 master weights under bfloat16 autocast on CUDA (float32 on "
                     "the CPU); the PRM and a refiner load in bfloat16 on CUDA")),
    "attn_implementation": (None, "the model's default attention (sdpa) in training, vLLM's own in its engine"),
    "trust_remote_code": (None, "models load without remote code (a PRM's checkpoint too: harness/engines/prm_checkpoint.py)"),
    "sync_ref_model": (None, "the KL reference (--kl-coef) is the initial policy throughout"),
    "lora_dropout": (None, "no LoRA dropout here (0 is taken): π_old, π_θ and the sampler must be the same network "
                     "for the PPO ratio (docs/choices.md, the LoRA row)"),
    **dict.fromkeys(("use_rslora", "use_dora", "lora_modules_to_save"),
                    (None, "plain LoRA: only the adapter trains, its output scaled by --lora-alpha / --lora-rank")),
    **dict.fromkeys(("load_in_4bit", "load_in_8bit"), (None, "no quantized base: a LoRA base stays in bf16 on a GPU")),
    **dict.fromkeys(("push_to_hub", "hub_model_id", "hub_strategy", "hub_private_repo", "hub_token"),
                    (None, "nothing is uploaded: runs/NAME/model is a transformers folder with its model card; "
                     "upload it with `hf upload REPO runs/NAME/model`")),
}
BOOLEAN_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}   # HfArgumentParser's


def _bool_word(word: str) -> bool | None:
    return BOOLEAN_WORDS.get(word.lower())


def trl_names(argv: list[str]) -> list[str]:
    """argv with TRL's names that mean what ours do in our spelling (TRL_SAME: --learning_rate 1e-5 → --lr 1e-5,
    --lora_target_modules q_proj v_proj → --lora-targets q_proj,v_proj), --use_peft [true] → --lora-rank 16 put first
    (a rank typed anywhere wins) and --lora_dropout 0 dropped (ours has none); --lora_dropout above 0 stops here."""
    out, peft, joining, i = [], False, False, 0
    while i < len(argv):
        word = argv[i]
        i += 1
        name, eq, value = word.partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if joining and key is None:   # TRL's list of target modules, one word each
            out[-1] += ("" if out[-1].endswith("=") else ",") + word
            continue
        joining = False
        if key == "use_peft":
            if not eq and i < len(argv) and _bool_word(argv[i]) is not None:   # --use_peft true (HfArgumentParser)
                eq, value, i = "=", argv[i], i + 1
            peft = _bool_word(value) is not False if eq else True
        elif key == "lora_dropout":
            if not eq and i < len(argv):
                value, i = argv[i], i + 1
            if not _zero(value):
                stop(f"--lora_dropout {value}: TRL's name; {TRL_NAMES['lora_dropout'][1]}")
        elif key in TRL_SAME:
            ours, joining = "--" + TRL_SAME[key].replace("_", "-"), key == "lora_target_modules" and not eq
            out.append(ours + "=" + value if eq or joining else ours)
        else:
            out.append(word)
    return [f"--lora-rank={USE_PEFT_RANK}"] * peft + out


# The data and prompt flags scope.py (harness/run/config.py EngineArgs) and eval.py share, one definition:
# name → (default, help text).
DATA_FLAGS = {
    "system_prompt": (DEFAULT_SYSTEM, "the system turn of every prompt (rollouts and evaluation) when the tokenizer "
                      "has a chat template; a tokenizer without one (the toy's) takes none, and a prompt given "
                      "anyway is named as unused; '' = none"),
    "question_field": ("", "the column of a data set of your own (a local file or hub id: scope.py's --dataset, "
                       "eval.py's --benchmarks) that holds the question; '' = the first of question, problem, "
                       "prompt, Problem, Question, query"),
    "answer_field": ("", "the column of that data set that holds the final answer; '' = the first of answer, "
                     "final_answer, Answer, ground_truth, gt, target (else a solution's last \\boxed{})"),
}


def add_data_flags(parser) -> None:
    """eval.py's --system-prompt, --question-field and --answer-field, as DATA_FLAGS defines them."""
    for name, (default, text) in DATA_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), default=default, help=f"{text} (default: {default!r})")


def own_data_refusal(sources: list[str], question_field: str, answer_field: str) -> str | None:
    """The refusal of --question-field / --answer-field when no source is a data set of one's own (every one is a
    named benchmark or 'toy', whose fields are set already); None otherwise."""
    from harness.data.problems import BENCHMARKS

    if not (question_field or answer_field) or any(s not in BENCHMARKS and s != "toy" for s in sources):
        return None
    flag = "--question-field" if question_field else "--answer-field"
    return (f"{flag} {question_field or answer_field}: only for a data set of your own (a local file or hub id); "
            f"{', '.join(sources)} {'has its' if len(sources) == 1 else 'have their'} fields set already")


def unused_system_prompt(tokenizer, system_prompt: str) -> str | None:
    """The note that names a --system-prompt the prompts cannot carry (a tokenizer without a chat template, as the
    toy's: generate.format_prompt then writes "Question: ...\\nSolution:"); None when it is used or not given."""
    if getattr(tokenizer, "chat_template", None) or system_prompt in (DEFAULT_SYSTEM, ""):
        return None
    return (f"note: --system-prompt {system_prompt!r} is not used: the tokenizer has no chat template, so every "
            f"prompt is the question alone")


def as_keys(message: str, booleans=frozenset()) -> str:
    """A refusal spelled for scope.main's dict: `--run-name x` → `run_name=x`, `--overwrite` → `overwrite=True`,
    `--no-memory-check` → `memory_check=False` (`booleans`: the flags that take no value)."""
    message = message.replace("python scope.py --help lists every flag", "help(scope.Args) lists every key")

    def key(m) -> str:
        name, value = m.group(1).replace("-", "_"), m.group(2)
        if name.startswith("no_") and name[3:] in booleans:
            return f"{name[3:]}=False" + (m.group(0)[len(m.group(1)) + 2:] if value else "")
        if name in booleans:
            return f"{name}=True" + (m.group(0)[len(m.group(1)) + 2:] if value else "")
        return f"{name}={value}" if value else name

    return re.sub(r"--([a-z][a-z0-9-]*)(?:[ =](-?\d[^\s,;:()]*|[^\s,;:()<>=\-][^\s,;:()]*))?", key, message)


def trl_hint(word: str, names: dict | None = None) -> str | None:
    """The refusal of a TRL flag name ("--num_generations", "num-generations"), naming ours; None otherwise.
    `names`: the table (TRL_NAMES, scope.py's; eval_cli.py passes its own)."""
    names = TRL_NAMES if names is None else names
    name = word.split("=", 1)[0].lstrip("-").replace("-", "_")
    if name not in names:
        return None
    ours, note = names[name]
    shown = word.split("=", 1)[0]
    if ours is None:
        return f"unknown flag {shown}: TRL's name; no such flag here ({note})"
    return f"unknown flag {shown}: TRL's name; did you mean {ours}?" + (f" ({note})" if note else "")


def config_argv(path: str, defaults: dict) -> list[str]:
    """The command-line words for the flags in the YAML file `path`; `defaults` (flag name → default value) says
    which flags exist and which are booleans. Every problem is one line naming the file (and the key)."""
    import yaml

    if not os.path.isfile(path):
        stop(f"--config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        stop(f"--config {path}: not valid YAML{where}: {getattr(err, 'problem', None) or err}")
    if data is None:
        return []
    if not isinstance(data, dict):
        stop(f"--config {path}: expected a mapping of flag: value, got a {type(data).__name__}")
    return flags_argv(data, defaults, f"--config {path}")


def flags_argv(data: dict, defaults: dict, where: str) -> list[str]:
    """The command-line words for {flag name: value} (a --config file's mapping, or the dict given to
    scope.main); TRL's names are taken as trl_names takes them. Every key that is not a flag or whose value has the
    wrong type is named in one refusal, each with its reason (`where`: the file or main)."""
    argv, problems = [], []
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in ("config", "resume") and where.startswith("--config"):
            problems.append(f"'{key}' belongs on the command line, not in a config file")
            continue
        if name in TRL_SAME or name in ("use_peft", "lora_dropout"):   # as on the command line (trl_names)
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            if name == "lora_dropout" and not _zero(text):
                problems.append(f"'{key}': TRL's name; {TRL_NAMES['lora_dropout'][1]}")
                continue
            words = trl_names([f"--{name}={text}"])
            argv = words + argv if name == "use_peft" else argv + words
            continue
        if name not in defaults:
            hint = trl_hint(str(key))
            near = difflib.get_close_matches(name, list(defaults), n=1, cutoff=0.75)
            problems.append(f"'{key}': " + (hint.split(": ", 1)[1] if hint else "no such flag"
                                            + (f": did you mean {near[0]}?" if near else "")))
            continue
        flag = "--" + name.replace("_", "-")
        kind = type(defaults[name])
        if kind is bool:
            if not isinstance(value, bool):
                problems.append(f"'{key}': {value!r} is not true or false")
            else:
                argv.append(flag if value else "--no-" + flag[2:])
            continue
        if isinstance(value, (dict, list, bool)) or value is None:
            problems.append(f"'{key}': {value!r} is not a single {kind.__name__}")
            continue
        try:
            if kind is int and isinstance(value, float):
                raise ValueError(value)
            kind(value)
        except (TypeError, ValueError):
            problems.append(f"'{key}': {value!r} is not {'an int' if kind is int else 'a ' + kind.__name__}")
            continue
        argv.append(f"{flag}={value}")   # '=' keeps a negative number a value (--lr=-1e-4)
    if problems:
        unknown = any("no such flag" in p for p in problems)
        stop((f"{where}: key " if len(problems) == 1 else f"{where}: {len(problems)} keys: ")
              + "; ".join(problems) + (" (python scope.py --help lists every flag; keys are its names with dashes "
                                       "or underscores)" if unknown else ""))
    return argv


def _zero(text: str) -> bool:
    try:
        return float(text) == 0
    except ValueError:
        return False


def normalise(argv: list[str], flags: list[str], booleans=frozenset()) -> list[str]:
    """argv as argparse should read it: our flags typed with underscores (--group_size, as YAML keys may be)
    get dashes, a negative number after a flag is joined to it (--lr -1e-4 → --lr=-1e-4), which argparse
    would otherwise take for a flag ("expected one argument"), and a boolean flag (`booleans`: --flag spellings)
    given a value as TRL's parser takes one (--adv_std false, --adv-std=True) becomes --flag or --no-flag."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        i += 1
        name, eq, value = word.partition("=")
        if name.startswith("--") and name.replace("_", "-") in flags:
            name = name.replace("_", "-")
            word = name + eq + value
        if name in booleans and not name.startswith("--no-"):
            if not eq and i < len(argv) and _bool_word(argv[i]) is not None:
                eq, value, i = "=", argv[i], i + 1
            if eq and _bool_word(value) is not None:
                word = name if _bool_word(value) else "--no-" + name[2:]
        if out and out[-1] in flags and word.startswith("-") and _is_number(word):
            out[-1] += "=" + word
            continue
        out.append(word)
    return out


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def expand_config(argv: list[str], defaults: dict) -> list[str]:
    """argv with the words of its `--config FILE` (if any) put first, so every flag typed after wins."""
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            return config_argv(argv[i + 1], defaults) + argv
        if word.startswith("--config="):
            return config_argv(word.split("=", 1)[1], defaults) + argv
    return argv


def flag_words(name: str, value) -> str:
    """One flag as typed: --adv-std / --no-adv-std for a boolean, --lr 1e-06, --refiner-url ''."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {shlex.quote(str(value))}"
