"""Checkpoints that are written atomically, checksummed, verified on load, and resume bit for bit.

A checkpoint holds the model, the optimizer, everything the engine owns (loss scale and its counters,
fp32 master weights, the stochastic-rounding generator), an optional LR scheduler, the RNG states of
torch, CUDA, ``random`` and NumPy, and the user's extras::

    save_checkpoint("run/step_1000.ckpt", mp, scheduler=sched, extra={"step": 1000})
    extra = load_checkpoint("run/step_1000.ckpt", mp, scheduler=sched)

File layout: a magic line, the payload's length (8 bytes, little endian) and SHA-256 (32 bytes), then
the payload as ``torch.save`` wrote it. The magic line starts with a tiny pickle that names
``use_mixprec_read_checkpoint``: ``torch.load`` on the file runs it (importing mixprec allowlists it for
torch's default ``weights_only=True``; without mixprec imported, torch's refusal names it), and it raises
an error saying how to open the file (``mixprec.read_checkpoint``, ``mixprec ckpt show``), where a bare
header gave "Unsupported operand 80". Files written with the v1 line still load. The file is written under a temporary name in the same folder,
flushed to disk and renamed over the target, so a crash leaves the old checkpoint or the new one,
never half of one (plus a hidden temporary file, which the next save to that path removes).
A load checks the whole payload first and restores from a snapshot if anything still fails: a failed
load changes nothing.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .check import check_fits
from ..engine import MixedPrecision

try:
    import fcntl
except ImportError:   # Windows: no flock, so stale temporary files are not cleaned up there
    fcntl = None

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError"]

# protocol 2, GLOBAL mixprec.checkpoint.use_mixprec_read_checkpoint, (), REDUCE, STOP: what torch.load meets.
_TORCH_LOAD_TRAP = b"\x80\x02cmixprec.checkpoint\nuse_mixprec_read_checkpoint\n)R."
_MAGIC = _TORCH_LOAD_TRAP + b"MIXPREC-CHECKPOINT v2\n"
_MAGICS = (_MAGIC, b"MIXPREC-CHECKPOINT v1\n")     # what read_verified accepts, newest first


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, altered, or does not fit the engine it is loaded into."""


def use_mixprec_read_checkpoint() -> None:
    """What ``torch.load`` (or ``pickle.load``) on a mixprec checkpoint runs first: an error with the way in."""
    raise CheckpointError("this is a mixprec checkpoint: a checksummed header sits before torch.save's "
                          "payload, so torch.load cannot read it. Open it with "
                          "mixprec.read_checkpoint(path) (returns what it holds, verified; .state is the "
                          "payload), or from a shell with `mixprec ckpt show PATH`; resume with "
                          "mixprec.load_checkpoint(path, engine)")


# torch.load's default (weights_only=True) refuses the header's global by name, at the end of a long message
# that suggests allowlisting it; allowlisted, it runs, and says how to open the file. It only raises, so
# allowing it lets nothing else run. Done where mixprec is imported, as the unpickler asks it to be.
# Allowlisted under the name the header spells (files on disk name mixprec.checkpoint, the package that
# re-exports it), not under this module's.
torch.serialization.add_safe_globals([(use_mixprec_read_checkpoint,
                                       "mixprec.checkpoint.use_mixprec_read_checkpoint")])


def save_checkpoint(path: str | os.PathLike, engine: MixedPrecision, *, scheduler: Any = None,
                    extra: Any = None, rng: bool = True) -> Path:
    """Write everything needed to resume ``engine``'s run to ``path``, atomically. Syncs with the host.

    The arguments are checked before anything is serialised: a swapped ``(engine, path)``, a bare
    model, an optimizer passed as ``scheduler=``, a scheduler of another optimizer, a path that names
    a folder, an ``extra`` that cannot be pickled: each a TypeError/ValueError naming the fix.
    """
    _check_call("save_checkpoint", path, engine)
    _check_flags("save_checkpoint", rng=rng)
    _check_scheduler_arg("save_checkpoint", scheduler, engine)
    _check_extra(extra)
    _check_file_path(path)
    state = {
        "model": engine.model.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "optimizer_type": type(engine.optimizer).__name__,   # an AdamW state must not load into an SGD
        "mixprec": engine.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scheduler_type": type(scheduler).__name__ if scheduler is not None else None,
        "rng": _rng_state() if rng else None,
        "extra": extra,
    }
    return write_verified(path, state)


