"""eval_cli.py — eval.py's command line, evaluating with the `evaluate` and `diversity_summary` eval.py hands in.

Top to bottom: the flags, the checks before any model loads, the model, the evaluation and its JSON report, the tables
and the pass@k picture, `main`. `python eval.py --model CKPT --benchmarks math500 --n 8` (every command:
docs/running.md). Its one-line refusals, flag ranges, TRL hints and Ctrl-C's line are scope.py's (harness/run/cli.py),
and so are its checks of model names, the hub and the data (harness/run/preflight.py): both answer alike.
"""
import argparse
import json
import os
import re
import sys
import time

from harness.data.grader import grader_benchmark
from harness.data.mathverify import for_name
from harness.data.problems import BENCHMARKS, load_problems, maybe_cached
from harness.run import cli
from harness.run.progress import bars_only_on_a_terminal
from harness.run.runs import (Refused, environment, format_changes, read_changes, refusals_raised, run_of, stop,
                              unwritable)


class DefaultsShown(argparse.HelpFormatter):
    """--help with each flag's default after its text, where it has one (not for switches or an unset path)."""

    def _get_help_string(self, action):
        shown = action.option_strings and not any(action.default is x for x in (None, False, argparse.SUPPRESS))
        shown = shown and action.default != "" and "(default:" not in action.help   # the data flags say their own
        return f"{action.help} (default: %(default)s)" if shown else action.help


def make_parser() -> cli.OneLineErrors:
    """eval.py's flags (--help)."""
    p = cli.OneLineErrors(
        prog="eval.py", allow_abbrev=False, formatter_class=DefaultsShown, description="Evaluate a checkpoint on math / OOD benchmarks (avg@n, "
        "pass@k, diversity), or time the grader (curves and traces: python -m tools.report).")
    p.add_argument("--model", help="HF model id, alias (Qwen2.5-1.5B, ... as scope.py takes them) or local model "
                   "folder (a run's runs/NAME/checkpoint or runs/NAME/model; a LoRA run's checkpoint/ is its "
                   "adapter, evaluated on its base with HF generate)")
    p.add_argument("--benchmarks", default="math500,aime24,aime25,amc,minerva,olympiad",
                   help="comma-separated names from BENCHMARKS, 'toy', or local .jsonl paths")
    p.add_argument("--ood", default="", help="comma-separated out-of-domain benchmarks, e.g. arc-c,gpqa,mmlu-pro "
                   "(default: none)")
    p.add_argument("--n", type=int, default=8, help="samples per problem (avg@n, pass@k for k <= n)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling top-p")
    p.add_argument("--max-new-tokens", type=int, default=1024,
                   help="new tokens per sample (clamped to the context)")
    p.add_argument("--batch-size", type=int, default=64, help="problems per generate call")
    p.add_argument("--gen-batch-size", type=int, default=64, help="sequences per HF generate call (training's "
                   "--gen-batch-size: the same samples as its periodic evaluation)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--limit", type=int, default=None,
                   help="first K problems of each benchmark (default: all)")
    cli.add_data_flags(p)   # --system-prompt, --question-field, --answer-field: as scope.py has them
    p.add_argument("--backend", choices=["auto", "vllm", "hf"], default="auto",
                   help="generation backend; auto = vLLM when importable and CUDA is present, else HF")
    p.add_argument("--vllm-mem", type=float, default=0.85, help="vLLM gpu_memory_utilization")
    p.add_argument("--out", default=None,
                   help="the results JSON file (default: eval_<folder>.json next to a local model folder, else "
                        "runs/eval_<hub id>.json), its pass@k picture beside it (.png)")
    p.add_argument("--overwrite", action="store_true", help="replace a report already at the --out path (without "
                   "it the evaluation stops before it starts)")
    p.add_argument("--save-samples", action="store_true", help="keep every sampled text in the results JSON")
    p.add_argument("--diversity", action="store_true",
                   help="also print the Table-4 diversity table (needs --n >= 2; paper: --n 10 --temperature 1.0)")
    p.add_argument("--grader", choices=["ours", "math-verify"], default="ours",
                   help="who grades: our grader (docs/grader.md) or Math-Verify, the paper's tables' convention "
                        "(pip install math-verify==0.9.0; LaTeX extraction only, in a child process)")
    p.add_argument("--grader-bench", action="store_true", help="time the grader on generated pairs and exit")
    return p


