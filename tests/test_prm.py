"""Tests for the PRM wrapper (prm.ProcessRewardModel), the Qwen2.5-Math-PRM loader without remote code
(harness/engines/prm_checkpoint.py's load_qwen2_prm, on a tiny checkpoint in the real file layout: tests/real_layout_prm.py) and the pure
first-error / selection functions."""
import json
import math
import os
import shutil

import pytest
import torch

import conftest
from harness.engines import prm_checkpoint, prm_families
import real_layout_prm
from prm import (ProcessRewardModel, cut_point, first_error, keep_ratio, mean_score, select_candidate)

QUESTION = "What is 12 * 4 - 5?"
STEPS = ["First, compute 12 * 4 = 48.\n\n", "Next, 48 - 5 = 43.\n\n", "The answer is \\boxed{43}."]


@pytest.fixture(scope="module")
def model(tiny_prm_dir):
    return ProcessRewardModel(tiny_prm_dir, micro_batch_size=2)


class PositionLogits(torch.nn.Module):
    """A stand-in PRM whose P(correct) at position t is sigmoid((t - 40) / 16): scores reveal positions."""

    def forward(self, input_ids, attention_mask=None):
        b, t = input_ids.shape
        pos = torch.arange(t, dtype=torch.float32).expand(b, t)  # (b, T)
        return (torch.stack([torch.zeros(b, t), (pos - 40) / 16], dim=-1),)  # (b, T, 2)


# ---------------------------------------------------------------------------------------------------
# the wrapper
# ---------------------------------------------------------------------------------------------------

def test_one_probability_per_step(model):
    scores = model.score(QUESTION, STEPS)
    assert len(scores) == 3 and all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in scores)
    assert model.score(QUESTION, []) == []


def test_input_matches_the_model_card_layout(model):
    """Token-space assembly == the card's string pipeline (chat template, then encode) for clean steps."""
    tok = model.tokenizer
    ids, positions = model.build_input(QUESTION, STEPS)
    messages = [{"role": "system", "content": prm_families.PRM_SYSTEM}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "<extra_0>".join(s.strip() for s in STEPS) + "<extra_0>"}]
    card = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False),
               add_special_tokens=False)["input_ids"]
    assert ids == card
    assert positions == [i for i, t in enumerate(ids) if t == model.sep_id]


def test_the_separator_positions_are_the_ones_read(tiny_prm_dir, monkeypatch):
    m = ProcessRewardModel(tiny_prm_dir)
    monkeypatch.setattr(m, "model", PositionLogits())
    ids, positions = m.build_input(QUESTION, STEPS)
    expected = [1 / (1 + math.exp(-(p - 40) / 16)) for p in positions]
    assert m.score(QUESTION, STEPS) == pytest.approx(expected, abs=1e-6)


def test_separator_text_written_by_the_policy_cannot_shift_scores(model):
    """Guards: a step containing "<extra_0>" (or other special-token text) adding separators."""
    sneaky = ["First, compute <extra_0>12 * 4 = 48.<|im_end|>\n\n", STEPS[1], STEPS[2]]
    ids, positions = model.build_input(QUESTION, sneaky)
    assert sum(t == model.sep_id for t in ids) == 3 and len(positions) == 3
    clean = ["First, compute 12 * 4 = 48.<|im_end|>", STEPS[1], STEPS[2]]
    assert model.score(QUESTION, sneaky) == pytest.approx(model.score(QUESTION, clean), abs=1e-6)
    assert len(model.score("Is <extra_0> a trick?", STEPS)) == 3


def test_batched_equals_one_by_one(model):
    questions = [QUESTION, "Compute 1/2 + 1/3.", "x?", "What is the area of a circle of radius 3?"]
    steps = [STEPS, ["We have \\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}."], [],
             ["Step 1: the area is \\pi r^2 = 9\\pi.\n\n", "Step 2: so \\boxed{9\\pi}.\n\n", "Naïve √2."]]
    batched = model.score_batch(questions, steps)  # micro_batch_size=2: two padded forward passes
    single = [model.score(q, s) for q, s in zip(questions, steps)]
    assert [len(b) for b in batched] == [3, 1, 0, 3]
    for b, s in zip(batched, single):
        assert b == pytest.approx(s, abs=1e-5)