def _check_call(name: str, path: Any, engine: Any) -> None:
    """TypeError for the two common slips: ``(engine, path)`` swapped, and a model in place of the engine."""
    if isinstance(path, MixedPrecision) and isinstance(engine, (str, os.PathLike)):
        raise TypeError(f"{name} takes the path first: call {name}(path, engine), not {name}(engine, path)")
    if not isinstance(engine, MixedPrecision):
        got = type(engine).__name__
        if isinstance(engine, torch.nn.Module):
            raise TypeError(f"{name} needs the MixedPrecision engine, got the bare model ({got}): pass the "
                            f"engine that wraps it, {name}(path, mp) with mp = MixedPrecision(model, "
                            "optimizer, recipe); it saves and restores model, optimizer and loss scale together")
        raise TypeError(f"{name} needs the MixedPrecision engine as its second argument, got {got}: "
                        f"call {name}(path, mp)")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} needs a file path (str or pathlib.Path) as its first argument, got "
                        f"{type(path).__name__}: call {name}('run/step_1000.ckpt', mp)")


def _check_flags(name: str, **flags: Any) -> None:
    """TypeError for a switch that is not a bool: ``rng="no"`` is truthy, and would save or restore RNG states."""
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}({flag}=...) takes True or False, got {type(value).__name__} {value!r}")


def _check_scheduler_arg(name: str, scheduler: Any, engine: MixedPrecision) -> None:
    """``scheduler=`` must be an LR scheduler (state_dict/load_state_dict) of the engine's own optimizer."""
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.Optimizer):
        raise TypeError(f"{name}(scheduler=...) got an optimizer ({type(scheduler).__name__}): the engine "
                        "saves its optimizer itself; pass the LR scheduler (e.g. a "
                        "torch.optim.lr_scheduler.LambdaLR), or leave scheduler= out")
    if not (callable(getattr(scheduler, "state_dict", None))
            and callable(getattr(scheduler, "load_state_dict", None))):
        raise TypeError(f"{name}(scheduler=...) got a {type(scheduler).__name__}, which has no "
                        "state_dict()/load_state_dict(): pass an LR scheduler (torch.optim.lr_scheduler.*), "
                        "or keep your own object's state in extra=")
    bound = getattr(scheduler, "optimizer", None)
    if isinstance(bound, torch.optim.Optimizer) and bound is not engine.optimizer:
        raise ValueError(f"{name}(scheduler=...) got a {type(scheduler).__name__} bound to another "
                         "optimizer than the engine's: build the scheduler on mp.optimizer (the one "
                         "passed to MixedPrecision)")


def _check_extra(extra: Any) -> None:
    """Pickle ``extra`` alone first: a lambda or an open file fails here, named, not inside the payload."""
    if extra is None:
        return
    try:
        torch.save(extra, io.BytesIO())
    except Exception as exc:    # pickle raises PicklingError, AttributeError or TypeError by object kind
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise TypeError(f"save_checkpoint(extra=...) holds something that cannot be pickled ({detail}): "
                        "keep extras to tensors, numbers, strings, lists and dicts (objects of "
                        "module-level classes work too, loaded with weights_only=False); store a "
                        "function by name, not the function") from None


def _check_file_path(path: str | os.PathLike) -> None:
    """A path that ends in a separator names a folder, even where none exists yet: refuse, with a file name."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    seps = (os.sep, os.altsep) if os.altsep else (os.sep,)
    folder = Path(text)
    if folder.is_dir():
        raise CheckpointError(f"{text} is a directory: save_checkpoint writes one file; give a file name, "
                              f"e.g. {folder / 'step_1000.ckpt'}")
    if text.endswith(seps):      # Path("run/") is "run": it would write a file named run
        raise CheckpointError(f"{text} ends with a path separator, so it names a folder: save_checkpoint "
                              f"writes one file; give a file name, e.g. {folder / 'step_1000.ckpt'}")


def write_verified(path: str | os.PathLike, state: Any) -> Path:
    """``torch.save(state)`` to ``path`` atomically, behind the magic, length and SHA-256 header.

    Removes the temporary files of ``path`` that a killed save left behind (hidden ``.NAME.*.tmp``,
    full-size): a writer holds an exclusive ``flock`` on its temporary file, so one nobody holds is stale.
    """
    _check_file_path(path)
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _locked_temp(path)
    except OSError as exc:
        raise _write_error(path, exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + len(payload).to_bytes(8, "little") + hashlib.sha256(payload).digest())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
            if fcntl is not None:      # still under our lock: a cleanup never takes a file being renamed
                os.replace(tmp, path)
        if fcntl is None:              # Windows cannot rename an open file
            os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):   # disk full, read-only, quota: the previous file is untouched
            raise _write_error(path, exc) from exc
        raise
    _fsync_dir(path.parent)
    _remove_stale_temps(path)
    return path


def _locked_temp(path: Path) -> tuple[int, str]:
    """A new temporary file beside ``path``, exclusively locked (where ``fcntl`` exists) while it is written."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        if fcntl is None:
            return fd, tmp
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:   # a cleanup may have taken it between mkstemp and flock: then make another
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


