"""trainer.py — the engine of one optimizer step, under grpo.update's loop: nothing here is the paper.

`Step` runs what surrounds the loss: length-sorted micro-batches (under torchrun padded with zero-weight ones,
so every rank runs the same forwards), one gradient exchange per step, the whole batch's Z over the ranks,
the forward pass in chunks of float32 log-softmax at the rollout temperature, the KL reference's log-probs,
the gradient norm of DTensor shards, the non-finite skip and the metrics. Below it: π_old's no-grad pass and the
mini-batches of several steps per rollout batch.
The per-token log-prob function (grpo.logprobs_and_entropy) is passed in: harness/ imports nothing above it.
Choices and reasons: docs/choices.md, row "7 update"; memory: docs/memory.md.
"""
import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


class Step:
    """One optimizer step on `batch` (N, L), its loop written by the caller: `for part in step.micro_batches()`,
    `step.forward(part, ...)`, the loss, `step.backward(loss, terms)`; then `step.clip_gradients(max_grad_norm)`,
    optimizer.step() if it says so, optimizer.zero_grad(), `step.metrics()`."""

    def __init__(self, model, optimizer, batch: dict, z: float, *, micro_batch_size: int, logprobs_fn, tis_tokens,
                 dist=None, ref_model=None, kl_coef: float = 0.0, tis_cap: float = 0.0, chunk_tokens: int = 512,
                 temperature: float = 1.0):
        """`logprobs_fn` (grpo.logprobs_and_entropy): the forward's and the KL reference's per-token log-probs;
        `tis_tokens` (grpo.tis_tokens): the tokens the TIS metrics average over."""
        if kl_coef > 0 and batch.get("ref_logp") is None and ref_model is None:
            raise ValueError("update: kl_coef > 0 needs batch['ref_logp'] or ref_model")
        self.model, self.optimizer, self.batch, self.dist, self.ref_model = model, optimizer, batch, dist, ref_model
        self.logprobs_fn, self.tis_tokens, self.kl_coef, self.tis_cap = logprobs_fn, tis_tokens, kl_coef, tis_cap
        self.chunk_tokens, self.temperature, self.mb = chunk_tokens, temperature, max(1, int(micro_batch_size))
        self.extents = row_extents(batch["input_ids"], batch["attention_mask"], batch["response_mask"], "update")
        self.device = next(model.parameters()).device
        self.plan = length_sorted_micro_batches(self.extents, self.mb)
        self.n_micro, self.z = len(self.plan), z
        if dist is not None:   # Z of the global batch; ÷ world: the ranks' gradients are averaged, not summed
            self.z = dist.sum(z) / dist.world
            self.n_micro = int(dist.max(self.n_micro))   # the same count on every rank: FSDP all-gathers in each
        self.loss_total, self.parts = 0.0, []
        optimizer.zero_grad(set_to_none=True)

    def micro_batches(self):
        """Each micro-batch's tensors on the model's device; a rank with fewer than the others gets zero-weight
        padding ones (row 0 again), so that every rank runs the same forwards. The caller's forward and backward
        of each run inside the gradient exchange's context: DDP exchanges gradients once per step, on the last
        micro-batch (`no_sync` on the others); FSDP2 reduce-scatters every micro-batch's gradients into its shards;
        one process holds nothing."""
        for self.i in range(self.n_micro):
            self.part, self.keep, self.padding = micro_batch(self.batch, self.plan, self.i, self.extents, self.device)
            last = self.i == self.n_micro - 1
            with contextlib.nullcontext() if self.dist is None or last else self.dist.no_sync(self.model):
                yield self.part

    def forward(self, part: dict, entropy_grad: bool) -> tuple[Tensor, Tensor]:
        """(logp, entropy) of this micro-batch, both (n, L), with gradients through logp."""
        return forward_logprobs(self.model, part["input_ids"], part["attention_mask"], part["response_mask"],
                                self.logprobs_fn, entropy_grad=entropy_grad, keep=self.keep,
                                chunk_tokens=self.chunk_tokens, temperature=self.temperature)

    def reference_logprobs(self, part: dict) -> Tensor | None:
        """ref_logp (n, L) for the KL term: the batch's own, else computed from `ref_model`; None without KL."""
        if part.get("ref_logp") is not None or self.kl_coef <= 0:
            return part.get("ref_logp")
        return token_logprobs(self.ref_model, part["input_ids"], part["attention_mask"], part["response_mask"],
                              self.mb, self.chunk_tokens, self.temperature, logprobs_fn=self.logprobs_fn)[0]

    def backward(self, loss: Tensor, terms: dict) -> None:
        """The micro-batch's backward pass (a padding one with weight 0) and its share of the metrics."""
        (loss * 0.0 if self.padding else loss).backward()
        if not self.padding:
            self.loss_total += float(loss.detach())
            extra = {}   # TIS: the tokens that carry a weight, and the cap, for the metrics
            if terms.get("is_weight") is not None:
                extra = {"is_mask": self.tis_tokens(self.part), "is_cap": float(self.tis_cap)}
            self.parts.append({**terms, **extra})

    def clip_gradients(self, max_grad_norm) -> bool:
        """Clip the gradient to `max_grad_norm` (None: no clipping); False when the loss or the gradient norm is
        non-finite on any rank: then the caller skips optimizer.step, so parameters and optimizer state stay."""
        clip_to = float("inf") if max_grad_norm is None else float(max_grad_norm)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip_to)
        self.grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # FSDP2
        self.terms = join_terms(self.parts)
        if self.dist is not None:   # the global batch's loss and metrics; non-finite anywhere skips everywhere
            self.loss_total = self.dist.mean(self.loss_total)
            self.terms = join_terms(self.dist.all_gather(self.terms))
        self.skipped = not (math.isfinite(self.loss_total) and math.isfinite(self.grad_norm))
        return not self.skipped

    def metrics(self) -> dict:
        """Python-float metrics of the step (after `clip_gradients`): loss, grad_norm, skipped, pad_share and
        `loss_metrics` of the whole (global) batch."""
        return {"loss": self.loss_total, "grad_norm": self.grad_norm, "skipped": float(self.skipped),
                "pad_share": padding_share(self.extents, self.plan), **loss_metrics(self.terms)}


