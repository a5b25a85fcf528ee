"""dist.py — one run over several processes: `torchrun --nproc_per_node N scope.py ...` (DDP), and `--fsdp`
(FSDP2) for a policy whose float32 weights and AdamW state do not fit one GPU. docs/scaling.md has the commands.

The split is nanochat's (scripts/chat_rl.py): every rank draws the same B problems and takes a contiguous slice
of whole groups, so rewards, advantages, the PRM and the refiner need no communication. What is shared:

  - the loss normaliser Z, summed over ranks (a local Z is wrong as soon as groups are ragged, `--merge append`,
    or the loss is a token mean), divided by the world size because DDP and FSDP average the ranks' gradients;
  - the gradients: DDP all-reduces once per optimizer step (`no_sync` on every micro-batch but the last), FSDP2
    reduce-scatters every micro-batch into its shards (so no rank holds a full-size gradient); the same number
    of micro-batches on every rank (`max`), which both need (FSDP2 also all-gathers in every forward);
  - the loss, whose finiteness decides the skip rule on every rank alike (the gradient norm is global already);
  - the step's rows (rollouts, trained batch, traces), gathered on rank 0, which logs them as one process would.

Rank 0 alone holds the run-folder lock and writes config, metrics, traces and checkpoints. With one process
every helper here is the identity and nothing is initialised.

Random draws follow the global index of a prompt (or a refiner request): vLLM seeds each request with
`seed + index`, so rank r passes `seed + offset` and draws what a one-process run draws. HF generate draws one
random stream for a whole call, which no slice reproduces: without vLLM each rank samples the whole batch (the
same on every rank) and keeps its groups, which is exact but does not split the sampling work.
"""
import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass
class Dist:
    """This process's place in the run: rank, world size, local rank (its GPU on the node)."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def groups(self, n_groups: int) -> range:
        """This rank's contiguous slice of whole groups (the world size divides n_groups: preflight)."""
        per = n_groups // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    def block(self, n: int) -> range:
        """This rank's contiguous share of n items (evaluation problems), the first ranks one longer."""
        per, extra = divmod(n, self.world)
        lo = self.rank * per + min(self.rank, extra)
        return range(lo, lo + per + (self.rank < extra))

    def all_gather(self, obj) -> list:
        """Every rank's obj, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        tdist.all_gather_object(out, obj)
        return out

    def gather(self, *lists: list) -> tuple[list, ...]:
        """Each list joined over the ranks in rank order (the global order of the groups), on every rank; one
        exchange for all of them."""
        if self.world == 1:
            return lists
        parts = self.all_gather(lists)
        return tuple([x for part in parts for x in part[k]] for k in range(len(lists)))

    def offset(self, n: int) -> int:
        """How many items the lower ranks hold (exclusive prefix sum): the global index of this rank's first."""
        return sum(self.all_gather(n)[:self.rank])

    def _reduce(self, x: float, op) -> float:
        if self.world == 1:
            return x
        t = torch.tensor([float(x)], dtype=torch.float64, device=self._device())
        tdist.all_reduce(t, op=op)
        return float(t.item())

    def sum(self, x: float) -> float:
        return self._reduce(x, tdist.ReduceOp.SUM)

    def mean(self, x: float) -> float:
        return self.sum(x) / self.world

    def max(self, x: float) -> float:
        return self._reduce(x, tdist.ReduceOp.MAX)

    def broadcast(self, obj):
        """Rank 0's obj on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            tdist.barrier()

    def no_sync(self, model):
        """DDP: a context in which backward accumulates gradients without communicating (DDP's no_sync; its
        gradients are full-size anyway). FSDP2 and a plain model: nothing. FSDP2 reduce-scatters every
        micro-batch, as torchtitan and verl do: its `set_requires_gradient_sync(False)` would keep each
        parameter's unsharded fp32 gradient on every rank until the last micro-batch (4 bytes per parameter of
        the whole model, where the sharded gradient is 4 / world)."""
        if hasattr(model, "no_sync"):
            return model.no_sync()
        return contextlib.nullcontext()

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else "cpu"


def init(timeout_s: float) -> Dist:
    """The process group of a torchrun launch (WORLD_SIZE > 1; NCCL on GPUs, gloo on the CPU), or a one-process
    Dist. A rank that waits longer than timeout_s in a collective raises instead of hanging."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not tdist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)   # "cuda" now means this rank's GPU
        tdist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return Dist(rank, world, local_rank)


