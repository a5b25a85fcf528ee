"""GRPO maths for SCOPE: group advantages, the mixed on/off-policy loss, the update, token log-probs.

SCOPE (Ren et al., "Recycling Failures: Salvaging Exploration in RLVR via Fine-Grained Off-Policy
Guidance", arXiv 2602.24110) repairs a failed rollout by keeping the policy's own correct prefix and
letting a refiner rewrite the rest. In the update the kept prefix is *on-policy* text (sampled by the
policy) and the refiner's suffix is *off-policy* text. This file credits each token accordingly. Pure
tensor code: no text, no PRM, no vLLM; the only model calls are the forward passes for log-probs.

Run the tests: `python -m pytest tests/test_grpo.py -q`. The file reads in the order of the step: the
equations below; `group_advantages` (step 6); the loss terms, one public function each (`clipped_surrogate`,
`shaped_offpolicy_loss`, `unit_offpolicy_loss`, `k3_kl`, `loss_normaliser`); `policy_loss`, which composes
them; `update`, one optimizer step that calls it per micro-batch; `update_epoch`, the --updates-per-batch
steps on one rollout batch, with π_old from `old_logprobs` (step 7); then the batch layout and the log-probs
(`build_batch`, `logprobs_and_entropy`, `token_logprobs`) and, under the last banner, the plumbing (importance
weights, metrics, micro-batches, mini-batches). The `# BEGIN SOLUTION` / `# END SOLUTION` comments mark what
`tools/exercises.py` turns into student exercises.

Conventions. Every per-token tensor is (N, L) over the whole right-padded prompt + response sequence.
`logp[:, t] = log π(input_ids[:, t] | input_ids[:, :t])`; position 0 (nothing predicts it) and every
position outside the response are 0. π is the distribution the rollouts were sampled from: softmax(logits / T)
at the rollout temperature T (`temperature`, 1 by default), as TRL computes it, so that vLLM's processed
log-probs and the trainer's agree at any T. `response_mask` is 1 on response tokens, `offpolicy_mask` is 1 on
the refiner's tokens (a subset of the response).

Equations (token t of sequence i, A_i its advantage, π = exp(logp), ε = clip_eps, γ = shaping_gamma):

    group advantage        A_i = r_i − mean_{j in group(i)} r_j             (÷ (std + 1e-6) with scale_std)
    on-policy tokens       ρ = exp(logp − old_logp)                         π_old: before the batch's first step
                           ℓ_it = −min(ρ A_i, clip(ρ, 1 − ε, 1 + ε) A_i)       PPO clipped surrogate
    off-policy tokens      ℓ_it = −f(π) A_i,   f(π) = π / (π + γ)              LUFFY policy shaping,
                                                                               behaviour prob = 1, no clip
    ... or, unit credit     ℓ_it = −A_i · logp_it                           offpolicy_credit="unit": as if sampled
    sampler mismatch       w_it = min(exp(old_logp − sampler_logp), C)      truncated importance sampling on the
                           ℓ_it ← w_it · ℓ_it  on on-policy tokens          policy's tokens (vLLM rollouts, C = tis_cap)
    KL (optional)          k3_it = exp(r) − r − 1,   r = ref_logp − logp      k3 estimator (Schulman)
    entropy (optional)     H_it = −Σ_v π_v log π_v  of the distribution that produced token t
    loss                   L = (1/Z) Σ_i Σ_{t in response_i} [ ℓ_it + kl_coef·k3_it − entropy_coef·H_it ]
                           Z = N × max_new_tokens              ("constant", Dr. GRPO)
                           Z = number of response tokens        ("token-mean")

Gradients worth knowing (the tests check them in closed form): an off-policy token gives
dL/dlogp = −A·γπ/(π+γ)² / Z, largest at π = γ, so low-probability refiner tokens are not ignored the
way a plain π-weighted term would ignore them; an on-policy token inside the clip range gives −A·ρ / Z,
and a clipped one gives 0. With one optimizer step per rollout batch ρ = 1 and nothing is clipped; with k
steps (one per mini-batch of whole groups, `update_epoch`) the mini-batches after the first train at ρ ≠ 1.

References:
  SCOPE  arXiv 2602.24110 (only its abstract, captions and tables are public);
  LUFFY  "Learning to Reason under Off-Policy Guidance", Yan et al., arXiv 2504.14945, and its code
         (ElliottYan/LUFFY, luffy/verl/verl/mix_src/mix_core_alg.py: policy shaping `p_div_p_0.1`);
  Dr. GRPO  "Understanding R1-Zero-Like Training: A Critical Perspective", Liu et al., arXiv 2503.20783;
  PPO    Schulman et al., arXiv 1707.06347;  k3 KL estimator: joschu.net/blog/kl-approx.html.

Choices (each is a keyword argument, so a flag in scope.py): no std in the advantage, the Dr. GRPO
constant normaliser over the whole batch, γ = 0.1, ε = 0.2, behaviour probability 1 on refiner tokens, no
KL or entropy bonus, a non-finite step skipped, k optimizer steps per rollout batch with π_old from one
no-grad pass (none for k = 1), a truncated importance weight
min(π_old/π_vLLM, C) on the policy's own tokens when vLLM sampled them (`truncated_is_weight`), float32
log-probs one micro-batch at a time and, within it, `chunk_tokens` positions at a time, recomputed in the
backward pass (`chunked_logprobs_and_entropy`), micro-batches of length-sorted rows
(`length_sorted_micro_batches`). Each is explained once, with its reason, in docs/choices.md (rows
"6 advantages" and "7 update").
"""
import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


