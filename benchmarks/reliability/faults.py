"""Fault injection and kill-resume on every named recipe: planted overflows leave every number unchanged,
and a run killed at a random step resumes bit for bit.

Planted overflows (in this process): for each recipe, a 3-layer MLP (128 wide, so every fp8 and fp4 layout
swaps each layer) trains ``--steps`` steps on fixed batches; at a seeded random third of the steps one
gradient element (a random parameter, a random element) is set to +inf, -inf or NaN after
``mp.backward``. A planted step must be skipped (``result.skipped`` true, the skip count one higher) and
must leave the model's weights, the masters, the compensations, the rounding noise's state and the
optimizer's state bitwise as they were before it; a clean step must step. Every tensor is compared with
``torch.equal`` on its bits.

Kills (in child processes): for each recipe, one whole run of ``--total`` steps, checkpointing after each
step, gives a digest of every weight, master, optimizer and fp8 tensor plus the loss scale and skip count.
Then ``--kills`` runs are SIGKILLed after a random step (seeded) and resumed from their last checkpoint in
a fresh interpreter; each resumed digest must equal the whole run's. Data and dropout come from the
global RNGs, so only a checkpoint that restores them resumes exactly.

Prints one line per recipe and the totals; exits 1 if any planted step changed a number or any resume
differs. Usage:
    python benchmarks/reliability/faults.py                     # all 14 named recipes, 80 steps, 3 kills each
    python benchmarks/reliability/faults.py --recipes fp16,bf16-sr --steps 40 --kills 1
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


def tiny(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 128), nn.LayerNorm(128), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128))


def tensors_of(mp: mixprec.MixedPrecision, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every number a skipped step must leave alone, by name: weights, the engine's update state (masters,
    compensations, noise), the optimizer's state. The fp8 scale state is left out: the forward of the
    planted step records its amaxes before anyone knows the step will be skipped, as in torchao and TE."""
    out = {f"model.{n}": p.detach() for n, p in mp.model.named_parameters()}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value.detach()
        elif isinstance(value, torch.Generator):
            out[prefix] = value.get_state()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)

    walk("master", mp.state_dict()["master"])
    walk("moments", mp.state_dict()["moments"])
    walk("optimizer", opt.state_dict()["state"])
    return {k: v.clone() for k, v in out.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():    # NaN == NaN on the bits
        a, b = a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
    return torch.equal(a, b)


def planted(recipe: str, steps: int, seed: int) -> tuple[int, int, list[str]]:
    """Train ``steps`` steps with a planted non-finite gradient in about a third of them. Returns
    (planted steps, clean steps, failures)."""
    rng = random.Random(seed)
    model = tiny(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mp = mixprec.MixedPrecision(model, opt, recipe, clip_grad_norm=1.0)
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(32, 128, generator=gen), torch.randint(0, 128, (32,), generator=gen))
               for _ in range(8)]
    params = [p for p in model.parameters() if p.requires_grad]
    failures, n_planted = [], 0
    for step in range(steps):
        x, y = batches[step % len(batches)]
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        plant = rng.random() < 1 / 3
        if plant:
            n_planted += 1
            p = rng.choice(params)
            p.grad.view(-1)[rng.randrange(p.numel())] = rng.choice([float("inf"), float("-inf"), float("nan")])
            before, skipped = tensors_of(mp, opt), mp.skipped_steps
        result = mp.step()
        mp.zero_grad()
        stepped = not bool(result.skipped)
        if plant:
            after = tensors_of(mp, opt)
            changed = [k for k in before if k not in after or not same_bits(before[k], after[k])]
            changed += [k for k in after if k not in before]
            if stepped or mp.skipped_steps != skipped + 1 or changed:
                failures.append(f"step {step}: stepped={stepped}, skips {skipped}->{mp.skipped_steps}, "
                                f"changed {changed[:3]}")
        elif not stepped:
            failures.append(f"step {step}: a clean step was skipped")
    return n_planted, steps - n_planted, failures


# -- kill and resume: this file is its own child process ---------------------------------------------

