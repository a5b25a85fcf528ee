"""export.py — a run's trained policy as a model folder the ecosystem loads: runs/NAME/model/.

runs/NAME/checkpoint/ is for `--resume`: float32 weights (a LoRA run: the adapter alone) beside the AdamW state and
the RNG states, and a README.md (`describe_checkpoint`, written into every checkpoint) that says so, where the model
to load is, and, for the toy's char-level tokenizer, that AutoTokenizer misreads the one saved there (below; the
checkpoint keeps it as trained, since a resume must read what the run read). A LoRA checkpoint's adapter_config.json
names its base as --model gave it (a hub id, a path as typed; the toy warm start relative to this repository), not
as an absolute path into the clone. model/ is for everyone else: the weights in bfloat16 (save_pretrained; a LoRA run's adapter merged
into its base, and the adapter alone in model/adapter/ for PEFT), the tokenizer with its chat template,
generation_config.json (the evaluation's sampling settings) and a README.md model card (YAML front matter for
the Hub; the flags of the run; accuracy before → after where the run evaluated; the system prompt and answer
format; how to load it with transformers and `vllm serve`). `transformers.AutoTokenizer`,
`AutoModelForCausalLM` and `pipeline` read the folder as it was trained, the toy model included.

Why the toy tokenizer is rewritten here: it is a char-level `tokenizers` pipeline (WordLevel, one token per
character, harness/data/toy.py). transformers 5 lists `qwen2` among the model types whose saved tokenizer class it
does not trust, so `AutoTokenizer` on a folder whose config.json says qwen2 builds `Qwen2Tokenizer` from the
saved vocabulary: byte-level BPE with Qwen's pre-tokenizer. There the space is the byte-level symbol "Ġ" and
the newline "Ċ"; the toy vocabulary holds " " and "\\n", so every space and newline vanished
("Question:Startat1,add9."). The export writes the same ids under their byte-level names as a BPE without merges,
with Qwen's pre-tokenizer and byte-level decoder: what `Qwen2Tokenizer` rebuilds from it is the same
tokenizer, one token per character. It has no chat template, so the export adds one that renders the plain
layout the toy policy was trained on ("Question: ...\\nSolution:\\n"). Every export ends by loading the
folder's tokenizer through `AutoTokenizer` and checking that sample texts come back exactly; a folder that
fails stops the export with the text that did not.

Run:
    python -m harness.run.export runs/NAME            # writes runs/NAME/model/ from runs/NAME/checkpoint/
    python -m harness.run.export runs/NAME --out DIR  # somewhere else
A run calls `export_run` after its last checkpoint (harness/run/progress.closing_outputs, from Run.finish).
"""
import argparse
import json
import os
import shutil
import sys

import torch

from harness.engines import lora
from harness.run.cli import flag_words
from harness.data.prompt import DEFAULT_SYSTEM, format_prompt
from harness.engines.generate import load_tokenizer
from harness.plan.memory import MODEL_ALIASES
from harness.run.preflight import COMMAND_ONLY
from harness.data.problems import BENCHMARKS
from harness.run.runs import read_log

EVAL_TEMPERATURE = 0.6   # the periodic evaluation's sampling temperature (harness/run/wiring.py), written as the default
PLAIN_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}Question: {{ message['content'] }}\n"
                  "{% endif %}{% endfor %}{% if add_generation_prompt %}Solution:\n{% endif %}")
SAMPLE_TEXTS = ("Question: Start at 7, add 5, times 2.\nSolution:\nSo 7 + 5 = 12.\n\nSo 12 * 2 = 24.\n\n\\boxed{24}",
                "Let $x = 2$. Then $x^2 + 1 = 5$, so the answer is \\boxed{5}.", "Hello, World! 3.14 é")