LOSS_AGGS = ("constant", "token-mean")


# ---------------------------------------------------------------------------------------------------
# 6. Advantages
# ---------------------------------------------------------------------------------------------------
def group_advantages(rewards, group_size: int, scale_std: bool = False) -> Tensor:
    """Advantages for rewards laid out group by group: (B*G,) → (B*G,).

    A = r − (mean of its group); with `scale_std`, divided by (unbiased std of its group + 1e-6).
    A group whose rewards are all equal gets zero advantages (never NaN), also for a group of one.
    Ragged groups: call once per group with `group_size=len(rewards)`.
    """
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if rewards.dim() != 1:
        raise ValueError(f"group_advantages: rewards must be 1-D (B*G,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"group_advantages: {rewards.numel()} rewards do not split into groups of "
                         f"group_size={group_size}")
    r = rewards.view(-1, group_size)  # (B, G)
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


# ---------------------------------------------------------------------------------------------------
# 7. The loss, one term per function
# ---------------------------------------------------------------------------------------------------
def clipped_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                      clip_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate on the policy's own tokens: ℓ = −min(ρ A, clip(ρ, 1 − ε, 1 + ε) A), ρ = π/π_old.

    logp, old_logp, mask: (N, L); advantages: (N,). Returns (per-token loss, ratio ρ, clipped), all
    (N, L) and 0 / 1 / False where `mask` is 0; `clipped` marks tokens on the clipped branch (zero
    gradient). The log-ratio is zeroed off the mask BEFORE exp, so junk or inf in old_logp there cannot
    become a 0·inf = NaN gradient. old_logp is treated as a constant.
    """
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
    """LUFFY policy shaping on the refiner's tokens: ℓ = −f(π) A with f(π) = π / (π + γ).

    The behaviour probability is taken as 1 and nothing is clipped. logp, mask: (N, L); advantages: (N,).
    Returns (per-token loss, f(π)), both (N, L) and 0 where `mask` is 0. Its gradient w.r.t. logp is
    −A γπ/(π+γ)², largest at π = γ; the unit-weight variant is `unit_offpolicy_loss`.
    """
    # BEGIN SOLUTION shaped_offpolicy
    mask = mask.bool()  # (N, L)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)
    prob = torch.exp(torch.where(mask, logp, torch.zeros_like(logp)))  # (N, L) π, 1 off the mask
    shaped = torch.where(mask, prob / (prob + shaping_gamma), torch.zeros_like(prob))  # (N, L) f(π)
    return -shaped * adv, shaped
    # END SOLUTION


def unit_offpolicy_loss(logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Unit credit on the refiner's tokens (`--offpolicy-credit unit`): ℓ = −A log π, as if the policy had
    sampled them (no importance weight, no shaping). Its gradient w.r.t. logp is −A on every masked token,
    where the shaping gives −A γπ/(π+γ)² ≤ A/4 (≈ 0.10 A at π = 0.77, γ = 0.1). logp, mask: (N, L);
    advantages: (N,). Returns the per-token loss (N, L), 0 where `mask` is 0."""
    mask = mask.bool()  # (N, L)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)
    return -torch.where(mask, logp, torch.zeros_like(logp)) * adv  # (N, L)


def k3_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """k3 KL estimator per token: exp(r) − r − 1 with r = ref_logp − logp (≥ 0; Schulman). (N, L), 0 off
    the mask; ref_logp is a constant."""
    r = torch.where(mask.bool(), ref_logp.detach() - logp, torch.zeros_like(logp))  # (N, L)
    return torch.exp(r) - r - 1.0  # (N, L)


