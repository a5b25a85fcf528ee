"""One rank of tests/test_dist.py's gradient check, launched by `python -m torch.distributed.run --standalone
--nproc_per_node 2 tests/dist_worker.py OUT.json TIMEOUT_S` (gloo, float64, a tiny random Qwen2).

Every rank builds the same global batch of B groups and the one-process gradient of all of it (grpo.update on a
plain copy of the model); then it trains its slice of whole groups through DDP and through FSDP2
(harness/engines/dist.py wrap) with grpo.update(dist=...) and compares the gradient the optimizer sees with the
one-process one. Cases: equal groups and ragged ones (one extra row in some groups, as `--merge append` makes),
each with both loss aggregations; the ragged cases give the ranks different micro-batch counts. The FSDP2 cases
first run a no-grad HF generation through the sharded model and call dist.reshard, as scope.py does. After
every micro-batch's backward the worker counts the FSDP2 parameters that hold an unsharded gradient (none may:
FSDP2 reduce-scatters every micro-batch); the "probe" entry shows the count sees what set_requires_gradient_sync
(False) leaves. Rank 0 writes {case: {"max_diff", "grad_norm", "grad_norm_ref", "loss", "loss_ref", "rows",
"unsharded_after_backward"}, "probe": {...}} to OUT.json.
"""
import copy
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from grpo import build_batch, update  # noqa: E402
from harness.engines import dist  # noqa: E402

B, G, MB, MAX_NEW = 4, 2, 2, 8


class Capture:
    """An optimizer that records the gradients it is asked to apply (full tensors under FSDP2) and moves nothing."""

    def __init__(self, model):
        self.params, self.grads = list(model.parameters()), None

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                      for p in self.params]


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).double()


def global_rows(ragged: bool):
    """(group, prompt ids, response ids, off-policy mask, advantage) of every row, group by group."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for b in range(B):
        size = G + (1 if ragged and b in (0, 1) else 0)   # appended repairs land on rank 0's groups only
        rewards = torch.randint(0, 2, (size,), generator=g).double()
        for k in range(size):
            prompt = torch.randint(1, 40, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
            response = torch.randint(1, 40, (int(torch.randint(1, MAX_NEW + 1, (1,), generator=g)),), generator=g).tolist()
            off = [0] * len(response) if k < G else [0] + [1] * (len(response) - 1)   # a repair: refiner tokens
            rows.append((b, prompt, response, off, float(rewards[k] - rewards.mean())))
    return rows


def as_batch(rows):
    return build_batch([r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                       torch.tensor([r[4] for r in rows]), pad_id=0)


def unsharded_grads(model) -> int:
    """How many FSDP2 parameters hold an unsharded gradient (FSDPParam's unsharded_accumulated_grad, or the grad
    of its unsharded parameter: what `set_requires_gradient_sync(False)` leaves after a backward)."""
    from torch.distributed.fsdp import FSDPModule
    held = 0
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else []:
            full = getattr(fp, "_unsharded_param", None)
            held += fp.unsharded_accumulated_grad is not None or (full is not None and full.grad is not None)
    return held


class AfterBackward:
    """Counts, after every backward inside the block, the parameters of `model` that hold an unsharded gradient."""

    def __init__(self, model):
        self.model, self.counts = model, []

    def __enter__(self):
        self.backward = torch.Tensor.backward

        def backward(tensor, *args, **kwargs):
            self.backward(tensor, *args, **kwargs)
            self.counts.append(unsharded_grads(self.model))
        torch.Tensor.backward = backward
        return self

    def __exit__(self, *exc):
        torch.Tensor.backward = self.backward


def grads_of(model, batch, loss_agg, d=None):
    opt = Capture(model)
    with AfterBackward(model) as probe:
        stats = update(model, opt, batch, micro_batch_size=MB, max_grad_norm=1e9, loss_agg=loss_agg,
                       max_new_tokens=MAX_NEW, dist=d)
    return opt.grads, {**stats, "unsharded_after_backward": probe.counts}


def probe_sees_no_sync(base, d) -> list[int]:
    """The probe's own check: an FSDP2 backward under set_requires_gradient_sync(False) (what the update must not
    do) leaves unsharded gradients the probe counts."""
    model = dist.wrap(copy.deepcopy(base), d, fsdp=True)
    model.set_requires_gradient_sync(False)
    with AfterBackward(model) as probe:
        model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    model.set_requires_gradient_sync(True)
    return probe.counts


def main(out_path, timeout_s):
    d = dist.init(timeout_s=timeout_s)   # the launching test's bound on a collective wait (it scales with load)
    base = tiny_model()
    results = {}
    for wrapper in ("ddp", "fsdp"):
        for ragged in (False, True):
            for loss_agg in ("constant", "token-mean"):
                rows = global_rows(ragged)
                ref_grads, ref = grads_of(copy.deepcopy(base), as_batch(rows), loss_agg)
                mine = [r for r in rows if r[0] in d.groups(B)]
                model = copy.deepcopy(base)
                if wrapper == "fsdp":
                    model = dist.wrap(model, d, fsdp=True)
                    with torch.no_grad():   # a rollout through the sharded model, the same on every rank
                        model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False,
                                       pad_token_id=0)
                    dist.reshard(model)
                else:
                    model = dist.wrap(model, d, fsdp=False)
                grads, stats = grads_of(model, as_batch(mine), loss_agg, d)
                diff = max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads))
                results[f"{wrapper}-{'ragged' if ragged else 'equal'}-{loss_agg}"] = {
                    "max_diff": diff, "grad_norm": stats["grad_norm"], "grad_norm_ref": ref["grad_norm"],
                    "loss": stats["loss"], "loss_ref": ref["loss"], "rows": d.all_gather(len(mine)),
                    "unsharded_after_backward": stats["unsharded_after_backward"]}
    results["probe"] = {"unsharded_after_backward": probe_sees_no_sync(base, d)}
    if d.main:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