# ---------------------------------------------------------------------------------------------------
# Several optimizer steps per rollout batch: π_old, mini-batches of whole groups, their metrics
# ---------------------------------------------------------------------------------------------------
def mini_batches(model, batch: dict, groups: list[int] | None, k: int, logprobs_fn, *, micro_batch_size: int,
                 amp=contextlib.nullcontext, dist=None, chunk_tokens: int = 512, temperature: float = 1.0
                 ) -> list[dict]:
    """The k mini-batches of whole groups that grpo.update steps on, in order (k = 1: the batch itself). With k > 1
    the first one carries no π_old: no weight has moved when it steps, so its π_old is its own first forward,
    detached (ρ = 1, as grpo.update reads it). Mini-batches 2..k take batch["old_logp"], else `old_logprobs` over
    their rows first, by the update's own `logprobs_fn`."""
    if k == 1:
        return [batch]
    if k < 1:
        raise ValueError(f"update: updates_per_batch must be at least 1, got {k}")
    if groups is None:
        raise ValueError(f"update: updates_per_batch={k} needs `groups`, each row's group")
    first, *rest = group_mini_batches(batch, groups, k)
    first.pop("old_logp", None)
    if batch.get("old_logp") is None:
        rest = [{**mini, "old_logp": old_logprobs(model, mini, logprobs_fn=logprobs_fn, amp=amp, dist=dist,
                                                  micro_batch_size=micro_batch_size, chunk_tokens=chunk_tokens,
                                                  temperature=temperature)} for mini in rest]
    return [first, *rest]


