"""--overlap-old-logp (harness/engines/overlap.py): π_old computed over the rollouts beside the PRM and the refiner.

- the loss reads π_old on the policy's tokens only: a refiner token's (or a padding position's) π_old changes no
  loss, gradient, metric or truncated importance weight, so the reused π_old may hold 0 there;
- the reused π_old equals the update's own pass on every policy token of every row (unchanged rollouts, a repair
  that replaces its failure, one appended beside it, a whole-solution repair); rows whose policy tokens are no
  rollout's prefix give None (the update computes π_old itself);
- a failure in the worker thread is one line in the caller's; an interrupted process waits for the thread;
- `auto` is on only with CUDA, several optimizer steps per batch, no FSDP, a refiner other than the policy and room
  in the memory plan for the pass's working set; `on` where nothing overlaps is refused;
- two toy steps with the flag on and off log the same numbers (slow).
"""
import copy
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from conftest import ROOT, make_char_tokenizer, make_tiny_causal_lm, run_scope

sys.path.insert(0, ROOT)

import grpo  # noqa: E402
from harness.engines import overlap, trainer  # noqa: E402

LOGPROBS = grpo.logprobs_and_entropy   # the engine's log-prob function, as scope.py passes it


def traj(prompt, response):
    return types.SimpleNamespace(prompt_ids=list(prompt), response_ids=list(response))


def test_the_loss_never_reads_old_logp_on_refiner_tokens():
    """policy_loss, its gradient, its metrics and the TIS weight (grpo.truncated_is_weight) are the same
    whatever π_old holds on refiner tokens and off the response: 0 there is as good as the model's value."""
    torch.manual_seed(0)
    resp = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    off = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1]])   # a repair; a whole-solution repair
    on = resp.bool() & ~off.bool()
    old = torch.randn(2, 6)
    garbage = torch.where(on, old, torch.full_like(old, 123.0))   # huge values where the loss must not look
    sampler = torch.randn(2, 6)
    adv = torch.tensor([0.7, -0.4])
    results = []
    for old_logp in (old, garbage):
        logp = (old + 0.3 * torch.randn(2, 6, generator=torch.Generator().manual_seed(1))).requires_grad_()
        is_mask = torch.ones_like(resp).bool() & resp.bool() & ~off.bool()
        weight = grpo.truncated_is_weight(old_logp, {"sampler_logp": sampler, "sampler_mask": torch.ones_like(resp),
                                                     "response_mask": resp, "offpolicy_mask": off}, 2.0)
        loss, terms = grpo.policy_loss(logp, old_logp, adv, resp, off, clip_eps=0.2, max_new_tokens=6,
                                       is_weight=weight)
        loss.backward()
        results.append((loss.detach(), logp.grad, weight, trainer.loss_metrics({**terms, "is_mask": is_mask,
                                                                                 "is_cap": 2.0})))
    (l1, g1, w1, m1), (l2, g2, w2, m2) = results
    assert l1 != 0 and g1.abs().sum() > 0
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    torch.testing.assert_close(w1, w2, rtol=0, atol=0)
    assert m1 == m2


@pytest.fixture(scope="module")
def rollouts_and_merged():
    """Four rollouts of two prompts (different lengths) and the merged rows a step can train on."""
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok, seed=3)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(5, len(tok), (n,), generator=g).tolist()  # noqa: E731
    p0, p1 = rand(7), rand(4)
    trajs = [traj(p0, rand(12)), traj(p0, rand(9)), traj(p1, rand(15)), traj(p1, rand(5))]
    fix = rand(8)   # a refiner's suffix
    merged = [  # (prompt, response, offpolicy mask)
        (p0, trajs[0].response_ids, [0] * 12),                        # a rollout, unchanged
        (p0, trajs[1].response_ids[:4] + fix, [0] * 4 + [1] * 8),     # a repair replacing rollout 1 (kept 4 ids)
        (p1, trajs[2].response_ids, [0] * 15),
        (p1, trajs[3].response_ids, [0] * 5),                          # --merge append: the failure stays ...
        (p1, trajs[3].response_ids[:2] + fix[:5], [0] * 2 + [1] * 5),  # ... and its repair joins the group
        (p0, fix, [1] * 8),                                            # a whole-solution repair (mode replace)
    ]
    batch = grpo.build_batch([m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged],
                             torch.zeros(len(merged)), pad_id=0)
    return model, trajs, batch