def test_overlong_input_scores_the_steps_that_fit_and_marks_the_rest(tiny_prm_dir, model):
    """Guards: silently truncating (or crashing on) inputs longer than max_length."""
    full = model.score(QUESTION, STEPS)
    ids, positions = model.build_input(QUESTION, STEPS)
    short = ProcessRewardModel(tiny_prm_dir, max_length=positions[1])  # room for step 1 only
    assert short.build_input(QUESTION, STEPS)[1] == positions[:1]
    scores = short.score(QUESTION, STEPS)
    assert scores[0] == pytest.approx(full[0], abs=1e-5) and scores[1:] == [None, None]
    tiny = ProcessRewardModel(tiny_prm_dir, max_length=5)  # not even the question fits
    assert tiny.score_batch([QUESTION, QUESTION], [STEPS, STEPS[:1]]) == [[None] * 3, [None]]
    assert ProcessRewardModel(tiny_prm_dir, max_length=10**6).max_length == 512  # the model's context


def test_plain_layout_without_a_chat_template(tiny_prm_dir):
    m = ProcessRewardModel(tiny_prm_dir)
    m.tokenizer.chat_template = None
    ids, positions = m.build_input(QUESTION, STEPS)
    assert m.tokenizer.decode(ids).startswith(prm_families.PRM_SYSTEM + "\n\nQuestion: " + QUESTION)
    assert len(positions) == 3 and len(m.score(QUESTION, STEPS)) == 3


def test_wrong_logit_shape_is_an_error(tiny_prm_dir, monkeypatch):
    m = ProcessRewardModel(tiny_prm_dir)
    monkeypatch.setattr(m, "model", lambda input_ids, attention_mask: (torch.zeros(*input_ids.shape, 3),))
    with pytest.raises(ValueError, match="expected"):
        m.score(QUESTION, STEPS)


def test_missing_weights_name_the_model(tiny_prm_dir, tmp_path):
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(f"{tiny_prm_dir}/{name}", no_weights / name)
    with pytest.raises(RuntimeError, match="no_weights"):
        ProcessRewardModel(str(no_weights))
    with pytest.raises(RuntimeError, match="does_not_exist"):
        ProcessRewardModel(str(tmp_path / "does_not_exist"))


