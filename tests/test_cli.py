"""harness/run/cli.py through scope.parse_args: --config FILE (YAML) and the hints for TRL's flag names."""
import json
import os
import sys
from dataclasses import asdict

import pytest

import scope
from harness.run import cli


def refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        scope.parse_args(argv)
    err = capsys.readouterr().err.strip() or str(exit_.value.code)
    assert "\n" not in err and exit_.value.code == 2, (err, exit_.value.code)   # every usage error exits 2
    return err


def test_config_values_and_typed_flags_override_them(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("toy: true\ngroup_size: 4\nlr: 1e-4\nadv-std: true\nsteps: 3\nmode: grpo\n")
    args = scope.parse_args(["--config", str(recipe), "--steps", "5", "--no-adv-std"])
    assert (args.group_size, args.lr, args.steps, args.adv_std, args.mode) == (4, 1e-4, 5, False, "grpo")
    assert args.toy and args.prompts_per_step == 8   # --toy from the file brings the toy defaults
    assert args.config == str(recipe)                # recorded in config.json like any flag
    args = scope.parse_args([f"--config={recipe}"])
    assert args.steps == 3 and args.adv_std


def test_a_resume_continues_with_the_config_files_values(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("toy: true\ngroup_size: 4\nlr: 0.0003\n")
    started = scope.parse_args(["--config", str(recipe)])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(asdict(started)))   # what open_run records
    recipe.write_text("toy: true\ngroup_size: 16\n")                  # the file changes afterwards
    resumed = scope.parse_args(["--resume", str(run)])
    assert (resumed.group_size, resumed.lr, resumed.toy) == (4, 0.0003, True)


def test_config_file_refusals_name_the_file_and_key(tmp_path, capsys):
    def refuse(text):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        return refusal(capsys, ["--config", str(path)])

    assert "key 'per_device_train_batch_size': TRL's name; did you mean --prompts-per-step?" in refuse(
        "per_device_train_batch_size: 4\n")
    assert "key 'group_sise': no such flag: did you mean group_size?" in refuse("group_sise: 4\n")
    assert "not valid YAML (line 2)" in refuse("lr: [1\n")
    assert "key 'adv_std': 'yes please' is not true or false" in refuse("adv_std: yes please\n")
    assert "key 'steps': [1, 2] is not a single int" in refuse("steps: [1, 2]\n")
    assert refuse("steps: four\n") == f"error: --config {tmp_path / 'c.yaml'}: key 'steps': 'four' is not an int"
    assert "key 'lr': 'fast' is not a float" in refuse("lr: fast\n")
    assert "expected a mapping" in refuse("- lr\n")
    assert "invalid choice: 'foo'" in refuse("mode: foo\n")
    assert "key 'steps': 1.5 is not an int" in refuse("steps: 1.5\n")
    assert "no such file" in refusal(capsys, ["--config", str(tmp_path / "none.yaml")])


def test_a_trl_recipe_is_refused_once_naming_every_key_it_cannot_take(tmp_path, capsys):
    """An 11-key TRL recipe through --config took 8 tries: each refusal named one key. Now one line names every key
    the file cannot take, each with its reason, and the TRL keys that mean ours are taken."""
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen2.5-1.5B\nlearning_rate: 3.0e-6\nnum_generations: 4\n"
                      "max_completion_length: 512\nbeta: 0.04\nuse_peft: true\nlora_dropout: 0.0\n"
                      "per_device_train_batch_size: 16\nbf16: true\npush_to_hub: true\noutput_dir: out\n"
                      "group_sise: 3\nsteps: four\n")
    line = refusal(capsys, ["--config", str(recipe)])
    assert line.startswith(f"error: --config {recipe}: 6 keys: 'per_device_train_batch_size': TRL's name; did you "
                           f"mean --prompts-per-step?")
    for part in ("'bf16': TRL's name; no such flag here (the policy trains in float32", "'push_to_hub': TRL's name",
                 "hf upload", "'output_dir': TRL's name; did you mean --run-name?",
                 "'group_sise': no such flag: did you mean group_size?", "'steps': 'four' is not an int"):
        assert part in line, part
    recipe.write_text("\n".join(line for line in recipe.read_text().splitlines()
                                 if line.split(":")[0] in ("model_name_or_path", "learning_rate", "num_generations",
                                                           "max_completion_length", "beta", "use_peft",
                                                           "lora_dropout")))
    args = scope.parse_args(["--config", str(recipe)])
    assert (args.model, args.lr, args.group_size, args.max_new_tokens, args.kl_coef, args.lora_rank) == (
        "Qwen/Qwen2.5-1.5B", 3e-6, 4, 512, 0.04, 16)


