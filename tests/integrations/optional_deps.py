"""Third-party models and trainers (transformers, timm, torchvision, accelerate, lightning).

Each test imports what it needs with ``need(name)``: a missing package skips the test with a reason
(``make test`` installs them where they can work, so there they run). A package that is installed but
cannot be imported fails the test, with the fix: that is a broken environment, not a missing extra.
"""

import pytest

_EXTRA = {"timm": "vision-test", "torchvision": "vision-test", "transformers": "hf", "accelerate": "hf",
          "lightning": "lightning"}


def need(name: str):
    """The module ``name``, or skip the test saying which extra to install."""
    try:
        return pytest.importorskip(name, reason=f"{name} is not installed (pip install "
                                                f"'mixprec[{_EXTRA.get(name, 'integrations-test')}]')")
    except (ImportError, pytest.skip.Exception):
        raise
    except Exception as e:
        # PyPI's Linux torchvision wheels are CUDA builds: against a CPU-only torch their C++ ops do
        # not load, and importing torchvision (or timm, or what imports it) raises RuntimeError.
        pytest.fail(f"{name} is installed but cannot be imported ({type(e).__name__}: {e}); most often a "
                    f"torchvision built for another torch: `pip uninstall torchvision timm` (make test "
                    f"leaves them out next to a CPU-only torch) or install the build that matches your torch")
