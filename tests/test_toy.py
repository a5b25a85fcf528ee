"""Tests for toy.py: the task, the char tokenizer, ToyPRM, OracleRefiner and the cached warm start."""
import random
import re
import time

import pytest

from conftest import pace
from harness.data import toy


def oracle_texts(refiner, *args, **kwargs) -> list[list[str]]:
    """The texts of an oracle refiner's continuations ((text, finished) pairs)."""
    return [[text for text, _ in row] for row in refiner.continue_from(*args, **kwargs)]


def boxed(text):
    found = re.findall(r"\\boxed\{(-?\d+)\}", text)
    return found[-1] if found else None


def steps_of(text):
    """Lossless split on the blank line, each step keeping its trailing "\\n\\n" (as prm.split_steps does)."""
    parts = text.split("\n\n")
    return [p + "\n\n" for p in parts[:-1]] + [parts[-1]]


def test_prm_split_steps_keeps_one_step_per_operation(problems):
    """Guards the bug where "7 * 2 = 14" (6 non-blank chars) fell under split_steps' min_chars=8 and merged."""
    from prm import split_steps

    for p in problems:
        for err in (None, 0):
            text = toy.solution_text(p, error_at=err, rng=random.Random(1))
            assert split_steps(text) == steps_of(text)


@pytest.fixture(scope="module")
def problems():
    return toy.make_problems(200, seed=3)


def test_problems_are_deterministic_and_in_range(problems):
    assert problems == toy.make_problems(200, seed=3)
    assert problems != toy.make_problems(200, seed=4)
    for p in problems:
        values = toy.correct_chain(p["question"])
        assert toy.TASK_DEFAULTS["min_ops"] <= len(values) - 1 <= toy.TASK_DEFAULTS["max_ops"]
        assert all(0 <= v <= toy.TASK_DEFAULTS["max_value"] for v in values), p
        assert str(values[-1]) == p["answer"]


def test_correct_solution_grades_right_and_scores_all_ones(problems):
    prm = toy.ToyPRM()
    for p in problems:
        text = toy.solution_text(p)
        assert boxed(text) == p["answer"]
        assert prm.score(p["question"], steps_of(text)) == [1.0] * len(p["solution_steps"])


def test_hand_made_example():
    q = "Start at 7, add 5, times 3, minus 4, add 9."
    assert toy.parse_question(q) == (7, [("+", 5), ("*", 3), ("-", 4), ("+", 9)])
    assert toy.correct_chain(q) == [7, 12, 36, 32, 41]
    steps = ["So 7 + 5 = 12.\n\n", "So 12 * 3 = 37.\n\n", "So 37 - 4 = 33.\n\n", "So 33 + 9 = 42.\n\n",
             "\\boxed{42}"]
    # the slip is at step 1; steps 2-4 do right arithmetic on the wrong value and are still wrong
    assert toy.ToyPRM().score(q, steps) == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_injected_error_is_the_first_zero(problems):
    prm, rng = toy.ToyPRM(), random.Random(0)
    for p in problems:
        n_steps = len(p["solution_steps"])
        for k in range(n_steps):
            text = toy.solution_text(p, error_at=k, rng=rng)
            scores = prm.score(p["question"], steps_of(text))
            assert scores.index(0.0) == k and scores[:k] == [1.0] * k
            assert boxed(text) != p["answer"]


def test_malformed_and_extra_steps_score_zero():
    q = "Start at 7, add 5, times 3, minus 4, add 9."
    steps = ["So 7 + 5 = 12.\n\n", "So 12 times 3 is 36.\n\n", "", "x", "So 12 * 3 = 36. x", "41",
             "So 12 * 3 = 36.\n\nSo 36 - 4 = 32.\n\n", "So 32 + 9 = 41.", "\\boxed{41}", "\\boxed{41}"]
    # items are counted across steps, so a merged step ("...36.\n\nSo 36 - 4 = 32.") is judged exactly
    assert toy.ToyPRM().score(q, steps) == [1.0] + [0.0] * 5 + [1.0, 1.0, 1.0, 0.0]


def test_lateness_makes_late_errors_likelier():
    rng = random.Random(0)
    draws = [toy.draw_error_at(5, rng, lateness=2.0) for _ in range(6000)]
    counts = [draws.count(k) for k in range(6)]
    assert counts == sorted(counts)             # weights 1, 4, 9, 16, 25, 36
    assert counts[5] / 6000 == pytest.approx(36 / 91, abs=0.03)


