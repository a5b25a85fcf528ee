"""Tests for the toy world's solution styles (harness/data/toy.py choice 10, scope.py --toy-styles): every style is
parsed and graded exactly, the oracle refiner continues in the prefix's style, style_of / style_stats by hand,
the default settings keep every shipped cache path, and the flag is checked and logs its metrics."""
import json
import math
import os
import random
import sys

import pytest

from conftest import run_scope
from harness.data import toy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

Q = "Start at 7, add 5, times 3, minus 4, add 9."   # chain 7, 12, 36, 32, 41
BY_HAND = {0: ["So 7 + 5 = 12.", "So 12 * 3 = 36.", "So 36 - 4 = 32.", "So 32 + 9 = 41."],
           1: ["7 add 5 is 12.", "12 times 3 is 36.", "36 minus 4 is 32.", "32 add 9 is 41."],
           2: ["So 12 = 7 + 5.", "So 36 = 12 * 3.", "So 32 = 36 - 4.", "So 41 = 32 + 9."]}


def oracle_texts(refiner, *args, **kwargs) -> list[list[str]]:
    """The texts of an oracle refiner's continuations ((text, finished) pairs)."""
    return [[text for text, _ in row] for row in refiner.continue_from(*args, **kwargs)]


def steps_of(text):
    """Lossless split on the blank line, each step keeping its trailing "\\n\\n" (as prm.split_steps does)."""
    parts = text.split("\n\n")
    return [p + "\n\n" for p in parts[:-1]] + [parts[-1]]


def by_hand(style, slip_at=None):
    """BY_HAND's chain in `style` as one text; with slip_at = k, step k's result is 1 too high, later steps follow."""
    steps = list(BY_HAND[style])
    if slip_at is not None:
        start, ops = toy.parse_question(Q)
        value = toy.correct_chain(Q)[slip_at]
        for k in range(slip_at, len(ops)):
            sym, arg = ops[k]
            result = toy._apply(value, sym, arg) + (1 if k == slip_at else 0)
            steps[k] = toy.format_step(value, sym, arg, result, style)
            value = result
        return "\n\n".join(steps + [f"\\boxed{{{value}}}"])
    return "\n\n".join(steps + ["\\boxed{41}"])


@pytest.mark.parametrize("style", [0, 1, 2])
def test_each_style_is_written_as_stated_and_scores_exactly(style):
    text = by_hand(style)
    start, ops = toy.parse_question(Q)
    problem = {"question": Q, "solution_steps": BY_HAND[0] + ["\\boxed{41}"]}
    assert toy.solution_text(problem, style=style) == text                   # the templates as stated
    assert toy.ToyPRM().score(Q, steps_of(text)) == [1.0] * 5
    # a slip at step 1 (36 -> 37): steps 1.. are wrong, the earlier one right, whatever the style
    assert toy.ToyPRM().score(Q, steps_of(by_hand(style, slip_at=1))) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert toy.ToyPRM().score(Q, steps_of(by_hand(style, slip_at=3))) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert toy.style_of(text) == style


def test_styles_fit_the_tokenizer_and_split_steps():
    """Every style is made of the tokenizer's characters (no <unk>) and each step stays one split_steps step."""
    from prm import split_steps

    tok = toy.make_tokenizer()
    for p in toy.make_problems(200, seed=3):
        for style in range(len(toy.STYLES)):
            for err in (None, 0):
                text = toy.solution_text(p, error_at=err, rng=random.Random(1), style=style)
                assert tok.unk_token_id not in tok.encode(text, add_special_tokens=False)
                assert split_steps(text) == steps_of(text)
                scores = toy.ToyPRM().score(p["question"], steps_of(text))
                assert scores == ([1.0] * len(scores) if err is None else [0.0] * len(scores))


def test_the_shortest_step_of_every_style_has_eight_non_blank_characters():
    for style in range(len(toy.STYLES)):
        step = toy.format_step(1, "+", 1, 2, style)
        assert len(step.replace(" ", "")) >= 8, step


def test_a_mixed_solution_grades_right_but_has_no_style():
    text = "So 7 + 5 = 12.\n\n12 times 3 is 36.\n\nSo 32 = 36 - 4.\n\nSo 32 + 9 = 41.\n\n\\boxed{41}"
    assert toy.ToyPRM().score(Q, steps_of(text)) == [1.0] * 5
    assert toy.style_of(text) is None
    assert toy.style_of("So 7 + 5 = 12. x") is None     # malformed
    assert toy.style_of("\\boxed{41}") is None           # no operation step
    assert toy.style_of("") is None