@torch.no_grad()
def old_logprobs(model, batch: dict, *, logprobs_fn, micro_batch_size: int, chunk_tokens: int = 512,
                 amp=contextlib.nullcontext, dist=None, temperature: float = 1.0) -> Tensor:
    """π_old: log π(token) of every row (N, L), 0 off the response, by the update's own `logprobs_fn`
    (grpo.logprobs_and_entropy), in its micro-batches and under its `amp`, so that a step's ρ is 1 up to float
    noise where no weight has moved; the entropy it also returns is dropped; under torchrun padded like `Step`."""
    extents = row_extents(batch["input_ids"], batch["attention_mask"], batch["response_mask"], "old_logprobs")
    device = next(model.parameters()).device
    plan = length_sorted_micro_batches(extents, micro_batch_size)
    n_micro = len(plan) if dist is None else int(dist.max(len(plan)))
    old = None
    for i in range(n_micro):
        part, keep, padding = micro_batch(batch, plan, i, extents, device)
        with amp():
            logp, _ = forward_logprobs(model, part["input_ids"], part["attention_mask"], part["response_mask"],
                                       logprobs_fn, entropy_grad=False, keep=keep, chunk_tokens=chunk_tokens,
                                       temperature=temperature)  # (n, L)
        if old is None:
            old = torch.zeros(batch["input_ids"].shape, dtype=logp.dtype, device=batch["input_ids"].device)
        if not padding:
            old[torch.tensor(plan[i], device=old.device)] = logp.to(old.device)
    return old  # (N, L)


def group_order(groups: list[int], k: int) -> list[list[int]]:
    """The distinct groups, in order of first appearance, cut into k runs of near-equal length (the first ones one
    group longer): the groups of each of k mini-batches."""
    order = list(dict.fromkeys(groups))
    if not 1 <= k <= len(order):
        raise ValueError(f"group_mini_batches: {k} mini-batches of whole groups need 1..{len(order)} (the groups)")
    sizes = [len(order) // k + (j < len(order) % k) for j in range(k)]
    return [order[sum(sizes[:j]):sum(sizes[:j + 1])] for j in range(k)]


def group_mini_batches(batch: dict, groups: list[int], k: int) -> list[dict]:
    """The rows of `batch` as k mini-batches of whole groups (`group_order`). Every row appears exactly once."""
    out = []
    for chunk in map(set, group_order(groups, k)):
        rows = torch.tensor([i for i, g in enumerate(groups) if g in chunk], device=batch["input_ids"].device)
        out.append({key: v[rows] if isinstance(v, Tensor) else v for key, v in batch.items()})
    return out


def set_learning_rate(optimizer, lr: float | None) -> None:
    """Every parameter group's learning rate to `lr` (grpo.update's, from scope.py's warm-up); None: left as it is."""
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr


def mean_metrics(steps: list[dict]) -> dict:
    """The metrics of several `update` steps: each the mean over the steps, `skipped` their count."""
    out = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
    out["skipped"] = float(sum(s["skipped"] for s in steps))
    return out


# ---------------------------------------------------------------------------------------------------
# Token log-probs of a model: the forward pass, chunked float32 log-softmax, the rollout temperature
# ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor, micro_batch_size: int,
                   chunk_tokens: int = 512, temperature: float = 1.0, *, logprobs_fn) -> tuple[Tensor, Tensor]:
    """Per-token log-prob of the taken token and per-token entropy, both (N, L), 0 off the response, of
    softmax(logits / temperature), without gradients, `micro_batch_size` rows at a time; returned on input_ids'
    device, float32 (float64 for a float64 model)."""
    extents = row_extents(input_ids, attention_mask, response_mask, "token_logprobs")
    device = next(model.parameters()).device
    logps, ents = [], []
    for s in range(0, input_ids.shape[0], max(1, micro_batch_size)):
        sl = slice(s, s + max(1, micro_batch_size))
        logp, ent = forward_logprobs(model, input_ids[sl].to(device), attention_mask[sl].to(device),
                                     response_mask[sl].to(device), logprobs_fn, entropy_grad=False,
                                     keep=max(extents[sl]), chunk_tokens=chunk_tokens, temperature=temperature)
        logps.append(logp.to(input_ids.device))
        ents.append(ent.to(input_ids.device))
    return torch.cat(logps), torch.cat(ents)  # (N, L), (N, L)


