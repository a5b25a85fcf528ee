"""overlap.py — π_old beside the PRM and the refiner (--overlap-old-logp; docs/scaling.md, "Step time").

With several optimizer steps per rollout batch, π_old is one no-grad forward of the policy over every row
(trainer.old_logprobs) over mini-batches 2..k (the first one's π_old is its own first forward). No weight changes
between the rollout and the update, so that pass can run while the PRM scores and the refiner decodes:
`OldLogprobs` runs it over those groups' rollouts on a worker thread (on a GPU, its own CUDA stream) and
`for_batch` lays it out on the update's merged batch. A merged row's policy tokens are a
prefix of one rollout's tokens (a repair keeps the prefix ids and the refiner's tokens follow them), and a causal
LM's log-prob at position t depends on the tokens up to t only, so each position where the loss reads π_old takes
the value of the rollout that shares the row's tokens up to there. The refiner's tokens get 0: the loss never
reads π_old there (grpo.clipped_surrogate and grpo.truncated_is_weight mask them out; tests/test_overlap.py).

It saves time only when the GPU runs both streams' kernels at once: the PRM and the refiner on their own `vllm
serve` need CUDA MPS (`nvidia-cuda-mps-control -d`) for that; in this process they share the GPU by streams.
"""
import contextlib
import threading
import time

import torch
from torch import Tensor

from harness.engines import trainer


def enabled(args, device: str) -> bool:
    """--overlap-old-logp: on, off, or auto = on with CUDA, more than one optimizer step per batch (the π_old
    pass exists), no --fsdp (a sharded policy's forward is a collective; the thread must not run one) and a
    refiner other than the policy (`--refiner policy` decodes in this process: the thread would take its GPU time
    and the GIL, and hide nothing). On a GPU auto also needs room in the memory plan (memory.old_logp_beside)."""
    if args.overlap_old_logp != "auto":
        return args.overlap_old_logp == "on"
    return device.startswith("cuda") and args.updates_per_batch > 1 and not args.fsdp and args.refiner != "policy"


def later_rows(groups: list[int], k: int) -> list[bool]:
    """Which rows (by their group) fall in mini-batches 2..k of the update (trainer.group_order): the rows whose
    π_old the update reads; none with k = 1."""
    first = set(trainer.group_order(groups, k)[0]) if k > 1 else set(groups)
    return [g not in first for g in groups]


def padded_rows(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> dict[str, Tensor]:
    """input_ids, attention_mask, response_mask (N, L): prompt + response right-padded, as grpo.build_batch."""
    length = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
    ids = torch.full((len(prompt_ids), length), pad_id, dtype=torch.long)  # (N, L)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)  # (N, L) each
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[i, :len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attn[i, :len(p) + len(r)] = 1
        resp[i, len(p):len(p) + len(r)] = 1
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp}


def reuse_prefix_logprobs(rows: dict, rows_old: Tensor, batch: dict, needed: list[bool] | None = None) -> Tensor | None:
    """π_old (N, L) of `batch` from `rows_old` (N0, L0), the π_old of `rows` (padded_rows): at each policy token
    of row i (response_mask and not offpolicy_mask), the value of a row with the same tokens up to and including
    row i's last policy token; 0 elsewhere and on rows not `needed` (default: all are). None when some needed row
    has no such row (then the update computes π_old)."""
    ids, attn, old = rows["input_ids"], rows["attention_mask"].bool(), rows_old.to("cpu")
    on = batch["response_mask"].bool() & ~batch["offpolicy_mask"].bool()  # (N, L) where the loss reads π_old
    out = torch.zeros(batch["input_ids"].shape, dtype=old.dtype)  # (N, L)
    for i in range(on.shape[0]):
        cols = on[i].nonzero()
        if len(cols) == 0 or (needed is not None and not needed[i]):   # no policy token (a whole-solution repair): nothing is read
            continue
        k = int(cols[-1]) + 1   # tokens 0..k-1 decide every policy token's log-prob of row i
        if k > ids.shape[1]:
            return None
        same = attn[:, :k].all(1) & (ids[:, :k] == batch["input_ids"][i, :k].cpu()).all(1)  # (N0,)
        if not same.any():
            return None
        j = int(same.nonzero()[0])
        out[i, :k] = torch.where(on[i, :k].cpu(), old[j, :k], torch.zeros_like(old[j, :k]))
    return out  # (N, L)


class OldLogprobs:
    """π_old of `trajs` (anything with prompt_ids and response_ids) under `model`, on a worker thread started
    here; `for_batch` joins it. A failure in the thread is one line in the caller's (`result`). The thread is
    not a daemon: an interrupted run waits for its pass (seconds) before the process exits."""

    def __init__(self, model, trajs: list, pad_id: int, stream=None, **old_logprobs_kwargs):
        """`stream`: the CUDA stream to run on (the caller keeps one for the run: the caching allocator keeps each
        stream's freed blocks for that stream); None on the CPU."""
        self.rows = padded_rows([t.prompt_ids for t in trajs], [t.response_ids for t in trajs], pad_id)
        self.value, self.error, self.seconds = None, None, 0.0
        # the pass follows every kernel queued so far on the device, on any stream: the weights' last writer may
        # be the optimizer, the push to vLLM or vLLM's own stream, not the caller's current one
        if stream is not None:
            torch.cuda.synchronize(stream.device)
        self.thread = threading.Thread(target=self._run, args=(model, stream, old_logprobs_kwargs),
                                       name="old-logprobs")
        self.thread.start()

    def _run(self, model, stream, kwargs) -> None:
        t0 = time.time()
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.value = trainer.old_logprobs(model, self.rows, dist=None, **kwargs)  # (N0, L0)
                if stream is not None:
                    stream.synchronize()
        except BaseException as err:   # handed to the caller's thread by `result`
            self.error = err
        self.seconds = time.time() - t0

    def result(self) -> Tensor:
        """Wait for the pass; its π_old (N0, L0) on the CPU, or its error as one line (SystemExit)."""
        self.thread.join()
        if self.error is not None:
            said = str(self.error).strip().splitlines()[0] if str(self.error).strip() else ""
            raise SystemExit(f"error: the π_old pass beside the PRM and the refiner (--overlap-old-logp) failed: "
                             f"{type(self.error).__name__}{': ' + said if said else ''} (--overlap-old-logp off "
                             f"computes π_old inside the update instead)")
        return self.value

    def for_batch(self, batch: dict, needed: list[bool] | None = None) -> Tensor | None:
        """π_old (N, L) of the update's `batch` on its `needed` rows (reuse_prefix_logprobs), after the pass."""
        return reuse_prefix_logprobs(self.rows, self.result(), batch, needed)
