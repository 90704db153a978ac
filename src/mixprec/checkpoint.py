"""Checkpoints that are written atomically, checksummed, verified on load, and resume bit for bit.

A checkpoint holds the model, the optimizer, everything the engine owns (loss scale and its counters,
fp32 master weights, the stochastic-rounding generator), an optional LR scheduler, the RNG states of
torch, CUDA, ``random`` and NumPy, and the user's extras::

    save_checkpoint("run/step_1000.ckpt", mp, scheduler=sched, extra={"step": 1000})
    extra = load_checkpoint("run/step_1000.ckpt", mp, scheduler=sched)

File layout: a magic line, the payload's length (8 bytes, little endian) and SHA-256 (32 bytes), then
the payload as ``torch.save`` wrote it. The magic line starts with a tiny pickle that names
``use_mixprec_read_checkpoint``: ``torch.load`` on the file fails on that name (weights_only) or runs
it, and it raises an error saying how to open the file (``mixprec.read_checkpoint``, ``mixprec ckpt
show``), where a bare header gave "Unsupported operand 80". Files written with the v1 line still load. The file is written under a temporary name in the same folder,
flushed to disk and renamed over the target, so a crash leaves the old checkpoint or the new one,
never half of one.
"""

from __future__ import annotations

import contextlib
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

from .checkpoint_check import check_fits
from .engine import MixedPrecision

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


def save_checkpoint(path: str | os.PathLike, engine: MixedPrecision, *, scheduler: Any = None,
                    extra: Any = None, rng: bool = True) -> Path:
    """Write everything needed to resume ``engine``'s run to ``path``, atomically. Syncs with the host."""
    if not isinstance(engine, MixedPrecision):
        raise TypeError(f"save_checkpoint needs the MixedPrecision engine, got {type(engine).__name__}")
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


def write_verified(path: str | os.PathLike, state: Any) -> Path:
    """``torch.save(state)`` to ``path`` atomically, behind the magic, length and SHA-256 header."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory: save_checkpoint writes one file; give a file name, "
                              f"e.g. {path / 'step_1000.ckpt'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _write_error(path, exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + len(payload).to_bytes(8, "little") + hashlib.sha256(payload).digest())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):   # disk full, read-only, quota: the previous file is untouched
            raise _write_error(path, exc) from exc
        raise
    _fsync_dir(path.parent)
    return path


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

    A bad or misfitting file changes nothing: the checksum is checked before anything is unpickled,
    and everything the file holds is checked against the engine (model keys, shapes and dtypes, the
    recipe, the loss scale, master weights, fp8 state, the optimizer's type, groups and state shapes,
    the scheduler both ways, the RNG state: ``checkpoint_check``) before the first tensor is copied.
    A file that holds scheduler state must be loaded with ``scheduler=`` (or ``ignore_scheduler=True``).
    ``weights_only=False`` lets extras hold arbitrary Python objects: only for files you trust.
    """
    path = Path(path)
    state = read_verified(path, engine.device, weights_only)
    try:
        check_fits(state, engine, scheduler, ignore_scheduler=ignore_scheduler)
    except ValueError as exc:
        raise CheckpointError(f"{path}: does not fit this model/optimizer/recipe: {exc}") from None
    # Everything below was checked to fit: each load accepts what it is given.
    try:
        engine.model.load_state_dict(state["model"])
        engine.load_state_dict(state["mixprec"])
        engine.optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if rng and state["rng"] is not None:
            _set_rng_state(state["rng"])
    except Exception as exc:   # a misfit the checks do not know yet: say the engine is half-restored
        raise CheckpointError(f"{path}: restoring failed after every check passed ({exc}); the engine may "
                              "be partly restored: rebuild it before training on, and report this as a "
                              "mixprec bug") from exc
    return state["extra"]


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

