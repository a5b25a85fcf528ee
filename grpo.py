"""GRPO maths for SCOPE: group advantages, the mixed on/off-policy loss, the update, the batch and its log-probs.

SCOPE (Ren et al., arXiv 2602.24110) keeps a failed rollout's prefix (the policy's own, *on-policy* tokens) and
lets a refiner rewrite the rest (*off-policy* tokens); this file credits each token accordingly. Per-token tensors
are (N, L) over the right-padded prompt + response; logp[:, t] = log π(input_ids[:, t] | input_ids[:, :t]), 0 at
position 0 and off the response, π = softmax(logits / T) at the rollout temperature T. Token t of sequence i,
A_i its advantage, π = exp(logp), ε = clip_eps, γ = shaping_gamma:

    group advantage     A_i = r_i − mean_{j in group(i)} r_j             (÷ (std + 1e-6) with scale_std)
    policy tokens       ρ = exp(logp − old_logp),  ℓ = −min(ρ A, clip(ρ, 1 − ε, 1 + ε) A)      PPO clip
    refiner tokens      ℓ = −f(π) A,  f(π) = π / (π + γ)       LUFFY policy shaping (behaviour prob 1, no clip)
      ... unit credit   ℓ = −A · logp                          offpolicy_credit="unit": as if sampled
    sampler mismatch    ℓ ← w·ℓ,  w = min(exp(old_logp − sampler_logp), C)   TIS, policy tokens (vLLM rollouts)
    KL, entropy         k3 = exp(r) − r − 1, r = ref_logp − logp;   H = −Σ_v π_v log π_v
    loss                L = (1/Z) Σ_i Σ_{t in response_i} [ℓ_it + kl_coef·k3_it − entropy_coef·H_it],
                        Z = N × max_new_tokens ("constant", Dr. GRPO) or the response tokens ("token-mean")

Gradients (tested in closed form): a refiner token gives dL/dlogp = −A·γπ/(π+γ)² / Z, largest at π = γ, so
unlikely refiner tokens still teach; a policy token inside the clip range gives −A·ρ / Z, and a clipped one 0.
With one optimizer step per rollout batch ρ = 1 and nothing is clipped; with k steps (`update`, one per
mini-batch of whole groups) the mini-batches after the first train at ρ ≠ 1.

LUFFY (arXiv 2504.14945, its mix_core_alg.py `p_div_p_0.1`), Dr. GRPO (arXiv 2503.20783), PPO (arXiv 1707.06347),
k3: joschu.net/blog/kl-approx.html. The engine under `update`: harness/engines/trainer.py; tests: tests/test_grpo.py;
choices: docs/choices.md ("6 advantages", "7 update"). `# BEGIN/END SOLUTION` mark the course's exercises.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from harness.engines import trainer

LOSS_AGGS, OFFPOLICY_CREDITS = ("constant", "token-mean"), ("shaped", "unit")   # --loss-agg's, --offpolicy-credit's


# ---------------------------------------------------------------------------------------------------
# 6. Advantages: scope.py's step 6, and the phantom-success control
# ---------------------------------------------------------------------------------------------------
def group_advantages(rewards, group_size: int | None = None, scale_std: bool = False, *, groups=None) -> Tensor:
    """Advantages for rewards laid out group by group: (B*G,) → (B*G,).

    A = r − (mean of its group); with `scale_std`, divided by (unbiased std of its group + 1e-6).
    A group whose rewards are all equal gets zero advantages (never NaN), also for a group of one.
    Groups of any size (the merged groups of --merge append): `groups`, each row's group, instead of group_size.
    """
    if groups is not None:  # any sizes: this formula on each group, one at a time, back in the rows' order
        return per_group_advantages(rewards, groups, scale_std)
    r = rewards_in_groups(rewards, group_size)  # (B, G) float; a bad shape is a one-line error
    # BEGIN SOLUTION group_advantages
    # GRPO group-relative advantage (DeepSeekMath eq. 3 without std; Dr. GRPO)
    adv = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if scale_std:
        if group_size > 1:
            std = r.std(dim=1, keepdim=True)  # (B, 1) unbiased
        else:
            std = torch.zeros_like(r)  # a group of one has no spread; its advantage is 0 anyway
        adv = adv / (std + 1e-6)  # (B, G)
    return adv.reshape(-1)  # (B*G,)
    # END SOLUTION


def per_group_advantages(rewards, groups: list, scale_std: bool = False) -> Tensor:
    """`group_advantages` of each group of `groups` (each row's group; any sizes, any order) as one group of its
    own size; the results back in the rows' order, (N,)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)  # (N,)
    out = torch.zeros_like(rewards)  # (N,)
    for g in dict.fromkeys(groups):
        rows = torch.tensor([i for i, h in enumerate(groups) if h == g])
        out[rows] = group_advantages(rewards[rows], len(rows), scale_std)
    return out


def rewards_in_groups(rewards, group_size: int | None) -> Tensor:
    """`group_advantages`' input as a float (B, G) tensor: rewards (B*G,) laid out group by group; a shape that does
    not split into groups is a one-line error."""
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if rewards.dim() != 1:
        raise ValueError(f"group_advantages: rewards must be 1-D (B*G,), got shape {tuple(rewards.shape)}")
    if group_size is None or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"group_advantages: {rewards.numel()} rewards do not split into groups of "
                         f"group_size={group_size}")
    return rewards.view(-1, group_size)  # (B, G)