def forward_logprobs(model, input_ids, attention_mask, response_mask, logprobs_fn, entropy_grad: bool, keep: int,
                     chunk_tokens: int = 512, temperature: float = 1.0):
    """One forward pass over one micro-batch: (logp, entropy), both (n, L), 0 off the response. Only the first
    `keep` columns go through the model (a causal model's output at t never depends on later positions)."""
    n, length = input_ids.shape
    ids, attn = input_ids[:, :keep], attention_mask[:, :keep]  # (n, K)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits  # (n, K, V)
    taken, ent = chunked_logprobs_and_entropy(logits[:, :-1], ids[:, 1:], logprobs_fn, entropy_grad, chunk_tokens,
                                              temperature)  # (n, K-1) predicts 1..K-1
    del logits
    resp = response_mask[:, :keep].to(taken.dtype)  # (n, K)
    pad = (1, length - keep)  # position 0 and the trimmed tail are 0
    logp = F.pad(taken, pad) * F.pad(resp[:, 1:], pad)  # (n, L)
    entropy = F.pad(ent, pad) * F.pad(resp[:, 1:], pad)  # (n, L)
    return logp, entropy


def chunked_logprobs_and_entropy(logits: Tensor, targets: Tensor, logprobs_fn, entropy_grad: bool = False,
                                 chunk_tokens: int = 512, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """`logprobs_fn` of softmax(logits / temperature) over (n, T, V) logits, about `chunk_tokens` positions at
    a time: the same (n, T) results without a float32 (n, T, V) tensor. With gradients on, each chunk is
    recomputed in the backward pass (non-reentrant checkpointing). chunk_tokens <= 0: one chunk."""
    n, T = targets.shape
    if chunk_tokens <= 0:  # one chunk, no recomputation (small vocabularies: the toy world)
        return tempered(logits, targets, logprobs_fn, entropy_grad, temperature)
    step = max(1, int(chunk_tokens) // max(1, n))  # positions per chunk
    track = torch.is_grad_enabled() and logits.requires_grad
    taken, entropy = [], []
    for s in range(0, T, step):
        lg, tg = logits[:, s:s + step], targets[:, s:s + step]  # (n, t, V), (n, t)
        if track:
            t, e = checkpoint(tempered, lg, tg, logprobs_fn, entropy_grad, temperature, use_reentrant=False)
        else:
            t, e = tempered(lg, tg, logprobs_fn, entropy_grad, temperature)
        taken.append(t)
        entropy.append(e)
    return torch.cat(taken, dim=1), torch.cat(entropy, dim=1)  # (n, T), (n, T)


def tempered(logits: Tensor, targets: Tensor, logprobs_fn, entropy_grad: bool, temperature: float):
    """`logprobs_fn` of softmax(logits / temperature), the distribution vLLM and HF generate sample from.
    Low-precision logits are upcast first and divided in place (one float32 copy, as at temperature 1)."""
    if temperature != 1.0 and logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float().div_(temperature)
    elif temperature != 1.0:
        logits = logits / temperature
    return logprobs_fn(logits, targets, entropy_grad)


# ---------------------------------------------------------------------------------------------------
# Metrics, micro-batches, shape checks
# ---------------------------------------------------------------------------------------------------
def loss_metrics(terms: dict) -> dict:
    """Python-float metrics of `policy_loss`'s terms (one batch, or micro-batches joined by `join_terms`):
    clip fraction and mean ratio over the policy's tokens, mean f(π) over the refiner's, the refiner's share
    of response tokens, KL and entropy as means over response tokens, entropy_policy over the policy's
    tokens only (0 where a set is empty); with importance weights, their mean and the share of policy tokens
    at the cap, over the tokens that carry one (`is_mask`, grpo.tis_tokens)."""
    on, off = terms["on"], terms["off"]
    resp = on | off

    def mean_over(x, mask):
        return float(x[mask].sum() / mask.sum()) if x is not None and mask.any() else 0.0

    metrics = {"clip_frac": mean_over(terms["clipped"].double(), on), "ratio_mean": mean_over(terms["ratio"], on),
               "shaped_mean": mean_over(terms["shaped"], off), "offpolicy_share": mean_over(off.double(), resp),
               "kl": mean_over(terms["kl"], resp), "entropy": mean_over(terms["entropy"], resp),
               "entropy_policy": mean_over(terms["entropy"], on)}
    if terms.get("is_weight") is not None and terms.get("is_mask") is not None:
        weighted, w = terms["is_mask"].bool(), terms["is_weight"]
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


def row_extents(input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor, who: str) -> list[int]:
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


def micro_batch(batch: dict, micro_batches: list[list[int]], i: int, extents: list[int], device,
                ) -> tuple[dict, int, bool]:
    """(the tensors of micro-batch i on `device`, its columns to compute, padding): past the last micro-batch,
    row 0 again as a zero-weight padding micro-batch (padding=True)."""
    idx, padding = (micro_batches[i], False) if i < len(micro_batches) else ([0], True)
    rows = torch.tensor(idx, device=batch["input_ids"].device)
    part = {k: v[rows].to(device) for k, v in batch.items() if isinstance(v, Tensor)}
    return part, max(extents[j] for j in idx), padding


def check_batch_inputs(prompt_ids, response_ids, offpolicy_mask, advantages) -> None:
    """`build_batch`'s one-line errors, before any tensor is made: as many prompts, responses, masks and advantages
    as sequences; no empty prompt; a mask (None: all on-policy) as long as its response."""
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("build_batch: no sequences")
    if not (len(response_ids) == len(offpolicy_mask) == n):
        raise ValueError(f"build_batch: {n} prompts, {len(response_ids)} responses, "
                         f"{len(offpolicy_mask)} offpolicy masks; they must match")
    n_adv = torch.as_tensor(advantages).numel()
    if n_adv != n:
        raise ValueError(f"build_batch: {n_adv} advantages for {n} sequences")
    for i, (p, r, m) in enumerate(zip(prompt_ids, response_ids, offpolicy_mask)):
        if len(p) == 0:
            raise ValueError(f"build_batch: prompt_ids[{i}] is empty (the first response token needs context)")
        if m is not None and len(m) != len(r):
            raise ValueError(f"build_batch: offpolicy_mask[{i}] has {len(m)} entries for {len(r)} response tokens")


def sampler_rows(prompt_ids, response_ids, sampler_logp, length: int) -> dict[str, Tensor]:
    """The sampler's log-probs (vLLM's, for the truncated importance weight) laid out like grpo.build_batch's rows:
    "sampler_logp" (N, L) float32 and "sampler_mask" (N, L) int64, 1 where a value is known. Row i's values cover
    its FIRST len() response tokens (a repaired trajectory keeps its prefix's); None or [] = none known."""
    n = len(prompt_ids)
    if len(sampler_logp) != n:
        raise ValueError(f"sampler_rows: {len(sampler_logp)} sampler_logp rows for {n} sequences")
    logp = torch.zeros((n, length), dtype=torch.float32)  # (N, L)
    known = torch.zeros((n, length), dtype=torch.long)  # (N, L)
    for i, (p, r, lp) in enumerate(zip(prompt_ids, response_ids, sampler_logp)):
        if lp and len(lp) > len(r):
            raise ValueError(f"sampler_rows: sampler_logp[{i}] has {len(lp)} entries for {len(r)} response tokens")
        if lp:
            logp[i, len(p):len(p) + len(lp)] = torch.tensor(lp, dtype=torch.float32)
            known[i, len(p):len(p) + len(lp)] = 1
    return {"sampler_logp": logp, "sampler_mask": known}


def check_loss_inputs(logp: Tensor, advantages: Tensor, offpolicy_credit: str, credits: tuple, **per_token) -> None:
    """`policy_loss`'s one-line errors: every per-token tensor given (not None) has logp's (N, L) shape, the
    advantages are (N,), the credit is one of the `credits` it is handed."""
    shape = tuple(logp.shape)
    for name, t in per_token.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, logp has {shape}")
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(f"policy_loss: advantages must be ({shape[0]},), got {tuple(advantages.shape)}")
    if offpolicy_credit not in credits:
        raise ValueError(f"policy_loss: offpolicy_credit must be one of {credits}, got {offpolicy_credit!r}")
