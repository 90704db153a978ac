"""Third-party models and trainers (transformers, timm, torchvision, accelerate, lightning).

Each test imports what it needs with ``need(name)``: a missing package skips the test with a reason
(CI installs them, so there they run). The torchvision stand-in declared in tests/conftest.py keeps
a CUDA-built torchvision wheel from breaking these imports on a CPU-only torch.
"""

import pytest


def need(name: str):
    """The module ``name``, or skip the test saying which package to install."""
    return pytest.importorskip(name, reason=f"{name} is not installed (pip install 'mixprec[hf]' or "
                                            f"'mixprec[lightning]', or {name} itself)")
