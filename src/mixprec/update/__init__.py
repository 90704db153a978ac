"""How a 16-bit weight takes its optimizer step.

Under a pure recipe (``fp16-pure``, ``bf16-pure``) the optimizer steps fp32 master copies and the model's
16-bit weights are their rounding (``master.py``: ``MasterWeights``, made of the step taken chunk by chunk,
``chunks.py``, the fp32 transients in flat buffers, ``transients.py``, and their rounding back into the
model, ``writeback.py``); ``bf16-sr`` keeps no master and rounds the fp32 update stochastically
(``stochastic_rounding.py``); ``rounding=kahan`` keeps the fp32 value's low half beside each
bf16 weight (``kahan.py``); ``moments=bf16|bf16-sr|fp8`` steps with the engine's own AdamW
(``compact_adamw.py``). ``bit_views.py`` and ``operands.py`` are what those passes work on: a flat fp32
buffer's bit patterns, and constants kept as 0-d tensors.

May import: ``formats``, ``recipe``, and its own modules; nothing of the engine or the step.
"""
