"""Train one workload under one recipe and record what happened, as a typed ``RunResult``.

Every recipe starts from the same place: the model is built under ``torch.manual_seed(seed)`` (inside
``fork_rng``, so the caller's generator is untouched) and then prepared for the recipe, and the
minibatches come in one order fixed by ``seed``. Differences between runs are the recipe's doing::

    result = train(get_workload("mlp"), "bf16", steps=500, seed=0)
    result.test_metric, result.samples_per_s, result.losses[:3]

Syncs: the loop keeps each step's loss, loss scale and skip flag as device tensors and reads them once
at the end, so the timed loop syncs only where the engine does (the generic optimizer path, once a step)
and when ``on_progress`` is called (every ``progress_every`` steps, to read the loss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Generator

import torch
import torch.distributed as dist
from torch import nn

from ..casting.model import check_module_patterns
from ..devices import resolve_device
from ..diagnostics.memory import MemoryBreakdown, SavedTensorMeter, state_bytes
from ..distributed.parallel import shard_model, wrap_ddp
from ..engine import MixedPrecision
from ..fp8.swap import check_fp8_patterns
from ..model_io import output_logits, predictions
from ..recipe import Recipe, get_recipe
from .workloads import Workload, get_workload

__all__ = ["TrainProgress", "RunResult", "train", "train_steps", "batch_order", "warmup_steps", "check_steps", "check_seed",
           "check_recipe_patterns", "MAX_STEPS"]

# Steps left out of the samples/s timing: the first ones allocate memory, pick kernels and (on CUDA)
# autotune; they say nothing about steady-state speed.
_MAX_WARMUP = 10
# A bound on steps: the trainer draws every step's batch order up front ((steps, batch) int64: 1 GB at a
# million steps of batch 128) and keeps every step's loss; the built-in workloads learn in thousands.
MAX_STEPS = 1_000_000
# The final train loss is the mean over this fraction of the last steps: one minibatch's loss is noisy.
_FINAL_LOSS_FRACTION = 0.1
_EVAL_BATCH = 1024


@dataclasses.dataclass(frozen=True)
class TrainProgress:
    """A snapshot handed to ``on_progress`` while a run trains."""

    step: int                # steps done so far; 0 once, as the run starts
    steps: int               # steps in the run
    loss: float              # the last step's train loss; NaN before the first
    samples_per_s: float     # since the warm-up ended; NaN while still warming up


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What one run under one recipe did. Plain numbers and tuples: it goes into JSON as it is."""

    recipe: str                      # the full recipe string, str(Recipe): parse_recipe reads it back
    label: str                       # the recipe's name where it has one: for tables and plots
    final_loss: float                # mean train loss over the last 10% of steps
    test_metric: float               # the workload's metric on the test set, e.g. accuracy as a fraction
    samples_per_s: float             # training throughput, warm-up steps excluded
    skipped_steps: int               # steps skipped for an inf/NaN gradient norm
    final_scale: float               # the loss scale after the last step (1.0 without loss scaling)
    losses: tuple[float, ...]        # train loss per step, before that step's update
    scales: tuple[float, ...]        # loss scale after each step's update
    skipped_at: tuple[int, ...]      # 0-based indices of the skipped steps
    wall_s: float                    # seconds for the whole run: build, train, evaluate
    eval_steps: tuple[int, ...]      # steps after which the test metric was measured (the last included)
    eval_metrics: tuple[float, ...]  # the test metric at each of eval_steps
    memory: MemoryBreakdown          # bytes by role, measured on the first step taken (not skipped); CUDA peak for the run


def check_steps(steps: object) -> int:
    """``steps`` if it is a positive int, else a ValueError/TypeError that says what to pass."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be an integer, got {type(steps).__name__}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}: pass e.g. --steps 500")
    if steps > MAX_STEPS:
        raise ValueError(f"steps must be at most {MAX_STEPS:,} (the built-in workloads learn in a few "
                         f"thousand; the batch order of every step is drawn up front), got {steps:,}")
    return steps


def check_seed(seed: object) -> int:
    """``seed`` if it is an int in [0, 2**64) (what torch.manual_seed takes), else a ValueError."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be a non-negative integer below 2**64 (what torch.manual_seed takes), "
                         f"got {seed!r}")
    return seed


