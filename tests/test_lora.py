"""--lora-rank (harness/engines/lora.py): the policy trained as a PEFT LoRA adapter on a tiny Qwen2 built in code.

- at init the adapted policy is the base: the same log-probs, bit for bit, and the same sampled tokens;
- the update trains the adapter alone: no gradient and no AdamW state for the base, whose weights stay as loaded;
  the KL reference (the adapter switched off) is still the base;
- the weights pushed to vLLM and the exported model/ are W + (α / r) B A, with no adapter key left, and give the
  adapted policy's log-probs (within bf16 for model/); model/adapter/ loads with PEFT;
- a resume from the checkpoint takes the next step bit for bit as the run that never stopped;
- TRL's spellings (--use_peft, --lora_r, --lora_target_modules) and the one-line refusals.
"""
import json
import os
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_tiny_causal_lm
from grpo import build_batch, token_logprobs, update
from harness.engines import lora
from harness.run import cli, wiring
from harness.engines.generate import HFGenerator, load_tokenizer
from harness.run.runs import save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def lora_args(**kw):
    return SimpleNamespace(**{"lora_rank": 4, "lora_alpha": 0.0, "lora_targets": lora.TARGETS, "kl_coef": 0.0,
                              "gradient_checkpointing": False, "lr": 1e-2, "fused_adamw": False, **kw})


@pytest.fixture(scope="module")
def base_dir():
    """The shipped toy warm start (0.3 M parameters): a base whose tokenizer the export can write."""
    from harness.data import toy
    return toy.cache_path(os.path.join(ROOT, "cache"), seed=0)


@pytest.fixture(scope="module")
def toy_tokenizer(base_dir):
    return load_tokenizer(base_dir)


def load_base(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def a_batch(tok, n=4):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, len(tok), (3 + i,), generator=g).tolist() for i in range(n)]
    responses = [torch.randint(4, len(tok), (6,), generator=g).tolist() for _ in range(n)]
    return build_batch(prompts, responses, [[0] * 6] * n, torch.tensor([1.0, -1.0, 0.5, -0.5][:n]), tok.pad_token_id)


def logprobs(model, batch):
    return token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], 8)[0]


