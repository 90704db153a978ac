"""Training over several processes: FSDP2 sharding with a recipe's policy, DDP wrapping, sharded
checkpoints, and a small process launcher for tests and the lab.

The lockstep itself (one all_reduce of the gradient norm per step, so every rank skips, clips and
updates its loss scale alike) is the engine's own, in ``mixprec.step.grad_sync``; ``GradSync``,
``SyncKind`` and ``local_shard`` (this rank's piece of a sharded tensor) are re-exported here.

May import: the core; never the lab.
"""

from ..step.grad_sync import GradSync, SyncKind, local_shard
from .checkpoint import load_distributed_checkpoint, save_distributed_checkpoint
from .parallel import COMM_DTYPES, fsdp_policy, shard_model, wrap_ddp
from .spawn import default_backend, free_port, run_processes

__all__ = [
    "shard_model", "wrap_ddp", "fsdp_policy", "COMM_DTYPES",
    "save_distributed_checkpoint", "load_distributed_checkpoint",
    "run_processes", "free_port", "default_backend", "GradSync", "SyncKind", "local_shard",
]