@pytest.mark.parametrize("word,value,field,want", [
    ("--learning_rate", "1e-5", "lr", 1e-5), ("--num_generations", "4", "group_size", 4),
    ("--model_name_or_path", "Qwen/Qwen2.5-Math-1.5B", "model", "Qwen/Qwen2.5-Math-1.5B"),
    ("--max_completion_length", "256", "max_new_tokens", 256), ("--beta", "0.04", "kl_coef", 0.04),
    ("--epsilon", "0.3", "clip_eps", 0.3), ("--dataset_name", "gsm8k", "dataset", "gsm8k"),
    ("--num-generations", "4", "group_size", 4), ("--learning_rate=1e-5", None, "lr", 1e-5)])
def test_trl_names_that_mean_ours_are_taken(word, value, field, want):
    """TRL's names with our meaning were refused one at a time ("did you mean --lr?"); they are ours now."""
    args = scope.parse_args([word] + ([value] if value else []))
    assert getattr(args, field) == want and asdict(args) == asdict(scope.parse_args(
        [f"--{field.replace('_', '-')}", value or word.split("=")[1]]))


@pytest.mark.parametrize("word,ours", [("--output_dir", "--run-name"),
                                       ("--per_device_train_batch_size", "--prompts-per-step"),
                                       ("--num_train_epochs", "--steps"), ("--max_steps", "--steps"),
                                       ("--save_steps", "--save-every"), ("--epsilon_high", "--clip-eps")])
def test_trl_names_whose_meaning_differs_get_ours_and_what_differs(capsys, word, ours):
    line = refusal(capsys, [word, "4"])
    assert f"TRL's name; did you mean {ours}? (" in line


def test_trl_names_are_handled_evenly(capsys):
    """--lora_dropout was refused as "did you mean --lora-rank?", --push_to_hub was a plain unknown flag and
    --hub_model_id suggested --model. Each now says what it is here: a dropout of 0 is ours (taken), another is
    refused with the reason; the hub names say that nothing is uploaded and how to upload model/."""
    assert scope.parse_args(["--use_peft", "--lora_dropout", "0"]) == scope.parse_args(["--use_peft"])
    assert scope.parse_args(["--use_peft", "--lora_dropout=0.0"]) == scope.parse_args(["--use_peft"])
    line = refusal(capsys, ["--use_peft", "--lora_dropout", "0.05"])
    assert "--lora_dropout 0.05: TRL's name; no LoRA dropout here" in line and "--lora-rank" not in line
    for word in ("--push_to_hub", "--hub_model_id", "--hub_strategy"):
        line = refusal(capsys, [word, "me/model"] if word != "--push_to_hub" else [word])
        assert f"unknown flag {word}: TRL's name" in line and "hf upload REPO runs/NAME/model" in line, line
        assert "--model?" not in line
    assert scope.parse_args(["--use_peft", "true"]).lora_rank == 16 and scope.parse_args(
        ["--use_peft", "false"]).lora_rank == 0
    assert not set(cli.TRL_SAME) & set(cli.TRL_NAMES)   # each TRL name once: taken or hinted
    assert all(f"--{v.replace('_', '-')}" in cli.flag_words(v, 1) for v in cli.TRL_SAME.values())