@torch.no_grad()
def log_softmax(model, batch, rows):
    """(N, L, rows) log-probs over the first `rows` ids of the vocabulary."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., :rows].log_softmax(-1)


def train_step(policy, optimizer, batch):
    return update(policy, optimizer, batch, micro_batch_size=2, max_new_tokens=6)


def test_at_init_the_adapted_policy_is_the_base(bpe_tokenizer):
    """B starts at 0: the same log-probs bit for bit and the same sampled tokens (HF generate, one seed)."""
    base = make_tiny_causal_lm(bpe_tokenizer)
    batch, prompts = a_batch(bpe_tokenizer), [[5, 6, 7], [8, 9]]
    want_logp = logprobs(base, batch)
    want_ids = [c.ids for g in HFGenerator(base, bpe_tokenizer).generate(prompts, n=2, max_tokens=8, seed=3) for c in g]
    policy = lora.wrap(make_tiny_causal_lm(bpe_tokenizer), rank=4)
    assert torch.equal(logprobs(policy, batch), want_logp)
    got_ids = [c.ids for g in HFGenerator(lora.inner(policy), bpe_tokenizer).generate(prompts, n=2, max_tokens=8,
                                                                                        seed=3) for c in g]
    assert got_ids == want_ids


def test_the_update_trains_the_adapter_alone_and_the_reference_stays_the_base(base_dir, toy_tokenizer):
    args = lora_args(kl_coef=0.1)
    policy, _, ref = wiring.load_policy(args, base_dir, base_dir, "cpu")
    optimizer = wiring.make_optimizer(args, policy, "cpu")
    batch = a_batch(toy_tokenizer)
    base_logp = logprobs(policy, batch)
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}
    adapter = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    assert adapter and all(p.requires_grad for p in adapter.values())
    update(policy, optimizer, batch, micro_batch_size=2, max_new_tokens=6, kl_coef=0.1, ref_model=ref)
    for name, p in policy.named_parameters():
        if name in frozen:
            assert not p.requires_grad and p.grad is None and torch.equal(p.detach(), frozen[name]), name
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {id(p) for p in adapter.values()}
    assert {id(p) for p in optimizer.state} == {id(p) for p in adapter.values()}
    assert any(p.abs().sum() > 0 for n, p in adapter.items() if "lora_B" in n)   # B moved off 0
    moved = logprobs(policy, batch)
    assert (moved - base_logp).abs().max() > 1e-3                                 # the policy changed ...
    assert torch.equal(logprobs(ref, batch), base_logp)                           # ... its reference did not


def trained_run(tmp_path, base_dir, tok, steps=1):
    """A run folder holding a LoRA checkpoint after `steps` updates; (run folder, policy, optimizer)."""
    args = lora_args()
    torch.manual_seed(0)
    policy, tokenizer, _ = wiring.load_policy(args, base_dir, base_dir, "cpu")
    optimizer = wiring.make_optimizer(args, policy, "cpu")
    for _ in range(steps):
        train_step(policy, optimizer, a_batch(tok))
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint(str(run), steps, lora.Saved(policy), tokenizer, optimizer)
    (run / "config.json").write_text('{"lora_rank": 4}')
    return str(run), policy, optimizer


def test_the_push_and_the_export_hold_the_merged_weights(tmp_path, base_dir, toy_tokenizer):
    from peft import PeftModel

    from harness.run import export

    run, policy, _ = trained_run(tmp_path, base_dir, toy_tokenizer)
    batch = a_batch(toy_tokenizer)
    adapted, base = logprobs(policy, batch), logprobs(load_base(base_dir), batch)
    pushed = load_base(base_dir)
    pushed.load_state_dict(dict(lora.Merged(policy).state_dict().items()))   # base names only, none missing
    torch.testing.assert_close(logprobs(pushed, batch), adapted, rtol=0, atol=1e-5)

    out = export.export_run(run, quiet=True)
    merged = load_base(out)
    assert not any("lora" in k for k in merged.state_dict())
    assert "LoRA adapter of rank 4" in open(os.path.join(out, "README.md"), encoding="utf-8").read()
    rows = policy.get_input_embeddings().weight.shape[0]   # the export adds rows for bytes the toy lacks: left out
    want = log_softmax(policy, batch, rows)
    gap = (log_softmax(merged, batch, rows) - want).abs().max()
    rounding = (log_softmax(load_base(base_dir).to(torch.bfloat16).float(), batch, rows)
                - log_softmax(load_base(base_dir), batch, rows)).abs().max()
    assert gap < 2 * rounding < (base - adapted).abs().max()   # bf16 weights: within their rounding, far from the base
    again = PeftModel.from_pretrained(load_base(base_dir), os.path.join(out, "adapter"))
    assert torch.equal(logprobs(again, batch), adapted)


def test_a_resume_takes_the_next_step_bit_for_bit(tmp_path, base_dir, toy_tokenizer):
    run, policy, optimizer = trained_run(tmp_path, base_dir, toy_tokenizer)
    args = lora_args()
    ckpt = os.path.join(run, "checkpoint")
    resumed, _, _ = wiring.load_policy(args, ckpt, base_dir, "cpu")
    resumed_opt = wiring.make_optimizer(args, resumed, "cpu")
    wiring.restore_checkpoint(ckpt, resumed_opt, "cpu")
    batch = a_batch(toy_tokenizer)
    train_step(policy, optimizer, batch)
    train_step(resumed, resumed_opt, batch)
    want, got = policy.state_dict(), resumed.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_resume_cannot_change_the_adapter(tmp_path, capsys):
    import scope
    from harness.run import preflight

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(asdict(scope.parse_args(["--toy", "--lora-rank", "8"]))))
    with pytest.raises(SystemExit):
        preflight.check_args(scope.parse_args(["--resume", str(run), "--lora-rank", "16", "--change-config"]))
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: --lora-rank 16: {run} trained with 8")


def test_trl_spellings_and_one_line_refusals(capsys):
    import scope
    from harness.run import preflight

    args = scope.parse_args(["--toy", "--use_peft"])
    assert (args.lora_rank, args.lr) == (16, 1e-3)   # TRL's default r; 10 × the toy's --lr unless typed
    assert scope.parse_args(["--use_peft", "--lr", "3e-6"]).lr == 3e-6 and scope.parse_args(["--use_peft"]).lr == 1e-5
    args = scope.parse_args(["--toy", "--lora_r", "8", "--use_peft", "--lora_alpha", "4",
                             "--lora_target_modules", "q_proj", "v_proj"])
    assert (args.lora_rank, args.lora_alpha, args.lora_targets) == (8, 4.0, "q_proj,v_proj")
    recipe = {"use_peft": True, "lora_r": 8, "lora_target_modules": ["q_proj", "v_proj"]}   # a TRL recipe's keys
    args = scope.parse_args(["--toy"] + cli.flags_argv(recipe, {}, "test"))
    assert (args.lora_rank, args.lora_targets) == (8, "q_proj,v_proj")
    for argv, culprit in ((["--lora-alpha", "8"], "--lora-alpha 8.0: only with --lora-rank"),
                          (["--lora_target_modules", "q_proj"], "--lora-targets q_proj: only with --lora-rank"),
                          (["--lora-rank", "-2"], "--lora-rank -2: must be 0"),
                          (["--use_peft", "--fsdp"], "--lora-rank 16: not with --fsdp")):
        with pytest.raises(SystemExit):
            preflight.check_args(scope.parse_args(["--toy", *argv]))
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"error: {culprit}"), err


@pytest.mark.parametrize("targets, culprit", [("embed_tokens", "embed_tokens"), ("lm_head", "lm_head"),
                                              ("nonexistent_proj", "nonexistent_proj"),
                                              ("q_proj,nonexistent_proj", "nonexistent_proj")])
def test_targets_other_than_the_decoders_projections_are_refused_in_one_line(targets, culprit, capsys):
    """Regression: any --lora-targets went to PEFT: an embed_tokens adapter on a tied model was merged into the row
    vLLM samples from while the trained head was not adapted, an lm_head adapter was dropped by the push, a name the
    model lacks stopped with PEFT's text, and q_proj,nonexistent_proj was taken as q_proj."""
    import scope
    from harness.run import preflight

    with pytest.raises(SystemExit) as stopped:
        preflight.check_args(scope.parse_args(["--toy", "--lora-rank", "4", "--lora-targets", targets]))
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --lora-targets {targets}: {culprit} is not one of the decoder's projections")
    for fine in ("q_proj,v_proj", "all-linear", lora.TARGETS):   # the decoder's projections are taken
        preflight.check_args(scope.parse_args(["--toy", "--lora-rank", "4", "--lora-targets", fine]))


