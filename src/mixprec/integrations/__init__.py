"""Integrations with the trainers people use; each is an optional extra, imported on its own.

- ``mixprec.integrations.hf``: ``MixedPrecisionTrainer``, a Hugging Face ``Trainer`` that trains under
  a mixprec recipe (``pip install 'mixprec[hf]'``).
- ``mixprec.integrations.lightning``: ``MixedPrecisionPlugin``, a Lightning ``Precision`` plugin
  (``pip install 'mixprec[lightning]'``).
- ``mixprec.integrations.logging``: ``MetricsLogger``, loss scale, skipped steps, grad norm and
  per-layer range fractions to TensorBoard's ``SummaryWriter`` or any logger (no extra needed).

This package imports none of them: ``import mixprec`` never imports transformers or lightning.
Accelerate needs no integration: build the engine on the prepared model and optimizer (docs/integrations.md).

May import: the core; nothing in mixprec imports this package.
"""