def check_recipe_patterns(model: nn.Module, recipe: Recipe) -> None:
    """The engine's checks of a recipe's names against ``model`` (``modules=``, ``fp32_modules=``, fp8's
    ``skip=``), run before training: the engine would raise them only once the run had started."""
    check_module_patterns(model, recipe)
    if recipe.fp8 is not None:
        check_fp8_patterns(model, recipe.fp8)


def resolve_run(workload: str | Workload, device: str | torch.device | None,
                steps: int | None) -> tuple[Workload, torch.device]:
    """The workload and device a run names; a GPU benchmark on a CPU needs an explicit ``steps``.

    Benchmarks are sized for GPUs (ResNet-50 at batch 256 keeps ~22 GB of fp32 activations for
    backward), so on a CPU they run only when the user names how many steps to spend.
    """
    if not isinstance(workload, Workload):
        workload = get_workload(workload)
    device = device if isinstance(device, torch.device) else resolve_device(device)
    if workload.synthetic and device.type == "cpu" and steps is None:
        raise ValueError(f"{workload.name} is a GPU benchmark (realistic sizes, synthetic data); run it "
                         f"with --device cuda, or name --steps N to run it on the CPU anyway")
    return workload, device


def warmup_steps(steps: int) -> int:
    """How many of ``steps`` are left out of the timing: 10% of them, at most 10."""
    return min(_MAX_WARMUP, steps // 10)


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """Row indices for every step, ``(steps, batch_size)`` int64: one shuffle per epoch, seeded.

    Epochs are concatenated before cutting into batches, so a batch may straddle two epochs; within
    an epoch every row is seen once.
    """
    generator = torch.Generator().manual_seed(seed)
    epochs = math.ceil(steps * batch_size / n)
    flat = torch.cat([torch.randperm(n, generator=generator) for _ in range(epochs)])
    return flat[: steps * batch_size].view(steps, batch_size)


def train(workload: Workload, recipe: str | Recipe, *, steps: int, device: torch.device | str = "cpu",
          seed: int = 0, on_progress: Callable[[TrainProgress], None] | None = None,
          progress_every: int = 10, eval_every: int | None = None,
          parallel: str | None = None, progress_s: float = 2.0) -> RunResult:
    """Train ``workload`` under ``recipe`` for ``steps`` steps from seed-fixed weights; evaluate; report.

    ``eval_every=K`` also measures the test metric after every K steps (the clock pauses meanwhile);
    the final evaluation always happens. Memory by role is measured on the first step (saved-tensor
    hooks for activations) and after the first step not skipped (tensor sizes for the rest: optimizer
    state exists only once a step was taken) and, on CUDA, the allocator's peak for the run.
    Raises ValueError if the recipe cannot run on ``device`` (MixedPrecision checks). Syncs with the
    host at the end, on every progress report and at each evaluation.

    ``parallel="ddp"`` or ``"fsdp"`` (inside an initialized process group, one call per rank): every
    rank trains its contiguous slice of each global batch (``batch_size / world`` rows) through DDP or
    FSDP2; the losses reported are averaged over ranks (one all_reduce at the end) and samples/s
    counts the global batch.
    """
    run = train_steps(workload, recipe, steps=steps, device=device, seed=seed, on_progress=on_progress,
                      progress_every=progress_every, eval_every=eval_every, parallel=parallel,
                      progress_s=progress_s)
    while True:
        try:
            next(run)
        except StopIteration as done:
            return done.value


def train_steps(workload: Workload, recipe: str | Recipe, *, steps: int, device: torch.device | str = "cpu",
                seed: int = 0, on_progress: Callable[[TrainProgress], None] | None = None,
                progress_every: int = 10, eval_every: int | None = None, parallel: str | None = None,
                progress_s: float = 2.0, chunk: int | None = None) -> Generator[None, bool | None, RunResult]:
    """``train`` as a generator that pauses after every ``chunk`` steps, so runs can take turns.

    ``mixprec compare`` trains its recipes interleaved: each run on its own model, optimizer and engine,
    a chunk of steps at a time, so a machine that gets busier (or a GPU that heats up) slows every recipe
    alike. While paused a run's clock stops (its samples/s counts its own steps only) and, on CUDA, its
    peak is counted above what the other runs hold. ``next(run)`` trains the next chunk; ``run.send(True)``
    stops the run where it is (a Ctrl-C), and it returns a ``RunResult`` of the steps it took (through
    ``StopIteration.value``), as it does at its end.
    """
    recipe = get_recipe(recipe)
    steps = check_steps(steps)
    if eval_every is not None and (isinstance(eval_every, bool) or not isinstance(eval_every, int)
                                   or eval_every < 1):
        raise ValueError(f"eval_every must be a positive number of steps, got {eval_every!r}")
    device = torch.device(device)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive number of steps, got {chunk!r}")
    clock = _RunClock(device)

    data = workload.load_data().to(device)
    order = batch_order(len(data.y_train), workload.batch_size, steps, seed).to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = workload.build_model()   # on the CPU: the same initial weights whatever the device
    model.to(device)
    world, rank = (dist.get_world_size(), dist.get_rank()) if parallel else (1, 0)
    rows = workload.batch_size // world                      # each rank's slice of the global batch
    if parallel == "fsdp":
        shard_model(model, recipe)                           # before the optimizer sees the parameters
    optimizer = workload.make_optimizer(model.parameters())
    mp = MixedPrecision(model, optimizer, recipe, seed=seed)
    forward = wrap_ddp(mp) if parallel == "ddp" else model

    warmup = warmup_steps(steps)
    losses_t, scales_t, skipped_t = [], [], []
    eval_steps, eval_metrics = [], []
    memory, memory_counted, activations = MemoryBreakdown(), False, 0
    model.train()
    if on_progress is not None:
        on_progress(TrainProgress(0, steps, math.nan, math.nan))   # the run starts now
    t_reported = time.perf_counter()
    done = 0
    for step in range(steps):
        if step == warmup:
            clock.start_timing()                             # the warm-up steps stay off the clock
        idx = order[step][rank * rows:(rank + 1) * rows]     # (B / world,)
        with SavedTensorMeter(model, mp.master.masters if mp.master else []) if step == 0 \
                else contextlib.nullcontext() as meter:
            with mp.autocast():
                loss = workload.loss_fn(predictions(forward(data.x_train[idx])), data.y_train[idx])
            mp.backward(loss)
        result = mp.step()
        if step == 0:
            activations = meter.bytes
        if not memory_counted and (step == steps - 1 or not result.skipped):   # syncs until then
            # After the first step taken: gradients, fp32 copies and optimizer state all exist now
            # (a skipped first step leaves AdamW's moments unallocated: counting then undercounts).
            memory = dataclasses.replace(state_bytes(mp), activations=activations)
            memory_counted = True
        mp.zero_grad()
        losses_t.append(loss.detach())
        scales_t.append(result.scale_t)
        skipped_t.append(result.skipped_t)
        done = step + 1
        if eval_every is not None and done % eval_every == 0 and done != steps:
            clock.pause()                                     # evaluation is kept off the clock
            eval_steps.append(done)
            eval_metrics.append(_evaluate(workload, model, mp, data.x_test, data.y_test))
            clock.resume()
        # Every progress_every steps, and at least every progress_s seconds: a GPU benchmark on a CPU
        # takes seconds per step, and ten of them before the first report looked like a hang.
        if on_progress is not None and (done % progress_every == 0 or done == steps
                                        or time.perf_counter() - t_reported >= progress_s):
            t_reported = time.perf_counter()
            loss_now = float(losses_t[-1])                    # syncs: the clock below is then honest
            elapsed = clock.timed_s()
            timed = done - warmup
            rate = timed * workload.batch_size / elapsed if timed > 0 and elapsed > 0 else math.nan
            on_progress(TrainProgress(done, steps, loss_now, rate))
        if chunk is not None and done % chunk == 0 and done != steps:
            clock.pause()                                     # another run's turn: its steps are not ours
            stop = yield
            clock.resume()
            if stop:
                break                                         # Ctrl-C: report the steps taken

    clock.pause()
    train_s = clock.timed_s()
    test_metric = _evaluate(workload, model, mp, data.x_test, data.y_test)
    eval_steps.append(done)
    eval_metrics.append(test_metric)
    if device.type == "cuda":
        memory = dataclasses.replace(memory, peak=clock.peak)
    losses_f32 = torch.stack(losses_t).float()
    if world > 1:   # each rank saw its slice: the global batch's loss is the mean over ranks
        dist.all_reduce(losses_f32)
        losses_f32 /= world
    losses = tuple(losses_f32.tolist())
    scales = tuple(torch.stack(scales_t).tolist())
    skipped_at = tuple(torch.nonzero(torch.stack(skipped_t)).flatten().tolist())
    tail = losses[-max(1, round(done * _FINAL_LOSS_FRACTION)):]
    return RunResult(
        recipe=str(recipe), label=recipe.label,
        final_loss=math.fsum(tail) / len(tail),
        test_metric=test_metric,
        samples_per_s=(done - warmup) * workload.batch_size / train_s if train_s > 0 else math.nan,
        skipped_steps=mp.skipped_steps, final_scale=mp.scale,
        losses=losses, scales=scales, skipped_at=skipped_at,
        wall_s=clock.active_s,
        eval_steps=tuple(eval_steps), eval_metrics=tuple(eval_metrics), memory=memory,
    )


class _RunClock:
    """One run's own time and CUDA peak, while other runs may take turns between its chunks.

    ``active_s``: seconds this run held the machine (build, train, evaluate; not while paused).
    ``timed_s()``: its training seconds since ``start_timing`` (the end of the warm-up), evaluation and
    other runs' turns left out. ``peak`` (CUDA): the allocator's peak during this run's turns, less what
    the other runs held meanwhile (their tensors stay allocated, unchanged, while this run trains).
    Every pause and resume synchronizes the device, so queued kernels are counted where they ran.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active_s = 0.0
        self._timed_s = 0.0
        self._timing = False
        self._running = False
        self._own_bytes = 0          # CUDA: what this run holds, as of its last pause
        self._others = 0             # CUDA: what the other runs hold during this turn
        self.peak = 0
        self.resume()

    def start_timing(self) -> None:
        _synchronize(self.device)
        self._timing, self._t_timed = True, time.perf_counter()

    def pause(self) -> None:
        _synchronize(self.device)
        now = time.perf_counter()
        self._running = False
        self.active_s += now - self._t_active
        if self._timing:
            self._timed_s += now - self._t_timed
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) - self._others)
            self._own_bytes = torch.cuda.memory_allocated(self.device) - self._others

    def resume(self) -> None:
        if self.device.type == "cuda":
            _synchronize(self.device)
            self._others = torch.cuda.memory_allocated(self.device) - self._own_bytes
            torch.cuda.reset_peak_memory_stats(self.device)
        self._running = True
        self._t_active = self._t_timed = time.perf_counter()

    def timed_s(self) -> float:
        """Training seconds so far (the caller has synchronized where it matters)."""
        return self._timed_s + (time.perf_counter() - self._t_timed if self._timing and self._running else 0.0)


@torch.no_grad()
def _evaluate(workload: Workload, model: nn.Module, mp: MixedPrecision, x: torch.Tensor,
              y: torch.Tensor) -> float:
    """The workload's metric on ``(x, y)``, computed in the recipe's autocast, as it would be served."""
    model.eval()
    try:
        with mp.autocast():
            # An HF model returns a ModelOutput: its logits are the predictions (model_io).
            outputs = torch.cat([output_logits(model(x[i:i + _EVAL_BATCH]))
                                 for i in range(0, len(x), _EVAL_BATCH)])
    finally:
        model.train()
    # Low-compute recipes already hand back fp32 outputs (casting hooks); fp32 here keeps metrics exact.
    return workload.metric(outputs.float(), y)


def _synchronize(device: torch.device) -> None:
    # Accelerator kernels run asynchronously: wait for them before reading the clock.
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize(device)
