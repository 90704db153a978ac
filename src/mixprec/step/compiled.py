"""A compiled ``MixedPrecision.step()``: the norm, clip, overflow check, fused optimizer step and loss-scale
update as one ``torch.compile`` graph, with no host sync and no Python branching on device values.

What the eager step runs as a few dozen small kernels (a norm per gradient, the clip coefficient, the
divisor, the optimizer, a dozen tiny scale-update ops) Inductor fuses into a handful; under
``mode="reduce-overhead"`` on CUDA the whole step is one CUDA-graph replay. The numbers are those of
the eager fused path: the same norm, the same divisor ``S / clip``, the same skip.

Only the fused path compiles (torch's ``fused=True`` Adam, AdamW or SGD): it divides, clips and skips
inside its own kernel, reading ``grad_scale`` and ``found_inf`` tensors. The generic path must ask the
host whether to call ``optimizer.step()`` at all, which a graph cannot do without a sync: so any other
optimizer, and the compact-moment recipes (``moments=bf16|bf16-sr|fp8``: the engine's own AdamW), are
refused here with that reason.

Which recipes: all the others (fp32, tf32, fp16, bf16, the pure, stochastic-rounding and Kahan recipes,
fp8, per-layer scales), tested through compile on a CPU (``tests/test_compile.py``) and, with CUDA graphs,
on a GPU (``tests/gpu/test_compile_cuda.py``). Recipes with fp32 copies fill them and round them back
eagerly around the graph (one multi-tensor copy each way); ``bf16-sr`` and ``bf16-kahan`` build those
copies afresh each step, so under CUDA graphs their addresses change from step to step, which a
recorded graph cannot replay (expect it to be recorded again; not yet measured on a GPU): compile their
step without ``mode="reduce-overhead"``, unless the model is small (fp32 weights and gradients within
4 MiB: ``MasterWeights`` keeps one buffer for them, at the same addresses every step). torch's ``optimizer.step()`` itself breaks the
graph on each side (torch/optim/optimizer.py, so that AOTAutograd sees it as an inference graph): the
step is three graphs, norm and divisor / the fused optimizer / the scale update, each one replay.

Those two tensors are *static buffers* owned here, written inside the graph and handed to the
optimizer for the call: CUDA graphs need inputs at fixed addresses, and torch.compile cannot trace
setting and deleting attributes on the optimizer. With the model eager (or compiled without CUDA
graphs), ``mp.zero_grad(set_to_none=False)`` keeps the gradients at fixed addresses. With the model
compiled with ``mode="reduce-overhead"`` too, its backward graph's outputs are the gradients: set them
to None (``zero_grad()``'s default) and call ``torch.compiler.cudagraph_mark_step_begin()`` before each
forward. Kept, they are outputs the next replay overwrites ("accessing tensor output of CUDAGraphs that
has been overwritten by a subsequent run": the H100 and H200 runs of 2026-11-27 and 28); the H200 run
of 11-28 trained that way for bf16 and fp8 (benchmarks/host/bench_host.py's captured variants).

    >>> import mixprec
    >>> model = torch.nn.Linear(4, 2)
    >>> mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), "bf16")
    >>> mp = mp.compile_step()         # compiles on the first step(); later steps replay the graph
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .optimizer import divides, unscale_and_clip

if TYPE_CHECKING:
    from ..engine import MixedPrecision

__all__ = ["CompiledStep"]


class CompiledStep:
    """``engine``'s step from the gradients to the updated loss scale, compiled once with ``options``
    (``torch.compile``'s keywords, e.g. ``mode="reduce-overhead"``)."""

    def __init__(self, engine: MixedPrecision, options: dict[str, Any]) -> None:
        opt = engine.optimizer
        fused = all(g.get("fused") for g in opt.param_groups)
        if not (fused and getattr(opt, "_step_supports_amp_scaling", False)):
            raise ValueError(f"compile_step() needs a fused optimizer, which unscales, clips and skips "
                             f"inside its kernel without a host sync; {type(opt).__name__} is not one: "
                             "build it with fused=True, e.g. torch.optim.AdamW(params, lr=..., "
                             "fused=True) (Adam, AdamW and SGD have it)")
        if engine.moments is not None:
            raise ValueError(f"compile_step() cannot compile recipe {engine.recipe.label!r}: moments="
                             f"{engine.recipe.moments.value} steps the engine's own AdamW (compact_adamw), "
                             "which has no fused kernel to skip an inf/NaN step on the device, so each step "
                             "asks the host whether to step. Use moments=fp32 with a fused optimizer to "
                             "compile the step, or leave it eager")
        self.engine = engine
        device = engine.device
        # 1.0 and 0.0 until the first step writes them; fp32 as the fused kernels expect.
        self.grad_scale = torch.ones((), dtype=torch.float32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        # The graph writes these and the loss scale's state in place. To Inductor they are graph inputs,
        # and CUDA graphs refuse a graph that mutates an input not marked static ("skipping cudagraphs
        # due to mutated inputs": the H100 run of 2026-11-27 fell back to eager that way). They live as
        # long as the engine, at fixed addresses, so static is true of them.
        for t in (self.grad_scale, self.found_inf, *_state_tensors(engine.loss_scale)):
            torch._dynamo.mark_static_address(t)
        self.compiled = torch.compile(self._body, **options)

    def _body(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        engine = self.engine
        found_inf, grad_norm, divisor = unscale_and_clip(engine, grads)
        if divisor is not None:     # a Python-level fact of the recipe and clip setting: no branch on data
            self.grad_scale.copy_(divisor)
        self.found_inf.copy_(found_inf.to(torch.float32))
        engine.optimizer.step()
        engine.loss_scale.update(found_inf)
        return found_inf, grad_norm

    def __call__(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(found_inf, grad_norm)``, the optimizer stepped or skipped and the loss scale updated."""
        opt = self.engine.optimizer
        opt.grad_scale = self.grad_scale if divides(self.engine) else None   # type: ignore[attr-defined]
        opt.found_inf = self.found_inf                            # type: ignore[attr-defined]
        checks = self.engine._checks
        checks.in_engine_step = True     # the optimizer's guard (usage_checks) lets the graph's step through
        try:
            return self.compiled(grads)
        finally:
            checks.in_engine_step = False
            del opt.grad_scale, opt.found_inf                     # type: ignore[attr-defined]


def _state_tensors(obj: object) -> list[torch.Tensor]:
    """The tensors ``obj`` holds as attributes (a loss scale's value, counters and hysteresis)."""
    return [v for v in vars(obj).values() if isinstance(v, torch.Tensor)]