def test_a_boolean_flag_takes_trls_true_and_false_and_the_help_epilogue_parses(capsys):
    """The --help epilogue said --toy sets "--gradient-checkpointing False", which the parser refused. A boolean
    takes TRL's (HfArgumentParser's) spelling with a value, and every flag the epilogue names parses as written."""
    import re

    from harness.run import config

    assert scope.parse_args(["--toy", "--gradient_checkpointing", "true", "--adv-std=False"]) == scope.parse_args(
        ["--toy", "--gradient-checkpointing", "--no-adv-std"])
    assert scope.parse_args(["--gradient-checkpointing", "no"]).gradient_checkpointing is False
    with pytest.raises(SystemExit):
        scope.parse_args(["--help"])
    epilogue = " ".join(capsys.readouterr().out.split())
    toy_line = re.search(r"--toy also sets, unless typed: (.*?)\. --lora-rank", epilogue).group(1)
    assert "--no-gradient-checkpointing" in toy_line
    assert scope.parse_args(["--toy"]) == scope.parse_args(["--toy", *toy_line.split()])
    assert asdict(scope.parse_args(toy_line.split())) == {**asdict(scope.Args()), **config.TOY_DEFAULTS}


def test_use_peft_is_told_apart_from_trls_and_its_learning_rate_is_said(capsys):
    """--use_peft trained all seven projections without dropout (TRL's: q_proj, v_proj, dropout 0.05) and at 10 ×
    the default --lr, said only in --help's epilogue and config.json. --help says both; the run's first lines and
    the dry run's notes say the learning rate."""
    from harness.run import config, preflight

    with pytest.raises(SystemExit):
        scope.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "TRL's resolves to q_proj,v_proj with dropout 0.05" in text and "q_proj,k_proj,v_proj,o_proj" in text
    args = scope.parse_args(["--toy", "--use_peft"])
    notes = preflight.check_args(args, config.notes_of(args))
    assert notes == ["--lora-rank 16: --lr 0.001, 10 × the default (an adapter's usual rate; TRL keeps "
                     "learning_rate as given): type --lr to choose it"]
    assert capsys.readouterr().err == f"note: {notes[0]}\n"
    assert config.notes_of(scope.parse_args(["--toy", "--use_peft", "--lr", "1e-3"])) == []


def test_trl_names_we_do_not_have_say_so(capsys):
    assert "TRL's name; no such flag here (the learning rate is constant after --warmup-steps" in refusal(
        capsys, ["--lr_scheduler_type", "cosine"])


def test_trls_reward_and_dtype_names_say_what_they_mean_here(capsys):
    """`--reward_funcs` got "did you mean --prm-reward-coef?" and `--torch_dtype` "--toy-styles": close spellings,
    wrong meanings. Each now says what the reward and the dtype are here."""
    line = refusal(capsys, ["--reward_funcs", "accuracy"])
    assert "TRL's name; no such flag here (the reward is the grader's 1/0 on the final" in line
    assert "--toy-styles" not in refusal(capsys, ["--torch_dtype", "bfloat16"]) and "float32 master weights" in \
        cli.trl_hint("--torch_dtype")


def test_every_trl_name_points_at_a_flag_we_have():
    flags = {"--" + name.replace("_", "-") for name in asdict(scope.Args())}
    assert {ours for ours, _ in cli.TRL_NAMES.values() if ours} <= flags
    assert {"--" + ours.replace("_", "-") for ours in cli.TRL_SAME.values()} <= flags


def test_the_docs_table_lists_every_trl_name():
    import os
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "running.md")).read()
    missing = [name for name in [*cli.TRL_SAME, *cli.TRL_NAMES, "use_peft"] if f"`{name}`" not in text]
    assert not missing, missing


def test_a_dict_runs_like_the_same_flags_typed():
    """Training could only start from the command line; a notebook now calls scope.main with a dict, which is
    resolved as the typed flags are (the --toy defaults, the checks, one-line refusals)."""
    from harness.run import config

    assert config.as_args(scope.Args, {"toy": True, "group-size": 4, "lr": -1e-4}) == scope.parse_args(
        ["--toy", "--group-size", "4", "--lr=-1e-4"])
    typed = scope.parse_args(["--steps", "3"])
    assert config.as_args(scope.Args, typed) is typed   # the command line's Args: taken as it is
    with pytest.raises(SystemExit) as exit_:
        config.as_args(scope.Args, {"steps": "four"})
    assert exit_.value.code == 2


