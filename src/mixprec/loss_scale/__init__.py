"""Loss scales: none, static, dynamic and per-layer, behind one ``LossScale`` protocol.

``scales.py`` holds the protocol and the global scales; ``per_layer.py`` adds ``scale=per-layer`` (a
power-of-two factor per layer on top of the dynamic scale, applied by hooks at the layer's edges:
``edge_hooks.py``) and ``layer_graph.py`` says which modules are layers and proves a graph suits them.

May import: ``fusion``, ``recipe``, ``step.grad_sync``, and its own modules.
"""

from .scales import DynamicLossScale, LossScale, NoLossScale, ScaleInBackward, StaticLossScale, make_loss_scale

__all__ = ["LossScale", "NoLossScale", "StaticLossScale", "DynamicLossScale", "ScaleInBackward",
           "make_loss_scale"]