def zero_repair_advantages(trajs: list, advantages: Tensor) -> Tensor:
    """--repair-advantage zero, the phantom-success control: the accepted repairs already counted in their groups'
    means; here their own advantage becomes 0, so no gradient flows through their tokens while the group's other
    rollouts keep the shifted baseline. trajs: refine.Trajectory, a repair's source not "policy"; advantages: (N,)."""
    return advantages * advantages.new_tensor([t.source == "policy" for t in trajs])   # (N,)


# ---------------------------------------------------------------------------------------------------
# 7.1 The loss, one term per function
# ---------------------------------------------------------------------------------------------------
def clipped_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                      clip_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clip → (per-token loss, ρ, clipped), each (N, L), 0 / 1 / False off the mask (log-ratio zeroed there)."""
    # BEGIN SOLUTION clipped_surrogate
    mask = mask.bool()  # (N, L)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)
    log_ratio = torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp))  # (N, L)
    ratio = torch.exp(log_ratio)  # (N, L) PPO importance ratio ρ
    surr = ratio * adv  # (N, L)
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv  # (N, L)
    loss = torch.where(mask, -torch.min(surr, surr_clipped), torch.zeros_like(logp))  # (N, L)
    clipped = (-surr_clipped > -surr) & mask  # (N, L) the clipped branch is active
    return loss, ratio, clipped
    # END SOLUTION


def shaped_offpolicy_loss(logp: Tensor, advantages: Tensor, mask: Tensor,
                          shaping_gamma: float) -> tuple[Tensor, Tensor]:
    """LUFFY shaping → (per-token loss −f(π)·A, f(π)), each (N, L), 0 off the mask; behaviour prob 1, no clip."""
    # BEGIN SOLUTION shaped_offpolicy
    mask = mask.bool()  # (N, L)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)
    prob = torch.exp(torch.where(mask, logp, torch.zeros_like(logp)))  # (N, L) π, 1 off the mask
    shaped = torch.where(mask, prob / (prob + shaping_gamma), torch.zeros_like(prob))  # (N, L) f(π)
    return -shaped * adv, shaped
    # END SOLUTION


def unit_offpolicy_loss(logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Unit credit (--offpolicy-credit unit): per-token loss −A·logp, (N, L), 0 off the mask."""
    mask = mask.bool()  # (N, L)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)
    return -torch.where(mask, logp, torch.zeros_like(logp)) * adv  # (N, L)


def k3_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """k3 KL per token, exp(r) − r − 1 with r = ref_logp − logp: (N, L), 0 off the mask; ref_logp a constant."""
    r = torch.where(mask.bool(), ref_logp.detach() - logp, torch.zeros_like(logp))  # (N, L)
    return torch.exp(r) - r - 1.0  # (N, L)