def _remove_stale_temps(path: Path) -> None:
    """Delete ``.NAME.XXXXXXXX.tmp`` files of ``path`` that no live writer holds (a save killed mid-write).

    Only where ``fcntl`` exists (POSIX): the kernel drops a killed writer's lock, so a temporary file we
    can lock is one nobody is writing. Best effort: a file we cannot open or remove is left alone.
    """
    if fcntl is None:
        return
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[A-Za-z0-9_]{{8}}\.tmp")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if not pattern.fullmatch(name):
            continue
        stale = path.parent / name
        with contextlib.suppress(OSError):
            fd = os.open(stale, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)    # BlockingIOError: a live writer
                if os.path.samestat(os.fstat(fd), os.stat(stale)):
                    os.unlink(stale)
            finally:
                os.close(fd)


def _write_error(path: Path, exc: OSError) -> CheckpointError:
    """The user's path, the system's reason (not our temporary file's name) and what to do."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, (FileExistsError, NotADirectoryError)):
        fix = "a part of the folder path is a file; choose another folder"
    else:
        fix = "choose a writable folder with free space; any previous checkpoint at that path is unchanged"
    return CheckpointError(f"{path}: could not be written ({reason}): {fix}")


def load_checkpoint(path: str | os.PathLike, engine: MixedPrecision, *, scheduler: Any = None,
                    rng: bool = True, weights_only: bool = True, ignore_scheduler: bool = False) -> Any:
    """Verify ``path`` and restore it into ``engine`` (and ``scheduler``); returns the saved extras.

    A bad or misfitting file changes nothing, twice over. The checksum is checked before anything is
    unpickled, and everything the file holds is checked against the engine (model keys, shapes and
    dtypes, the recipe, the loss scale and its values, master weights, fp8 state, the optimizer's
    type, groups, settings and per-parameter state, the scheduler both ways, the RNG states:
    ``checkpoint_check``) before the first tensor is copied. And the restore itself runs against a
    snapshot of everything it touches (model, engine, optimizer, scheduler, RNG states; tensors
    copied to the CPU): any failure part way puts all of it back before the error is raised.
    A file that holds scheduler state must be loaded with ``scheduler=`` (or ``ignore_scheduler=True``).
    ``weights_only=False`` lets extras hold arbitrary Python objects: only for files you trust.
    """
    _check_call("load_checkpoint", path, engine)
    _check_flags("load_checkpoint", rng=rng, weights_only=weights_only, ignore_scheduler=ignore_scheduler)
    _check_scheduler_arg("load_checkpoint", scheduler, engine)
    path = Path(path)
    state = read_verified(path, engine.device, weights_only)
    try:
        check_fits(state, engine, scheduler, ignore_scheduler=ignore_scheduler)
    except ValueError as exc:
        raise CheckpointError(f"{path}: does not fit this model/optimizer/recipe: {exc}") from None
    snapshot = _Snapshot(engine, scheduler, rng)
    try:
        engine.model.load_state_dict(state["model"])
        engine.load_state_dict(state["mixprec"])
        engine.optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if rng and state["rng"] is not None:
            _set_rng_state(state["rng"])
    except Exception as exc:   # a misfit the checks do not know yet: put everything back
        try:
            snapshot.restore()
        except Exception as again:
            raise CheckpointError(f"{path}: restoring failed after every check passed ({exc}), and putting "
                                  f"the engine back failed too ({again}): it may be partly restored: "
                                  "rebuild it before training on, and report this as a mixprec bug") from exc
        raise CheckpointError(f"{path}: restoring failed after every check passed ({exc}); the model, "
                              "optimizer, engine, scheduler and RNG states were put back as they were. "
                              "Report this as a mixprec bug, with the file") from exc
    return state["extra"]


class _Snapshot:
    """What ``load_checkpoint`` may change, kept so a failed restore can be undone bit for bit.

    Tensors are copied to the CPU (the loaded file already holds one device copy; a second would
    double the peak). The optimizer's ``state`` and ``param_groups`` are kept by reference:
    ``Optimizer.load_state_dict`` builds new ones and never writes into the old.
    """

    def __init__(self, engine: MixedPrecision, scheduler: Any, rng: bool) -> None:
        self.engine, self.scheduler = engine, scheduler
        self.model = {k: _cpu_copy(v) for k, v in engine.model.state_dict().items()}
        self.mixprec = _cpu_copy(engine.state_dict())
        self.opt_state, self.opt_groups = engine.optimizer.state, engine.optimizer.param_groups
        self.opt_group_items = [dict(g) for g in engine.optimizer.param_groups]
        self.sched_dict = dict(scheduler.__dict__) if scheduler is not None else None
        self.sched_state = _cpu_copy(scheduler.state_dict()) if scheduler is not None else None
        self.rng = _rng_snapshot() if rng else None

    def restore(self) -> None:
        engine = self.engine
        with torch.no_grad():
            for key, tensor in engine.model.state_dict().items():
                tensor.copy_(self.model[key])
        engine.load_state_dict(self.mixprec)
        engine.optimizer.state, engine.optimizer.param_groups = self.opt_state, self.opt_groups
        for group, items in zip(self.opt_groups, self.opt_group_items):
            group.clear()
            group.update(items)
        if self.scheduler is not None:
            self.scheduler.__dict__.clear()
            self.scheduler.__dict__.update(self.sched_dict)
            self.scheduler.load_state_dict(self.sched_state)
        if self.rng is not None:
            _restore_rng(self.rng)


def _cpu_copy(obj: Any) -> Any:
    """A deep copy with every tensor cloned to the CPU (dicts, lists and tuples rebuilt, the rest copied)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _rng_snapshot() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def _restore_rng(saved: tuple) -> None:
    cpu, cuda, python, numpy_state = saved
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    np.random.set_state(numpy_state)


