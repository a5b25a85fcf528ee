"""The exported model folder (harness/run/export.py): transformers' Auto classes and pipeline read it as trained."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from harness.run import export
from harness.data.prompt import format_prompt
from harness.engines.generate import load_causal_lm, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY_CONFIG = {"toy": True, "mode": "scope", "model": "toy", "dataset": "toy", "eval_dataset": "toy", "eval_size": 200,
              "eval_n": 1, "eval_max_new_tokens": 128, "steps": 2, "lr": 1e-4, "run_name": "scope-toy-s0"}


def toy_run(tmp_path) -> str:
    """A run folder as scope.py leaves it: config.json, metrics.jsonl, checkpoint/ (the shipped toy warm start)."""
    from harness.data import toy

    run = tmp_path / "scope-toy-s0"
    shutil.copytree(toy.cache_path(os.path.join(ROOT, "cache"), seed=0), run / "checkpoint")
    (run / "config.json").write_text(json.dumps(TOY_CONFIG))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_acc": 0.25}) + "\n"
                                       + json.dumps({"step": 1, "reward_mean": 0.5}) + "\n"
                                       + json.dumps({"step": 2, "reward_mean": 0.6, "eval_acc": 0.375}) + "\n")
    return str(run)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    run = toy_run(tmp_path_factory.mktemp("export"))
    return run, export.export_run(run, quiet=True)


def test_the_toy_checkpoints_tokenizer_is_what_autotokenizer_misreads():
    """Regression: AutoTokenizer on a qwen2 folder rebuilds the tokenizer as Qwen2Tokenizer (byte-level), which
    drops the toy vocabulary's " " and "\\n". This is why the export rewrites it; if transformers stops doing
    this, the rewrite may go."""
    from harness.data import toy
    from transformers import AutoTokenizer

    path = toy.cache_path(os.path.join(ROOT, "cache"), seed=0)
    text = "Question: Start at 1, add 9.\nSolution:\n"
    auto = AutoTokenizer.from_pretrained(path)
    assert auto.decode(auto.encode(text, add_special_tokens=False)) == "Question:Startat1,add9.Solution:"
    ours = load_tokenizer(path)
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


def test_the_folder_holds_bf16_weights_tokenizer_generation_config_and_card(exported):
    run, out = exported
    assert out == os.path.join(run, "model")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "README.md"} <= set(os.listdir(out))
    assert not os.path.exists(os.path.join(out, "optimizer.pt"))
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert gen["temperature"] == 0.6 and gen["do_sample"] and gen["max_new_tokens"] == 128 and gen["eos_token_id"] == 0


def test_the_model_card(exported):
    _, out = exported
    card = open(os.path.join(out, "README.md")).read()
    front = card.split("---")[1]
    assert "library_name: transformers" in front and "- scope" in front and "- toy" in front
    assert "0.250 at step 0 → 0.375 at step 2" in card and "toy, 200 problems × 1 sample(s) at T = 0.6" in card
    assert "Question: <problem>" in card and "\\boxed{<answer>}" in card
    assert 'pipeline("text-generation"' in card and "vllm serve" in card
    assert "\n--lr 0.0001\n" in card and "\n--mode scope\n" in card and "\n--toy\n" in card


def test_the_card_of_a_hub_model_names_base_model_dataset_and_system_prompt():
    config = {"model": "Qwen2.5-1.5B", "dataset": "math-train", "eval_dataset": "math500", "mode": "grpo",
              "eval_n": 4, "eval_size": 500, "eval_max_new_tokens": 3000}
    card = export.model_card(config, [], chat=True)
    front = card.split("---")[1]
    assert "base_model: Qwen/Qwen2.5-1.5B" in front
    assert "- DigitalLearningGmbH/MATH-lighteval" in front and "- HuggingFaceH4/MATH-500" in front
    assert "Please reason step by step, and put your final answer within \\boxed{}." in card
    assert "No evaluation was logged" in card


def test_the_toy_card_names_a_system_prompt_it_could_not_use_and_keeps_other_characters():
    """The card of a toy run given --system-prompt said both "No system prompt" and listed the flag; it said
    AutoTokenizer drops unknown characters, which the exported tokenizer no longer does (byte ids read as <unk>)."""
    card = export.model_card({"toy": True, "system_prompt": "Be brief.", "run_name": "t"}, [], chat=False)
    assert "No system prompt (the run's --system-prompt 'Be brief.' was not used" in card
    assert "drops" not in card and "keeps any other character" in card
    assert "No system prompt." in export.model_card({"toy": True, "run_name": "t"}, [], chat=False)


def test_auto_classes_and_pipeline_round_trip_the_toy_model(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    _, out = exported
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "Question: Start at 7, add 5, times 3.\nSolution:\nSo 7 + 5 = 12.\n\nSo 12 * 3 = 36.\n\n\\boxed{36}"
    trained = load_tokenizer(os.path.join(os.path.dirname(out), "checkpoint"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == trained.encode(text, add_special_tokens=False) and tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == trained.eos_token_id and tokenizer.pad_token_id == trained.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    # greedy text through pipeline + chat messages == the trained model (bf16) on the training prompt
    reference, _ = load_causal_lm(os.path.join(os.path.dirname(out), "checkpoint"), "cpu", torch.bfloat16)
    prompt = torch.tensor([format_prompt(trained, "Start at 7, add 5, times 3.")])
    want = trained.decode(reference.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1]:],
                          skip_special_tokens=True)
    generate = pipeline("text-generation", model=out)
    got = generate([{"role": "user", "content": "Start at 7, add 5, times 3."}], max_new_tokens=40,
                   do_sample=False)[0]["generated_text"][-1]["content"]
    assert got == want and " " in got   # spaces kept: the misread tokenizer wrote none


def test_qwens_tokenizer_and_chat_template_are_saved_as_they_are(tmp_path, qwen_tokenizer):
    from conftest import make_tiny_causal_lm
    from transformers import AutoTokenizer

    model = make_tiny_causal_lm(qwen_tokenizer)
    out = export.export_model(model, qwen_tokenizer, str(tmp_path / "model"), {"model": "x", "mode": "grpo"}, [])
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.chat_template == qwen_tokenizer.chat_template
    text = "We have \\frac{1}{2} + 3 = 7.\n\nSo \\boxed{7}. Naïve ∑"
    assert loaded.encode(text, add_special_tokens=False) == qwen_tokenizer.encode(text, add_special_tokens=False)
    assert next(model.parameters()).dtype == torch.float32   # the exported copy is bf16, the model untouched


def test_a_tokenizer_that_qwen2tokenizer_would_rebuild_differently_is_refused(tmp_path, bpe_tokenizer):
    """The tests' BPE has a plain byte-level pre-tokenizer, not Qwen's split: AutoTokenizer on a qwen2 folder
    rebuilds it as Qwen2Tokenizer with other ids, so the export stops instead of writing a folder vLLM and
    transformers would misread."""
    from conftest import make_tiny_causal_lm

    with pytest.raises(ValueError, match="does not read the tokenizer as trained"):
        export.export_model(make_tiny_causal_lm(bpe_tokenizer), bpe_tokenizer, str(tmp_path / "model"),
                            {"model": "x"}, [])
    assert not os.path.exists(tmp_path / "model") and not os.path.exists(tmp_path / "model.tmp")


def test_an_export_that_autotokenizer_would_misread_stops(tmp_path, monkeypatch):
    """Without the byte-level rewrite the round-trip check catches the dropped spaces."""
    from harness.data import toy

    model, tokenizer = load_causal_lm(toy.cache_path(os.path.join(ROOT, "cache"), seed=0), "cpu")
    monkeypatch.setattr(export, "is_char_level", lambda tok: False)
    with pytest.raises(ValueError, match="does not read the tokenizer as trained"):
        export.export_model(model, tokenizer, str(tmp_path / "model"), TOY_CONFIG, [])
    assert not os.path.exists(tmp_path / "model")


def test_the_command_refuses_a_folder_without_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint/ to export"):
        export.main([str(tmp_path)])


def card_snippet(folder: str) -> tuple[str, str]:
    """(the transformers snippet of the model card in `folder`, the answer its comment says is right)."""
    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    return code, re.search(r"the right answer: \\boxed\{(.+?)\}", code).group(1)


def run_card_snippet(folder: str, cwd: str) -> str:
    """What the card's own snippet prints, run as a user would paste it (a fresh Python in `cwd`)."""
    code, _ = card_snippet(folder)
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_cards_example_is_a_toy_problem_with_its_answer(exported):
    """The card asked "Start at 7, add 5, times 3."; the toy world only multiplies by 2, so the trained model
    answered \\boxed{24} every time and a newcomer took the export for broken."""
    from harness.data import toy

    code, expected = card_snippet(exported[1])
    question = re.search(r'"content": "(Start at [^"]+)"', code).group(1)
    start, ops = toy.parse_question(question)
    assert all(arg == toy.TASK_DEFAULTS["max_factor"] for sym, arg in ops if sym == "*")   # in the toy world
    assert expected == str(toy.correct_chain(question)[-1])
    assert "do_sample=False" in code   # greedy: the same reply each time it is pasted