def truncated_is_weight(old_logp: Tensor, batch: dict, cap: float) -> Tensor | None:
    """TIS: vLLM's kernels give a sampled token a π_sampler a little off the trainer's π_old, so each policy token
    whose sampler log-prob is known weighs w = min(exp(old_logp − sampler_logp), C), detached; 1 elsewhere.
    → (N, L), or None when off (cap 0) or without sampler log-probs (HF generate has none)."""
    if cap <= 0 or "sampler_logp" not in batch:
        return None
    if cap < 1:
        raise ValueError(f"truncated_is_weight: cap must be >= 1 (a cap below 1 scales every token down), got {cap}")
    known = tis_tokens(batch)  # (N, L)
    log_ratio = old_logp.detach() - batch["sampler_logp"].to(old_logp.dtype)  # (N, L)
    return torch.clamp(torch.where(known, log_ratio, torch.zeros_like(log_ratio)).exp(), max=cap)  # (N, L)


def tis_tokens(batch: dict) -> Tensor:
    """The tokens that carry the TIS weight, (N, L) bool: the policy's response tokens whose sampler log-prob is
    known (the weight's and its metrics' one definition)."""
    return batch["sampler_mask"].bool() & batch["response_mask"].bool() & ~batch["offpolicy_mask"].bool()


def loss_normaliser(response_mask: Tensor, loss_agg: str, max_new_tokens) -> float:
    """Z of the batch one optimizer step trains on (in `update`: its mini-batch, every micro-batch of it):
    N × max_new_tokens ("constant") or the response-token count ("token-mean", ≥ 1)."""
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if loss_agg == "constant" and (max_new_tokens is None or max_new_tokens <= 0):
        raise ValueError(f"loss_agg='constant' needs max_new_tokens > 0, got {max_new_tokens!r}")
    # BEGIN SOLUTION policy_loss
    if loss_agg == "constant":
        return float(response_mask.shape[0] * max_new_tokens)  # Dr. GRPO constant normaliser
    return max(float(response_mask.bool().sum()), 1.0)  # masked token mean; an empty batch sums to 0 anyway
    # END SOLUTION


# ---------------------------------------------------------------------------------------------------
# 7.2 The loss: the terms composed
# ---------------------------------------------------------------------------------------------------
def policy_loss(logp, old_logp, advantages, response_mask, offpolicy_mask, *, clip_eps=0.2,
                shaping_gamma=0.1, loss_agg="constant", max_new_tokens=None, z=None, ref_logp=None, kl_coef=0.0,
                entropy=None, entropy_coef=0.0, offpolicy_credit="shaped", is_weight=None) -> tuple[Tensor, dict]:
    """The SCOPE loss L above → (L, its per-token terms, detached, for the metrics). z: None = this batch's
    `loss_normaliser`; is_weight: the truncated importance weight of the policy's tokens (None = 1)."""
    trainer.check_loss_inputs(logp, advantages, offpolicy_credit, OFFPOLICY_CREDITS, old_logp=old_logp,
                              response_mask=response_mask, offpolicy_mask=offpolicy_mask, ref_logp=ref_logp,
                              entropy=entropy, is_weight=is_weight)
    z = loss_normaliser(response_mask, loss_agg, max_new_tokens) if z is None else z
    resp = response_mask.bool()  # (N, L)
    off = offpolicy_mask.bool() & resp  # (N, L) refiner tokens
    on = resp & ~off  # (N, L) policy tokens
    shaped = kl = None
    # BEGIN SOLUTION policy_loss
    on_loss, ratio, clipped = clipped_surrogate(logp, old_logp, advantages, on, clip_eps)  # (N, L) each
    if is_weight is not None:  # truncated importance sampling against the sampler (policy tokens only)
        on_loss = on_loss * torch.where(on, is_weight.detach(), torch.ones_like(on_loss))  # (N, L)
    if offpolicy_credit == "shaped":  # LUFFY: −f(π)·A
        off_loss, shaped = shaped_offpolicy_loss(logp, advantages, off, shaping_gamma)  # (N, L) each
    else:  # unit: the refiner's tokens as if the policy had sampled them, −A·log π
        off_loss = unit_offpolicy_loss(logp, advantages, off)  # (N, L)
    per_token = torch.where(off, off_loss, on_loss)  # (N, L)
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp, resp)  # (N, L)
        per_token = per_token + kl_coef * kl
    if entropy is not None:  # entropy bonus: subtracted, so minimising the loss raises the entropy
        entropy = torch.where(resp, entropy, torch.zeros_like(entropy))  # (N, L)
        per_token = per_token - entropy_coef * entropy
    loss = torch.where(resp, per_token, torch.zeros_like(per_token)).sum() / z  # L = (1/Z) Σ_i Σ_t ℓ_it
    # END SOLUTION
    terms = dict(on=on, off=off, ratio=ratio, clipped=clipped, shaped=shaped, kl=kl, entropy=entropy,
                 is_weight=is_weight)
    return loss, {k: v if v is None else v.detach() for k, v in terms.items()}


