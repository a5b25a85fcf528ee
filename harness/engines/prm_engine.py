"""prm_engine.py — the PRM's engine under prm.ProcessRewardModel: loading, micro-batched forwards, the served PRM.

Not the paper. `PRMEngine` holds the loaded checkpoint (harness/engines/prm_checkpoint.py: no remote code; or
`served`, the PRM on vLLM's pooling runner, harness/engines/served_prm.py) and its family
(harness/engines/prm_families.py: the input layout and where P(step correct) is read), and runs the forwards:

    engine.probs_at([engine.build_input(question, steps), ...])  ->  [[P(correct) at each scored position], ...]

Not the hub's remote code (it does not run on transformers 5). With vLLM on a GPU, `served` takes the same
inputs instead of the module; the head runs in float32 as vLLM's pooling runner does, and tests/test_vllm.py
checks the scores against vLLM's own, in-process and served.
"""
import torch

from harness.engines.prm_checkpoint import load_prm


class PRMEngine:
    """A loaded PRM, its tokenizer and its family; `max_length` is capped at the model's `max_position_embeddings`.
    `prm_format`: "auto" (prm_families.choose decides) or a family's name; the chosen family is `self.family`, its
    name `self.format`, its token ids `self.ids` (`self.sep_id`: its step tag's, when it has one)."""

    def __init__(self, name_or_path, device="cpu", dtype=None, max_length=4096, micro_batch_size=4,
                 served=None, prm_format="auto"):
        self.name = str(name_or_path)
        self.model, self.tokenizer, config, self.family = load_prm(self.name, device, dtype, served, prm_format)
        self.format = self.family.name
        self.ids = self.family.tokens(self.tokenizer)
        self.sep_id = self.ids.get("tag")
        self.device = device
        self.micro_batch_size = int(micro_batch_size)
        if self.micro_batch_size < 1:
            raise ValueError(f"ProcessRewardModel: micro_batch_size must be >= 1, got {micro_batch_size}")
        limit = getattr(config, "max_position_embeddings", None)
        self.max_length = int(min(max_length, limit) if limit else max_length)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    def build_input(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        """(input ids, scored positions of the steps that fit in max_length) in the family's layout."""
        return self.family.build(self, question, steps)

    @torch.no_grad()
    def probs_at(self, built: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """P(step correct) (the family's `read`) at each listed position of each input: sorted by length,
        right-padded, one forward per micro-batch (on a served PRM one request each); results in input order, []
        for an input without positions."""
        results = [[] for _ in built]
        todo = sorted((i for i, (_, pos) in enumerate(built) if pos), key=lambda i: len(built[i][0]))
        for b0 in range(0, len(todo), self.micro_batch_size):
            chunk = todo[b0:b0 + self.micro_batch_size]
            width = max(len(built[i][0]) for i in chunk)
            input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)  # (b, T)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)  # (b, T)
            for row, i in enumerate(chunk):
                ids = built[i][0]
                input_ids[row, :len(ids)] = torch.tensor(ids)
                attention[row, :len(ids)] = 1
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device))
            logits = out if torch.is_tensor(out) else getattr(out, "logits", None)
            logits = out[0] if logits is None else logits  # (b, T, classes); a tuple's first item
            probs = self.family.read(self, logits).cpu()  # (b, T) P(step correct)
            for row, i in enumerate(chunk):
                results[i] = [float(probs[row, p]) for p in built[i][1]]
        return results