def test_the_merged_weights_carry_no_autograd_graph(base_dir, toy_tokenizer):
    """Regression: Merged.items computed W + (α / r) B A with autograd on, one graph (and its saved B, A) per tensor
    the push reads."""
    policy, _, _ = wiring.load_policy(lora_args(), base_dir, base_dir, "cpu")
    for p in policy.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)   # B != 0: the delta is really computed
    merged = dict(lora.Merged(policy).state_dict().items())
    assert merged and all(t.grad_fn is None and not t.requires_grad for t in merged.values())


def test_the_export_of_a_lora_run_casts_its_merge_in_place(tmp_path, base_dir, toy_tokenizer, monkeypatch):
    """Regression: the export merged the adapter in float32, then deep-copied the model before the bf16 cast: two
    float32 copies in memory (~12 GB at 1.5B). The merge it loads is its own, so it is cast in place."""
    import copy

    from harness.run import export

    run, _, _ = trained_run(tmp_path, base_dir, toy_tokenizer)
    real = copy.deepcopy

    def no_model_copy(obj, *a, **k):
        assert not isinstance(obj, torch.nn.Module), "the export copied the model"
        return real(obj, *a, **k)
    monkeypatch.setattr(copy, "deepcopy", no_model_copy)
    out = export.export_run(run, quiet=True)
    assert {t.dtype for t in load_base(out).state_dict().values()} == {torch.float32}   # loaded as asked
    import safetensors.torch
    saved = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