# ---------------------------------------------------------------------------------------------------
# 7.3 The update: k optimizer steps per rollout batch (scope.py's step 7)
# ---------------------------------------------------------------------------------------------------
def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """The learning rate of training step `step` (from 1): lr · min(1, step / warmup_steps), a linear warm-up to
    `lr` over the first `warmup_steps` steps; `lr` throughout when warmup_steps is 0."""
    return lr * min(1.0, step / warmup_steps) if warmup_steps else lr


def update(model, optimizer, batch: dict, groups: list[int] | None = None, *, updates_per_batch: int = 1,
           clip_eps=0.2, shaping_gamma=0.1, loss_agg="constant", max_new_tokens=None, kl_coef=0.0, ref_model=None,
           entropy_coef=0.0, offpolicy_credit="shaped", tis_cap=0.0, temperature=1.0, max_grad_norm=1.0, lr=None,
           amp=contextlib.nullcontext, **engine) -> dict:
    """k = `updates_per_batch` optimizer steps, one per mini-batch of whole `groups` (each row's group), in order.
    The first one steps before any weight moved, so its π_old is its own forward (ρ = 1): mini_batches drops its
    "old_logp" (a k = 1 batch has one only if the caller gives it; scope.py never does: --overlap-old-logp needs k > 1).
    π at the rollout `temperature`; the gradient clipped to `max_grad_norm` (the paper's 1.0); each micro-batch's
    loss ÷ its mini-batch's Z; `ref_model`: the KL reference (kl_coef > 0 without batch["ref_logp"]); `lr`: the k
    steps' learning rate (None: the optimizer's). π_old's pass, the forwards and the KL reference all take their
    log-probs from `logprobs_and_entropy`. `engine`, `amp` and the metrics (means over the k steps):
    harness/engines/trainer.py."""
    trainer.set_learning_rate(optimizer, lr)   # scope.py: `warmup_lr` of the step; None: as it is
    stats = []
    minis = trainer.mini_batches(model, batch, groups, updates_per_batch, logprobs_and_entropy, amp=amp,
                                 temperature=temperature, **engine)  # k > 1: π_old's no-grad pass on 2..k first
    for mini in minis:
        # the engine of one optimizer step; step.z: this mini-batch's Z (torchrun: all ranks' sum ÷ world)
        step = trainer.Step(model, optimizer, mini, loss_normaliser(mini["response_mask"], loss_agg, max_new_tokens),
                            logprobs_fn=logprobs_and_entropy, tis_tokens=tis_tokens, ref_model=ref_model,
                            kl_coef=kl_coef, tis_cap=tis_cap, temperature=temperature, **engine)
        for part in step.micro_batches():  # length-sorted; DDP exchanges gradients after the last one
            # BEGIN SOLUTION update
            with amp():  # around the forward and the loss only
                logp, entropy = step.forward(part, entropy_grad=entropy_coef != 0)  # (n, L) each
                # π_old: the batch's (a pass before any weight moved: the engine's or mini_batches'), else ρ = 1
                old_logp = part.get("old_logp", logp.detach())
                is_weight = truncated_is_weight(old_logp, part, tis_cap)  # (n, L) TIS vs vLLM's sampler, or None
                loss, terms = policy_loss(logp, old_logp, part["advantages"], part["response_mask"],
                                          part["offpolicy_mask"], z=step.z, clip_eps=clip_eps, kl_coef=kl_coef,
                                          shaping_gamma=shaping_gamma, offpolicy_credit=offpolicy_credit,
                                          ref_logp=step.reference_logprobs(part), entropy=entropy,
                                          entropy_coef=entropy_coef, is_weight=is_weight)
            # END SOLUTION
            step.backward(loss, terms)  # the loss is already ÷ Z (z=step.z above): backward adds no scale
        if step.clip_gradients(max_grad_norm):  # False: a non-finite loss or gradient norm, on any rank
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stats.append(step.metrics())
    return trainer.mean_metrics(stats)