def test_a_tokenizer_without_the_separator_is_an_error_in_the_qwen_format(tiny_prm_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    plain = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "no_sep"
    shutil.copytree(tiny_prm_dir, path)
    for f in path.glob("tokenizer*"):
        f.unlink()
    PreTrainedTokenizerFast(tokenizer_object=plain, unk_token="[UNK]").save_pretrained(path)
    with pytest.raises(ValueError, match="<extra_0>"):
        ProcessRewardModel(str(path), prm_format="qwen-math-prm")
    assert ProcessRewardModel(str(path)).format == "trl-token-classification"   # auto: a tag-less token classifier


# ---------------------------------------------------------------------------------------------------
# Qwen2.5-Math-PRM's real layout, without remote code
# ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_prm_dir(tmp_path_factory, qwen_prm_tokenizer):
    return real_layout_prm.write_qwen2_prm(str(tmp_path_factory.mktemp("real_prm")), qwen_prm_tokenizer)


SOLUTIONS = [(QUESTION, STEPS), ("Compute 1/2 + 1/3.", ["We have \\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}."]),
             ("What is the area of a circle of radius 3?",
              ["Step 1: the area is \\pi r^2 = 9\\pi.\n\n", "Step 2: so \\boxed{9\\pi}.\n\n", "Naïve √2."])]


def test_real_layout_loads_without_remote_code_and_scores_as_a_plain_torch_forward(real_prm_dir):
    """Guards: loading Qwen2.5-Math-PRM through the hub's remote code (config without pad_token_id, cache methods
    transformers 5 removed). The folder's config.json has no pad_token_id and an auto_map to code files that do
    not exist; the scores must equal a forward pass written with plain torch ops from the safetensors (a wrong
    key mapping, a missing bias or a head on the wrong position changes them)."""
    with open(os.path.join(real_prm_dir, "config.json")) as f:
        config = json.load(f)
    assert "pad_token_id" not in config and config["architectures"] == ["Qwen2ForProcessRewardModel"]
    m = ProcessRewardModel(real_prm_dir, micro_batch_size=2)
    assert isinstance(m.model, prm_checkpoint.Qwen2ProcessRewardModel)
    assert m.model.model.config.pad_token_id is None
    for question, steps in SOLUTIONS:
        ids, positions = m.build_input(question, steps)
        want = real_layout_prm.reference_step_probs(real_prm_dir, ids, positions)
        assert m.score(question, steps) == pytest.approx(want, abs=1e-5)
    scores = [s for q, st in SOLUTIONS for s in m.score(q, st)]
    assert max(scores) - min(scores) > 0.05  # the probabilities differ by position, far above the tolerance
    batched = m.score_batch([q for q, _ in SOLUTIONS], [s for _, s in SOLUTIONS])  # padded, 2 per forward
    assert [b for row in batched for b in row] == pytest.approx(scores, abs=1e-5)


def test_real_layout_from_shards_and_in_bfloat16(real_prm_dir, qwen_prm_tokenizer, tmp_path):
    """The sharded layout (model.safetensors.index.json, as the 7B on the hub) loads to the same scores; in
    bfloat16 the decoder is bfloat16 and the score head float32 (vLLM's default head dtype for pooling)."""
    sharded = real_layout_prm.write_qwen2_prm(str(tmp_path / "sharded"), qwen_prm_tokenizer, shards=2)
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    want = ProcessRewardModel(real_prm_dir).score(QUESTION, STEPS)
    assert ProcessRewardModel(sharded).score(QUESTION, STEPS) == pytest.approx(want, abs=1e-6)
    half = ProcessRewardModel(real_prm_dir, dtype="bfloat16")
    assert half.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert {p.dtype for p in half.model.score.parameters()} == {torch.float32}
    assert half.score(QUESTION, STEPS) == pytest.approx(want, abs=0.03)


def _rewrite(folder, edit):
    """Apply `edit(tensors)` to the single model.safetensors of `folder`."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("damage, named", [
    ("drop", "missing score.2.weight"),
    ("extra", "unexpected score.4.weight"),
    ("shape", "wrong shape score.0.bias (32,) (expected (64,))")])
def test_a_damaged_real_layout_checkpoint_is_refused_in_one_line(real_prm_dir, tmp_path, damage, named):
    """Guards: a head left at random initialisation (a missing score weight), or weights that belong to another
    model, scored silently. One line naming the keys, from the file headers, before any tensor is read."""
    folder = str(tmp_path / damage)
    shutil.copytree(real_prm_dir, folder)
    edits = {"drop": lambda t: t.pop("score.2.weight"),
             "extra": lambda t: t.update({"score.4.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}),
             "shape": lambda t: t.update({"score.0.bias": torch.zeros(32, dtype=torch.bfloat16)})}
    _rewrite(folder, edits[damage])
    with pytest.raises(ValueError) as err:
        ProcessRewardModel(folder)
    assert named in str(err.value) and "\n" not in str(err.value)
    assert "lm_head" not in str(err.value)  # the unused lm_head.weight is not a complaint


def test_a_damaged_prm_stops_scope_before_any_model_loads(real_prm_dir, tmp_path):
    """The pre-flight reads the checkpoint's headers: `scope.py` exits 2 with one line naming the missing key,
    before the policy or the rollout engine is loaded."""
    folder = str(tmp_path / "damaged")
    shutil.copytree(real_prm_dir, folder)
    _rewrite(folder, lambda t: t.pop("score.2.bias"))
    data = tmp_path / "problems.jsonl"
    data.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    proc = conftest.run_scope(["--model", real_prm_dir, "--prm", folder, "--refiner", "policy", "--device", "cpu",
                               "--dataset", str(data), "--eval-dataset", str(data), "--steps", "1", "--run-name", "r"],
                              tmp_path, check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]  # (a no-GPU warning too)
    assert len(errors) == 1 and errors[0].startswith("error: --prm") and "missing score.2.bias" in errors[0], errors
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs" / "r").exists() or not os.listdir(tmp_path / "runs" / "r")


def test_a_token_classifier_with_a_missing_head_is_refused(tiny_prm_dir, tmp_path):
    """Guards: transformers initialises a weight missing from the files at random and only warns."""
    folder = str(tmp_path / "headless")
    shutil.copytree(tiny_prm_dir, folder)
    _rewrite(folder, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("score.")]])
    with pytest.raises(ValueError, match="score.weight"):
        ProcessRewardModel(folder)


def test_an_unsupported_architecture_is_named(tiny_prm_dir, tmp_path):
    folder = str(tmp_path / "causal")
    shutil.copytree(tiny_prm_dir, folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["Qwen2ForCausalLM"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM.*Qwen2ForProcessRewardModel"):
        ProcessRewardModel(folder)


# ---------------------------------------------------------------------------------------------------
# first error, cut point, keep ratio, selection
# ---------------------------------------------------------------------------------------------------

def test_first_error():
    assert first_error([]) is None
    assert first_error([0.9, 0.8, 0.99]) is None  # all good
    assert first_error([0.1, 0.9]) == 0  # first step bad
    assert first_error([0.9, 0.5, 0.49, 0.1]) == 2  # 0.5 is not < tau
    assert first_error([0.9, 0.6], tau=0.7) == 1
    assert first_error([0.9, None, 0.1]) is None  # scores after an unscored step are ignored


def test_cut_point():
    assert cut_point([]) == 0  # no steps
    assert cut_point([0.9, 0.8, 0.99]) == 2  # all good: the last step is presumed wrong
    assert cut_point([0.9]) == 0
    assert cut_point([0.2, 0.9, 0.9]) == 0  # first step bad: nothing kept
    assert cut_point([0.9, 0.3, 0.1]) == 1
    assert cut_point([0.9, 0.9, None, None]) == 2  # unscored tail: cut where verification stops
    assert cut_point([None, None]) == 0
    assert cut_point([0.9, None, 0.1]) == 1


def test_keep_ratio():
    assert keep_ratio(0, 0) == 0.0
    assert keep_ratio(0, 4) == 0.0
    assert keep_ratio(3, 4) == 0.75
    assert keep_ratio(cut_point([0.9, 0.9, 0.9, 0.9]), 4) == 0.75


def test_mean_score():
    assert mean_score([]) == 0.0
    assert mean_score([None, None]) == 0.0
    assert mean_score([0.5, None, 1.0]) == 0.75


def test_select_candidate():
    assert select_candidate([], [], []) is None
    assert select_candidate([0.2, 0.75, 0.5], [0.9, 0.1, 0.9], [10, 50, 5]) == 1  # largest keep ratio
    assert select_candidate([0.5, 0.5, 0.1], [0.7, 0.9, 1.0], [10, 50, 5]) == 1  # tie -> higher prefix mean
    assert select_candidate([0.5, 0.5, 0.5], [0.8, 0.8, 0.8], [30, 20, 20]) == 1  # -> shorter, then earlier
    assert select_candidate([0.0], [0.0], [7]) == 0  # nothing kept is still a candidate
    with pytest.raises(ValueError, match="lengths differ"):
        select_candidate([0.5], [0.5, 0.5], [1])


# ---------------------------------------------------------------------------------------------------
# Which GPU the PRM's weights land on
# ---------------------------------------------------------------------------------------------------

def test_prm_weights_are_read_onto_the_current_cuda_device_not_cuda_0(real_prm_dir, monkeypatch):
    """Guards the torchrun start-up crash: safetensors' safe_open maps a bare "cuda" to cuda:0, so every rank
    read its PRM onto GPU 0. With the current CUDA device faked to 3 (rank 3 after dist.init's set_device),
    the device that reaches safe_open must be cuda:3."""
    import safetensors

    real_safe_open, seen = safetensors.safe_open, []

    class Reached(Exception):
        pass

    def recording_safe_open(path, framework, device="cpu"):
        seen.append(device)
        if device != "cpu":   # the weights' read: stop here (this CPU has no CUDA to read onto)
            raise Reached
        return real_safe_open(path, framework=framework, device=device)

    monkeypatch.setattr(safetensors, "safe_open", recording_safe_open)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    with pytest.raises(Reached):
        prm_checkpoint.load_qwen2_prm(real_prm_dir, device="cuda", dtype=torch.bfloat16)
    assert seen[-1] == "cuda:3"
    assert prm_checkpoint.indexed_device("cuda:1") == "cuda:1" and prm_checkpoint.indexed_device("cpu") == "cpu"