# the card's example, with its answer: a problem of the toy world (harness/data/toy.py: add, minus, times 2 only), and one
# for a chat model
EXAMPLE_TOY = ("Start at 7, add 5, times 2.", "24")
EXAMPLE_CHAT = ("What is 7 * 6?", "42")
TOY_ALPHABET = (" Its tokenizer knows only the toy task's characters (digits, `+ - * =`, `\\boxed{}` and the letters "
                "of its words); AutoTokenizer keeps any other character, but the model reads each one as an unknown "
                "token it never trained on, so write problems as the example does.")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository (cache/: toy warm starts)


def base_name(name: str) -> str:
    """An adapter's base as adapter_config.json keeps it: a model in this repository's cache/ (the toy warm start,
    which PEFT records as an absolute path) relative to the repository; any other name as --model gave it."""
    cache = os.path.join(ROOT, "cache")
    if os.path.isabs(name) and os.path.commonpath([os.path.abspath(name), cache]) == cache:
        return os.path.relpath(name, ROOT)
    return name


def base_path(name: str) -> str:
    """Where an adapter's base loads from: `name` itself, or a path relative to this repository (base_name) that the
    current folder lacks, in the repository."""
    if not os.path.isabs(name) and not os.path.exists(name) and os.path.isdir(os.path.join(ROOT, name)):
        return os.path.join(ROOT, name)
    return name


def in_repository(name: str) -> bool:
    """True for a base named relative to this repository (base_name: the toy warm start)."""
    return not os.path.isabs(name) and os.path.isdir(os.path.join(ROOT, name))


def base_words(base: str) -> str:
    """What an adapter's base is, in words: the toy warm start in this repository, or the run's --model."""
    if in_repository(base):
        return ("the toy world's warm start, a folder of the SCOPE repository (load it from the repository's root, "
                "or give its full path)")
    return "the run's `--model`"


def adapter_base(folder: str) -> str:
    """The base model named in the adapter_config.json of `folder`."""
    with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as f:
        return json.load(f)["base_model_name_or_path"]


def describe_checkpoint(folder: str, run_dir: str, tokenizer) -> None:
    """Called on a checkpoint being written (`folder`, before its swap into run_dir/checkpoint): a LoRA adapter's base
    named as --model gave it (base_name), and README.md saying what the folder is for and what to load instead; it
    replaces PEFT's blank model card."""
    adapter = lora.is_adapter(folder)
    if adapter:
        path = os.path.join(folder, "adapter_config.json")
        with open(path, encoding="utf-8") as f:
            adapter_config = json.load(f)
        adapter_config["base_model_name_or_path"] = base_name(adapter_config["base_model_name_or_path"])
        with open(path, "w", encoding="utf-8") as f:
            json.dump(adapter_config, f, indent=2, sort_keys=True)
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write(checkpoint_readme(run_dir, is_char_level(tokenizer), adapter_base(folder) if adapter else None))


def checkpoint_readme(run_dir: str, char_level: bool, base: str | None) -> str:
    """The README.md of runs/NAME/checkpoint/: for --resume, not for loading; model/ is; the toy tokenizer's
    warning; a LoRA adapter's base."""
    ckpt, model = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "model")
    text = f"""# {ckpt}: for `--resume`, not for loading

`python scope.py --resume {run_dir}` continues the run from this folder: the policy's float32 weights
{"(the LoRA adapter alone) " if base else ""}beside `optimizer.pt` (AdamW's state) and `state.pt` (the step, the RNG states).

To use the trained model, load **`{model}/`**: bf16 weights{", the adapter merged in" if base else ""}, a tokenizer
that `AutoTokenizer` reads as trained, its chat template, `generation_config.json` and a model card. The run writes
it after its last step; `python -m harness.run.export {run_dir}` writes it from this folder at any time.
`AutoModelForCausalLM`, `pipeline` and `vllm serve` read it; so does `python eval.py --model {model}`.
"""
    if char_level:
        text += f"""
**`AutoTokenizer.from_pretrained("{ckpt}")` misreads the tokenizer saved here.** It is the toy world's char-level
tokenizer; transformers rebuilds it as Qwen2's byte-level BPE, which silently drops every space and newline
("Question: Start at 7, add 5." becomes "Question:Startat7,add5.") and has no chat template. Only this project's
loader reads it as trained (`harness.engines.generate.load_tokenizer`, which scope.py, eval.py and a resume use); `{model}/`
holds the same tokenizer written so that `AutoTokenizer` reads it exactly.
"""
    if base:
        text += f"""
The adapter's base is `{base}`, {base_words(base)}. With PEFT:

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained("{base}")   # the adapter's base (adapter_config.json)
model = PeftModel.from_pretrained(base, "{ckpt}")
```
"""
    return text