def read_verified(path: Path, device: torch.device, weights_only: bool = True) -> Any:
    """Check ``path``'s header and checksum, then ``torch.load`` it; CheckpointError if anything is off."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a directory, not a checkpoint file: give the file written by "
                              "save_checkpoint (an FSDP2 checkpoint folder loads with "
                              "load_distributed_checkpoint)") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: could not be read ({exc.strerror or exc})") from None
    # A file cut inside the magic line still names itself: it is a truncated checkpoint.
    magic = next((m for m in _MAGICS if data.startswith(m) or (data and m.startswith(data))), None)
    if magic is None:
        raise CheckpointError(f"{path}: not a mixprec checkpoint (no mixprec header)")
    header = len(magic) + 8 + 32
    if len(data) < header:
        raise CheckpointError(f"{path}: truncated inside its header ({len(data)} bytes)")
    length = int.from_bytes(data[len(magic):len(magic) + 8], "little")
    digest = data[len(magic) + 8:header]
    payload = data[header:]
    if len(payload) != length:
        raise CheckpointError(f"{path}: truncated or padded: the header promises {length} bytes of "
                              f"payload, the file holds {len(payload)}")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch: the file was altered or corrupted after it "
                              "was written")
    try:
        return torch.load(io.BytesIO(payload), map_location=device, weights_only=weights_only)
    except Exception as exc:   # the bytes are as written, so this is an unpickling restriction
        # The hint first: torch's own message runs to a thousand characters with ANSI colour codes.
        first = _ANSI.sub("", str(exc)).strip().splitlines()
        detail = (first[0] if first else type(exc).__name__)[:200]
        raise CheckpointError(f"{path}: holds Python objects that weights_only=True refuses to load; if "
                              "you trust the file, pass load_checkpoint(..., weights_only=False) "
                              f"(torch said: {detail})") from exc


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _rng_state() -> dict[str, Any]:
    version, keys, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "python": [version, list(keys), gauss],
        # Plain types only, so the file loads with weights_only=True.
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk (POSIX); not possible on Windows.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

