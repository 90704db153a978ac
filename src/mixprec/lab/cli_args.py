"""What the ``mixprec`` subcommands share: arguments spelled once (so their help and defaults agree), the
usage-error type that ``lab/cli.py`` prints as one line, the recipe-word splitter, and the output-path
checks that run before anything trains."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading

import torch
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..recipe import split_top_level
from .workloads import BENCHMARKS, WORKLOADS

__all__ = ["UsageError", "usage_errors", "add_workload_args", "add_device_arg", "recipe_words", "check_writable",
           "make_out_dir", "check_no_file_on_the_way", "check_outputs", "write_json", "torch_threads",
           "EXIT_INTERRUPTED", "EXIT_FAILED", "cpu_cores", "Interrupts", "interrupts_deferred"]

EXIT_INTERRUPTED = 130      # the shell's status for Ctrl-C (128 + SIGINT)
EXIT_FAILED = 1             # the command ran but produced no result (every run failed): scripts must see it


class UsageError(Exception):
    """A user mistake found while checking the command; its message says how to fix it."""


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Inside: a ValueError/TypeError from checking the user's words becomes a ``UsageError``."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from e


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


def recipe_words(values: Sequence[str] | None, default: Sequence[str] = ()) -> list[str]:
    """Split ``--recipes`` words into recipe specs for ``get_recipe`` (``default`` when not given).

    Names are joined by commas; a full recipe string's commas separate its keys, so consecutive
    ``key=value`` items form one recipe until a key repeats::

        ["fp32,params=bf16,compute=bf16,fp16"] -> ["fp32", "params=bf16,compute=bf16", "fp16"]
        ["fp32,bf16,fp32_ops=softmax"] -> ["fp32", "bf16,fp32_ops=softmax"]
        ["fp32,fp16,scale=static:1024"] -> ["fp32", "fp16,scale=static:1024"]
    """
    if values is None:
        return list(default)
    specs: list[str] = []
    for value in values:
        group: list[str] = []           # key=value items of the recipe string being read
        for item in split_top_level(value):
            key, is_pair, _ = item.partition("=")
            if is_pair and key.strip() not in {g.partition("=")[0].strip() for g in group}:
                group.append(item)
                continue
            if group:
                specs.append(",".join(group))
            group = [item] if is_pair else []
            if not is_pair:
                specs.append(item)
        if group:
            specs.append(",".join(group))
    # Tweaking keys right after a name edit that named recipe: bf16,fp32_ops=softmax.
    merged: list[str] = []
    for spec in specs:
        keys = {item.partition("=")[0].strip() for item in split_top_level(spec)}
        if merged and "=" not in split_top_level(merged[-1])[0] and "=" in spec and keys <= _EDIT_KEYS:
            merged[-1] += "," + spec
        else:
            merged.append(spec)
    return merged


# Keys that tweak the named recipe before them (fp16,scale=static:1024; fp8-delayed,fp8=delayed(margin=1));
# params, compute and master start a recipe of their own (fp32,params=bf16,compute=bf16 is two).
_EDIT_KEYS = {"fp32_ops", "low_ops", "follow_ops", "modules", "scale", "fp8", "rounding", "fp32_modules",
              "moments", "saved"}


def make_out_dir(path: Path, files: tuple[str, str] = ("report.json", "report.html")) -> None:
    """Create ``--out``'s directory (and its parents) now, so a bad path fails before training.

    ``files``: the two files the tool writes there, named in the error when ``path`` is a file.
    """
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} is a file; give a directory for {files[0]} and {files[1]}, "
                         f"e.g. --out {path.with_suffix('')}-report")
    check_no_file_on_the_way(path, "--out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create the directory ({e.strerror}); choose a path in a "
                         "writable directory") from None


def check_writable(path: Path, option: str, fix: str | None = None) -> None:
    """Fail now, not after training, if ``option``'s file cannot be written to ``path``.

    ``fix`` says what to do when ``path`` is a directory (default: name a file in it).
    """
    if path.is_dir():
        fix = fix or f"give a file path, e.g. {option} {path / 'compare.json'}"
        raise ValueError(f"{option} {path} is a directory; {fix}")
    parent = path.parent
    check_no_file_on_the_way(parent, option, path)
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: directory {parent} does not exist; create it "
                         f"(mkdir -p {parent}) or choose another path")
    existed = path.exists()
    try:
        # Open for append: proves we may write there without truncating an existing file now.
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{option} {path} is not writable ({e.strerror}); choose a path in a writable "
                         "directory") from None
    if not existed:
        os.unlink(path)


def check_no_file_on_the_way(directory: Path, option: str, path: Path | None = None) -> None:
    """A file where the path needs a directory (``afile`` in ``afile/x.json``): mkdir -p cannot help."""
    for ancestor in (directory, *directory.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise ValueError(f"{option} {path or directory}: {ancestor} is a file, not a directory; "
                                 "choose a path whose folders are folders")
            return


def check_outputs(json_path: Path | None, out_dir: Path | None, names: tuple[str, str]) -> None:
    """``--json PATH`` and ``--out DIR`` (with ``names``, e.g. report.json and report.html, in it) can be
    written: checked, and DIR created, before anything trains."""
    if json_path is not None:
        check_writable(json_path, "--json")
    if out_dir is not None:
        make_out_dir(out_dir, names)
        for name in names:
            check_writable(out_dir / name, "--out", fix="remove it or choose another --out directory")


def torch_threads(threads: int | None) -> contextlib.AbstractContextManager[None]:
    """``--threads`` checked now (below 1 is a ValueError); inside the returned context torch uses that
    many CPU threads (None: as it was). The count is process-global, so it is restored on leaving, for
    whoever called ``main()``."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    cores = cpu_cores()
    if threads is not None and threads > cores:
        # More threads than cores only contend: --threads 9999 ran the mlp at 3 samples/s.
        raise ValueError(f"--threads {threads} is more than the {cores} CPU cores this process may use; "
                         f"more threads than cores only wait on each other: choose 1 to {cores}")
    return _threads(threads)


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # macOS, Windows: no affinity mask
        return os.cpu_count() or 1


def write_json(text: str, json_path: Path | None, out_dir: Path | None, name: str) -> None:
    """Write a report's JSON ``text`` to ``--json PATH`` and to ``--out DIR``/``name``; say where on stderr."""
    paths = [json_path] if json_path is not None else []
    if out_dir is not None:
        paths.append(out_dir / name)
    for path in paths:
        path.write_text(text + "\n")
        print(f"report written to {path}", file=sys.stderr)


@contextlib.contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads or saved)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class Interrupts:
    """Ctrl-C presses counted by ``interrupts_deferred`` (``pressed`` is read after its block)."""

    pressed: int = 0


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[Interrupts]:
    """Inside: a first Ctrl-C is counted, not raised, so the block writes whole files; a second one raises.

    Once every recipe has trained, writing the report, table and page takes a second or two; a Ctrl-C
    then would otherwise leave a report without its table or page (or half a page). The caller reads
    ``pressed`` afterwards and exits 130. Outside the main thread (where Python delivers signals) it
    changes nothing.
    """
    interrupts = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield interrupts
        return

    def count(signum, frame) -> None:
        interrupts.pressed += 1
        if interrupts.pressed > 1:
            raise KeyboardInterrupt        # pressed again: the user means it
        print("mixprec: interrupted; finishing the report, table and page first (Ctrl-C again to stop "
              "now)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, count)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, previous)