def loss_normaliser(response_mask: Tensor, loss_agg: str, max_new_tokens) -> float:
    """Z of the loss: N × max_new_tokens ("constant", Dr. GRPO) or the number of response tokens
    ("token-mean", at least 1). Always over the WHOLE batch, never per micro-batch."""
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
# 7. The loss: the terms composed
# ---------------------------------------------------------------------------------------------------
def policy_loss(logp, old_logp, advantages, response_mask, offpolicy_mask, *, clip_eps=0.2,
                shaping_gamma=0.1, loss_agg="constant", max_new_tokens=None, z=None, ref_logp=None, kl_coef=0.0,
                entropy=None, entropy_coef=0.0, offpolicy_credit="shaped", is_weight=None) -> tuple[Tensor, dict]:
    """The SCOPE token loss L (the module docstring's equations): `clipped_surrogate` on the policy's own
    tokens, `shaped_offpolicy_loss` on the refiner's (or `unit_offpolicy_loss` with offpolicy_credit="unit"),
    optional `k3_kl` and entropy bonus, summed over response tokens and divided by Z.

    logp, old_logp, response_mask, offpolicy_mask, ref_logp, entropy: (N, L); advantages: (N,).
    z: the normaliser; None = `loss_normaliser` of this batch (`update` passes the whole batch's Z to every
    micro-batch). is_weight: (N, L) per-token weights of the policy's tokens' surrogate (`truncated_is_weight`;
    None = 1), treated as constants. Returns (scalar loss with gradient through logp and entropy, terms):
    `terms` holds the detached per-token tensors the metrics are made of, for `loss_metrics` (f(π) only
    under shaped credit).
    """
    _check_loss_inputs(logp, advantages, offpolicy_credit, old_logp=old_logp, response_mask=response_mask,
                       offpolicy_mask=offpolicy_mask, ref_logp=ref_logp, entropy=entropy, is_weight=is_weight)
    if z is None:
        z = loss_normaliser(response_mask, loss_agg, max_new_tokens)
    resp = response_mask.bool()  # (N, L)
    off = offpolicy_mask.bool() & resp  # (N, L) refiner tokens
    on = resp & ~off  # (N, L) policy tokens
    kl = None
    # BEGIN SOLUTION policy_loss
    on_loss, ratio, clipped = clipped_surrogate(logp, old_logp, advantages, on, clip_eps)  # (N, L) each
    if is_weight is not None:  # truncated importance sampling against the sampler (policy tokens only)
        on_loss = on_loss * torch.where(on, is_weight.detach(), torch.ones_like(on_loss))  # (N, L)
    if offpolicy_credit == "shaped":  # LUFFY: −f(π)·A
        off_loss, shaped = shaped_offpolicy_loss(logp, advantages, off, shaping_gamma)  # (N, L) each
    else:  # unit: the refiner's tokens as if the policy had sampled them, −A·log π
        off_loss, shaped = unit_offpolicy_loss(logp, advantages, off), None  # (N, L)
    per_token = torch.where(off, off_loss, on_loss)  # (N, L)
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp, resp)  # (N, L)
        per_token = per_token + kl_coef * kl
    if entropy is not None:  # entropy bonus: subtracted, so minimising the loss raises the entropy
        entropy = torch.where(resp, entropy, torch.zeros_like(entropy))  # (N, L)
        per_token = per_token - entropy_coef * entropy
    per_token = torch.where(resp, per_token, torch.zeros_like(per_token))  # (N, L) response tokens only
    loss = per_token.sum() / z  # L = (1/Z) Σ_i Σ_t ℓ_it
    # END SOLUTION
    terms = {"on": on, "off": off, "ratio": ratio.detach(), "clipped": clipped,
             "shaped": None if shaped is None else shaped.detach(),
             "kl": None if kl is None else kl.detach(), "entropy": None if entropy is None else entropy.detach(),
             "is_weight": None if is_weight is None else is_weight.detach()}
    return loss, terms


