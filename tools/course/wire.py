"""What crosses between a graded process and the grader: plain data only, never pickle.

A message is one safetensors blob: its tensors, and in its metadata the JSON of everything else (None, bools,
ints, floats, strings, lists, tuples, dicts; a tensor is {"__tensor__": i}; the grading's tokenizer is
{"__tokenizer__": 0}, the only object that crosses, by name). Over a pipe a message is its length (8 bytes) then
the blob, refused past `LIMIT` bytes before it is read.

`Dependencies` is the graded process's end of the functions its problem depends on (the reference's, answered by
`serve` in a reference process of the grader's): each call sends its arguments and gets the outputs; a call whose inputs
need a gradient gets a node in the autograd graph whose backward asks the reference for the vector-Jacobian
product, so a loss built on a dependency's outputs trains as if the reference ran in place.
"""
import hashlib
import inspect
import json
import os
import struct

LIMIT = 64 << 20          # the largest message either end reads, bytes
DEPTH = 64                # the deepest nesting of containers a message may hold


class NotPlain(TypeError):
    """A value that is not plain data (a function, a model, an object of the student's)."""


def encode(obj, tensors: list, tokenizer=None, depth: int = 0):
    import torch

    if depth > DEPTH:
        raise NotPlain(f"nested deeper than {DEPTH}")
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if obj == obj and abs(obj) != float("inf") else {"__float__": repr(float(obj))}
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__tensor__": len(tensors) - 1, "grad": bool(obj.requires_grad)}
    if tokenizer is not None and obj is tokenizer:
        return {"__tokenizer__": 0}
    if isinstance(obj, (list, tuple)):
        items = [encode(x, tensors, tokenizer, depth + 1) for x in obj]
        return items if type(obj) is list else {"__tuple__": items}
    if isinstance(obj, dict):
        return {"__dict__": [[encode(k, tensors, tokenizer, depth + 1), encode(v, tensors, tokenizer, depth + 1)]
                             for k, v in obj.items()]}
    raise NotPlain(f"a {type(obj).__name__} is not plain data")