# ---------------------------------------------------------------------------------------------------
# The batch and its token log-probs
# ---------------------------------------------------------------------------------------------------
def build_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], offpolicy_mask: list[list[int]],
                advantages: Tensor, pad_id: int) -> dict[str, Tensor]:
    """Right-padded (N, L) tensors for `token_logprobs` / `update`.

    Row i is prompt_ids[i] + response_ids[i] + padding. `response_mask` is 1 on the response tokens and
    `offpolicy_mask` is 1 where `offpolicy_mask[i]` marks a refiner token (None: none), both aligned with
    input_ids positions. All masks are int64 0/1. `advantages` is returned as a float32 (N,) tensor.
    """
    trainer.check_batch_inputs(prompt_ids, response_ids, offpolicy_mask, advantages)
    n = len(prompt_ids)
    advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)  # (N,)
    # a missing mask (Trajectory's default None) means an all on-policy response
    offpolicy_mask = [[0] * len(r) if m is None else m for r, m in zip(response_ids, offpolicy_mask)]
    # BEGIN SOLUTION build_batch
    length = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)  # (N, L)
    attention_mask = torch.zeros((n, length), dtype=torch.long)  # (N, L)
    response_mask = torch.zeros((n, length), dtype=torch.long)  # (N, L)
    off_mask = torch.zeros((n, length), dtype=torch.long)  # (N, L)
    for i, (p, r, m) in enumerate(zip(prompt_ids, response_ids, offpolicy_mask)):
        a, b = len(p), len(p) + len(r)
        input_ids[i, :b] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention_mask[i, :b] = 1
        response_mask[i, a:b] = 1
        if len(r):
            off_mask[i, a:b] = torch.tensor([1 if x else 0 for x in m], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
            "offpolicy_mask": off_mask, "advantages": advantages}
    # END SOLUTION


def entropy_from_logprobs(logprobs_all: Tensor) -> Tensor:
    """Entropy of each next-token distribution: (..., V) log-probs → (...).

    H = −Σ_v π_v log π_v, from log-probs (e.g. a log_softmax output, finite everywhere).
    """
    # BEGIN SOLUTION logprob_entropy
    return -(logprobs_all.exp() * logprobs_all).sum(dim=-1)  # (...) entropy H = −Σ p log p
    # END SOLUTION


def logprobs_and_entropy(logits: Tensor, targets: Tensor, entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """The per-token core: (n, T, V) logits and (n, T) target ids → (log π(target), entropy), both (n, T).

    logits[:, t] is the distribution that produced targets[:, t] (the caller shifts by one). Computed in
    float32 (bf16/fp16 logits are upcast; float64 stays float64). The entropy carries a graph only when
    `entropy_grad` (an entropy bonus is on), so no extra (n, T, V) tensor is kept for the backward pass.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # log_softmax over a large vocabulary needs float32
    # BEGIN SOLUTION logprob_entropy
    logprobs_all = F.log_softmax(logits, dim=-1)  # (n, T, V) log π(v | context)
    taken = logprobs_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (n, T) log π(target)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logprobs(logprobs_all if entropy_grad else logprobs_all.detach())  # (n, T)
    return taken, entropy
    # END SOLUTION


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor, micro_batch_size: int,
                   chunk_tokens: int = 512, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(logp, entropy), both (N, L), 0 off the response, of `model` at `temperature` without gradients (benchmarks,
    tests): `logprobs_and_entropy` through trainer.token_logprobs, as trainer.Step's KL reference calls it."""
    return trainer.token_logprobs(model, input_ids, attention_mask, response_mask, micro_batch_size, chunk_tokens,
                                  temperature, logprobs_fn=logprobs_and_entropy)