def test_reused_old_logp_equals_the_update_pass_on_every_policy_token(rollouts_and_merged):
    """On every position where the loss reads π_old, the rows' π_old computed over the rollouts (other rows, other
    micro-batches, other padding widths) equals the update's own pass over the merged batch to 1e-6 (float32
    reduction order differs with the micro-batch shapes; the values are of order 1-10), and is 0 elsewhere."""
    model, trajs, batch = rollouts_and_merged
    job = overlap.OldLogprobs(model, trajs, 0, logprobs_fn=LOGPROBS, micro_batch_size=3, chunk_tokens=0)
    reused = job.for_batch(batch)
    in_update = trainer.old_logprobs(model, batch, logprobs_fn=LOGPROBS, micro_batch_size=4)
    on = batch["response_mask"].bool() & ~batch["offpolicy_mask"].bool()
    assert reused is not None and reused.shape == in_update.shape
    assert on.sum() == 12 + 4 + 15 + 5 + 2 and in_update[on].abs().min() > 0.1   # the check is not vacuous
    torch.testing.assert_close(reused[on], in_update[on], rtol=0, atol=1e-6)
    assert torch.equal(reused[~on], torch.zeros_like(reused[~on]))
    assert job.seconds > 0 and not job.thread.is_alive()


def test_the_pass_starts_after_every_stream_of_the_device(rollouts_and_merged, monkeypatch):
    """Regression: the side stream waited on an event of the caller's current stream only, while the weights' last
    writer may be another stream (the optimizer's, the push to vLLM, vLLM's own). The whole device is synchronized,
    in the caller's thread, before the worker thread starts. Stand-ins for torch.cuda's calls record the order (no
    GPU here)."""
    import contextlib
    import threading

    model, trajs, _ = rollouts_and_merged
    seen = []

    class Side:
        device = "cuda:0"

        def synchronize(self):
            seen.append(("side stream synchronize", threading.current_thread().name))

    real_old_logprobs = overlap.trainer.old_logprobs
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(
        ("device synchronize", device, threading.current_thread().name)))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(overlap.trainer, "old_logprobs", lambda *a, **k: (
        seen.append(("pass", threading.current_thread().name)), real_old_logprobs(*a, **k))[1])
    job = overlap.OldLogprobs(model, trajs, 0, stream=Side(), logprobs_fn=LOGPROBS, micro_batch_size=3,
                              chunk_tokens=0)
    job.result()
    assert seen == [("device synchronize", "cuda:0", threading.current_thread().name), ("pass", "old-logprobs"),
                    ("side stream synchronize", "old-logprobs")]


def test_a_row_that_is_no_rollouts_prefix_gives_none(rollouts_and_merged):
    model, trajs, batch = rollouts_and_merged
    ids = batch["input_ids"].clone()
    ids[1, 8] = (ids[1, 8] + 1) % 50 + 5   # a kept-prefix token that no rollout has
    job = overlap.OldLogprobs(model, trajs, 0, logprobs_fn=LOGPROBS, micro_batch_size=8, chunk_tokens=0)
    assert job.for_batch({**batch, "input_ids": ids}) is None


def test_a_failure_in_the_thread_is_one_line():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, **kw):
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")

    job = overlap.OldLogprobs(Broken(), [traj([1, 2], [3, 4])], 0, logprobs_fn=LOGPROBS, micro_batch_size=1)
    with pytest.raises(SystemExit) as err:
        job.result()
    message = str(err.value)
    assert "\n" not in message and "RuntimeError: CUDA out of memory." in message
    assert message.startswith("error: the π_old pass") and "--overlap-old-logp off" in message


