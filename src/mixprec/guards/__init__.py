"""What the engine watches so that a mistake or a bad number is named, not silent.

Loop mistakes caught without a host sync (``usage.py``: no autocast, ``loss.backward()`` under a scale, a
bare ``optimizer.step()``, a model cast after the build), and the NaN/Inf origin tracer the engine hosts
(``nonfinite.py``) with the map from autograd nodes to the module that made them (``module_scope.py``).

May import: ``formats``, ``recipe``, and its own modules.
"""