# ---------------------------------------------------------------------------------------------------
# 7. The update: one optimizer step, and several per rollout batch
# ---------------------------------------------------------------------------------------------------
def update(model, optimizer, batch: dict, *, micro_batch_size: int, max_grad_norm=1.0, clip_eps=0.2,
           shaping_gamma=0.1, loss_agg="constant", max_new_tokens=None, kl_coef=0.0, entropy_coef=0.0,
           ref_model=None, offpolicy_credit="shaped", tis_cap=0.0, dist=None, chunk_tokens: int = 512,
           amp=contextlib.nullcontext, temperature: float = 1.0) -> dict:
    """One optimizer step on `batch`: `policy_loss` micro-batch by micro-batch, gradients accumulated.

    batch: input_ids, attention_mask, response_mask, offpolicy_mask (N, L), advantages (N,), optionally
    old_logp and ref_logp (N, L). Without old_logp (one optimizer step per rollout batch) the old log-probs
    are this forward's own, detached: ρ = 1 exactly, the gradient of a separate no-grad pass without the pass
    (`update_epoch` passes old_logp when a rollout batch gets several steps). Each micro-batch's loss is
    divided by the WHOLE batch's Z, so the accumulated gradient is the batch's. Gradients are clipped to
    `max_grad_norm` (None: no clipping); a non-finite loss or gradient norm skips the step (gradients zeroed,
    parameters untouched). Returns Python-float metrics: loss, grad_norm, skipped, pad_share (padding share of
    this rank's computed positions) and `loss_metrics` of the whole batch.

    Around the method, each in its helper below: KL reference log-probs from `ref_model` when kl_coef > 0 and
    no ref_logp (`_reference_logprobs`); the truncated importance weight against vLLM's log-probs with
    tis_cap > 0 (`_sampler_weights`); length-sorted micro-batches and, under torchrun, a zero-weight padding
    micro-batch (`_micro_batch`) and one gradient exchange (`_gradient_exchange`); `chunk_tokens` bounds the
    float32 log-softmax (`chunked_logprobs_and_entropy`); log-probs are of softmax(logits / `temperature`), the
    rollouts' distribution. `amp` (e.g. bf16 autocast) is entered around each
    micro-batch's forward and loss only, so autocast's bf16 weight copies are freed after every forward
    (docs/memory.md). Under torchrun (`dist`, harness/dist.py) `batch` is this rank's rows; Z, the loss and the
    metrics are the global batch's (Z summed over the ranks ÷ the world size, as DDP and FSDP2 average the
    gradients), so the skip decision is the same on every rank.
    """
    if kl_coef > 0 and batch.get("ref_logp") is None and ref_model is None:
        raise ValueError("update: kl_coef > 0 needs batch['ref_logp'] or ref_model")
    extents = _row_extents(batch["input_ids"], batch["attention_mask"], batch["response_mask"], "update")
    z = loss_normaliser(batch["response_mask"], loss_agg, max_new_tokens)  # over the whole batch
    device = next(model.parameters()).device
    mb = max(1, int(micro_batch_size))
    micro_batches = length_sorted_micro_batches(extents, mb)
    n_micro = len(micro_batches)
    if dist is not None:  # Z of the global batch; ÷ world: the ranks' gradients are averaged, not summed
        z = dist.sum(z) / dist.world
        n_micro = int(dist.max(n_micro))  # the same count on every rank: FSDP all-gathers in every forward

    optimizer.zero_grad(set_to_none=True)
    loss_total, parts = 0.0, []
    for i in range(n_micro):
        part, keep, padding = _micro_batch(batch, micro_batches, i, extents, device)  # padding: zero weight
        with _gradient_exchange(model, dist, last=i == n_micro - 1):  # DDP: once per step, on the last
            # BEGIN SOLUTION update
            with amp():  # around the forward and the loss only
                logp, entropy = _forward_logprobs(model, part["input_ids"], part["attention_mask"],
                                                  part["response_mask"], entropy_grad=entropy_coef != 0,
                                                  keep=keep, chunk_tokens=chunk_tokens,
                                                  temperature=temperature)  # (n, L) each
                old_logp = part.get("old_logp")
                if old_logp is None:
                    old_logp = logp.detach()  # one optimizer step per rollout batch: ρ = 1 exactly
                ref_logp = _reference_logprobs(part, ref_model, kl_coef, mb, chunk_tokens,
                                               temperature)  # None without KL
                is_weight, is_mask = _sampler_weights(part, old_logp, tis_cap)  # None without vLLM log-probs
                loss, terms = policy_loss(logp, old_logp, part["advantages"], part["response_mask"],
                                          part["offpolicy_mask"], clip_eps=clip_eps, shaping_gamma=shaping_gamma,
                                          z=z, ref_logp=ref_logp, kl_coef=kl_coef, entropy=entropy,
                                          entropy_coef=entropy_coef, offpolicy_credit=offpolicy_credit,
                                          is_weight=is_weight)
            # END SOLUTION
            (loss * 0.0 if padding else loss).backward()  # ÷ the whole batch's Z: the full-batch gradient
        if not padding:
            loss_total += float(loss.detach())
            parts.append(terms if is_weight is None else {**terms, "is_mask": is_mask, "is_cap": float(tis_cap)})

    clip_to = float("inf") if max_grad_norm is None else float(max_grad_norm)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_to)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # FSDP2: DTensor
    terms = join_terms(parts)
    if dist is not None:  # the global batch's loss and metrics; a non-finite loss anywhere skips everywhere
        loss_total = dist.mean(loss_total)
        terms = join_terms(dist.all_gather(terms))
    skipped = not (math.isfinite(loss_total) and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # a skipped step leaves parameters and optimizer state untouched
    return {"loss": loss_total, "grad_norm": grad_norm, "skipped": float(skipped),
            "pad_share": padding_share(extents, micro_batches), **loss_metrics(terms)}


def update_epoch(model, optimizer, batch: dict, groups: list[int], *, updates_per_batch: int = 1,
                 micro_batch_size: int, chunk_tokens: int = 512, amp=contextlib.nullcontext, dist=None,
                 temperature: float = 1.0, **update_kwargs) -> dict:
    """One pass over a rollout batch: `updates_per_batch` optimizer steps (`update`), one per mini-batch of
    whole groups, in order (LUFFY: 128 prompts in mini-batches of 64, two steps per rollout batch).

    With one step, `update` takes π_old from its own forward: ρ = 1 and the PPO clip never binds. With k > 1,
    π_old comes from one no-grad pass over the whole batch before the first step (`old_logprobs`): the first
    mini-batch trains at ρ = 1, every later one at ρ = π_θ/π_old with θ moved by the steps before it, so the
    clip acts. vLLM's own log-probs are not used as π_old: they come from bf16 weights and other kernels, a
    mismatch that `truncated_is_weight` corrects separately, against this π_old.

    groups: the group of each row of `batch` (N,); update_kwargs: `update`'s loss settings. Under torchrun each
    rank splits its own groups (it needs at least k). Returns `update`'s metrics, each the mean over the k steps;
    `skipped` counts the skipped steps.
    """
    if updates_per_batch > 1 and batch.get("old_logp") is None:
        old = old_logprobs(model, batch, micro_batch_size=micro_batch_size, chunk_tokens=chunk_tokens, amp=amp,
                           dist=dist, temperature=temperature)  # (N, L) π_old, before the first step
        batch = {**batch, "old_logp": old}
    steps = [update(model, optimizer, mini, micro_batch_size=micro_batch_size, chunk_tokens=chunk_tokens, amp=amp,
                    dist=dist, temperature=temperature, **update_kwargs)
             for mini in group_mini_batches(batch, groups, updates_per_batch)]
    return _mean_metrics(steps)


@torch.no_grad()
def old_logprobs(model, batch: dict, *, micro_batch_size: int, chunk_tokens: int = 512,
                 amp=contextlib.nullcontext, dist=None, temperature: float = 1.0) -> Tensor:
    """π_old of several optimizer steps on one rollout batch: log π(token) of every row (N, L), 0 off the
    response, in length-sorted micro-batches of the whole batch and under the `amp` context the update uses, so
    that the first step's ρ is 1 up to float noise. Under torchrun every rank runs as many forwards as the busiest one (FSDP2 all-gathers in
    each), like `update`."""
    extents = _row_extents(batch["input_ids"], batch["attention_mask"], batch["response_mask"], "old_logprobs")
    device = next(model.parameters()).device
    micro_batches = length_sorted_micro_batches(extents, micro_batch_size)
    n_micro = len(micro_batches) if dist is None else int(dist.max(len(micro_batches)))
    old = None
    for i in range(n_micro):
        part, keep, padding = _micro_batch(batch, micro_batches, i, extents, device)
        with amp():
            logp, _ = _forward_logprobs(model, part["input_ids"], part["attention_mask"], part["response_mask"],
                                        entropy_grad=False, keep=keep, chunk_tokens=chunk_tokens,
                                        temperature=temperature)  # (n, L)
        if old is None:
            old = torch.zeros(batch["input_ids"].shape, dtype=logp.dtype, device=batch["input_ids"].device)
        if not padding:
            old[torch.tensor(micro_batches[i], device=old.device)] = logp.to(old.device)
    return old  # (N, L)


# ---------------------------------------------------------------------------------------------------
# The batch and its token log-probs
# ---------------------------------------------------------------------------------------------------
def build_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], offpolicy_mask: list[list[int]],
                advantages: Tensor, pad_id: int, sampler_logp: list[list[float] | None] | None = None,
                ) -> dict[str, Tensor]:
    """Right-padded (N, L) tensors for `token_logprobs` / `update`.

    Row i is prompt_ids[i] + response_ids[i] + padding. `response_mask` is 1 on the response tokens and
    `offpolicy_mask` is 1 where `offpolicy_mask[i]` marks a refiner token (None: none), both aligned with
    input_ids positions. All masks are int64 0/1. `advantages` is returned as a float32 (N,) tensor.
    `sampler_logp` (optional): per row, the sampler's log-probs of the FIRST len() response tokens (None: none
    known); it adds "sampler_logp" (N, L) float32 and "sampler_mask" (N, L), 1 where a value is known.
    """
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("build_batch: no sequences")
    if not (len(response_ids) == len(offpolicy_mask) == n):
        raise ValueError(f"build_batch: {n} prompts, {len(response_ids)} responses, "
                         f"{len(offpolicy_mask)} offpolicy masks; they must match")
    advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)  # (N,)
    if advantages.numel() != n:
        raise ValueError(f"build_batch: {advantages.numel()} advantages for {n} sequences")
    # a missing mask (Trajectory's default None) means an all on-policy response
    offpolicy_mask = [[0] * len(r) if m is None else m for r, m in zip(response_ids, offpolicy_mask)]
    for i, (p, r, m) in enumerate(zip(prompt_ids, response_ids, offpolicy_mask)):
        if len(p) == 0:
            raise ValueError(f"build_batch: prompt_ids[{i}] is empty (the first response token needs context)")
        if len(m) != len(r):
            raise ValueError(f"build_batch: offpolicy_mask[{i}] has {len(m)} entries for "
                             f"{len(r)} response tokens")
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
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
             "offpolicy_mask": off_mask, "advantages": advantages}
    # END SOLUTION
    if sampler_logp is not None:
        if len(sampler_logp) != n:
            raise ValueError(f"build_batch: {len(sampler_logp)} sampler_logp rows for {n} sequences")
        logp = torch.zeros((n, length), dtype=torch.float32)  # (N, L)
        known = torch.zeros((n, length), dtype=torch.long)  # (N, L)
        for i, (p, r, lp) in enumerate(zip(prompt_ids, response_ids, sampler_logp)):
            if lp is None or len(lp) == 0:
                continue
            if len(lp) > len(r):
                raise ValueError(f"build_batch: sampler_logp[{i}] has {len(lp)} entries for {len(r)} response tokens")
            logp[i, len(p):len(p) + len(lp)] = torch.tensor(lp, dtype=torch.float32)
            known[i, len(p):len(p) + len(lp)] = 1
        batch.update(sampler_logp=logp, sampler_mask=known)
    return batch


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


