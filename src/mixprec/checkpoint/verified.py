"""The verified file a checkpoint is: a header, a checksum, and a write that is atomic.

Layout: a magic line, the payload's length (8 bytes, little endian) and SHA-256 (32 bytes), then the
payload as ``torch.save`` wrote it::

    write_verified("run/step_1000.ckpt", state)      # atomically, behind the header
    state = read_verified(Path("run/step_1000.ckpt"), torch.device("cpu"))   # checked, then loaded

The magic line starts with a tiny pickle that names ``use_mixprec_read_checkpoint``: ``torch.load`` on
the file runs it (importing mixprec allowlists it for torch's default ``weights_only=True``; without
mixprec imported, torch's refusal names it), and it raises an error saying how to open the file
(``mixprec.read_checkpoint``, ``mixprec ckpt show``), where a bare header gave "Unsupported operand 80".
Files written with the v1 line still load. The file is written under a temporary name in the same
folder, flushed to disk and renamed over the target, so a crash leaves the old checkpoint or the new
one, never half of one (plus a hidden temporary file, which the next save to that path removes).

What the payload holds, and restoring it into an engine, is ``files.py``'s (``save_checkpoint``,
``load_checkpoint``); this module knows bytes, not engines, and imports nothing of mixprec.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:   # Windows: no flock, so stale temporary files are not cleaned up there
    fcntl = None

__all__ = ["write_verified", "read_verified", "CheckpointError", "use_mixprec_read_checkpoint"]

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


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk (POSIX); not possible on Windows.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
