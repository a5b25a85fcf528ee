"""cli.py — the command line's conveniences for people coming from TRL: `--config FILE` and TRL's flag names.

- `config_argv(path, defaults)`: a YAML file of flags (`--config recipe.yaml`, as TRL's recipes are run) turned
  into the command-line words it stands for, so argparse checks its values exactly as typed ones (types,
  choices) and a flag typed on the command line after it wins. Keys are our flag names, with dashes or
  underscores (`group_size: 8` or `group-size: 8`); a boolean is `true`/`false`. A key we do not have stops
  in one line naming the file and the key, with our name when the key is TRL's (`num_generations` → group_size).
  The values land in the run's config.json as every flag does, so `--resume` continues with them.
- `trl_hint(word)`: the one-line refusal of a TRL flag name (`--num_generations` → `--group-size`), or None for
  a word that is not one. The table is TRL_NAMES (docs/running.md shows it).
- `trl_lora(argv)`: TRL's LoRA flags taken as ours (`--use_peft` = `--lora-rank 16`, `--lora_r`, `--lora_alpha`,
  `--lora_target_modules`), on the command line, in a --config file and in scope.main's dict.
- `DATA_FLAGS`: --system-prompt, --question-field and --answer-field, defined once for scope.py's Args and
  eval.py's parser; `unused_system_prompt` names a system prompt a tokenizer without chat template cannot carry.
- `as_keys(message)`: a refusal in the spelling of scope.main's dict (`--run-name x` → `run_name=x`), for a
  Python caller (config.library_call).
"""
import os
import re

from harness.problems import DEFAULT_SYSTEM

# TRL (GRPOConfig / TrainingArguments / ModelConfig) name → (our flag, what differs; "" = the same meaning)
TRL_NAMES = {
    "num_generations": ("--group-size", "rollouts per prompt (G)"),
    "learning_rate": ("--lr", ""),
    "output_dir": ("--run-name", "the run folder is runs/<run-name>"),
    "model_name_or_path": ("--model", ""),
    "per_device_train_batch_size": ("--prompts-per-step", "ours counts prompts (B); TRL's counts completions, "
                                    "B × G per device"),
    "gradient_accumulation_steps": ("--micro-batch-size", "ours sets sequences per forward/backward pass; each "
                                    "mini-batch is one optimizer step"),
    "max_completion_length": ("--max-new-tokens", ""),
    "beta": ("--kl-coef", "β of the k3 KL penalty; 0 = no reference model"),
    "epsilon": ("--clip-eps", "symmetric: [1 − ε, 1 + ε]"),
    "epsilon_high": ("--clip-eps", "ours is symmetric; no separate upper ε"),
    "num_iterations": ("--updates-per-batch", "ours takes that many optimizer steps on one rollout batch, one per "
                       "mini-batch of whole groups"),
    "num_train_epochs": ("--steps", "ours counts rollout steps, not epochs"),
    "max_steps": ("--steps", ""),
    "loss_type": ("--loss-agg", "dr_grpo = constant; token-mean as DAPO's"),
    "scale_rewards": ("--adv-std", "divide advantages by the group's std (--no-adv-std: mean-centred only)"),
    "save_steps": ("--save-every", ""),
    "eval_steps": ("--eval-every", ""),
    "resume_from_checkpoint": ("--resume", "takes the run folder runs/NAME"),
    "dataset_name": ("--dataset", ""),
    "use_vllm": ("--backend", "--backend vllm (auto: vLLM when installed and CUDA is present)"),
    "vllm_gpu_memory_utilization": ("--refiner-mem", "the policy's engine is sized by need; this is the served "
                                    "refiner's share"),
    "top_entropy_quantile": (None, "no token-entropy masking here"),
    "max_prompt_length": (None, "prompts are not truncated here (a prompt past the context stops the run)"),
    "logging_steps": (None, "every step is logged (metrics.jsonl and one line)"),
    "bf16": (None, "bfloat16 autocast on CUDA always, float32 master weights"),
    "max_grad_norm": ("--max-grad-norm", ""),
    "lr_scheduler_type": (None, "the learning rate is constant after --warmup-steps"),
    "warmup_ratio": ("--warmup-steps", "ours counts steps, not a share of them"),
    "reward_funcs": (None, "the reward is the grader's 1/0 on the final \\boxed{} answer (harness/grader.py); "
                     "--mode prm-reward adds --prm-reward-coef × the mean PRM step score"),
    "torch_dtype": (None, "the policy trains in float32 master weights under bfloat16 autocast on CUDA (float32 on "
                    "the CPU); the PRM and a refiner load in bfloat16 on CUDA"),
}

# TRL's LoRA flags (ModelConfig) are taken as spellings of ours; --use_peft alone is TRL's default rank
TRL_LORA = {"lora_r": "lora_rank", "lora_alpha": "lora_alpha", "lora_target_modules": "lora_targets"}
USE_PEFT_RANK = 16


