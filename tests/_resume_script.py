"""Trains a few steps, checkpointing after each; optionally kills itself at a step (SIGKILL) or resumes.

Used by test_checkpoint.py in subprocesses: a real kill, then a real resume in a fresh interpreter.
Data and dropout draw from the global RNGs, so the resume is bit-identical only if they are restored.
"""

import hashlib
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

recipe, ckpt, total, kill_at, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
# 16 -> 32 -> 32: two layers an fp8 recipe swaps (weight dims multiples of 16); the 4-class head is not.
model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32),
                      nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
mp = mixprec.MixedPrecision(model, opt, recipe, clip_grad_norm=1.0)
start = 0
if resume:
    start = mixprec.load_checkpoint(ckpt, mp, scheduler=sched)["step"]
for step in range(start, total):
    x = torch.randn(16, 16) * (1 + random.random())         # global torch and python RNGs
    y = torch.from_numpy(np.random.randint(0, 4, 16))       # global numpy RNG
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    mp.backward(loss)
    if step == 4:
        next(model.parameters()).grad.view(-1)[0] = float("inf")   # one skipped step inside the run
    mp.step()
    mp.zero_grad()
    sched.step()
    mixprec.save_checkpoint(ckpt, mp, scheduler=sched, extra={"step": step + 1})
    if step + 1 == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
digest = hashlib.sha256()
fp8_state = [t for layer in (mp.state_dict()["fp8"] or {}).values() for t in layer.values()]
for p in list(model.parameters()) + ([m for m in mp.master.masters] if mp.master else []) + fp8_state:
    digest.update(p.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
print(digest.hexdigest(), mp.scale, mp.skipped_steps, len(mp.fp8_report.swapped) if mp.fp8_report else 0)