def test_an_interrupted_process_waits_for_the_thread(tmp_path):
    """The worker is not a daemon: a main thread that stops (Ctrl-C: SystemExit 130) leaves the pass to finish."""
    marker = tmp_path / "done"
    code = (f"import sys, time\nsys.path.insert(0, {ROOT!r})\nimport torch\nfrom harness.engines import overlap, trainer\n"
            f"def slow(model, rows, **kw):\n    time.sleep(1.0)\n    open({str(marker)!r}, 'w').write('x')\n"
            f"    return torch.zeros(1)\n"
            f"trainer.old_logprobs = slow\n"
            f"overlap.OldLogprobs(torch.nn.Linear(1, 1), [], 0)\nraise SystemExit(130)\n")
    code = code.replace("[], 0)", "[type('T', (), {'prompt_ids': [1], 'response_ids': [2]})()], 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert marker.exists()


def test_auto_is_on_only_where_the_pass_exists_and_a_gpu_runs_it():
    args = lambda **kw: types.SimpleNamespace(**{"overlap_old_logp": "auto", "updates_per_batch": 2,  # noqa: E731
                                                 "fsdp": False, "refiner": "Qwen2.5-Math-7B-Instruct", **kw})
    assert overlap.enabled(args(), "cuda:0")
    assert not overlap.enabled(args(refiner="policy"), "cuda:0")   # the in-process refiner: nothing to hide behind
    assert overlap.enabled(args(refiner="policy", overlap_old_logp="on"), "cuda:0")
    assert not overlap.enabled(args(), "cpu")                       # the toy world's records stay as they are
    assert not overlap.enabled(args(updates_per_batch=1), "cuda:0")  # no π_old pass
    assert not overlap.enabled(args(fsdp=True), "cuda:0")
    assert overlap.enabled(args(overlap_old_logp="on"), "cpu")
    assert not overlap.enabled(args(overlap_old_logp="off"), "cuda:0")


@pytest.mark.parametrize("flags, says", [(["--updates-per-batch", "1"], "no π_old pass to overlap")])
def test_on_where_nothing_overlaps_is_refused(tmp_path, flags, says):
    proc = run_scope(["--toy", "--overlap-old-logp", "on", *flags, "--dry-run"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and says in proc.stderr + proc.stdout


@pytest.mark.slow
def test_two_toy_steps_log_the_same_numbers_with_the_overlap_on_and_off(tmp_path, toy_model_dir):
    """--merge append (repairs beside their failures) and two optimizer steps per batch, so the clip acts: every
    logged number but the times is the same to 1e-6 relative. Not exactly: the pass over the rollouts puts other
    rows in a micro-batch than the update's pass over the merged batch, so π_old differs in its last float32 bits
    (observed: the step-2 loss at 2e-8 relative; every count and the reward identical)."""
    rows = {}
    for flag in ("on", "off"):
        run_scope(["--toy", "--model", toy_model_dir, "--run-name", flag, "--overlap-old-logp", flag, "--steps", "2",
                   "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "96", "--micro-batch-size",
                   "6", "--updates-per-batch", "2", "--merge", "append", "--eval-every", "0"], cwd=tmp_path)
        with open(tmp_path / "runs" / flag / "metrics.jsonl") as f:
            rows[flag] = [{k: v for k, v in json.loads(line).items() if not k.startswith("time_")} for line in f]
    assert [r["step"] for r in rows["on"]] == [1, 2] and rows["on"][0]["loss"] != 0
    for on, off in zip(rows["on"], rows["off"]):
        assert on.keys() == off.keys()
        for key, value in on.items():
            if isinstance(value, float):
                assert value == pytest.approx(off[key], rel=1e-6, abs=1e-12), key
            else:
                assert value == off[key], key
    assert os.path.isdir(tmp_path / "runs" / "on")


def test_auto_leaves_the_overlap_off_where_the_plan_would_not_fit_with_it():
    """On a GPU `auto` also needs room for the pass's working set beside the rollout engine, PRM and refiner (the
    memory plan's "other" phase): a card just too small for it gets the run without the overlap; `on` keeps it."""
    import scope
    from harness.plan import memory

    has_pass = lambda rows: any(name.startswith(memory.OLD_LOGP_ROW) for name, _, _ in rows)  # noqa: E731
    args = scope.Args(model="Qwen2.5-1.5B", refiner_url="http://127.0.0.1:9")   # 80 GB: the PRM in the trainer,
    plan = lambda a, gib: memory.memory_plan(a, gib, True, prm_offload=True, prm_serve=False)[0]  # noqa: E731
    assert has_pass(plan(args, 79.2))   # offloaded; a served refiner (--refiner policy: off, overlap.enabled)
    assert not has_pass(plan(scope.Args(**{**vars(args), "refiner": "policy"}), 79.2))
    without = memory.plan_total(plan(scope.Args(**{**vars(args), "overlap_old_logp": "off"}), 79.2))
    with_it = memory.plan_total(plan(scope.Args(**{**vars(args), "overlap_old_logp": "on"}), 79.2))
    assert with_it - without > 1.5   # the pass's ≈ 5 GiB counts in the peak here ("other" is the larger phase)
    row = next(gib for name, gib, _ in plan(args, 79.2) if name.startswith(memory.OLD_LOGP_ROW))
    cached = 2 * memory.n_params(memory.model_config("Qwen2.5-1.5B")) / 2**30   # autocast's bf16 weight copies
    assert cached > 2.8 and row > cached + 1.5   # ≈ 2.9 GiB of copies + ≈ 2 GiB of logits and a log-softmax chunk
    tight = (without + with_it) / 2 / memory.FIT_SHARE   # fits without the pass, not with it
    assert not has_pass(plan(args, tight))
    assert has_pass(plan(scope.Args(**{**vars(args), "overlap_old_logp": "on"}), tight))
    assert not has_pass(plan(scope.Args(**{**vars(args), "updates_per_batch": 1}), 79.2))


def grouped_batch(model_seed: int = 5):
    """A tiny causal LM and 4 groups x 2 rows of random prompts and responses of mixed lengths, advantages ±."""
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok, seed=model_seed).float()
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(5, len(tok), (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(4 + b) for b in range(4) for _ in range(2)]
    responses = [rand(6 + 3 * (i % 3)) for i in range(8)]
    adv = torch.tensor([0.9, -0.9, 0.4, -0.4, 1.0, -1.0, 0.3, -0.3])
    return model, grpo.build_batch(prompts, responses, [None] * 8, adv, pad_id=0), [0, 0, 1, 1, 2, 2, 3, 3]


def test_the_pi_old_pass_covers_mini_batches_2_to_k_only_with_the_same_logprobs(monkeypatch):
    """With --updates-per-batch 2 the no-grad π_old pass runs over the second mini-batch's rows only (the first
    steps before any weight moves: its π_old is its own forward), and it takes its log-probs from the same function
    as the update's forwards (grpo.logprobs_and_entropy, passed down): ρ = 1 where no weight has moved depends on
    the two being one. Micro-batches of 3: π_old's 4 rows are 2 calls without gradients, then the 2 mini-batches'
    4 micro-batches are 4 calls with them."""
    model, batch, groups = grouped_batch()
    no_grad_rows, calls = [], []
    model.register_forward_hook(lambda m, args, kwargs, out: no_grad_rows.append(
        kwargs["input_ids"].shape[0]) if not torch.is_grad_enabled() else None, with_kwargs=True)
    real = grpo.logprobs_and_entropy
    monkeypatch.setattr(grpo, "logprobs_and_entropy", lambda *a: calls.append(torch.is_grad_enabled()) or real(*a))
    grpo.update(model.train(), torch.optim.SGD(model.parameters(), lr=0.1), batch, groups, updates_per_batch=2,
                micro_batch_size=3, chunk_tokens=0, max_new_tokens=12)
    assert sum(no_grad_rows) == 4   # groups 2 and 3, not all 8 rows
    assert calls == [False, False, True, True, True, True]   # π_old's pass, then the update's forwards


def test_an_update_of_two_mini_batches_equals_the_whole_batch_pass():
    """The π_old pass over mini-batches 2..k changes no number: grpo.update with k = 2 ends at the parameters (and
    logs the metrics) of the same two steps taken with π_old of the whole batch from one pass first (two k = 1
    updates, each mini-batch carrying that π_old). Equal to float32 noise, not bit for bit: mini-batch 1's π_old
    is now its own forward, computed in other micro-batches (other rows beside it, other padding widths) than
    the whole batch's pass, so ρ = exp(logp − π_old) is exactly 1 there instead of 1 ± 1e-7."""
    model, batch, groups = grouped_batch()
    reference, ours = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    kw = dict(micro_batch_size=3, chunk_tokens=0, max_new_tokens=12, clip_eps=0.2)
    old = trainer.old_logprobs(reference, batch, logprobs_fn=LOGPROBS, micro_batch_size=3, chunk_tokens=0)
    opt = torch.optim.SGD(reference.parameters(), lr=1.0)   # AdamW would blow float noise on ~0 gradients up
    ref_stats = [grpo.update(reference, opt, mini, **kw)
                 for mini in trainer.group_mini_batches({**batch, "old_logp": old}, groups, 2)]
    stats = grpo.update(ours, torch.optim.SGD(ours.parameters(), lr=1.0), batch, groups, updates_per_batch=2, **kw)
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = torch.cat([p.detach().flatten() for p in reference.parameters()])
    got = torch.cat([p.detach().flatten() for p in ours.parameters()])
    assert (ref - start).abs().max() > 1e-3   # both moved (two steps)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert stats["loss"] == pytest.approx(sum(s["loss"] for s in ref_stats) / 2, rel=1e-5)
    assert stats["ratio_mean"] == pytest.approx(sum(s["ratio_mean"] for s in ref_stats) / 2, rel=1e-6)