def trl_lora(argv: list[str]) -> list[str]:
    """argv with TRL's LoRA flags in our names: --lora_r 8 → --lora-rank 8, --lora_target_modules q_proj v_proj →
    --lora-targets q_proj,v_proj, and --use_peft → --lora-rank 16 put first, so a rank typed anywhere wins."""
    out, peft, joining = [], False, False
    for word in argv:
        name, eq, value = word.partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if joining and key is None:   # TRL's list of target modules, one word each
            out[-1] += ("" if out[-1].endswith("=") else ",") + word
            continue
        joining = False
        if key == "use_peft":
            peft = value.lower() not in ("false", "0")
        elif key in TRL_LORA:
            ours, joining = "--" + TRL_LORA[key].replace("_", "-"), key == "lora_target_modules" and not eq
            out.append(ours + "=" + value if eq or joining else ours)
        else:
            out.append(word)
    return [f"--lora-rank={USE_PEFT_RANK}"] * peft + out
# The data and prompt flags scope.py (harness/config.py EngineArgs) and eval.py share, one definition:
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
    from harness.problems import BENCHMARKS

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
    `names`: the table (TRL_NAMES, scope.py's; eval.py passes its own)."""
    names = TRL_NAMES if names is None else names
    name = word.split("=", 1)[0].lstrip("-").replace("-", "_")
    if name not in names:
        return None
    ours, note = names[name]
    shown = word.split("=", 1)[0]
    if ours is None:
        return f"unknown flag {shown}: TRL's name; no such flag here ({note})"
    return f"unknown flag {shown}: TRL's name; did you mean {ours}?" + (f" ({note})" if note else "")


def _fail(message: str):
    from harness.runs import stop

    stop(message)   # a usage error, as argparse's: one line, exit 2 (from Python: runs.Refused)


def config_argv(path: str, defaults: dict) -> list[str]:
    """The command-line words for the flags in the YAML file `path`; `defaults` (flag name → default value) says
    which flags exist and which are booleans. Every problem is one line naming the file (and the key)."""
    import yaml

    if not os.path.isfile(path):
        _fail(f"--config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        _fail(f"--config {path}: not valid YAML{where}: {getattr(err, 'problem', None) or err}")
    if data is None:
        return []
    if not isinstance(data, dict):
        _fail(f"--config {path}: expected a mapping of flag: value, got a {type(data).__name__}")
    return flags_argv(data, defaults, f"--config {path}")


def flags_argv(data: dict, defaults: dict, where: str) -> list[str]:
    """The command-line words for {flag name: value} (a --config file's mapping, or the dict given to
    scope.main); each problem is one line naming `where` and the key, its value's type checked here."""
    argv = []
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in ("config", "resume") and where.startswith("--config"):
            _fail(f"{where}: key '{key}' belongs on the command line, not in a config file")
        if name in TRL_LORA or name == "use_peft":   # TRL's LoRA keys, as on the command line (trl_lora)
            words = trl_lora([f"--{name}=" + (",".join(map(str, value)) if isinstance(value, list) else str(value))])
            argv = words + argv if name == "use_peft" else argv + words
            continue
        if name not in defaults:
            hint = trl_hint(str(key))
            _fail(f"{where}: key '{key}': " + (hint.split(": ", 1)[1] if hint else "no such flag "
                  "(python scope.py --help lists every flag; keys are its names with dashes or underscores)"))
        flag = "--" + name.replace("_", "-")
        kind = type(defaults[name])
        if kind is bool:
            if not isinstance(value, bool):
                _fail(f"{where}: key '{key}': {value!r} is not true or false")
            argv.append(flag if value else "--no-" + flag[2:])
            continue
        if isinstance(value, (dict, list, bool)) or value is None:
            _fail(f"{where}: key '{key}': {value!r} is not a single {kind.__name__}")
        try:
            if kind is int and isinstance(value, float):
                raise ValueError(value)
            kind(value)
        except (TypeError, ValueError):
            _fail(f"{where}: key '{key}': {value!r} is not {'an int' if kind is int else 'a ' + kind.__name__}")
        argv.append(f"{flag}={value}")   # '=' keeps a negative number a value (--lr=-1e-4)
    return argv


def normalise(argv: list[str], flags: list[str]) -> list[str]:
    """argv as argparse should read it: our flags typed with underscores (--group_size, as YAML keys may be)
    get dashes, and a negative number after a flag is joined to it (--lr -1e-4 → --lr=-1e-4), which argparse
    would otherwise take for a flag ("expected one argument")."""
    out = []
    for word in argv:
        name, eq, value = word.partition("=")
        if name.startswith("--") and name.replace("_", "-") in flags:
            word = name.replace("_", "-") + eq + value
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