def test_an_args_built_in_code_gets_the_toys_defaults_as_a_dict_does():
    """`scope.Args(toy=True)` was refused (its model, PRM and refiner were the real run's), although the README
    says an Args works: the toy's defaults reached dicts only. Its fields away from the defaults count as typed."""
    from harness.run import config

    assert config.as_args(scope.Args, scope.Args(toy=True)) == config.as_args(scope.Args, {"toy": True}) \
        == scope.parse_args(["--toy"])
    assert config.as_args(scope.Args, scope.Args(toy=True, steps=4)).steps == 4
    assert config.as_args(scope.Args, scope.Args(toy=True)).model == "toy"


def test_scope_main_from_python_raises_in_key_spelling_and_returns_its_plan(tmp_path, monkeypatch, capsys):
    """From Python a refusal was SystemExit(2) (Jupyter: "An exception has occurred") with hints in command-line
    spelling, and a dry run SystemExit(0); now a refusal raises runs.Refused (a ValueError) naming the dict's keys,
    a dry run returns its plan, and it never refuses an existing folder. The command line keeps its one-line
    refusals and exit status 2."""
    from harness.run.runs import Refused

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "scope-toy-s0").mkdir(parents=True)
    (tmp_path / "runs" / "scope-toy-s0" / "config.json").write_text("{}")   # the quick start's run
    with pytest.raises(Refused) as refusal:
        scope.main({"toy": True, "steps": 5})
    text = str(refusal.value)
    assert isinstance(refusal.value, ValueError) and not isinstance(refusal.value, SystemExit)
    assert "(resume=runs/scope-toy-s0), pick another run_name, or replace it (overwrite=True)" in text, text
    assert "--" not in text and capsys.readouterr().err == ""
    with pytest.raises(Refused, match=r"^lr=-1\.0: must be > 0 and < 1$"):
        scope.main({"toy": True, "lr": -1.0})
    with pytest.raises(Refused, match="main: key 'stpes': no such flag: did you mean steps\\? .*"
                                      "help\\(scope.Args\\) lists every key"):
        scope.main({"stpes": 5})
    plan = scope.main({"toy": True, "steps": 5, "dry_run": True})   # the folder exists: a note, not a refusal
    assert plan["dry_run"] and plan["run_dir"] == "runs/scope-toy-s0" and plan["args"]["steps"] == 5
    assert any(n.startswith("the run itself would stop here: runs/scope-toy-s0 already holds a run")
               for n in plan["notes"]) and capsys.readouterr().out == ""
    with pytest.raises(SystemExit) as exit_:   # the command line: one line in its own spelling, exit 2
        scope.main(scope.parse_args(["--toy", "--steps", "5"]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: runs/scope-toy-s0 already holds a run; continue it "
                                                    "(--resume runs/scope-toy-s0)") and err.count("\n") == 1


def test_a_python_dry_run_keeps_stdout_quiet_and_returns_every_warning(tmp_path, monkeypatch, capsys):
    """scope.main({"dry_run": True, ...}) printed ~80 lines of JSON on stdout and returned notes without the
    coherence warnings (the warm-up longer than the run went to stderr only). From Python the plan is the returned
    dict: every note, and "text", what the command line prints; the command line's dry run prints as before."""
    monkeypatch.chdir(tmp_path)
    plan = scope.main({"toy": True, "steps": 2, "warmup_steps": 5, "use_peft": True, "dry_run": True})
    out, err = capsys.readouterr()
    assert out == "" and plan["notes"][:2] == [
        "--lora-rank 16: --lr 0.001, 10 × the default (an adapter's usual rate; TRL keeps learning_rate as given): "
        "type --lr to choose it",
        "--warmup-steps 5 is longer than the run (--steps 2): the learning rate rises only to 40% of --lr 0.001"]
    assert plan["text"].count("\n") > 60 and '"warmup_steps": 5' in plan["text"]
    assert all(f"note: {n}" in err for n in plan["notes"][:2])   # warnings still reach stderr, as a run's do
    with pytest.raises(SystemExit) as exit_:   # the command line: the plan on stdout, exit 0
        scope.main(scope.parse_args(["--toy", "--steps", "2", "--dry-run"]))
    assert exit_.value.code == 0 and '"steps": 2' in capsys.readouterr().out


def test_underscored_flags_and_negative_numbers_on_the_command_line():
    """YAML took group_size but the command line refused --group_size; --lr -1e-4 was "expected one argument"."""
    args = scope.parse_args(["--toy", "--group_size", "4", "--max_grad_norm", "0.5", "--lr", "-1e-4"])
    assert (args.group_size, args.max_grad_norm, args.lr) == (4, 0.5, -1e-4)


def test_the_readmes_python_call_trains_with_warm_up_and_the_clip_it_is_given(tmp_path, monkeypatch,
                                                                               toy_model_dir, capsys):
    """The README's notebook line, scope.main({...}), runs in-process right after the quick start (whose run folder
    once refused it) and returns the closing summary; --warmup-steps and --max-grad-norm (once constants: a
    constant learning rate and a clip at 1.0) reach the optimizer and the clip."""
    import ast
    import os
    import re

    import torch

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    line = re.search(r"scope\.main\((\{[^}]*\})\)", readme).group(1)
    flags = ast.literal_eval(line.replace("\n", " "))
    assert flags["toy"] is True and flags["run_name"] != "scope-toy-s0"
    name = flags["run_name"]
    flags.update({"model": toy_model_dir, "steps": 2, "prompts-per-step": 2, "group_size": 2, "max_new_tokens": 48,
                  "eval_every": 0, "save_every": 100, "warmup_steps": 4, "max_grad_norm": 0.5})
    (tmp_path / "runs" / "scope-toy-s0").mkdir(parents=True)   # the quick start's run is there already
    (tmp_path / "runs" / "scope-toy-s0" / "config.json").write_text("{}")
    lrs, clips = [], []
    step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: lrs.append(self.param_groups[0]["lr"])
                        or step(self, *a, **k))
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm, *a, **k: clips.append(max_norm)
                        or clip(params, max_norm, *a, **k))
    monkeypatch.chdir(tmp_path)
    summary = scope.main(flags)
    assert summary["run_dir"] == os.path.join("runs", name) and "minutes" in summary
    metrics = [json.loads(line) for line in open(tmp_path / "runs" / name / "metrics.jsonl")]
    assert [m["learning_rate"] for m in metrics] == pytest.approx(lrs)   # TRL's name, each step
    assert ("note: --warmup-steps 4 is longer than the run (--steps 2): the learning rate rises only to 50% of --lr "
            "0.0001") in capsys.readouterr().err
    assert lrs == pytest.approx([1e-4 / 4, 1e-4 * 2 / 4])   # the toy lr 1e-4, warmed up over 4 steps
    assert clips == [0.5, 0.5]
    assert json.loads((tmp_path / "runs" / name / "config.json").read_text())["warmup_steps"] == 4