def child(recipe: str, ckpt: str, total: int, kill_at: int, resume: bool) -> None:
    torch.manual_seed(0)
    random.seed(0)
    model = tiny(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
    mp = mixprec.MixedPrecision(model, opt, recipe, clip_grad_norm=1.0)
    start = mixprec.load_checkpoint(ckpt, mp, scheduler=sched)["step"] if resume else 0
    for step in range(start, total):
        x = torch.randn(32, 128) * (1 + random.random())
        y = torch.randint(0, 128, (32,))
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        if step % 7 == 3:
            next(model.parameters()).grad.view(-1)[0] = float("inf")    # skipped steps inside the run
        mp.step()
        mp.zero_grad()
        sched.step()
        mixprec.save_checkpoint(ckpt, mp, scheduler=sched, extra={"step": step + 1})
        if step + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    digest = hashlib.sha256()
    for name, t in sorted(tensors_of(mp, opt).items()):
        digest.update(name.encode())
        digest.update(t.cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for layer in (mp.state_dict()["fp8"] or {}).values():
        for t in layer.values():
            if isinstance(t, torch.Tensor):
                digest.update(t.cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    print(digest.hexdigest(), mp.scale, mp.skipped_steps)


def spawn(recipe: str, ckpt: Path, total: int, kill_at: int = 0, resume: bool = False):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, __file__, "--child", recipe, str(ckpt), str(total), str(kill_at),
                           "1" if resume else "0"], capture_output=True, text=True, timeout=600, env=env)


def kills(recipe: str, total: int, n: int, rng: random.Random, tmp: Path) -> tuple[int, list[str]]:
    whole = spawn(recipe, tmp / f"{recipe}-whole.ckpt", total)
    if whole.returncode != 0:
        return 0, [f"the whole run failed: {whole.stderr.strip().splitlines()[-1:]}"]
    failures = []
    for i in range(n):
        at = rng.randrange(1, total)
        ckpt = tmp / f"{recipe}-cut{i}.ckpt"
        killed = spawn(recipe, ckpt, total, kill_at=at)
        if killed.returncode != -signal.SIGKILL:
            failures.append(f"kill at {at}: exit {killed.returncode}, {killed.stderr.strip()[-200:]}")
            continue
        resumed = spawn(recipe, ckpt, total, resume=True)
        if resumed.returncode != 0 or resumed.stdout != whole.stdout:
            failures.append(f"kill at {at}: resumed {resumed.stdout.split()[:1] or resumed.stderr[-200:]} "
                            f"against {whole.stdout.split()[:1]}")
    return n, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--recipes", default=",".join(mixprec.RECIPES))
    parser.add_argument("--steps", type=int, default=80, help="steps per recipe in the planted run")
    parser.add_argument("--total", type=int, default=12, help="steps of each kill-resume run")
    parser.add_argument("--kills", type=int, default=3, help="killed runs per recipe (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in mixprec.RECIPES]
    if unknown:
        parser.error(f"unknown recipe(s) {unknown}; the named ones are {', '.join(mixprec.RECIPES)}")
    rng = random.Random(args.seed)
    totals = {"planted": 0, "clean": 0, "kills": 0, "failures": 0}
    start = time.perf_counter()
    import warnings
    warnings.simplefilter("ignore")          # fp8 emulation notes on the CPU
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in recipes:
            n_planted, n_clean, bad = planted(recipe, args.steps, args.seed)
            n_kills, bad_kills = kills(recipe, args.total, args.kills, rng, Path(tmp)) if args.kills else (0, [])
            totals["planted"] += n_planted
            totals["clean"] += n_clean
            totals["kills"] += n_kills
            totals["failures"] += len(bad) + len(bad_kills)
            verdict = "ok" if not bad and not bad_kills else "FAILED"
            print(f"{recipe:12s} {verdict:6s} planted {n_planted:3d} (unchanged {n_planted - len(bad):3d}), "
                  f"clean {n_clean:3d}, kills {n_kills} (bit for bit {n_kills - len(bad_kills)})", flush=True)
            for line in bad + bad_kills:
                print(f"    {line}")
    print(f"total: {totals['planted']} planted overflows, {totals['clean']} clean steps, {totals['kills']} kills, "
          f"{totals['failures']} failures; {time.perf_counter() - start:.0f} s")
    return 1 if totals["failures"] else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, recipe, ckpt, total, kill_at, resume = sys.argv
        child(recipe, ckpt, int(total), int(kill_at), resume == "1")
    else:
        sys.exit(main())
