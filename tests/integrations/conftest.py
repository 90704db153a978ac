"""Third-party models and trainers (transformers, timm, torchvision, accelerate, lightning).

Each test imports what it needs with ``need(name)``: a missing package skips the test with a reason
(CI installs them, so there they run). torchvision's PyPI wheels are CUDA builds whose C++ ops cannot
load against a CPU-only torch; torchvision then fails at import (its fake kernel for ``nms`` needs the
op), and so do timm and transformers, which import it. The models tested here use none of those ops,
so where the ops cannot load their two schemas are declared (never implemented) before any import.
"""

import glob
import importlib.util
import os

import pytest
import torch

_KEEP = []


def _declare_missing_torchvision_ops() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for path in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(path)
            return                                  # the real ops are there
        except (OSError, RuntimeError):
            continue
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)                               # a dropped Library would undefine them


_declare_missing_torchvision_ops()


def need(name: str):
    """The module ``name``, or skip the test saying which package to install."""
    return pytest.importorskip(name, reason=f"{name} is not installed (pip install 'mixprec[hf]' or "
                                            f"'mixprec[lightning]', or {name} itself)")