def test_the_system_prompt_flag_reaches_every_rollout_and_evaluation_prompt(tmp_path, monkeypatch, toy_model_dir,
                                                                            capsys):
    """--system-prompt (once a constant) is the system turn of every prompt the run builds: the rollouts' and the
    evaluation's."""
    from harness.data import prompt
    from harness.run import wiring

    seen = []
    build = prompt.format_prompt

    def recording(tokenizer, question, system=None, *a, **k):
        caller = os.path.basename(sys._getframe(1).f_code.co_filename)
        if caller != "export.py":   # the export's round trip checks the template with and without a system turn
            seen.append((caller, system))
        return build(tokenizer, question, system, *a, **k)

    monkeypatch.setattr(wiring, "format_prompt", recording)     # the rollouts'
    monkeypatch.setattr(prompt, "format_prompt", recording)   # eval.py's, imported when it evaluates
    monkeypatch.chdir(tmp_path)
    scope.main({"toy": True, "model": toy_model_dir, "steps": 1, "prompts-per-step": 2, "group_size": 2,
                "max_new_tokens": 32, "eval_size": 2, "eval_every": 1, "save_every": 100, "run_name": "sys",
                "system_prompt": "Answer in one line."})
    assert {caller for caller, _ in seen} == {"wiring.py", "eval.py"}, seen   # the rollouts and the evaluation
    assert {system for _, system in seen} == {"Answer in one line."}, seen
    out = capsys.readouterr().out   # the toy tokenizer has no chat template: the prompt is named as unused, once
    assert out.count("note: --system-prompt 'Answer in one line.' is not used: the tokenizer has no chat template") \
        == 1


