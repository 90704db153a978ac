"""The ``moments=`` key of the recipe grammar: in which format the optimizer's Adam moments are held.

    >>> Moments.parse("bf16-sr")
    <Moments.BF16_SR: 'bf16-sr'>
    >>> Moments.BF16_SR.bytes_per_element
    4.0

``fp32`` (the default) leaves the user's torch optimizer as it is. Every other value makes the engine
step with its own AdamW (``compact_adamw.CompactAdamW``), which reads the hyperparameters from the
user's ``torch.optim.Adam``/``AdamW`` and keeps the two moments compact:

- ``bf16``: both moments rounded to nearest bf16. Cheap, but Adam's second moment moves by
  ``1 - beta2 = 0.1%`` a step, below half a bf16 ulp (0.2%), so round-to-nearest freezes it: a baseline
  to show why ``bf16-sr`` exists.
- ``bf16-sr``: bf16 with stochastic rounding, unbiased, so those small moves survive on average
  (DeepSeek-V3 trains with bf16 AdamW moments). 2 + 2 bytes per parameter instead of 4 + 4.
- ``fp8``: e4m3 with one fp32 scale per block of 128 elements, stochastic rounding; the second moment is
  stored as its square root (half the dynamic range, and the quantity the update divides by).
  1 + 1 bytes per parameter plus 2 x 4 / 128 for the scales (FP8-LM, COAT keep fp8 optimizer state).
"""

from __future__ import annotations

import enum

__all__ = ["Moments", "FP8_BLOCK"]

FP8_BLOCK = 128     # elements per fp8 scale: one fp32 scale costs 4/128 = 0.03 B per element


class Moments(enum.Enum):
    """The storage format of Adam's two moments (``moments=`` in a recipe string)."""

    FP32 = "fp32"
    BF16 = "bf16"
    BF16_SR = "bf16-sr"
    FP8 = "fp8"

    @property
    def bytes_per_element(self) -> float:
        """Bytes of both moments per parameter element (fp8 includes its per-block scales)."""
        return {"fp32": 8.0, "bf16": 4.0, "bf16-sr": 4.0, "fp8": 2.0 + 2 * 4 / FP8_BLOCK}[self.value]

    @classmethod
    def parse(cls, word: str) -> Moments:
        try:
            return cls(word.strip().lower())
        except ValueError:
            raise ValueError(f"unknown moments {word!r}; valid values: {', '.join(m.value for m in cls)} "
                             "(e.g. moments=bf16-sr: Adam's moments in bf16 with stochastic rounding)"
                             ) from None