# TRL's names (GRPOConfig, TrainingArguments, ModelConfig) of eval.py's flags: (ours, what differs). "" = the same
# meaning: taken as ours (--max_completion_length 512 = --max-new-tokens 512); else a one-line hint naming ours.
# Our own flags with underscores (--max_new_tokens, --top_p) are taken too, as scope.py takes them.
TRL_NAMES = {
    "model_name_or_path": ("--model", ""),
    "max_completion_length": ("--max-new-tokens", ""),
    "vllm_gpu_memory_utilization": ("--vllm-mem", ""),
    "num_generations": ("--n", "samples per problem, for avg@n and pass@k"),
    "per_device_eval_batch_size": ("--batch-size", "ours counts problems per generate call, each sampled --n times"),
    "output_dir": ("--out", "ours is the report's JSON file, by default beside the evaluated model folder"),
    "dataset_name": ("--benchmarks", "a comma-separated list of benchmark names or local .jsonl files"),
    "use_vllm": ("--backend", "--backend vllm (auto: vLLM when installed and CUDA is present)"),
    "top_k": (None, "nucleus sampling only (--top-p)"),
    "torch_dtype": (None, "bfloat16 on CUDA, float32 on the CPU"),
    "bf16": (None, "bfloat16 on CUDA, float32 on the CPU"),
}


def trl_argv(argv: list[str]) -> list[str]:
    """argv with TRL's names of the same meaning in ours (`--max_completion_length 512` → `--max-new-tokens 512`)."""
    out = []
    for word in argv:
        name, eq, value = word.partition("=")
        ours, note = TRL_NAMES.get(name[2:].replace("-", "_"), (None, None)) if name.startswith("--") else (None, None)
        out.append(ours + eq + value if ours and not note else word)
    return out


# the flags' ranges, checked in this order: (flag, test of its value, what it must be)
RANGES = (("n", lambda v: v >= 1, "an integer >= 1"),
          ("limit", lambda v: v is None or v >= 1, "an integer >= 1 (omit it: every problem)"),
          ("temperature", lambda v: v >= 0, ">= 0 (0 = greedy)"),
          ("top-p", lambda v: 0 < v <= 1, "in (0, 1]"),
          ("max-new-tokens", lambda v: v >= 1, "an integer >= 1"),
          ("batch-size", lambda v: v >= 1, "an integer >= 1"),
          ("gen-batch-size", lambda v: v >= 1, "an integer >= 1"),
          ("vllm-mem", lambda v: 0 < v < 1, "a share of the GPU's memory in (0, 1)"))


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, each value checked: a refusal is one line, "eval.py: ..." (exit 2), before anything loads. TRL's
    names: TRL_NAMES."""
    p = make_parser()
    flags = [o for a in p._actions for o in a.option_strings]
    try:
        with refusals_raised():   # every refusal below raises runs.Refused
            args, unknown = p.parse_known_args(cli.normalise(trl_argv(list(sys.argv[1:] if argv is None else argv)),
                                                             flags))
            if unknown:
                p.error(cli.trl_hint(unknown[0], TRL_NAMES) or cli.unknown_argument(unknown[0], flags))
            if not (args.grader_bench or args.model):
                p.error("--model is required (or --grader-bench; curves and traces: python -m tools.report "
                        "--plot/--trace RUN)")
            refusal = cli.out_of_range(args, RANGES)
            if refusal:
                p.error(refusal)
            if args.diversity and args.n < 2:
                p.error("--diversity needs --n >= 2 samples per prompt")
    except Refused as err:
        p.exit(2, f"eval.py: {err}\n")
    return args


def checked_inputs(args: argparse.Namespace) -> str:
    """What the input alone decides, checked before anything loads (the pre-flight's functions, as scope.py
    checks it); returns the model to load. A model name resolved as scope.py resolves it (an alias → its hub
    id); a path that does not exist names the closest one, a run folder its checkpoint/ and model/; a LoRA run's
    checkpoint/ (an adapter) is taken, for HF generate only (load_adapter); without
    network (no connection within 3 s) the hub libraries go offline at once, and a model or benchmark that must
    come from the hub and is not in the local cache stops here. --question-field / --answer-field need a data set
    of one's own. runs.Refused (a ValueError): one line."""
    from harness.engines import lora
    from harness.run import preflight

    model = preflight.check_model_name("--model", args.model, adapter=True)   # a LoRA checkpoint: on its base
    if lora.is_adapter(model) and args.backend == "vllm":
        stop(f"--model {args.model}: a LoRA adapter, which eval.py evaluates on its base with HF generate; pass "
             f"--backend hf, or the run's merged model{lora_merged_hint(model)} for vLLM")
    names = [name.strip() for names in (args.benchmarks, args.ood) for name in names.split(",") if name.strip()]
    refusal = cli.own_data_refusal(names, args.question_field, args.answer_field)
    if refusal:
        stop(refusal)
    from_hub = [n for n in names if n in BENCHMARKS or ("/" in n and not os.path.exists(n))]
    loads = adapter_base(model) if lora.is_adapter(model) else model   # an adapter loads its base first
    if (from_hub or not os.path.exists(loads)) and preflight.offline_now():
        if not os.path.exists(loads) and not preflight.in_hub_cache(loads):
            stop(f"--model {args.model}: {'its base ' + loads + ': ' if loads != model else ''}"
                 f"{preflight.uncached(loads)}")
        args.offline = True
        for name in from_hub:
            if not maybe_cached(name):
                stop(f"{'--ood' if name in args.ood.split(',') else '--benchmarks'} {name}: no network: cannot reach "
                     f"the Hugging Face hub and it is not in the local cache; {LOCAL_FILE_HINT}")
    return model


