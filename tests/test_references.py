"""Answer references of two exercises, kept out of the student copy (tools/exercises.py does not copy this file).

- `loop_policy_loss`: the SCOPE loss token by token, written straight from grpo.py's docstring. Vectorising
  it is the policy_loss exercise, so the copy's tests/test_grpo.py compares policy_loss with values this
  loop produced, stored in tests/fixtures/policy_loss_random.json; here the loop is run against both.
- `oracle_starts`: step starts by brute force (the largest token count whose text is a prefix of the steps
  before). It solves the step_token_spans exercise, so the copy's tests/test_steps.py checks properties of
  the spans instead; here random ids are compared with it.

    python tests/test_references.py     # rewrite tests/fixtures/policy_loss_random.json from the loop
"""
import json
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grpo import policy_loss  # noqa: E402
from harness.engines.trainer import loss_metrics  # noqa: E402
from prm import step_token_spans  # noqa: E402
from test_grpo import STORED, random_loss_inputs  # noqa: E402

CASES = [(agg, seed) for agg in ("constant", "token-mean") for seed in (0, 1, 2)]


def loop_policy_loss(logp, old, adv, resp, off, eps, gamma, loss_agg, max_new_tokens, ref, kl_coef,
                     ent, ent_coef):
    """Per-token Python reference of the loss, written straight from the module docstring."""
    n, length = logp.shape
    total, n_resp, n_on, n_off, n_clip, rsum, fsum, klsum, esum = logp.new_zeros(()), 0, 0, 0, 0, 0, 0, 0, 0
    for i in range(n):
        a = float(adv[i])
        for t in range(length):
            if not resp[i, t]:
                continue
            n_resp += 1
            if off[i, t]:
                pi = torch.exp(logp[i, t])
                f = pi / (pi + gamma)
                term = -f * a
                n_off += 1
                fsum += float(f.detach())
            else:
                rho = torch.exp(logp[i, t] - old[i, t])
                rho_c = torch.clamp(rho, 1 - eps, 1 + eps)
                term = -torch.min(rho * a, rho_c * a)
                n_on += 1
                rsum += float(rho.detach())
                n_clip += int(float(-rho_c.detach() * a) > float(-rho.detach() * a))
            r = ref[i, t] - logp[i, t]
            k3 = torch.exp(r) - r - 1
            klsum += float(k3.detach())
            esum += float(ent[i, t])
            total = total + term + kl_coef * k3 - ent_coef * ent[i, t]
    z = n * max_new_tokens if loss_agg == "constant" else max(n_resp, 1)
    metrics = {"clip_frac": n_clip / max(n_on, 1), "ratio_mean": rsum / max(n_on, 1),
               "shaped_mean": fsum / max(n_off, 1), "offpolicy_share": n_off / max(n_resp, 1),
               "kl": klsum / max(n_resp, 1), "entropy": esum / max(n_resp, 1)}
    return total / z, metrics


def loop_case(loss_agg, seed):
    """(loss tensor with its graph, logp leaf, metrics) of the loop on one stored case."""
    x, kw = random_loss_inputs(seed)
    logp = x["logp"].clone().requires_grad_(True)
    loss, metrics = loop_policy_loss(logp, x["old_logp"], x["advantages"], x["response_mask"], x["offpolicy_mask"],
                                     kw["clip_eps"], kw["shaping_gamma"], loss_agg, kw["max_new_tokens"],
                                     x["ref_logp"], kw["kl_coef"], x["entropy"], kw["entropy_coef"])
    loss.backward()
    return loss, logp, metrics


@pytest.mark.parametrize("loss_agg, seed", CASES)
def test_policy_loss_matches_loop(loss_agg, seed):
    ref_loss, ref_logp, ref_m = loop_case(loss_agg, seed)
    x, kw = random_loss_inputs(seed)
    logp = x.pop("logp").clone().requires_grad_(True)
    loss, terms = policy_loss(logp, loss_agg=loss_agg, **x, **kw)
    loss.backward()
    assert_close(loss, ref_loss)
    assert_close(logp.grad, ref_logp.grad)
    m = loss_metrics(terms)
    m.pop("entropy_policy")
    assert_close(m, ref_m)


def stored_values() -> dict:
    out = {}
    for loss_agg, seed in CASES:
        loss, logp, metrics = loop_case(loss_agg, seed)
        out[f"{loss_agg}-{seed}"] = {"loss": float(loss.detach()), "grad": logp.grad.tolist(), "metrics": metrics}
    return out


def test_the_stored_values_are_the_loop_s():
    with open(STORED, encoding="utf-8") as f:
        stored = json.load(f)
    assert_close(stored, stored_values(), rtol=1e-12, atol=1e-15)


def oracle_starts(ids, steps, tok):
    """Reference by brute force: the largest i such that decode(ids[:i]) is a prefix of steps[:k]."""
    starts, target = [0], steps[0]
    for step in steps[1:]:
        starts.append(max(i for i in range(len(ids) + 1)
                          if target.startswith(tok.decode(ids[:i], skip_special_tokens=True))))
        target += step
    return starts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 399), max_size=40), st.lists(st.integers(1, 30), max_size=6))
def test_random_ids_match_the_brute_force_reference(bpe_tokenizer, ids, cuts):
    """Any sampled id sequence and any cut of its text without invalid UTF-8 (with U+FFFD a lone lead byte
    is kept out of the prefix on purpose, which the brute force cannot see)."""
    tok = bpe_tokenizer
    text = tok.decode(ids, skip_special_tokens=True)
    if not text or "\ufffd" in text:
        return
    bounds = sorted({min(c, len(text)) for c in cuts} - {len(text)})
    steps = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    assert [a for a, _ in step_token_spans(ids, steps, tok)] == oracle_starts(ids, steps, tok)


if __name__ == "__main__":
    os.makedirs(os.path.dirname(STORED), exist_ok=True)
    with open(STORED, "w", encoding="utf-8") as f:
        json.dump(stored_values(), f, indent=1)
    print(f"wrote {STORED}")
