"""The pieces of ``mp.step()`` below the engine.

The step's middle (``optimizer.py``: one norm for the overflow check and the clip, then the fused or
generic optimizer call), the global gradient norm (``grad_norm.py``), the lockstep across ranks
(``grad_sync.py``), the step compiled as one graph (``compiled.py``: ``mp.compile_step()``), and what one
step did (``result.py``: ``StepResult`` and the ``StepObserver`` protocol), and the engine's parts that
every step uses, built once at construction (``parts.py``: the model and optimizer prepared for the recipe,
the flags ``autocast()``, ``backward()`` and ``step()`` read).

May import: ``fusion``, ``recipe``, and its own modules; ``parts.py`` also the rows below (``casting``,
``update``, ``guards``) and ``loss_scale`` and ``fp8`` beside it, to build those parts; the engine only for
type annotations.
"""
