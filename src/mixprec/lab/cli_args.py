"""Arguments several ``mixprec`` subcommands share, spelled once so their help and defaults agree."""

from __future__ import annotations

import argparse

from .workloads import BENCHMARKS, WORKLOADS

__all__ = ["add_workload_args", "add_device_arg"]


def add_workload_args(parser: argparse.ArgumentParser, benchmark_help: str) -> None:
    """``--workload NAME`` or ``--benchmark NAME`` (one of them; the handler reads ``benchmark or workload``)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--workload", default="mlp",
                       help=f"built-in workload ({', '.join(WORKLOADS)}; default mlp), a benchmark "
                            f"({', '.join(BENCHMARKS)}), or your own as package.module:function")
    which.add_argument("--benchmark", choices=list(BENCHMARKS), default=None,
                       help=f"shorthand for --workload NAME {benchmark_help}")


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