def test_noise_flips_at_the_stated_rate(problems):
    prm = toy.ToyPRM(noise=0.2, seed=1)
    flips = total = 0
    for p in problems:
        steps = steps_of(toy.solution_text(p))
        flips += prm.score(p["question"], steps).count(0.0)
        total += len(steps)
    assert total > 800
    assert flips / total == pytest.approx(0.2, abs=0.04)
    # seeded: the same seed and call order gives the same flips
    a, b = toy.ToyPRM(noise=0.3, seed=5), toy.ToyPRM(noise=0.3, seed=5)
    qs = [p["question"] for p in problems[:20]]
    lists = [steps_of(toy.solution_text(p)) for p in problems[:20]]
    assert a.score_batch(qs, lists) == b.score_batch(qs, lists)


def test_oracle_continuation_from_every_correct_prefix(problems):
    tok, ref = toy.make_tokenizer(), toy.OracleRefiner()
    for p in problems[:50]:
        steps = steps_of(toy.solution_text(p))
        prefixes = ["".join(steps[:k]) for k in range(len(steps))]
        outs = oracle_texts(ref, [p["question"]] * len(prefixes), prefixes, n=2,
                                 max_tokens=[200] * len(prefixes))
        for prefix, (a, b) in zip(prefixes, outs):
            assert a == b                                            # deterministic attempts
            assert boxed(prefix + a) == p["answer"]
            assert prefix + a == toy.solution_text(p)                # exactly the policy's format
            assert tok.decode(tok.encode(a, add_special_tokens=False)) == a
            assert tok.unk_token_id not in tok.encode(a, add_special_tokens=False)


def test_oracle_follows_a_wrong_prefix_and_truncates():
    q = "Start at 7, add 5, times 3, minus 4, add 9."
    ref = toy.OracleRefiner()
    [[suffix]] = oracle_texts(ref, [q], ["So 7 + 5 = 13.\n\n"], n=1, max_tokens=200)
    assert suffix == "So 13 * 3 = 39.\n\nSo 39 - 4 = 35.\n\nSo 35 + 9 = 44.\n\n\\boxed{44}"
    [[suffix]] = oracle_texts(ref, [q], ["So 7 + 5 = 12."], n=1, max_tokens=[200])   # no boundary yet
    assert suffix.startswith("\n\nSo 12 * 3 = 36.")
    [[suffix]] = oracle_texts(ref, [q], [""], n=1, max_tokens=[10])
    assert suffix == "So 7 + 5 ="
    assert ref.continue_from([q], [""], n=1, max_tokens=[200])[0][0][1]      # finished: it stopped by itself
    assert not ref.continue_from([q], [""], n=1, max_tokens=[10])[0][0][1]   # cut at its budget


def test_tokenizer_round_trip(problems):
    from harness.data.prompt import format_prompt

    tok = toy.make_tokenizer()
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert "<extra_0>" in tok.get_vocab() and tok.chat_template is None
    for p in problems[:20]:
        text = toy.solution_text(p, error_at=1, rng=random.Random(0))
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text) and tok.unk_token_id not in ids
        assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
        prompt = format_prompt(tok, p["question"])
        assert tok.decode(prompt) == f"Question: {p['question']}\nSolution:\n"


def test_warm_start_caches(tmp_path, monkeypatch):
    kw = dict(sft_steps=2, batch_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    model, tok = toy.warm_start(str(tmp_path), seed=0, **kw)
    assert (tmp_path / toy.cache_path(str(tmp_path), 0, **kw).split("/")[-1] / "warm_start.json").exists()

    def no_training(*a, **k):
        raise AssertionError("second warm_start call trained instead of loading the cache")

    monkeypatch.setattr(toy, "_sft", no_training)
    t0 = time.time()
    again, tok2 = toy.warm_start(str(tmp_path), seed=0, **kw)
    assert time.time() - t0 < 10 * pace()
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert (a == b).all(), name
    assert tok2.get_vocab() == tok.get_vocab()
    assert toy.cache_path(str(tmp_path), 1, **kw) != toy.cache_path(str(tmp_path), 0, **kw)
    with pytest.raises(TypeError, match="sft_stpes"):
        toy.warm_start(str(tmp_path), sft_stpes=3)