@pytest.mark.parametrize("style", [0, 1, 2])
def test_the_oracle_continues_in_the_style_of_the_prefix(style):
    steps = steps_of(by_hand(style))
    ref = toy.OracleRefiner()
    for k in range(1, len(steps)):
        prefix = "".join(steps[:k])
        [[suffix]] = oracle_texts(ref, [Q], [prefix], n=1, max_tokens=200)
        assert prefix + suffix == by_hand(style)                     # same style, graded correct
        assert toy.ToyPRM().score(Q, steps_of(prefix + suffix)) == [1.0] * 5
    # a wrong prefix in style 1: the continuation follows it in style 1
    [[suffix]] = oracle_texts(ref, [Q], ["7 add 5 is 13.\n\n"], n=1, max_tokens=200)
    assert suffix == "13 times 3 is 39.\n\n39 minus 4 is 35.\n\n35 add 9 is 44.\n\n\\boxed{44}"


def test_the_oracle_writes_style_0_after_an_empty_prefix_and_the_last_style_after_a_mixed_one():
    ref = toy.OracleRefiner()
    [[suffix]] = oracle_texts(ref, [Q], [""], n=1, max_tokens=200)
    assert suffix == by_hand(0)
    [[suffix]] = oracle_texts(ref, [Q], ["So 7 + 5 = 12.\n\nSo 36 = 12 * 3.\n\n"], n=1, max_tokens=200)
    assert suffix == "So 32 = 36 - 4.\n\nSo 41 = 32 + 9.\n\n\\boxed{41}"


def test_style_stats_by_hand():
    texts = [by_hand(0), by_hand(0), by_hand(1), by_hand(2, slip_at=1), "So 7 + 5 = 12.\n\n12 times 3 is 36.", "??"]
    stats = toy.style_stats(texts)
    # styled: 0, 0, 1, 2 -> shares 1/2, 1/4, 1/4; H = -(0.5 ln 0.5 + 2 * 0.25 ln 0.25) = 1.5 ln 2 = 1.0397
    assert stats["share"] == [0.5, 0.25, 0.25]
    assert stats["entropy"] == pytest.approx(1.0397208, abs=1e-6)
    assert stats["other"] == pytest.approx(2 / 6) and stats["n"] == 6
    one = toy.style_stats([by_hand(1)] * 3)
    assert one["share"] == [0.0, 1.0, 0.0] and one["entropy"] == 0.0 and one["other"] == 0.0
    even = toy.style_stats([by_hand(0), by_hand(1)], styles=2)
    assert even["share"] == [0.5, 0.5] and even["entropy"] == pytest.approx(math.log(2))
    # a style outside the first K counts as "other"
    assert toy.style_stats([by_hand(0), by_hand(2)], styles=2)["share"] == [1.0, 0.0]
    empty = toy.style_stats([])
    assert empty == {"share": None, "entropy": None, "other": None, "n": 0}


def test_sft_solutions_mix_styles_only_when_asked(monkeypatch):
    """_sft draws one style per solution with styles = K; the default draws nothing (the same SFT stream)."""
    seen = []
    monkeypatch.setattr(toy, "sft_example", lambda tok, p, text: seen.append(text) or ([0, 1], [-100, 1]))

    class Stop(Exception):
        pass

    class Model:
        def parameters(self):
            import torch
            return [torch.nn.Parameter(torch.zeros(1))]

        def train(self):
            pass

        def __call__(self, **kw):
            raise Stop

    for styles, expected in ((1, {0}), (3, {0, 1, 2})):
        seen.clear()
        with pytest.raises(Stop):
            toy._sft(Model(), toy.make_tokenizer(), toy._settings(0, {"batch_size": 64, "styles": styles}))
        assert {toy.style_of(t) for t in seen} - {None} == expected


def test_default_settings_keep_every_shipped_cache_path():
    """The shipped warm starts and refiner must still be found: styles = 1 hashes as without the setting."""
    cache = os.path.join(ROOT, "cache")
    for kw in ({}, {"styles": 1}):
        assert os.path.basename(toy.cache_path(cache, 0, **kw)) == "toy_warm_725d1cdb59cf"
        assert os.path.basename(toy.cache_path(cache, 0, lateness=1.5, **kw)) == "toy_warm_68f44f1849ef"
        assert os.path.basename(toy.refiner_path(cache, 0, **kw)) == "toy_refiner_3f9f426b1ba2"
    # the shipped three-style start (--toy-styles 3), its model refiner, and the two-style start
    assert os.path.basename(toy.cache_path(cache, 0, styles=3)) == "toy_warm_44467f8a339f"
    assert os.path.basename(toy.refiner_path(cache, 0, styles=3)) == "toy_refiner_576c2739bf7f"
    assert os.path.basename(toy.cache_path(cache, 0, styles=2)) == "toy_warm_04edeeba0859"   # two styles: 0 and 1
    for path in (toy.cache_path(cache, 0, styles=3), toy.refiner_path(cache, 0, styles=3),
                 toy.cache_path(cache, 0, styles=2)):
        assert os.path.exists(os.path.join(path, "warm_start.json")), f"{path} is not shipped"
    with pytest.raises(ValueError, match="styles=4"):
        toy.cache_path(cache, 0, styles=4)