@pytest.mark.slow
def test_the_cards_snippet_answers_right_on_the_toy_model_a_run_trains(tmp_path):
    """The whole path a newcomer takes: train the toy model with scope.py, then paste the card's snippet."""
    from conftest import run_scope

    run_scope(["--toy", "--steps", "2", "--eval-every", "0", "--run-name", "card"], cwd=tmp_path)
    folder = str(tmp_path / "runs" / "card" / "model")
    out = run_card_snippet(folder, str(tmp_path))
    assert re.findall(r"\\boxed\{(.+?)\}", out)[-1] == card_snippet(folder)[1], out


def test_the_toy_tokenizer_keeps_a_character_it_does_not_know_visible():
    """A character outside the toy alphabet is the <unk> id, which decodes as "<unk>", not nothing."""
    from harness.data import toy

    tokenizer = toy.make_tokenizer()
    ids = tokenizer.encode("Hello, World! é", add_special_tokens=False)
    assert ids.count(tokenizer.unk_token_id) == 4 and tokenizer.decode(ids) == "<unk>ello, <unk>orld<unk> <unk>"


def test_the_exported_tokenizer_keeps_a_character_the_toy_alphabet_lacks(exported):
    """Qwen2Tokenizer (what AutoTokenizer makes of model/) has no unknown token and dropped such a character:
    "Hello, World! 3.14 é" came back as "ello, orld 3.14 ". Now each byte the alphabet lacks has an id whose
    embedding is <unk>'s: the text comes back whole and the model reads it as it reads <unk>."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, out = exported
    text = "Hello, World! 3.14 é"
    tokenizer, trained = AutoTokenizer.from_pretrained(out), load_tokenizer(os.path.join(run, "checkpoint"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    new = sorted({i for i in ids if i >= len(trained)})   # H, W, !, é's two bytes: ids after the trained ones
    assert len(new) == 5 and len(ids) == len(text) + 1   # é is two bytes
    model = AutoModelForCausalLM.from_pretrained(out)
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == len(tokenizer) > len(trained)
    assert all(torch.equal(emb[i], emb[trained.unk_token_id]) for i in new)
    known = tokenizer.encode("So 7 + 5 = 12.", add_special_tokens=False)
    assert known == trained.encode("So 7 + 5 = 12.", add_special_tokens=False)   # the trained ids unchanged


def test_a_run_started_from_an_exported_folder_exports_its_own(exported, tmp_path):
    """A run whose policy came from a model/ folder could not export its own model/ (nor could
    `python -m harness.run.export`): the check wanted back characters that the byte-level tokenizer had never held."""
    run = tmp_path / "again"
    shutil.copytree(exported[1], run / "checkpoint")   # what such a run's checkpoint holds: the exported tokenizer
    (run / "config.json").write_text(json.dumps({**TOY_CONFIG, "model": exported[1], "run_name": ""}))
    out = export.export_run(str(run), quiet=True)
    card = open(os.path.join(out, "README.md")).read()
    assert card.startswith("---") and "\n# again\n" in card and "\n--run-name again\n" in card


def small_run(tmp_path, monkeypatch, name: str, **flags) -> str:
    """A one-step toy run in this process (scope.main), its folder as the run leaves it."""
    import scope

    monkeypatch.chdir(tmp_path)
    scope.main({"toy": True, "steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 48,
                "eval_every": 0, "run_name": name, **flags})
    return str(tmp_path / "runs" / name)


def test_the_checkpoint_says_it_is_for_resume_and_that_autotokenizer_misreads_its_toy_tokenizer(
        tmp_path, monkeypatch, toy_model_dir):
    """AutoTokenizer.from_pretrained(runs/NAME/checkpoint) of a full fine-tune silently turned "Question: Start at 7,
    add 5.\\nSolution:\\n" into "Question:Startat7,add5.Solution:", and nothing inside the folder said so. Its
    README.md now says what the folder is for, that model/ is what to load, and the misreading, in the words
    AutoTokenizer really produces; model/ round-trips."""
    from transformers import AutoTokenizer

    run = small_run(tmp_path, monkeypatch, "full", model=toy_model_dir)
    readme = open(os.path.join(run, "checkpoint", "README.md"), encoding="utf-8").read()
    assert readme.startswith("# runs/full/checkpoint: for `--resume`, not for loading")
    assert "load **`runs/full/model/`**" in readme and "python -m harness.run.export runs/full" in readme
    text = "Question: Start at 7, add 5."
    misread = AutoTokenizer.from_pretrained(os.path.join(run, "checkpoint"))
    said = re.search(r'\("Question: Start at 7, add 5\." becomes "([^"]+)"\)', readme).group(1)
    assert misread.decode(misread.encode(text, add_special_tokens=False)) == said != text   # the README is right
    assert load_tokenizer(os.path.join(run, "checkpoint")).decode(
        load_tokenizer(os.path.join(run, "checkpoint")).encode(text, add_special_tokens=False)) == text
    exported = AutoTokenizer.from_pretrained(os.path.join(run, "model"))
    assert exported.decode(exported.encode(text, add_special_tokens=False)) == text


def test_a_lora_checkpoint_names_its_base_as_given_and_the_card_says_what_base_is(tmp_path, monkeypatch):
    """adapter_config.json stored the base as an absolute path into the clone's cache, checkpoint/README.md was PEFT's
    blank template, and the model card's `PeftModel.from_pretrained(base, ...)` did not say what `base` is. The toy
    warm start is now named relative to the repository (a hub id or a typed path stays as given), the checkpoint's
    README is ours, and the card loads the adapter on its named base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from harness.data import toy

    run = small_run(tmp_path, monkeypatch, "lora", use_peft=True, lora_r=4)
    warm = os.path.relpath(toy.cache_path(os.path.join(ROOT, "cache"), seed=0), ROOT)   # cache/toy_warm_...
    for folder in ("checkpoint", os.path.join("model", "adapter")):
        assert export.adapter_base(os.path.join(run, folder)) == warm and not os.path.isabs(warm)
    readme = open(os.path.join(run, "checkpoint", "README.md"), encoding="utf-8").read()
    assert "Model Card for Model ID" not in readme and "for `--resume`, not for loading" in readme
    assert f'AutoModelForCausalLM.from_pretrained("{warm}")' in readme
    assert "the toy world's warm start, a folder of the SCOPE repository" in readme
    card = open(os.path.join(run, "model", "README.md"), encoding="utf-8").read()
    assert f'base = AutoModelForCausalLM.from_pretrained("{warm}", dtype="bfloat16")   # the adapter\'s base' in card
    assert 'PeftModel.from_pretrained(base, "runs/lora/model/adapter")' in card
    assert export.base_name("Qwen/Qwen2.5-1.5B") == "Qwen/Qwen2.5-1.5B" and export.base_name("/elsewhere/m") == \
        "/elsewhere/m"
    base = AutoModelForCausalLM.from_pretrained(export.base_path(warm))   # from any folder (this test's is tmp_path)
    assert isinstance(PeftModel.from_pretrained(base, os.path.join(run, "checkpoint")), PeftModel)