def adapter_base(adapter: str) -> str:
    """The base model a LoRA adapter folder names (adapter_config.json's base_model_name_or_path)."""
    with open(os.path.join(adapter, "adapter_config.json"), encoding="utf-8") as f:
        return json.load(f).get("base_model_name_or_path") or ""


def lora_merged_hint(adapter: str) -> str:
    """" (runs/R/model: python -m harness.run.export runs/R writes it)" for a run's LoRA checkpoint; else ""."""
    run = run_of(adapter)
    return f" ({os.path.join(run, 'model')}: python -m harness.run.export {run} writes it)" if run else ""


LOCAL_FILE_HINT = 'pass a local .jsonl file ({"question": ..., "answer": ...} per line)'


def load_benchmarks(args: argparse.Namespace) -> dict[str, dict[str, list[dict]]]:
    """{"benchmarks": {name: problems}, "ood": {...}}, every one loaded before the model; a source that cannot
    load is one line naming it (offline: with the hint to pass a local file)."""
    problems = {}
    for group, names in (("benchmarks", args.benchmarks), ("ood", args.ood)):
        problems[group] = {}
        for name in (n.strip() for n in names.split(",") if n.strip()):
            flag = "--" + group if group == "ood" else "--benchmarks"
            try:
                problems[group][name] = load_problems(name, limit=args.limit, question_field=args.question_field,
                                                      answer_field=args.answer_field)
            except (OSError, ValueError, RuntimeError) as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                hint = f"; no network: {LOCAL_FILE_HINT}" if getattr(args, "offline", False) else ""
                stop(f"{flag} {name}: cannot load problems: {first}{hint}")
    return problems


def report_path(model: str) -> str:
    """Where the results JSON goes without --out: next to the evaluated run (a local checkpoint folder
    runs/X/checkpoint gives runs/X/eval_checkpoint.json), so evaluating two runs never overwrites one file;
    a hub id gives runs/eval_<owner_name>.json (beside the runs, never in the working directory itself)."""
    if os.path.isdir(model):
        folder = os.path.normpath(model)
        return os.path.join(os.path.dirname(folder) or ".", f"eval_{os.path.basename(folder)}.json")
    return os.path.join("runs", f"eval_{re.sub(r'[^A-Za-z0-9_.-]+', '_', model.strip('/'))}.json")