def test_a_negative_learning_rate_reaches_the_check_of_its_range(capsys):
    """`--lr -1e-4` answered "expected one argument"; now the value is read and its range refused in one line."""
    from harness.run import preflight

    with pytest.raises(SystemExit) as exit_:
        preflight.check_args(scope.parse_args(["--toy", "--lr", "-1e-4"]))
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("error: --lr -0.0001: ")
    for flag, value in (("--warmup-steps", "-1"), ("--max-grad-norm", "0")):
        with pytest.raises(SystemExit):
            preflight.check_args(scope.parse_args(["--toy", flag, value]))
        assert capsys.readouterr().err.startswith(f"error: {flag} ")


def test_a_negative_step_count_is_one_line_before_any_note(capsys):
    """`--steps -3` was a ZeroDivisionError traceback (the warm-up note was computed before the range check), and
    with --warmup-steps 1 it first printed "rises only to -300% of --lr"."""
    from harness.run import preflight

    for argv in (["--steps", "-3"], ["--steps", "-3", "--warmup-steps", "1"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as exit_:
            preflight.check_args(scope.parse_args(["--toy", *argv]))
        assert exit_.value.code == 2 and capsys.readouterr().err == (
            f"error: --steps {argv[1]}: must be an integer >= 1\n")


def test_run_name_with_resume_and_system_paths_are_one_line(tmp_path, monkeypatch, capsys):
    """`--resume R --run-name X` continued R in silence; `--run-name /sys/x` (root passes os.access there) gave a
    16-line traceback from os.makedirs."""
    from dataclasses import asdict

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "config.json").write_text(json.dumps({**asdict(scope.Args(toy=True)), "run_name": "r"}))
    with pytest.raises(SystemExit) as exit_:
        scope.parse_args(["--resume", "runs/r", "--run-name", "x"])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith(
        "error: --run-name x with --resume runs/r: a resumed run continues in its own folder under its own name (r)")
    assert scope.parse_args(["--resume", "runs/r", "--run-name", "r"]).run_name == "r"
    with pytest.raises(SystemExit) as exit_:
        scope.main(scope.parse_args(["--toy", "--run-name", "/sys/x"]))   # an absolute path: the run folder itself
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: /sys/x: cannot write there (/sys is ") and \
        err.count("\n") == 1
    monkeypatch.chdir("/sys")   # runs/ in a folder that root may "access" but not write
    with pytest.raises(SystemExit) as exit_:
        scope.main(scope.parse_args(["--toy", "--run-name", "x"]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: runs/x: cannot write there (/sys is ") and \
        err.count("\n") == 1


def test_the_help_the_install_block_and_the_toy_example_are_true(capsys):
    """--help stopped at "nine numbered phases:"; docs/running.md's install block had no venv, no constraints and
    vLLM beside the CPU torch; harness/data/toy.py's example said "times 3" in a world that multiplies only by 2; the
    README's test times were older than CI's own."""
    import os
    import re

    from harness.data import toy

    with pytest.raises(SystemExit):
        scope.parse_args(["--help"])
    head = capsys.readouterr().out.split("\noptions:")[0]
    assert not head.rstrip().endswith(":") and "rollout →" in head
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    install = open(os.path.join(root, "docs", "running.md")).read().split("## Install", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", install, re.S)
    cpu = next(b for b in blocks if "download.pytorch.org/whl/cpu" in b)
    assert "python3 -m venv" in cpu and "-c constraints.txt" in cpu and "vllm" not in cpu
    gpu = next(b for b in blocks if "vllm==" in b)
    assert "python3 -m venv" in gpu and "whl/cpu" not in gpu
    example = re.search(r'Question: "([^"]+)"', toy.__doc__).group(1)
    chain = toy.correct_chain(example)
    assert all(arg == toy.TASK_DEFAULTS["max_factor"] for sym, arg in toy.parse_question(example)[1] if sym == "*")
    assert f"\\boxed{{{chain[-1]}}}" in toy.__doc__.replace("\\\\", "\\")
    tests = open(os.path.join(root, "README.md")).read().split("## Tests", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"the default tier: .*CI, 2 cores, quiet: about \d+ min", tests), tests   # CI's own figures
    assert re.search(r"the slow tier: .*CI, 2 cores, quiet: about \d+ min", tests), tests