def decode(obj, tensors: dict, tokenizer=None):
    if isinstance(obj, list):
        return [decode(x, tensors, tokenizer) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        t = tensors[f"t{int(obj['__tensor__'])}"]
        return t.requires_grad_(True) if obj.get("grad") and t.is_floating_point() else t
    if "__tuple__" in obj:
        return tuple(decode(x, tensors, tokenizer) for x in obj["__tuple__"])
    if "__dict__" in obj:
        return {_key(decode(k, tensors, tokenizer)): decode(v, tensors, tokenizer) for k, v in obj["__dict__"]}
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tokenizer__" in obj:
        if tokenizer is None:
            raise NotPlain("a tokenizer where none is expected")
        return tokenizer
    raise NotPlain("an unknown tag")


def _key(k):
    return tuple(_key(x) for x in k) if isinstance(k, (list, tuple)) else k


def pack(obj, tokenizer=None) -> bytes:
    """`obj` as one safetensors blob (NotPlain when it holds something that is not plain data)."""
    from safetensors.torch import save

    tensors = []
    meta = json.dumps(encode(obj, tensors, tokenizer), allow_nan=False)
    return save({f"t{i}": t.detach().contiguous().clone() for i, t in enumerate(tensors)}, metadata={"json": meta})


def metadata(blob: bytes) -> dict:
    """The metadata of a safetensors blob, read from its header (8-byte length, then JSON)."""
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise ValueError("a truncated message")
    return json.loads(blob[8:8 + n]).get("__metadata__") or {}


def unpack(blob: bytes, tokenizer=None):
    """The object `pack` wrote (fresh tensors; those sent as needing a gradient need one); any error is the
    sender's."""
    from safetensors.torch import load

    return decode(json.loads(metadata(blob)["json"]), load(blob), tokenizer)


def send(fd: int, blob: bytes) -> None:
    view = memoryview(struct.pack("<Q", len(blob)) + blob)
    while view:
        view = view[os.write(fd, view):]


def receive(fd: int, limit: int = LIMIT) -> bytes:
    """One message from `fd`; EOFError when the other end closed, ValueError past `limit` bytes."""
    (n,) = struct.unpack("<Q", _exactly(fd, 8))
    if n > limit:
        raise ValueError(f"a message of {n} bytes, over {limit}")
    return _exactly(fd, n)


def _exactly(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def fingerprint(fn, name: str, args: tuple, kwargs: dict, tokenizer=None) -> str:
    """A digest of the call `name(*args, **kwargs)` as `fn`'s signature binds it (defaults applied; tensors by
    dtype, shape and bytes, whether they need a gradient or not): the same on both ends of the wire."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    tensors = []
    meta = _without_grad(encode(dict(bound.arguments), tensors, tokenizer))
    h = hashlib.sha256(json.dumps([name, meta], sort_keys=True, default=str).encode())
    for t in tensors:
        t = t.detach().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update((t.double() if t.is_floating_point() else t.long()).contiguous().numpy().tobytes())
    return h.hexdigest()


def _without_grad(meta):
    if isinstance(meta, list):
        return [_without_grad(x) for x in meta]
    if isinstance(meta, dict):
        return {k: _without_grad(v) for k, v in meta.items() if k != "grad"}
    return meta


def _flat_tensors(obj, out: list) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _flat_tensors(x, out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flat_tensors(v, out)
    return out


def _replace_tensors(obj, new: list):
    import torch

    if isinstance(obj, torch.Tensor):
        return new.pop(0)
    if isinstance(obj, (list, tuple)):
        items = [_replace_tensors(x, new) for x in obj]
        return items if type(obj) is list else tuple(items)
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, new) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------------------------------
# the graded process's end
# ---------------------------------------------------------------------------------------------------
class Dependencies:
    """The reference's functions, answered over the pipes `ask` (requests) and `hear` (answers)."""

    def __init__(self, ask: int, hear: int, ctx: dict):
        self.ask, self.hear, self.ctx = ask, hear, ctx   # ctx.get("tokenizer"): the grading's, once it is built

    def round_trip(self, request: dict) -> dict:
        send(self.ask, pack(request, self.ctx.get("tokenizer")))
        answer = unpack(receive(self.hear), self.ctx.get("tokenizer"))
        if "refused" in answer:
            raise RuntimeError(answer["refused"])
        return answer

    def function(self, name: str, swaps=None):
        """A stand-in for the reference's `name` ("prm.first_error"). `swaps()`: the tags of the functions the
        reference should use in place of its own for this call (the grading's `_attached_surrogate`)."""
        import torch

        deps = self

        class Remote(torch.autograd.Function):
            """The call as one node: forward asks for the outputs, backward for the vector-Jacobian product."""

            @staticmethod
            def forward(ctx, request, holder, *inputs):
                answer = deps.round_trip(dict(request, op="call"))
                floats = [t for t in _flat_tensors(answer["output"], []) if t.is_floating_point()]
                ctx.request = request
                ctx.mark_non_differentiable(*[t for t, g in zip(floats, answer["grad"]) if not g])
                holder["output"] = answer["output"]
                return tuple(floats)

            @staticmethod
            def backward(ctx, *grads):
                answer = deps.round_trip(dict(ctx.request, op="vjp", grads=list(grads)))
                return (None, None, *answer["grads"])

        def stand_in(*args, **kwargs):
            request = {"name": name, "args": list(args), "kwargs": kwargs, "swaps": swaps() if swaps else []}
            leaves = [t for t in _flat_tensors([args, kwargs], []) if t.requires_grad]
            if not torch.is_grad_enabled() or not leaves:
                return deps.round_trip(dict(request, op="call"))["output"]
            holder = {}
            floats = list(Remote.apply(request, holder, *leaves))
            new = [floats.pop(0) if t.is_floating_point() else t for t in _flat_tensors(holder["output"], [])]
            return _replace_tensors(holder["output"], new)

        stand_in.__name__ = stand_in.__qualname__ = name.split(".")[-1]
        return stand_in


# ---------------------------------------------------------------------------------------------------
# the grader's end
# ---------------------------------------------------------------------------------------------------
def serve(ask: int, hear: int, functions: dict, tokenizer, refused: set, swaps: dict) -> None:
    """Answer a graded process's calls until it closes its end: `functions` {"prm.first_error": the reference's
    function}; a call whose fingerprint is in `refused` (the held-out inputs of the other problems) is refused;
    `swaps` {tag: (module, attribute, function)} the replacements a call may ask for. Every answer is plain
    data; an error in the reference's code on the student's inputs goes back as that error's first line."""
    import torch

    while True:
        try:
            request = unpack(receive(ask), tokenizer)
        except EOFError:
            return
        try:
            answer = _answer(request, functions, tokenizer, refused, swaps, torch)
            blob = pack(answer, tokenizer)
        except Exception as err:   # the student's inputs may make the reference raise anything
            blob = pack({"refused": f"{type(err).__name__}: {str(err)[:200]}"})
        try:
            send(hear, blob)
        except OSError:
            return


def _answer(request: dict, functions: dict, tokenizer, refused: set, swaps: dict, torch):
    name = request["name"]
    if name not in functions:
        raise PermissionError(f"{name} is not a function this problem depends on")
    fn = functions[name]
    args, kwargs = tuple(request["args"]), dict(request["kwargs"])
    if fingerprint(fn, name, args, kwargs, tokenizer) in refused:
        raise PermissionError(f"{name}: these are the held-out inputs of another problem")
    saved = []
    for tag in request.get("swaps") or []:
        module, attr, replacement = swaps[tag]
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, replacement)
    try:   # the inputs sent as needing a gradient need one here (`decode`): the outputs' flags are the reference's
        leaves = [t for t in _flat_tensors([args, kwargs], []) if t.requires_grad]
        with torch.enable_grad():
            out = fn(*args, **kwargs)
        floats = [t for t in _flat_tensors(out, []) if t.is_floating_point()]
        if request["op"] == "call":
            return {"output": out, "grad": [t.requires_grad for t in floats]}
        pairs = [(o, g) for o, g in zip(floats, request["grads"]) if o.requires_grad and g is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g.to(o.dtype) for o, g in pairs],
                                    allow_unused=True) if pairs and leaves else [None] * len(leaves)
        return {"grads": [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]}
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)
