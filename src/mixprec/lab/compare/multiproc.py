"""``mixprec compare --nproc N``: each recipe trained on N processes through DDP or FSDP2.

For every recipe, N fresh processes form one group (gloo on the CPU, nccl with one GPU each) and run
the same ``train`` as a single-process compare, with ``parallel="ddp"`` or ``"fsdp"``: every rank
takes its slice of each global batch, so the global batch, the data order and the initial weights are
those of the 1-process run, and the results differ from it only by rounding. Rank 0's ``RunResult``
(losses averaged over ranks) comes back through a file::

    plan = plan_compare("mlp", ["fp32", "bf16"], steps=200, device="cpu", nproc=2, parallel="fsdp")
    report = run_compare(plan)

The same thing under torchrun: any script that calls ``dist.init_process_group`` and then
``train(workload, recipe, steps=..., parallel="ddp")`` on every rank.
"""

from __future__ import annotations

import contextlib
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...recipe import Recipe, Rounding
from ...distributed.spawn import default_backend, run_processes
from ..trainer import RunResult, TrainProgress, train
from ..workloads import Workload, get_workload

if TYPE_CHECKING:
    from .run import ComparePlan

__all__ = ["PARALLEL", "check_parallel", "train_on_ranks"]

PARALLEL = ("ddp", "fsdp")
# Generous: a rank stuck in a collective fails the compare instead of hanging it; real runs on the
# built-in workloads take seconds to minutes.
_TIMEOUT_S = 6 * 3600


def check_parallel(workload: Workload, recipes: tuple[Recipe, ...], device: torch.device, nproc: object,
                   parallel: str, spec: str) -> None:
    """ValueError/TypeError naming the fix if ``nproc``/``parallel`` cannot run this compare."""
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise TypeError(f"nproc must be an integer, got {type(nproc).__name__}")
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if parallel not in PARALLEL:
        raise ValueError(f"unknown parallel mode {parallel!r}; valid values: {', '.join(PARALLEL)}")
    if nproc == 1:
        return
    if workload.batch_size % nproc:
        raise ValueError(f"{workload.name}'s batch of {workload.batch_size} does not split evenly over "
                         f"{nproc} processes; use an --nproc that divides it")
    if device.type == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(f"--nproc {nproc} on cuda needs {nproc} GPUs, {torch.cuda.device_count()} "
                         "visible; use fewer processes or --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--nproc runs on cpu (gloo) or cuda (nccl), not {device.type}")
    if parallel == "fsdp":
        sr = [r.label for r in recipes if r.rounding is not Rounding.NEAREST]    # bf16-sr, bf16-kahan
        if sr:
            raise ValueError(f"recipe {sr[0]!r} is not supported under FSDP2 yet; use --parallel ddp, "
                             "or bf16-pure")
    if not spec:
        raise ValueError("--nproc needs the workload by name (each process loads it again)")


def train_on_ranks(plan: ComparePlan,
                   on_progress: Callable[[int, TrainProgress], None] | None = None) -> list[RunResult]:
    """Train ``plan``'s recipes one after another on ``plan.nproc`` processes; rank 0's results.

    One group of processes serves every recipe (start-up and data loading are paid once); each
    recipe still starts from the seed's weights and data order. Rank 0 appends its progress to a
    file that this process reads about once a second: ``on_progress(run_index, progress)`` as for a
    1-process compare.
    """
    with tempfile.TemporaryDirectory(prefix="mixprec-ranks-") as tmp:
        out, log = Path(tmp) / "runs.pkl", Path(tmp) / "progress.log"
        log.touch()
        reader = _ProgressReader(log, on_progress)
        run_processes(_rank_main, plan.nproc, (plan.workload_spec, [str(r) for r in plan.recipes],
                                               plan.steps, plan.device.type, plan.seed, plan.eval_every,
                                               plan.parallel, torch.get_num_threads(), str(out), str(log)),
                      backend=default_backend(plan.device.type), timeout_s=_TIMEOUT_S,
                      on_tick=reader.poll if on_progress is not None else None)
        with open(out, "rb") as f:
            return pickle.load(f)   # written a moment ago by our own child process


class _ProgressReader:
    """Hands on the lines rank 0 appended since the last poll: ``run step steps loss samples_per_s``."""

    def __init__(self, path: Path, on_progress: Callable[[int, TrainProgress], None] | None) -> None:
        self.path, self.on_progress, self.offset = path, on_progress, 0

    def poll(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]         # a line still being written waits
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            run, step, steps, loss, rate = line.split()
            self.on_progress(int(run), TrainProgress(int(step), int(steps), float(loss), float(rate)))


def _rank_main(rank: int, world: int, spec: str, recipes: list[str], steps: int, device_type: str,
               seed: int, eval_every: int | None, parallel: str, threads: int, out: str, log: str) -> None:
    # The parent's thread count, split between the ranks that now share its cores.
    torch.set_num_threads(max(1, threads // world) if device_type == "cpu" else threads)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    workload = get_workload(spec)
    results = []
    with open(log, "a") if rank == 0 else contextlib.nullcontext() as progress_file:
        for i, recipe in enumerate(recipes):
            def report(p: TrainProgress, i: int = i) -> None:
                progress_file.write(f"{i} {p.step} {p.steps} {p.loss!r} {p.samples_per_s!r}\n")
                progress_file.flush()
            results.append(train(workload, recipe, steps=steps, device=device, seed=seed,
                                 eval_every=eval_every, parallel=parallel,
                                 on_progress=report if rank == 0 else None))
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)