def checked_out(args: argparse.Namespace) -> str:
    """The report's path, checked before anything loads: an earlier report there is kept unless --overwrite,
    and a folder that cannot be written stops here rather than after the evaluation. ValueError: one line."""
    out = args.out or report_path(args.model)
    if os.path.isdir(out) or out.endswith(("/", os.sep)):   # the report is a file; a folder fails only at the write
        raise ValueError(f"--out {out}: a folder; the report is a JSON file: pass --out "
                         f"{os.path.join(out, os.path.basename(report_path(args.model)))}, say")
    if os.path.exists(out) and not args.overwrite:
        raise ValueError(f"{out} already holds a report; pass --overwrite to replace it, or --out another path")
    blocked = unwritable(os.path.dirname(os.path.abspath(out)))
    if blocked is not None or (os.path.exists(out) and not os.access(out, os.W_OK)):
        raise ValueError(f"--out {out}: cannot write there ({blocked or out} is not writable); pass --out another "
                         f"path")
    return out


def model_label(model: str) -> str:
    """The model's name in the tables: a run's checkpoint/ or model/ folder is named by its run (runs/X/checkpoint
    → X), any other folder or id by its last part."""
    folder = os.path.normpath(model)
    if os.path.isdir(model) and os.path.basename(folder) in ("checkpoint", "model") and os.path.dirname(folder):
        return os.path.basename(os.path.dirname(folder))
    return os.path.basename(folder)


def run_changes(model: str) -> list[str]:
    """The accepted config changes of the training run a checkpoint folder belongs to (runs/X/checkpoint ->
    runs/X/changes.jsonl), one line each; [] for anything else."""
    run_dir = os.path.dirname(os.path.normpath(model))
    if not (os.path.isdir(model) and os.path.isfile(os.path.join(run_dir, "changes.jsonl"))):
        return []
    return format_changes(read_changes(run_dir))


TINY_MODEL = 10_000_000   # parameters: below this a CPU model is sampled on one thread (the toy policy: 0.3 M)


def make_generator(name_or_path: str, backend: str, *, seed: int = 0, vllm_mem: float = 0.85,
                   gen_batch_size: int = 64):
    """(generator, tokenizer) for evaluation: vLLM when asked, or with `auto` when vLLM imports and CUDA
    is present; else Hugging Face generate on CUDA or CPU, `gen_batch_size` rows per generate call (training's
    --gen-batch-size: then its periodic evaluation and this one draw the same samples)."""
    import torch

    from harness.engines import lora
    from harness.engines.generate import HFGenerator, VLLMGenerator, load_causal_lm, load_tokenizer, vllm_importable

    adapter = lora.is_adapter(name_or_path) and not os.path.isfile(os.path.join(name_or_path, "config.json"))
    if backend == "auto":
        backend = "vllm" if vllm_importable() and torch.cuda.is_available() and not adapter else "hf"
    if backend == "vllm":

        try:
            tokenizer = load_tokenizer(name_or_path)
        except (OSError, ValueError) as err:
            raise RuntimeError(f"could not load the tokenizer of model '{name_or_path}' "
                               f"(no local directory and no network?). [{err}]") from err
        return VLLMGenerator(name_or_path, tokenizer=tokenizer, gpu_memory_utilization=vllm_mem,
                             seed=seed), tokenizer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_adapter(name_or_path, device) if adapter else load_causal_lm(name_or_path, device)
    if device == "cpu" and sum(p.numel() for p in model.parameters()) < TINY_MODEL:
        torch.set_num_threads(1)   # as the toy world trains and evaluates: the same samples, no oversubscription
    return HFGenerator(model.eval(), tokenizer, micro_batch_size=gen_batch_size), tokenizer


def load_adapter(path: str, device: str):
    """(model, tokenizer) of a LoRA run's checkpoint: its adapter merged into the base that adapter_config.json
    names (lora.export_merged, as model/ is written), bfloat16 on CUDA, float32 on the CPU; the checkpoint's
    tokenizer. A base that cannot load: RuntimeError naming it."""
    import torch

    from harness.engines import lora
    from harness.engines.generate import load_tokenizer

    print(f"{path}: a LoRA adapter, evaluated merged into its base with HF generate")
    try:
        model = lora.export_merged(path)
    except SystemExit as err:   # lora's one-line refusal: the base named in adapter_config.json does not load
        raise RuntimeError(str(err.code).removeprefix("error: ")) from None
    return model.to(device, torch.bfloat16 if device.startswith("cuda") else torch.float32), load_tokenizer(path)


