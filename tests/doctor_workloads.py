"""Workloads for the doctor's CLI tests (``--workload doctor_workloads:NAME``, run from tests/)."""

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.lab.workloads import Split, Workload, accuracy


def no_params() -> Workload:
    """A model with nothing to train: the doctor must refuse it before training."""
    x = torch.randn(8, 4)
    y = torch.zeros(8, dtype=torch.int64)
    return Workload(name="no_params", summary="ReLU alone", build_model=nn.ReLU,
                    load_data=lambda: Split(x, y, x, y), loss_fn=F.cross_entropy,
                    make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), metric=accuracy,
                    metric_name="accuracy", batch_size=4, default_steps=1)
