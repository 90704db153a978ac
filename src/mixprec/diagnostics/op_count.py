"""What a training step costs, counted instead of timed: aten ops dispatched, and compiled graphs.

A drop-in must do no more than the loop it replaces. Timings on a shared machine wander by tens of
percent; counts do not. ``count_aten_ops(fn)`` runs ``fn`` once under a ``TorchDispatchMode`` and counts
every aten op that reaches a kernel (each one a kernel launch on a GPU), by name.
``count_compiled_graphs()`` records, while it is entered, each post-grad graph Inductor compiles (one
per forward and backward of a compiled region, and one per graph a break leaves) and its node count.

    >>> x = torch.ones(4)
    >>> ops = count_aten_ops(lambda: (x * 2).sum())
    >>> ops.total, ops.by_name
    (2, {'mul': 1, 'sum': 1})
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCount", "count_aten_ops", "CompiledGraphs", "count_compiled_graphs"]


@dataclasses.dataclass(frozen=True)
class OpCount:
    """Aten ops a call dispatched, by name (the overload packet: ``mul``, ``_foreach_mul_``)."""

    by_name: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def minus(self, other: OpCount) -> dict[str, int]:
        """Per op, how many more this count has than ``other`` (negative: fewer); zeros left out."""
        names = set(self.by_name) | set(other.by_name)
        diff = {n: self.by_name.get(n, 0) - other.by_name.get(n, 0) for n in sorted(names)}
        return {n: d for n, d in diff.items() if d}


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_aten_ops(fn: Callable[[], Any]) -> OpCount:
    """Run ``fn()`` once and count the aten ops it dispatched (forward, backward and optimizer alike).

    Composite ops count as what they decompose into, as the kernels that run. Ops inside a compiled
    region are not seen one by one (count graphs with ``count_compiled_graphs`` there).
    """
    with _Counter() as counter:
        fn()
    return OpCount(dict(counter.counts))


@dataclasses.dataclass
class CompiledGraphs:
    """Post-grad graphs Inductor compiled while ``count_compiled_graphs`` was entered."""

    nodes: list[int] = dataclasses.field(default_factory=list)   # per graph, in compile order

    @property
    def graphs(self) -> int:
        return len(self.nodes)

    @property
    def total_nodes(self) -> int:
        return sum(self.nodes)


@contextlib.contextmanager
def count_compiled_graphs() -> Iterator[CompiledGraphs]:
    """Record every post-grad graph Inductor compiles inside the block: how many, and their sizes.

    Uses Inductor's ``post_grad_custom_post_pass`` hook (restored on exit). Graphs served from a cache
    without compiling are not seen: compile fresh functions inside the block (``torch._dynamo.reset()``
    first where the same code was compiled before).
    """
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = CompiledGraphs()

    class _Record(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            seen.nodes.append(sum(1 for n in graph.nodes if n.op == "call_function"))

        def uuid(self) -> Any:
            return None      # never cached: each compile is counted

    saved = inductor_config.post_grad_custom_post_pass
    inductor_config.post_grad_custom_post_pass = _Record()
    try:
        yield seen
    finally:
        inductor_config.post_grad_custom_post_pass = saved
