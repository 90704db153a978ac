"""What runs in which dtype.

autocast's op lists and their edits (``oplists.py``; the probe of each op's policy: ``oplist_probe.py``),
the model prepared for a recipe (weights cast, norms kept fp32, per-module regions, the output cast:
``model.py``), which buffers a pure recipe may cast
(``buffers.py``), saved tensors kept in 16 bits (``saved16.py``), the fp32 loss from 16-bit logits
(``chunked_loss.py``: ``mixprec.cross_entropy``) and the TF32 switches of the ``fp32``/``tf32`` recipes
(``tf32.py``).

May import: ``formats``, ``recipe`` (only ``model.py``; the recipe itself reads ``OpPolicy``, the op names
and ``Saved`` from here), and its own modules.
"""