def run_evaluation(args: argparse.Namespace, evaluate, diversity_summary) -> dict:
    """Check every input and load every benchmark first (so a bad name fails before the model loads), then the
    model, then evaluate (eval.evaluate), print the tables and write the JSON report. Ctrl-C (or SIGTERM) stops
    calmly: the benchmarks already finished are written to the report, marked "interrupted", with the ones left
    named."""
    with refusals_raised():   # a refusal raises runs.Refused (a ValueError): main prints it as one line
        model = checked_inputs(args)   # the model name, the hub (offline at once), the data flags
        out = checked_out(args)   # an earlier report or an unwritable folder stops before the work
        problems = load_benchmarks(args)
    grade_fn = for_name(args.grader)   # a missing math-verify stops here, before the model loads
    bars_only_on_a_terminal()   # no "Loading weights" bar with carriage returns in a log file
    generator, tokenizer = make_generator(model, args.backend, seed=args.seed, vllm_mem=args.vllm_mem,
                                          gen_batch_size=args.gen_batch_size)
    note = cli.unused_system_prompt(tokenizer, args.system_prompt)
    if note:
        print(note)
    model_name = model_label(args.model)
    settings = dict(n=args.n, temperature=args.temperature, top_p=args.top_p,
                    max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size)
    report = {"model": args.model, "model_label": model_name, **settings, "gen_batch_size": args.gen_batch_size,
              "limit": args.limit, "grader": args.grader, "system_prompt": args.system_prompt,
              "environment": environment()}
    changes = run_changes(args.model)
    if changes:   # the checkpoint was trained under settings that changed on a resume: say so with the numbers
        report["run_config_changes"] = changes
        print("\n".join(f"note: its run changed config {line}" for line in changes))
    keep = args.diversity or args.save_samples
    try:
        for group, benchmarks in problems.items():
            results = report[group] = {}
            for name, items in benchmarks.items():
                start = time.perf_counter()
                result = evaluate(generator, tokenizer, items, keep_samples=keep, grade_fn=grade_fn,
                                  progress=_label(name), system=args.system_prompt, **settings)
                result["seconds"] = round(time.perf_counter() - start, 3)   # sampling and grading, not the load
                if args.diversity:
                    result["diversity"] = diversity_summary(result["per_problem"])
                if keep and not args.save_samples:
                    for row in result["per_problem"]:
                        del row["samples"], row["sample_correct"]
                results[name] = result
            if results:
                title = "math benchmarks" if group == "benchmarks" else "out-of-domain benchmarks"
                print(f"\n{title} ({args.model}, n={args.n}, T={args.temperature}, grader {args.grader}; "
                      f"accuracy in %)")
                print(accuracy_table(results))
                if args.diversity:
                    print("\ndiversity across prompts: median [p10, p90] (paper Table 4)")
                    print(diversity_table(results, model_name))
    except KeyboardInterrupt:
        done = [name for group in problems for name in report.get(group, {})]
        left = [name for group in problems for name in problems[group] if name not in report.get(group, {})]
        if not done:
            raise
        report.update(interrupted=True, not_evaluated=left)
        write_report(report, out)
        raise Interrupted(f"interrupted: {out} holds the {len(done)} finished benchmark(s) ({', '.join(done)}); "
                          f"not evaluated: {', '.join(left)}") from None
    write_report(report, out)
    return report


class Interrupted(KeyboardInterrupt):
    """Ctrl-C after some benchmarks finished and were written; its message says where and which."""