def refused(argv, tmp_path, monkeypatch, capsys) -> str:
    import scope

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        scope.main(scope.parse_args(argv))
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("warning:")]
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert not (tmp_path / "runs").exists()
    return err[0]


@pytest.mark.parametrize("argv, culprit", [(["--toy", "--toy-styles", "0"], "--toy-styles 0"),
                                           (["--toy", "--toy-styles", "4"], "--toy-styles 4"),
                                           (["--toy-styles", "2"], "--toy-styles 2")])
def test_the_flag_is_checked_before_anything_loads(argv, culprit, tmp_path, monkeypatch, capsys):
    line = refused(argv, tmp_path, monkeypatch, capsys)
    assert culprit in line, line
    if "--toy" not in argv:
        assert "only with --toy" in line


@pytest.mark.slow
def test_two_steps_with_three_styles_log_the_style_metrics(tmp_path):
    """The real entry point on the shipped three-style warm start: the style metrics are in every step's row."""
    run_scope(["--toy", "--toy-styles", "3", "--run-name", "r", "--eval-every", "0", "--steps", "2",
               "--prompts-per-step", "4", "--group-size", "4", "--micro-batch-size", "16", "--save-every", "100"],
              cwd=tmp_path)
    config = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())
    assert config["toy_styles"] == 3
    rows = [json.loads(line) for line in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert {"style_entropy_correct", "style_share_correct", "style_other_correct"} <= set(r)
        if r["style_share_correct"] is not None:
            assert len(r["style_share_correct"]) == 3 and sum(r["style_share_correct"]) == pytest.approx(1.0)
            assert 0.0 <= r["style_entropy_correct"] <= math.log(3) + 1e-9
    assert any(r["style_share_correct"] is not None for r in rows)   # the warm start solves some of 16 rollouts


# ---------------------------------------------------------------- --toy-refiner-style and the neutral empty prefix

def test_a_foreign_style_oracle_repair_grades_correct_and_parses_as_that_style():
    """--toy-refiner-style 1 after a style-0 prefix of two steps: the suffix is BY_HAND's style-1 steps 2-3 and the
    answer; the spliced text grades correct, scores 1.0 on every step, and is mixed (no one style); the
    suffix alone, and a whole replacement (empty prefix), parse as style 1."""
    from harness.data.grader import grade

    prefix = "\n\n".join(BY_HAND[0][:2]) + "\n\n"
    suffix = oracle_texts(toy.OracleRefiner(style=1), [Q], [prefix], n=2, max_tokens=200)[0]
    assert suffix == ["36 minus 4 is 32.\n\n32 add 9 is 41.\n\n\\boxed{41}"] * 2
    text = prefix + suffix[0]
    assert grade(text, "41") and toy.score_steps(Q, steps_of(text)) == [1.0] * 5
    assert toy.style_of(suffix[0]) == 1 and toy.style_of(text) is None
    whole = oracle_texts(toy.OracleRefiner(style=1), [Q], [""], n=1, max_tokens=200)[0][0]
    assert whole == by_hand(1) and toy.style_of(whole) == 1 and grade(whole, "41")
    assert oracle_texts(toy.OracleRefiner(style=None), [Q], [prefix], n=1, max_tokens=200)[0][0].startswith("So 36 - 4")


def test_the_empty_prefix_style_is_drawn_from_the_refine_seed_only_when_asked():
    """empty_styles = 3: after an empty prefix the i-th prefix of a call is written in style
    random.Random(seed + i).randrange(3); a non-empty prefix keeps its own style; default: style 0."""
    oracle = toy.OracleRefiner(empty_styles=3)
    prefix = BY_HAND[2][0] + "\n\n"
    for seed in (0, 1, 7):
        out = oracle_texts(oracle, [Q, Q, Q], ["", prefix, ""], n=1, max_tokens=200, seed=seed)
        assert toy.style_of(out[0][0]) == random.Random(seed).randrange(3)
        assert toy.style_of(out[1][0]) == 2
        assert toy.style_of(out[2][0]) == random.Random(seed + 2).randrange(3)
    drawn = {toy.style_of(oracle_texts(oracle, [Q], [""], n=1, max_tokens=200, seed=s)[0][0]) for s in range(30)}
    assert drawn == {0, 1, 2}
    assert toy.style_of(oracle_texts(toy.OracleRefiner(), [Q], [""], n=1, max_tokens=200, seed=5)[0][0]) == 0
    for bad in (dict(style=3), dict(style=-1), dict(empty_styles=0), dict(empty_styles=4)):
        with pytest.raises(ValueError):
            toy.OracleRefiner(**bad)
