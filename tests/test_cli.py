"""harness/cli.py through scope.parse_args: --config FILE (YAML) and the hints for TRL's flag names."""
import json
from dataclasses import asdict

import pytest

import scope
from harness import cli


def refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        scope.parse_args(argv)
    err = capsys.readouterr().err.strip() or str(exit_.value.code)
    assert "\n" not in err
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

    assert "key 'num_generations': TRL's name; did you mean --group-size?" in refuse("num_generations: 4\n")
    assert "key 'group_sise': no such flag" in refuse("group_sise: 4\n")
    assert "not valid YAML (line 2)" in refuse("lr: [1\n")
    assert "key 'adv_std': 'yes please' is not true or false" in refuse("adv_std: yes please\n")
    assert "key 'steps': [1, 2] is not a single value" in refuse("steps: [1, 2]\n")
    assert "expected a mapping" in refuse("- lr\n")
    assert "invalid choice: 'foo'" in refuse("mode: foo\n")
    assert "invalid int value: '1.5'" in refuse("steps: 1.5\n")
    assert "no such file" in refusal(capsys, ["--config", str(tmp_path / "none.yaml")])


@pytest.mark.parametrize("word,ours", [("--num_generations", "--group-size"), ("--learning_rate", "--lr"),
                                       ("--output_dir", "--run-name"), ("--model_name_or_path", "--model"),
                                       ("--per_device_train_batch_size", "--prompts-per-step"),
                                       ("--max_completion_length", "--max-new-tokens"), ("--beta", "--kl-coef"),
                                       ("--epsilon", "--clip-eps"), ("--num_train_epochs", "--steps"),
                                       ("--num-generations", "--group-size"), ("--learning_rate=1e-5", "--lr")])
def test_trl_names_get_ours(capsys, word, ours):
    assert f"TRL's name; did you mean {ours}?" in refusal(capsys, [word, "4"] if "=" not in word else [word])


def test_trl_names_we_do_not_have_say_so(capsys):
    assert "TRL's name; no such flag here (the learning rate is constant" in refusal(
        capsys, ["--lr_scheduler_type", "cosine"])


def test_every_trl_name_points_at_a_flag_we_have():
    flags = {"--" + name.replace("_", "-") for name in asdict(scope.Args())}
    assert {ours for ours, _ in cli.TRL_NAMES.values() if ours} <= flags


def test_the_docs_table_lists_every_trl_name():
    import os
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "running.md")).read()
    assert all(f"`{name}`" in text for name in cli.TRL_NAMES)