def write_report(report: dict, out: str) -> None:
    """The JSON report at `out` and its pass@k picture beside it."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    picture = plot_pass_at_k(report, os.path.splitext(out)[0] + ".png") if any(report.get(g) for g in
                                                                               ("benchmarks", "ood")) else None
    print(f"\nwrote {out}" + (f" and {picture}" if picture else ""))


def plot_pass_at_k(report: dict, path: str) -> str:
    """The picture beside a report: pass@k (%) against k, one line per benchmark (math and out-of-domain), k on a
    log-2 axis. Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for group in ("benchmarks", "ood"):
        for name, result in (report.get(group) or {}).items():
            points = sorted((int(k), 100 * v) for k, v in result["pass@k"].items())   # keys: ints, or str from JSON
            ax.plot([k for k, _ in points], [v for _, v in points], marker="o", label=_label(name))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples per problem)")
    ax.set_ylabel("pass@k (%)")
    ax.set_title(f"{report.get('model_label') or model_label(report['model'])}: n = {report['n']}, T = {report['temperature']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain text table, columns padded to their widest cell."""
    widths = [max(len(str(cell)) for cell in col) for col in zip(headers, *rows)]

    def line(cells):  # first column left-aligned, numbers right-aligned
        return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _label(name: str) -> str:
    """A benchmark's name for a table: its file name when it is a path."""
    return os.path.basename(name) if os.sep in name else name


def accuracy_table(results: dict[str, dict]) -> str:
    """One row per benchmark: problems, avg@n, pass@k for k in pass_ks(n), share of samples cut at
    max_new_tokens (all in percent), plus the unweighted mean over benchmarks (the paper's "Avg.")."""
    n = next(iter(results.values()))["n"]
    ks = list(next(iter(results.values()))["pass@k"])   # evaluate's k: eval.pass_ks(n)
    headers = ["benchmark", "problems", f"avg@{n}"] + [f"pass@{k}" for k in ks] + ["truncated"]
    rows = [[_label(name), str(r["num_problems"]), f"{100 * r['acc']:.1f}"]
            + [f"{100 * r['pass@k'][k]:.1f}" for k in ks] + [f"{100 * r['truncated']:.1f}"]
            for name, r in results.items()]
    if len(results) > 1:
        def mean(key, k=None):
            return f"{100 * sum(r[key] if k is None else r[key][k] for r in results.values()) / len(results):.1f}"

        rows.append(["average", "", mean("acc")] + [mean("pass@k", k) for k in ks] + [mean("truncated")])
    return format_table(headers, rows)


DIVERSITY_COLUMNS = [("distinct_1", "distinct-1"), ("distinct_4", "distinct-4"),
                     ("one_minus_self_bleu", "1-self-BLEU"), ("one_minus_self_rouge", "1-self-ROUGE"),
                     ("div_score", "div-score")]


def diversity_table(results: dict[str, dict], model: str) -> str:
    """Paper Table 4: per benchmark, each diversity metric as median [p10, p90] across prompts, plus
    pass@1 and pass@n (percent)."""
    n = next(iter(results.values()))["n"]
    headers = ["model", "benchmark"] + [label for _, label in DIVERSITY_COLUMNS] + ["pass@1", f"pass@{n}"]
    rows = []
    for name, r in results.items():
        d = r["diversity"]
        rows.append([model, _label(name)]
                    + [f"{d[key]['median']:.2f} [{d[key]['p10']:.2f}, {d[key]['p90']:.2f}]"
                       for key, _ in DIVERSITY_COLUMNS]
                    + [f"{100 * r['pass@k'][1]:.1f}", f"{100 * r['pass@k'][n]:.1f}"])
    return format_table(headers, rows)


def main(argv, evaluate, diversity_summary) -> int:
    """eval.py's command line with eval.py's `evaluate` and `diversity_summary`: 0 when done, 2 for a refusal (one
    line), 130 on Ctrl-C or SIGTERM (one line, no traceback; the benchmarks already finished are kept in the
    report)."""
    args = parse_args(argv)

    def say(err):   # Ctrl-C's line: Interrupted's, or that nothing was written
        print(f"\neval.py: {str(err) or 'interrupted before any benchmark finished; no report written'}",
              file=sys.stderr)

    try:
        with cli.calm_interrupt(say):
            if args.grader_bench:
                print(json.dumps(grader_benchmark(), indent=2, default=str))
            else:
                run_evaluation(args, evaluate, diversity_summary)
    except (OSError, ValueError, RuntimeError) as err:  # missing files, bad rows, unloadable models: one line
        print(f"eval.py: {err}", file=sys.stderr)
        return 2
    except SystemExit as end:   # the calm interrupt's exit 130, returned to a Python caller
        if end.code != 130:
            raise
        return 130
    return 0
