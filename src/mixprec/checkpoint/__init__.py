"""Checkpoints: written atomically, checksummed, verified before any state moves, resumed bit for bit.

``files.py`` saves and loads (``save_checkpoint``, ``load_checkpoint``); ``verified.py`` is the file
itself (header, SHA-256, atomic write, ``CheckpointError``); ``check.py`` checks that a state fits an
engine before anything is written, ``optim.py`` the optimizer's and LR scheduler's part of that;
``values.py`` refuses values no run can produce; ``read.py`` sums a checkpoint up without an engine
(``read_checkpoint``); ``export.py`` gives the fp32 weights for ``save_pretrained`` and serving;
``engine_state.py`` is the engine's own state (``mp.state_dict()``, ``mp.load_state_dict``) and fp32
weights loaded at fp32 precision (``mp.load_model_state_dict``).

May import: the engine (``files.py``, ``export.py``, ``engine_state.py`` for annotations), ``fp8``,
``recipe``, and its own modules. The engine imports ``engine_state.py`` (which imports ``check.py``, with
``optim.py`` and ``values.py``) and ``export.py``.
"""

import importlib as _importlib

# The public names, resolved at first use: ``files.py`` imports the engine, which imports ``check.py``
# from this package, so importing ``files`` here would make a circle. Checkpoints on disk name
# ``mixprec.checkpoint.use_mixprec_read_checkpoint`` (the header torch.load meets): it must resolve here.
_PUBLIC = {**dict.fromkeys(["save_checkpoint", "load_checkpoint"], "files"),
           **dict.fromkeys(["CheckpointError", "use_mixprec_read_checkpoint"], "verified"),
           **dict.fromkeys(["read_checkpoint", "CheckpointInfo"], "read"),
           "fp32_state_dict": "export"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mixprec.checkpoint' has no attribute {name!r}")
    return getattr(_importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)


def __dir__() -> list:
    return sorted([*globals(), *_PUBLIC])
