"""The compare experiment: one workload, several recipes, same seed and steps; a CompareReport out.

Two phases, so a typo never costs a training run: ``plan_compare`` checks every input (workload, steps,
device, each recipe and whether the device can run it) and returns a frozen plan; ``run_compare``
trains it::

    plan = plan_compare("mlp", ["fp32", "bf16"], steps=300, device="cpu")
    report = run_compare(plan)
    report.run("bf16").test_metric
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence

import torch

from ... import __version__
from ...devices import device_name, supports
from ...recipe import RECIPES, Recipe, get_recipe
from ...recipe.core import DEFAULT_FP32_MODULES
from .multiproc import check_parallel, train_on_ranks
from .report import CompareReport
from ..trainer import TrainProgress, check_recipe_patterns, check_seed, check_steps, resolve_run, train_steps
from ..workloads import Workload

__all__ = ["DEFAULT_RECIPES", "ComparePlan", "plan_compare", "run_compare", "turn_steps"]

DEFAULT_RECIPES = ("fp32", "fp16", "bf16", "fp16-pure")
_TURNS = 20                # turns each recipe takes when recipes are interleaved


@dataclasses.dataclass(frozen=True)
class ComparePlan:
    """A validated compare run: every recipe here can run on ``device``."""

    workload: Workload
    recipes: tuple[Recipe, ...]
    device: torch.device
    steps: int
    seed: int
    eval_every: int | None = None
    nproc: int = 1                 # processes (ranks) per run; > 1 trains through `parallel`
    parallel: str = "ddp"          # ddp | fsdp
    workload_spec: str = ""        # what get_workload resolves in each rank's process


def unique_recipes(recipes: Sequence[str | Recipe] | str | Recipe, verb: str) -> dict[str, Recipe]:
    """Parse recipe names/strings, dropping repeats (by their canonical string), in the order given."""
    if isinstance(recipes, (str, Recipe)):
        recipes = [recipes]
    parsed: dict[str, Recipe] = {}
    for spec in recipes:
        recipe = get_recipe(spec)
        parsed.setdefault(str(recipe), recipe)
    if not parsed:
        raise ValueError(f"no recipes to {verb}; name some, e.g. {','.join(DEFAULT_RECIPES)}")
    if len(parsed) == 1 and len(recipes) > 1:     # e.g. "fp32 fp32": a comparison of nothing
        raise ValueError(f"the recipes to {verb} ({', '.join(map(str, recipes))}) are one recipe, "
                         f"{next(iter(parsed))!r}, named {len(recipes)} times: name different ones, e.g. fp32 bf16")
    return parsed


def plan_compare(workload: str | Workload = "mlp", recipes: Sequence[str | Recipe] = DEFAULT_RECIPES, *,
                 steps: int | None = None, device: str | torch.device | None = "auto",
                 seed: int = 0, eval_every: int | None = None, nproc: int = 1,
                 parallel: str = "ddp") -> ComparePlan:
    """Check everything a compare run needs before any training; ValueError/TypeError name the fix.

    ``steps=None`` takes the workload's default. ``eval_every=None`` evaluates every tenth of the run.
    Recipes given twice run once. ``nproc > 1`` trains each recipe on that many processes
    (mixprec.lab.multiproc), splitting every global batch between them through DDP or FSDP2.
    """
    workload_spec = workload if isinstance(workload, str) else ""
    workload, device = resolve_run(workload, device, steps)
    steps = workload.default_steps if steps is None else check_steps(steps)
    seed = check_seed(seed)
    if eval_every is None:
        eval_every = max(1, steps // 10)
    elif isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval-every must be a positive number of steps, got {eval_every!r}")
    parsed = unique_recipes(recipes, "compare")
    if any(r.modules or r.fp8 is not None or r.fp32_modules != DEFAULT_FP32_MODULES for r in parsed.values()):
        # A name that matches nothing (modules=, fp32_modules=, fp8 skip=) is a typo: catch it on the real
        # model before training, not when its recipe's turn comes.
        with torch.random.fork_rng(devices=[]):
            model = workload.build_model()
        for recipe in parsed.values():
            check_recipe_patterns(model, recipe)
    for recipe in parsed.values():
        support = supports(recipe, device)
        if not support.ok:
            runnable = [n for n, r in RECIPES.items() if supports(r, device).ok]
            raise ValueError(f"recipe {recipe.label!r} cannot run on {device}: {support.reason} "
                             f"(recipes {device.type} can run: {', '.join(runnable)})")
    check_parallel(workload, tuple(parsed.values()), device, nproc, parallel, workload_spec)
    return ComparePlan(workload, tuple(parsed.values()), device, steps, seed, eval_every, nproc, parallel,
                       workload_spec)


def turn_steps(steps: int) -> int:
    """Steps a recipe trains per turn when recipes take turns: a twentieth of the run (at least 1).

    Twenty turns each: a slowdown that lasts a minute of a compare falls on every recipe, and a turn is
    long enough that the switch (one device sync, a cold cache for the first step) stays small.
    """
    return max(1, steps // _TURNS)


def run_compare(plan: ComparePlan,
                on_progress: Callable[[int, TrainProgress], None] | None = None) -> CompareReport:
    """Train ``plan``'s workload under each recipe, interleaved; ``on_progress(run_index, progress)``.

    The recipes take turns of ``turn_steps(plan.steps)`` steps, each on its own model, optimizer and
    engine (``trainer.train_steps``), so load from other work on the machine, or a GPU's clock changing
    as it warms, slows every recipe alike and the speed ratios stay side by side. A run's clock stops
    while the others train. Ctrl-C keeps every run that was paused between turns, each at the steps it
    took, in a report with ``partial=True`` (the run that was training when it came is lost).
    """
    plan.workload.load_data()   # loaded (and cached) up front, so no run's wall_s includes it
    runs: list = []
    turn = 0
    if plan.nproc > 1:
        runs = train_on_ranks(plan, on_progress)     # one recipe after another, rank 0's progress relayed
    partial = False
    if plan.nproc == 1:
        turn = turn_steps(plan.steps)
        live = {}
        for i, recipe in enumerate(plan.recipes):
            callback = None if on_progress is None else (lambda p, i=i: on_progress(i, p))
            live[i] = train_steps(plan.workload, recipe, steps=plan.steps, device=plan.device, seed=plan.seed,
                                  on_progress=callback, eval_every=plan.eval_every, chunk=turn)
        results = {}
        try:
            while live:
                for i in list(live):
                    try:
                        next(live[i])                        # this recipe's next turn
                    except StopIteration as done:
                        results[i] = done.value
                        del live[i]
        except KeyboardInterrupt:
            live.pop(i, None)          # interrupted mid-turn: its generator is closed
            for j, run in live.items():
                if inspect.getgeneratorstate(run) == inspect.GEN_SUSPENDED:   # not those yet to start
                    try:
                        run.send(True)                       # stop where it is and report its steps
                    except StopIteration as done:
                        results[j] = done.value
            if not results:
                raise
            partial = True      # Ctrl-C: keep the runs that had taken steps, in a report marked partial
        runs = [results[i] for i in sorted(results)]
    return CompareReport(
        workload=plan.workload.name, metric=plan.workload.metric_name,
        device=str(plan.device) + (f" x{plan.nproc} ({plan.parallel})" if plan.nproc > 1 else ""),
        device_name=device_name(plan.device), threads=torch.get_num_threads(),
        torch_version=torch.__version__, mixprec_version=__version__, steps=plan.steps,
        batch_size=plan.workload.batch_size, seed=plan.seed, runs=tuple(runs),
        tokens_per_sample=plan.workload.tokens_per_sample,
        higher_is_better=plan.workload.higher_is_better, synthetic=plan.workload.synthetic, partial=partial,
        turn_steps=turn)