def chunked_logprobs_and_entropy(logits: Tensor, targets: Tensor, entropy_grad: bool = False,
                                 chunk_tokens: int = 512, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """`logprobs_and_entropy` of softmax(logits / temperature) over (n, T, V) logits, about `chunk_tokens`
    positions (n × positions) at a time: the same (n, T) log-probs and entropies, without a float32 (n, T, V)
    tensor. With gradients on, each chunk runs under non-reentrant activation checkpointing: only the model's
    logits are kept for the backward pass, and the chunk's float32 log-softmax is recomputed there.
    chunk_tokens <= 0: one chunk."""
    n, T = targets.shape
    if chunk_tokens <= 0:  # one chunk, no recomputation (small vocabularies: the toy world)
        return _tempered_logprobs_and_entropy(logits, targets, entropy_grad, temperature)
    step = max(1, int(chunk_tokens) // max(1, n))  # positions per chunk
    track = torch.is_grad_enabled() and logits.requires_grad
    taken, entropy = [], []
    for s in range(0, T, step):
        lg, tg = logits[:, s:s + step], targets[:, s:s + step]  # (n, t, V), (n, t)
        if track:
            t, e = checkpoint(_tempered_logprobs_and_entropy, lg, tg, entropy_grad, temperature, use_reentrant=False)
        else:
            t, e = _tempered_logprobs_and_entropy(lg, tg, entropy_grad, temperature)
        taken.append(t)
        entropy.append(e)
    return torch.cat(taken, dim=1), torch.cat(entropy, dim=1)  # (n, T), (n, T)


def _tempered_logprobs_and_entropy(logits: Tensor, targets: Tensor, entropy_grad: bool, temperature: float):
    """`logprobs_and_entropy` of softmax(logits / temperature): the distribution vLLM and HF generate sample
    from at that temperature. Low-precision logits are upcast first and divided in place, so the chunk holds one
    float32 copy, as at temperature 1."""
    if temperature != 1.0 and logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float().div_(temperature)
    elif temperature != 1.0:
        logits = logits / temperature
    return logprobs_and_entropy(logits, targets, entropy_grad)


@torch.no_grad()
def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                   micro_batch_size: int, chunk_tokens: int = 512, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per-token log-prob of the taken token and per-token entropy, both (N, L), 0 off the response.

    logp[:, t] = log π(input_ids[:, t] | input_ids[:, :t]) with π = softmax(logits / temperature); entropy[:, t]
    is the entropy of that same distribution. Runs without gradients (the KL reference's log-probs, benchmarks,
    tests); `update` computes its own with gradients, `old_logprobs` π_old under torchrun's rules. Computed
    `micro_batch_size` rows at a time; returned on input_ids' device, float32 (float64 for a float64 model).
    """
    extents = _row_extents(input_ids, attention_mask, response_mask, "token_logprobs")
    device = next(model.parameters()).device
    logps, ents = [], []
    for s in range(0, input_ids.shape[0], max(1, micro_batch_size)):
        sl = slice(s, s + max(1, micro_batch_size))
        logp, ent = _forward_logprobs(model, input_ids[sl].to(device), attention_mask[sl].to(device),
                                      response_mask[sl].to(device), entropy_grad=False,
                                      keep=max(extents[sl]), chunk_tokens=chunk_tokens, temperature=temperature)
        logps.append(logp.to(input_ids.device))
        ents.append(ent.to(input_ids.device))
    return torch.cat(logps), torch.cat(ents)  # (N, L), (N, L)


def _forward_logprobs(model, input_ids, attention_mask, response_mask, entropy_grad: bool, keep: int,
                      chunk_tokens: int = 512, temperature: float = 1.0):
    """One forward pass over one micro-batch: (logp, entropy) of softmax(logits / temperature), both (n, L),
    float32 (float64 for a float64 model), 0 off the response.

    Only the first `keep` columns (up to the last attended position of these rows) go through the model
    (a causal model's output at t never depends on later positions); the rest is padded back with zeros.
    """
    n, length = input_ids.shape
    ids, attn = input_ids[:, :keep], attention_mask[:, :keep]  # (n, K)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits  # (n, K, V)
    taken, ent = chunked_logprobs_and_entropy(logits[:, :-1], ids[:, 1:], entropy_grad, chunk_tokens,
                                              temperature)  # (n, K-1) predicts 1..K-1
    del logits
    resp = response_mask[:, :keep].to(taken.dtype)  # (n, K)
    pad = (1, length - keep)  # position 0 and the trimmed tail are 0
    logp = F.pad(taken, pad) * F.pad(resp[:, 1:], pad)  # (n, L)
    entropy = F.pad(ent, pad) * F.pad(resp[:, 1:], pad)  # (n, L)
    return logp, entropy


# ---------------------------------------------------------------------------------------------------
# Plumbing: importance weights, metrics, micro- and mini-batches, shape checks
# ---------------------------------------------------------------------------------------------------
def truncated_is_weight(train_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Truncated importance weight of each token for the sampler / trainer mismatch (docs/choices.md):
    w = min(π_train / π_sampler, C) = min(exp(train_logp − sampler_logp), C), detached; 1 where `mask` is 0.

    train_logp, sampler_logp, mask: (N, L); cap C >= 1. The log-ratio is zeroed off the mask before exp."""
    if cap < 1:
        raise ValueError(f"truncated_is_weight: cap must be >= 1 (a cap below 1 scales every token down), got {cap}")
    mask = mask.bool()  # (N, L)
    log_ratio = torch.where(mask, train_logp.detach() - sampler_logp.to(train_logp.dtype), torch.zeros_like(train_logp))
    return torch.clamp(torch.exp(log_ratio), max=cap)  # (N, L) truncated IS weight


def loss_metrics(terms: dict) -> dict:
    """Python-float metrics of `policy_loss`'s terms (one batch, or micro-batches joined by `join_terms`):
    clip fraction and mean ratio over the policy's tokens, mean f(π) over the refiner's, the refiner's share
    of response tokens, KL and entropy as means over response tokens, entropy_policy over the policy's
    tokens only (0 where a set is empty); with importance weights, their mean and the share of policy tokens
    at the cap, over the policy tokens that carry one (`is_mask`)."""
    on, off = terms["on"], terms["off"]
    resp = on | off

    def mean_over(x, mask):
        return float(x[mask].sum() / mask.sum()) if x is not None and mask.any() else 0.0

    metrics = {"clip_frac": mean_over(terms["clipped"].double(), on), "ratio_mean": mean_over(terms["ratio"], on),
               "shaped_mean": mean_over(terms["shaped"], off), "offpolicy_share": mean_over(off.double(), resp),
               "kl": mean_over(terms["kl"], resp), "entropy": mean_over(terms["entropy"], resp),
               "entropy_policy": mean_over(terms["entropy"], on)}
    if terms.get("is_weight") is not None and terms.get("is_mask") is not None:
        weighted, w = terms["is_mask"].bool() & on, terms["is_weight"]
        metrics.update(tis_weight_mean=mean_over(w, weighted),
                       tis_capped_frac=mean_over((w >= terms["is_cap"]).double(), weighted))
    return metrics


def join_terms(parts: list[dict]) -> dict:
    """The terms of micro-batches (or of ranks), concatenated along the batch dimension; a shorter sequence
    dimension is padded with zeros (False), which every mask leaves out. Non-tensor entries (the TIS cap)
    are the same in every part."""
    width = max(p["on"].shape[1] for p in parts)
    return {k: torch.cat([F.pad(p[k].cpu(), (0, width - p[k].shape[1])) for p in parts])
            if isinstance(parts[0][k], Tensor) else parts[0][k] for k in parts[0]}


def _row_extents(input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor, who: str) -> list[int]:
    """Per row, the last attended position + 1 (1 for a row with no attended position), as Python ints."""
    if input_ids.shape != attention_mask.shape or input_ids.shape != response_mask.shape:
        raise ValueError(f"{who}: input_ids {tuple(input_ids.shape)}, attention_mask "
                         f"{tuple(attention_mask.shape)}, response_mask {tuple(response_mask.shape)} differ")
    if response_mask[:, 0].any():
        raise ValueError(f"{who}: response_mask is 1 at position 0, which no token predicts; "
                         "every row needs at least one prompt token")
    positions = torch.arange(1, input_ids.shape[1] + 1, device=attention_mask.device)  # (L,)
    return (attention_mask.bool() * positions).amax(dim=1).clamp(min=1).tolist()  # (N,)


def length_sorted_micro_batches(lengths: list[int], micro_batch_size: int) -> list[list[int]]:
    """Row indices in micro-batches of at most `micro_batch_size`, longest rows first, so that rows of similar
    length share a forward pass (ties keep their order). Every index appears exactly once."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    mb = max(1, int(micro_batch_size))
    return [order[s:s + mb] for s in range(0, len(order), mb)]


def padding_share(lengths: list[int], micro_batches: list[list[int]]) -> float:
    """Share of the computed positions that are padding: 1 − Σ lengths / Σ (rows × longest row) over the
    micro-batches."""
    computed = sum(len(idx) * max(lengths[i] for i in idx) for idx in micro_batches)
    return 1.0 - sum(lengths[i] for idx in micro_batches for i in idx) / max(1, computed)


def _check_loss_inputs(logp: Tensor, advantages: Tensor, offpolicy_credit: str, **per_token) -> None:
    """`policy_loss`'s one-line errors: every per-token tensor given (not None) has logp's (N, L) shape, the
    advantages are (N,), the credit is known."""
    shape = tuple(logp.shape)
    for name, t in per_token.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, logp has {shape}")
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(f"policy_loss: advantages must be ({shape[0]},), got {tuple(advantages.shape)}")
    if offpolicy_credit not in ("shaped", "unit"):
        raise ValueError(f"policy_loss: offpolicy_credit must be 'shaped' or 'unit', got {offpolicy_credit!r}")


def _micro_batch(batch: dict, micro_batches: list[list[int]], i: int, extents: list[int], device,
                 ) -> tuple[dict, int, bool]:
    """(the tensors of micro-batch i on `device`, its columns to compute, padding). Under torchrun a rank with
    fewer micro-batches than the others runs row 0 again as a zero-weight padding micro-batch (padding=True),
    so that every rank runs the same forwards (FSDP2 all-gathers in each)."""
    idx, padding = (micro_batches[i], False) if i < len(micro_batches) else ([0], True)
    rows = torch.tensor(idx, device=batch["input_ids"].device)
    part = {k: v[rows].to(device) for k, v in batch.items() if isinstance(v, Tensor)}
    return part, max(extents[j] for j in idx), padding


def _gradient_exchange(model, dist, last: bool):
    """The context of one micro-batch's backward under torchrun: DDP exchanges gradients once per step, on the
    last micro-batch (`dist.no_sync` on the others); FSDP2 reduce-scatters every micro-batch's gradients into its
    shards (holding them back would keep a full-size fp32 gradient per rank); one process: nothing to hold."""
    return contextlib.nullcontext() if dist is None or last else dist.no_sync(model)


def _reference_logprobs(part: dict, ref_model, kl_coef: float, micro_batch_size: int, chunk_tokens: int,
                        temperature: float = 1.0):
    """ref_logp (n, L) for the KL term: the batch's own, else computed from `ref_model`; None without KL."""
    if part.get("ref_logp") is not None or kl_coef <= 0:
        return part.get("ref_logp")
    ref_logp, _ = token_logprobs(ref_model, part["input_ids"], part["attention_mask"], part["response_mask"],
                                 micro_batch_size=micro_batch_size, chunk_tokens=chunk_tokens, temperature=temperature)
    return ref_logp


def _sampler_weights(part: dict, old_logp: Tensor, tis_cap: float) -> tuple[Tensor | None, Tensor | None]:
    """(truncated IS weight, the tokens that carry one), both (n, L), for the policy's own tokens whose sampler
    log-prob is known (vLLM rollouts; `truncated_is_weight`); (None, None) with tis_cap 0 or no sampler log-probs."""
    if tis_cap <= 0 or "sampler_logp" not in part:
        return None, None
    is_mask = part["sampler_mask"].bool() & part["response_mask"].bool() & ~part["offpolicy_mask"].bool()  # (n, L)
    return truncated_is_weight(old_logp, part["sampler_logp"], is_mask, tis_cap), is_mask


def group_mini_batches(batch: dict, groups: list[int], k: int) -> list[dict]:
    """The rows of `batch` as k mini-batches of whole groups: the distinct groups, in order of first appearance,
    cut into k runs of near-equal length (the first ones one group longer). Every row appears exactly once."""
    order = list(dict.fromkeys(groups))
    if not 1 <= k <= len(order):
        raise ValueError(f"group_mini_batches: {k} mini-batches of whole groups need 1..{len(order)} (the groups)")
    sizes = [len(order) // k + (j < len(order) % k) for j in range(k)]
    out, start = [], 0
    for size in sizes:
        chunk = set(order[start:start + size])
        start += size
        rows = torch.tensor([i for i, g in enumerate(groups) if g in chunk], device=batch["input_ids"].device)
        out.append({key: v[rows] if isinstance(v, Tensor) else v for key, v in batch.items()})
    return out


def _mean_metrics(steps: list[dict]) -> dict:
    """The metrics of several `update` steps: each the mean over the steps, `skipped` their count."""
    out = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
    out["skipped"] = float(sum(s["skipped"] for s in steps))
    return out
