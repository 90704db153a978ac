"""Property: a checkpoint payload mutated anywhere (a key dropped, a type changed, a value changed, a
list cut) and re-wrapped with a correct checksum either loads and the engine steps on, or is refused
with CheckpointError/ValueError/TypeError and leaves the engine bit for bit as it was.

Files with a correct checksum and wrong contents are what an edit, a bug in another tool or a version
skew produce; the checksum cannot catch them, so ``load_checkpoint``'s checks and its snapshot must.
"""

import copy
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mixprec import CheckpointError, MixedPrecision, load_checkpoint, save_checkpoint
from mixprec.checkpoint.verified import read_verified, write_verified

from conftest import batches, tiny_model

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

# 200 fixed examples (~20 s on a laptop core) by default; MIXPREC_FUZZ_EXAMPLES=2000 for a longer,
# randomised hunt (hypothesis's --hypothesis-seed then picks the examples).
MAX_EXAMPLES = int(os.environ.get("MIXPREC_FUZZ_EXAMPLES", "200"))
DERANDOMIZE = "MIXPREC_FUZZ_EXAMPLES" not in os.environ


def build(seed, recipe="fp16-pure"):
    model = tiny_model(seed, hidden=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mp = MixedPrecision(model, optimizer, recipe)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9 ** s)
    for x, y in batches(2, seed=seed + 1, batch=4):
        train_step(mp)
        scheduler.step()
    return mp, scheduler


def train_step(mp, seed=11):
    x, y = batches(1, seed=seed, batch=4)[0]
    with mp.autocast():
        loss = F.cross_entropy(mp.model(x), y)
    mp.backward(loss)
    mp.step()
    mp.zero_grad()


def everything(mp, scheduler):
    """All a load may touch, as plain comparable data (tensors cloned)."""
    return copy.deepcopy({
        "model": mp.model.state_dict(), "engine": mp.state_dict(),
        "optimizer": mp.optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()),
    })


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point and a.dim() else a,
                        b.view(torch.uint8) if b.dtype.is_floating_point and b.dim() else b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return a == b


def nodes(obj, path=()):
    """Every place in the payload a mutation can hit (long lists, like the RNG's 625 words, as one)."""
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from nodes(v, path + (k,))
    elif isinstance(obj, (list, tuple)) and len(obj) <= 10:
        for i, v in enumerate(obj):
            yield from nodes(v, path + (i,))


def get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def put(obj, path, value):
    parent = get(obj, path[:-1])
    if isinstance(parent, tuple):      # rebuild the tuple in its own parent
        items = list(parent)
        items[path[-1]] = value
        put(obj, path[:-1], tuple(items))
    else:
        parent[path[-1]] = value


OTHER_VALUES = [None, "x", 0, -1, 1.5, float("nan"), float("inf"), True, [], {}, [1, 2],
                torch.tensor(3.0), torch.tensor([1.0, 2.0]), torch.zeros(2, 2, dtype=torch.int64)]


def mutate(payload, data):
    places = [p for p in nodes(payload) if p]
    path = data.draw(st.sampled_from(places), label="path")
    value = get(payload, path)
    kind = data.draw(st.sampled_from(["drop", "type", "value", "truncate"]), label="kind")
    parent = get(payload, path[:-1])
    if kind == "drop" and isinstance(parent, dict):
        del parent[path[-1]]
    elif kind == "truncate" and isinstance(value, (list, tuple, torch.Tensor)) and (
            value.dim() > 0 if isinstance(value, torch.Tensor) else True) and len(value):
        cut = data.draw(st.integers(0, len(value) - 1), label="keep")
        put(payload, path, value[:cut])
    elif kind == "value" and isinstance(value, torch.Tensor) and value.numel():
        value = value.clone()
        fill = data.draw(st.sampled_from([0, -1, 7, 2 ** 40, float("nan"), float("inf")]), label="fill")
        if value.dtype == torch.bool:
            fill = not bool(value.view(-1)[0])
        elif not value.dtype.is_floating_point:   # in the dtype's range: the file can hold only those
            info = torch.iinfo(value.dtype)
            fill = max(info.min, min(info.max, -5 if isinstance(fill, float) else fill))
        value.view(-1)[data.draw(st.integers(0, value.numel() - 1), label="at")] = fill
        put(payload, path, value)
    elif kind == "value" and isinstance(value, (int, float)) and not isinstance(value, bool):
        put(payload, path, data.draw(st.sampled_from([-1, 0, -0.5, 1e30, float("nan"), 10 ** 12]), label="v"))
    else:
        put(payload, path, data.draw(st.sampled_from(OTHER_VALUES), label="other"))
    return path, kind


_REFERENCE = []


def reference(folder):
    """The payload of a valid checkpoint (built once per session)."""
    if not _REFERENCE:
        path = folder / "ref.ckpt"
        mp, scheduler = build(3)
        save_checkpoint(path, mp, scheduler=scheduler, extra={"step": 2, "tags": ["a", "b"]})
        _REFERENCE.append(read_verified(path, torch.device("cpu")))
    return _REFERENCE[0]


@hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=DERANDOMIZE,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(data=st.data())
def test_a_mutated_payload_loads_whole_or_changes_nothing(tmp_path_factory, data):
    folder = tmp_path_factory.getbasetemp()
    payload = copy.deepcopy(reference(folder))
    where = mutate(payload, data)
    path = folder / "case.ckpt"
    write_verified(path, payload)
    mp, scheduler = build(0)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    before = everything(mp, scheduler)
    try:
        load_checkpoint(path, mp, scheduler=scheduler)
    except (CheckpointError, ValueError, TypeError) as exc:
        assert not str(exc).startswith("Traceback") and len(str(exc)) > 20, where
        assert "put back" not in str(exc), (where, str(exc))       # the checks, not the snapshot, caught it
        assert same(before, everything(mp, scheduler)), (where, str(exc))
    else:
        train_step(mp)             # loaded whole: the engine steps on
        scheduler.step()