def close() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def mixed_precision(cuda: bool):
    """FSDP2's precision on a GPU: weights all-gathered and computed in bf16 from the fp32 shards, gradients
    reduce-scattered in fp32 into the fp32 shards (torchtitan's and verl's setting). The update then runs
    without autocast (`Run.update_amp`): autocast would cast every gathered fp32 layer and keep all the bf16
    copies until its region ends. None on the CPU (the gloo tests compute in the model's own dtype)."""
    if not cuda:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def wrap(model, d: Dist, fsdp: bool):
    """The module the update trains: the model itself (one process), DDP, or FSDP2 sharded per decoder layer
    and at the root (`fully_shard` turns the model into an FSDPModule in place; build the optimizer after), in
    bf16 on a GPU (`mixed_precision`)."""
    if d.world == 1 and not fsdp:
        return model
    if fsdp:
        return shard(model, mp_policy=mixed_precision(next(model.parameters()).is_cuda))
    from torch.nn.parallel import DistributedDataParallel
    cuda = next(model.parameters()).is_cuda
    return DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if cuda else None)


def shard(model, mesh=None, mp_policy=None):
    """FSDP2 units: each decoder layer, then the root (embeddings, final norm, lm_head); `mesh` None: the world.
    tools/bench/memory.py traces the same layout on a fake process group."""
    from torch.distributed.fsdp import fully_shard
    options = {k: v for k, v in (("mesh", mesh), ("mp_policy", mp_policy)) if v is not None}
    for layer in model.model.layers:   # HF causal LMs: model.model.layers (Qwen2, Llama, Mistral)
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def reshard(model) -> None:
    """Free the gathered full weights of every FSDP2 unit after a forward without backward (generation,
    evaluation). FSDP2 keeps the root unit (embeddings, final norm, lm_head) unsharded after a forward; left so,
    its parameters are not the sharded ones the gradient clipping and the optimizer see, and the clipped
    gradient norm is silently wrong. No-op for a plain or DDP model."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_tensors(model):
    """(name, full tensor) of the model's state dict, gathered one tensor at a time as the consumer asks for the
    next: a collective under FSDP2 (every rank consumes all of them, in the same order). The generator keeps no
    reference to what it handed out, so the consumer decides how many full tensors are alive (the weight push:
    the one it converts, and the previous one until its loop moves on)."""
    from torch.distributed.tensor import DTensor
    for k, v in model.state_dict().items():
        yield k, (v.full_tensor() if isinstance(v, DTensor) else v)


class _FullTensors:
    """A state dict read lazily: `items()` gathers one full tensor at a time (`full_tensors`)."""

    def __init__(self, model):
        self._model = model

    def items(self):
        return full_tensors(self._model)


class FullView:
    """Stands in for an FSDP2 model where the weight push reads `state_dict().items()`: one full tensor at a
    time, never the whole fp32 model at once (28 GiB for a 7B policy)."""

    def __init__(self, model):
        self.config, self._model = model.config, model

    def state_dict(self):
        return _FullTensors(self._model)


class _Consolidated:
    """A model whose save_pretrained writes the given full state dict (an FSDP2 model's, gathered)."""

    def __init__(self, model, state: dict):
        self.model, self.state = model, state

    def save_pretrained(self, path):
        self.model.save_pretrained(path, state_dict=self.state)


class _OptimizerState:
    """An optimizer whose state_dict is the given one."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self):
        return self.state


def full_checkpoint(model, optimizer):
    """(model, optimizer) stand-ins whose save_pretrained / state_dict give the consolidated FSDP2 weights and
    AdamW state in the one-process format: an HF folder that eval.py reads, and optimizer.pt keyed by parameter
    index in `model.parameters()` order. A collective: every rank calls it; the tensors land on rank 0's CPU."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    state = get_optimizer_state_dict(model, optimizer, options=options)   # keyed by parameter name
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    if state:
        state = {"state": {index[k]: v for k, v in state["state"].items()},
                 "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in state["param_groups"]]}
    return _Consolidated(model, weights), _OptimizerState(state)


def load_optimizer(model, optimizer, state: dict) -> None:
    """A one-process optimizer.pt (keyed by parameter index) into the sharded optimizer of an FSDP2 model; every
    rank reads the whole file and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    names = [name for name, _ in model.named_parameters()]
    state = {"state": {names[i]: v for i, v in state["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