def byte_level_names() -> dict[int, str]:
    """GPT-2's byte → printable-character table, the names byte-level BPE gives bytes (space → "Ġ", "\\n" → "Ċ")."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    names, extra = {}, 0
    for b in range(256):
        if b in visible:
            names[b] = chr(b)
        else:
            names[b] = chr(256 + extra)
            extra += 1
    return names


def is_char_level(tokenizer) -> bool:
    """True for a WordLevel tokenizer whose ordinary tokens are single characters (the toy tokenizer); a tokenizer
    without a fast backend is none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    state = json.loads(backend.to_str())
    if state["model"]["type"] != "WordLevel":
        return False
    specials = {t["content"] for t in state.get("added_tokens", [])} | set(tokenizer.all_special_tokens)
    return all(len(tok) == 1 for tok in state["model"]["vocab"] if tok not in specials)


def byte_level_char_tokenizer(tokenizer):
    """The char-level tokenizer rewritten as a byte-level BPE without merges: the same id for every character
    and special token, the pre-tokenizer and decoder Qwen2Tokenizer builds, so AutoTokenizer reads it as saved.
    Qwen2Tokenizer has no unknown token (it drops a byte its vocabulary lacks), so every byte the toy alphabet
    lacks gets an id of its own after the trained ones; `export_model` gives those ids <unk>'s embedding, so the
    model reads such a character as it read <unk>, and decode gives the character back."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    names = byte_level_names()
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    specials = {t["content"] for t in state.get("added_tokens", [])} | set(tokenizer.all_special_tokens)
    vocab = {}
    for tok, i in state["model"]["vocab"].items():
        if tok in specials:
            vocab[tok] = i
        elif len(tok.encode()) == 1:
            vocab[names[tok.encode()[0]]] = i
        else:
            raise ValueError(f"export: the character {tok!r} is not one byte; a byte-level vocabulary cannot hold it")
    for b in range(256):   # the bytes the toy alphabet lacks: new ids, read as <unk> (export_model)
        vocab.setdefault(names[b], max(vocab.values()) + 1)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, continuing_subword_prefix="",
                                end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(s, special=True) for s in sorted(specials, key=lambda s: vocab[s])])
    extra = [s for s in tokenizer.all_special_tokens
             if s not in (tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token, tokenizer.bos_token)]
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=tokenizer.eos_token,
                                   pad_token=tokenizer.pad_token, unk_token=tokenizer.unk_token,
                                   additional_special_tokens=extra)


def portable_tokenizer(tokenizer):
    """The tokenizer to save in model/: a char-level one rewritten (module docstring), and a chat template
    (the plain "Question:/Solution:" layout where the tokenizer has none)."""
    out = byte_level_char_tokenizer(tokenizer) if is_char_level(tokenizer) else tokenizer
    if not getattr(out, "chat_template", None):
        out.chat_template = PLAIN_TEMPLATE
    return out


def unknown_rows(model, n_tokens: int, unk_id: int | None) -> None:
    """Grow the embedding (and a separate output layer) to `n_tokens` rows, each new row a copy of <unk>'s: the
    ids byte_level_char_tokenizer adds for the bytes the toy alphabet lacks. Nothing when none were added."""
    n_rows = model.get_input_embeddings().weight.shape[0]
    if n_tokens <= n_rows:
        return
    if unk_id is None:
        raise ValueError("export: the tokenizer adds ids but has no <unk> whose embedding they could take")
    model.resize_token_embeddings(n_tokens, mean_resizing=False)
    with torch.no_grad():
        for layer in {model.get_input_embeddings(), model.get_output_embeddings()} - {None}:
            layer.weight[n_rows:] = layer.weight[unk_id]


def check_round_trip(folder: str, original, texts=SAMPLE_TEXTS) -> None:
    """AutoTokenizer on `folder` must give the original tokenizer's ids and decode them to the same text, and
    its chat template must render the prompt the policy was trained with; raises ValueError naming the text."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(folder)
    for text in texts:
        ids, want = loaded.encode(text, add_special_tokens=False), original.encode(text, add_special_tokens=False)
        if is_char_level(original) and any(ch not in original.get_vocab() for ch in text):
            if loaded.decode(ids) != text:   # a character the toy vocabulary lacks: its own ids, read as <unk>
                raise ValueError(f"export: AutoTokenizer on {folder} loses a character of {text!r}")
            continue
        back = loaded.decode(ids)   # as the original reads it (a tokenizer that drops a character drops it in both)
        if ids != want or back != original.decode(want):
            raise ValueError(f"export: AutoTokenizer on {folder} does not read the tokenizer as trained: "
                             f"{text!r} came back as {back!r}")
    question = "Start at 7, add 5."
    system = None if getattr(original, "chat_template", None) is None else DEFAULT_SYSTEM
    want = format_prompt(original, question, system)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    got = loaded.encode(loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    if got != want:
        raise ValueError(f"export: the chat template in {folder} does not render the training prompt")


def hub_id(name: str) -> str | None:
    """A Hugging Face id for a model or dataset name of the run, None for the toy world or a local path."""
    name = MODEL_ALIASES.get(name, name)
    if name in BENCHMARKS:
        return BENCHMARKS[name]["hf_id"]
    if name.count("/") == 1 and not os.path.exists(name) and not name.startswith((".", "/")):
        return name.split(":")[0]
    return None


def accuracy_line(records: list[dict], config: dict) -> str:
    """Accuracy before → after from metrics.jsonl's eval_acc records, with the setting; or why there is none."""
    evals = [r for r in records if r.get("eval_acc") is not None]
    if not evals:
        return "No evaluation was logged (--eval-every 0, or the run stopped before its first)."
    first, last = evals[0], evals[-1]
    size = config.get("eval_size") or "all"
    setting = (f"{config.get('eval_dataset')}, {size} problems × {config.get('eval_n', 1)} sample(s) at "
               f"T = {EVAL_TEMPERATURE}, up to {config.get('eval_max_new_tokens')} new tokens, graded by "
               + ("Math-Verify" if config.get("grader") == "math-verify" else "the SCOPE grader"))
    return (f"Accuracy (avg@{config.get('eval_n', 1)}): {first['eval_acc']:.3f} at step {first['step']} → "
            f"{last['eval_acc']:.3f} at step {last['step']} ({setting}).")


def adapter_line(config: dict, folder_name: str) -> str:
    """The card's sentence on a LoRA run (--lora-rank): the weights are the merge, the adapter is in adapter/."""
    if not config.get("lora_rank"):
        return ""
    return (f"\nTrained as a LoRA adapter of rank {config['lora_rank']} (PEFT); these weights have it merged in, "
            f"and `{folder_name}/adapter` holds it alone (PEFT, below).")


def adapter_snippet(folder_name: str, base: str | None) -> str:
    """The card's PEFT section for a LoRA run: what `base` is, and the lines that load the adapter on it."""
    if not base:
        return ""
    return f"""
PEFT, the adapter alone on its base, `{base}`: {base_words(base)}.

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained("{base}", dtype="bfloat16")   # the adapter's base
model = PeftModel.from_pretrained(base, "{folder_name}/adapter")
```
"""


def model_card(config: dict, records: list[dict], chat: bool, folder_name: str = "model",
               adapter_base_name: str | None = None) -> str:
    """The README.md of model/: front matter, what was trained how, accuracy, prompt format, how to load it."""
    toy = bool(config.get("toy"))
    base = None if toy else hub_id(config.get("model", ""))
    data = [d for d in (hub_id(config.get("dataset", "")), hub_id(config.get("eval_dataset", ""))) if d]
    mode = config.get("mode", "scope")
    front = ["---"]
    if base:
        front.append(f"base_model: {base}")
    tags = dict.fromkeys(["scope", mode, "grpo", "math", "reinforcement-learning"] + (["toy"] if toy else []))
    front += ["library_name: transformers", "pipeline_tag: text-generation", "tags:"] + [f"- {t}" for t in tags]
    if data:
        front += ["datasets:"] + [f"- {d}" for d in dict.fromkeys(data)]
    front.append("---")
    what = {"scope": "SCOPE (GRPO whose failed rollouts are repaired from their first wrong step: the policy's "
                     "prefix kept, a refiner's suffix trained off-policy)",
            "grpo": "GRPO (the on-policy baseline: no PRM, no refiner)",
            "replace": "GRPO with whole-solution replacement of failures by a refiner",
            "prm-reward": "GRPO with a dense PRM reward added to the outcome reward"}.get(mode, mode)
    steps = max((r.get("step", 0) for r in records), default=0)
    started = ("the toy world's warm start (a tiny char-level Qwen2, not on the Hub)" if toy
               else f"`{base or config.get('model')}`")
    flags = "\n".join(flag_words(k, v) for k, v in sorted(config.items())
                      if k not in COMMAND_ONLY or k == "run_name" if not isinstance(v, (dict, list)))
    system = config.get("system_prompt", DEFAULT_SYSTEM)
    if chat:
        prompt = (f"Chat template of the tokenizer, with this system prompt:\n\n> {system}\n\nand the problem as the "
                  "user turn. The final answer is the last `\\boxed{...}` of the reply." if system else
                  "Chat template of the tokenizer, no system prompt, the problem as the user turn. The final answer "
                  "is the last `\\boxed{...}` of the reply.")
        question, expected = EXAMPLE_CHAT
        messages = ((f'[{{"role": "system", "content": {json.dumps(system)}}},\n                  ' if system else "[")
                    + f'{{"role": "user", "content": "{question}"}}]')
    else:
        unused = (f" (the run's --system-prompt {system!r} was not used: this tokenizer's template has no system "
                  f"turn)" if system and system != DEFAULT_SYSTEM else "")
        prompt = (f"No system prompt{unused}. The prompt is `Question: <problem>\\nSolution:\\n` (the tokenizer's chat "
                  "template renders a user turn that way); the solution is one step per paragraph and ends with "
                  "`\\boxed{<answer>}`." + (TOY_ALPHABET if toy else ""))
        question, expected = EXAMPLE_TOY if toy else EXAMPLE_CHAT
        messages = f'[{{"role": "user", "content": "{question}"}}]'
    gen = f"do_sample=True, temperature={EVAL_TEMPERATURE}, max_new_tokens={config.get('eval_max_new_tokens', 1024)}"
    return "\n".join(front) + f"""

# {os.path.basename(os.path.normpath(config.get('run_name') or 'SCOPE run'))}

Trained with {what}, {steps} steps, starting from {started}; the training problems: `{config.get('dataset')}`.
Code: the SCOPE reimplementation (scope.py, "Recycling Failures: Salvaging Exploration in RLVR via Fine-Grained
Off-Policy Guidance", arXiv 2602.24110). Weights in bfloat16.{adapter_line(config, folder_name)}

## Accuracy

{accuracy_line(records, config)}

## Prompt and answer format

{prompt}

`generation_config.json` holds the evaluation's sampling settings ({gen}).

## Load with

transformers:

```python
from transformers import pipeline
generate = pipeline("text-generation", model="{folder_name}", dtype="bfloat16")
reply = generate({messages}, max_new_tokens={config.get('eval_max_new_tokens', 1024)}, do_sample=False)
print(reply[0]["generated_text"][-1]["content"])   # greedy; the right answer: \\boxed{{{expected}}}
```

vLLM (an OpenAI-compatible server):

```bash
vllm serve {folder_name} --dtype bfloat16
```
{adapter_snippet(folder_name, adapter_base_name if config.get("lora_rank") else None)}
## Flags of the run

```
{flags}
```
"""


def export_model(model, tokenizer, out: str, config: dict, records: list[dict], adapter: str | None = None,
                 own: bool = False) -> str:
    """Write `out`: bfloat16 weights, the portable tokenizer, generation_config.json, README.md, and with `adapter`
    (a LoRA checkpoint; `model` its merge) the adapter's files in out/adapter/; then check that AutoTokenizer reads
    the tokenizer back exactly. `model` is not changed (a bfloat16 copy is saved), unless `own`: the caller hands it
    over and it is cast to bfloat16 in place (no second copy of the weights in memory)."""
    import copy

    from transformers import GenerationConfig

    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    half = (model if own else copy.deepcopy(model)).to(torch.bfloat16)
    half.config.dtype = "bfloat16"
    portable = portable_tokenizer(tokenizer)
    unknown_rows(half, len(portable), tokenizer.unk_token_id)
    from transformers.utils import logging as hf_logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()   # "Writing model shards" would be a carriage-return bar in a run's log
    half.save_pretrained(tmp)
    if bars:
        hf_logging.enable_progress_bar()
    del half
    portable.save_pretrained(tmp)
    if adapter:   # PeftModel.from_pretrained(base, "model/adapter") loads it
        os.makedirs(os.path.join(tmp, "adapter"))
        for name in lora.ADAPTER_FILES:
            shutil.copy(os.path.join(adapter, name), os.path.join(tmp, "adapter", name))
    GenerationConfig(do_sample=True, temperature=EVAL_TEMPERATURE, top_p=1.0,
                     max_new_tokens=config.get("eval_max_new_tokens", 1024), eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                     else tokenizer.eos_token_id).save_pretrained(tmp)
    with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(config, records, chat=bool(getattr(tokenizer, "chat_template", None)),
                           folder_name=out, adapter_base_name=adapter_base(adapter) if adapter else None))
    try:
        check_round_trip(tmp, tokenizer)
    except ValueError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def export_run(run_dir: str, out: str | None = None, quiet: bool = False) -> str:
    """runs/NAME/model/ (or `out`) from runs/NAME/checkpoint/, config.json and metrics.jsonl."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    ckpt = os.path.join(run_dir, "checkpoint")
    adapter = ckpt if lora.is_adapter(ckpt) else None   # a LoRA run's checkpoint holds the adapter alone
    if not adapter and not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise SystemExit(f"error: {run_dir}: no checkpoint/ to export (a run writes it every --save-every steps)")
    config_path = os.path.join(run_dir, "config.json")
    config = json.load(open(config_path)) if os.path.isfile(config_path) else {}
    config["run_name"] = config.get("run_name") or os.path.basename(os.path.normpath(run_dir))
    records = read_log(os.path.join(run_dir, "metrics.jsonl"))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    model = (lora.export_merged(ckpt, base_path(adapter_base(ckpt))) if adapter
             else AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16))
    if bars:
        hf_logging.enable_progress_bar()
    # the model was loaded here: cast in place (a LoRA merge is float32, a copy would hold it twice)
    out = export_model(model, load_tokenizer(ckpt), out or os.path.join(run_dir, "model"), config, records, adapter,
                       own=True)
    if not quiet:
        print(f"model: {out} (bfloat16{', the LoRA adapter merged; the adapter alone in adapter/' if adapter else ''}, "
              f"tokenizer, generation_config.json, README.md); "
              f"load: AutoModelForCausalLM.from_pretrained('{out}') or vllm serve {out}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write runs/NAME/model/: bf16 weights, tokenizer, model card.")
    p.add_argument("run_dir", help="a run folder holding checkpoint/ (runs/NAME)")
    p.add_argument("--out", default=None, help="where to write the model folder (default: RUN_DIR/model)")
    args = p.parse_args(argv)
    try:
        export_run(args.run_dir, args.out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
