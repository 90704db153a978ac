"""The probe's command-line cases: ``mixprec compare|doctor|inspect|trace|report|ckpt`` given what a
careless user types. Most run ``mixprec.lab.cli.main`` in this process (stdout and stderr captured); a few
run the installed ``mixprec`` as a real process, for the exit status a shell sees.

A CLI case is a clear error when it exits with the expected status (2 for a usage error, 1 for a run that
produced no result) and prints ``mixprec: error: ...`` naming the mistake, with no Python traceback; exit
0 after a failure is silent wrong (see probe_bad_inputs.py for the outcome rules)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from mixprec import save_checkpoint
from mixprec.lab.cli import main

from probe_bad_inputs import CLEAR, CORRECT, RAW, SILENT, UNCLEAR, Outcome, add, captured, case, cwd, engine, train

_TMP = Path(tempfile.mkdtemp(prefix="mixprec-probe-cli-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
_RAW_NAMES = ("Traceback (most recent call last)", "KeyError", "AttributeError", "IndexError", "NameError",
              "UnboundLocalError", "AssertionError", "ZeroDivisionError", "OverflowError")

# The user's own workloads, each broken one way (issue 26: a model whose every step is NaN).
_WORKLOADS = '''
import torch
import torch.nn.functional as F
from torch import nn
from mixprec.lab.workloads import Split

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
DATA = Split(X[:64], Y[:64], X[64:], Y[64:])


class NanNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(x) * float("nan")


def base(**changes):
    d = {"model": nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), "data": DATA,
         "loss": F.cross_entropy, "optimizer": lambda p: torch.optim.SGD(p, lr=0.1), "batch_size": 16}
    d.update(changes)
    return d


def good():
    return base()


def nan_model():
    return base(model=NanNet())


def needs_args(x):
    return base()


def returns_none():
    return None


def missing_keys():
    return {"model": nn.Linear(8, 3)}


def model_is_int():
    return base(model=3)


def optimizer_is_word():
    return base(optimizer="adamw")


def optimizer_built():
    m = nn.Linear(8, 3)
    return base(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def data_is_tuple():
    return base(data=(X, Y, X, Y))


def wrong_width():
    return base(model=nn.Linear(9, 3))


def frozen():
    m = nn.Linear(8, 3).requires_grad_(False)
    return base(model=m)


def batch_size_zero():
    return base(batch_size=0)


def typo_key():
    d = base()
    d["optimiser"] = d.pop("optimizer")
    return d


def integer_inputs():
    return base(data=Split(X[:64].long(), Y[:64], X[64:].long(), Y[64:]))


def loss_returns_vector():
    return base(loss=lambda out, y: F.cross_entropy(out, y, reduction="none"))


not_a_function = 3
'''
(_TMP / "probe_workloads.py").write_text(textwrap.dedent(_WORKLOADS))
(_TMP / "probe_broken_import.py").write_text("import no_such_module_anywhere\n\ndef tiny():\n    return {}\n")


def cli(argv: list[str], *words: str, rc: int = 2, crash: bool = False) -> Outcome:
    """Run ``mixprec argv`` here; it must exit ``rc`` with one ``mixprec: error:`` line holding ``words``.

    ``crash``: the case is a bug in the user's own workload, found while it runs; its one line is the
    failure's (``lab/failure.py``: type, module, op, "run with --traceback"). Elsewhere that line means
    a mistake that was not caught before the run started, or a crash inside mixprec or torch.
    """
    with cwd(_TMP), captured() as (out, err):
        try:
            status = main(argv)
        except BaseException as exc:   # noqa: BLE001 - anything that escapes main is a traceback to a user
            return Outcome(RAW, f"main() raised {type(exc).__name__}: {str(exc)[:160]}")
    return judge(status, out.getvalue(), err.getvalue(), words, rc, crash)


def judge(status: int, out: str, err: str, words: tuple[str, ...], rc: int, crash: bool = False) -> Outcome:
    text = " ".join(err.split())
    raw = [n for n in _RAW_NAMES if n in err]
    if raw:
        return Outcome(RAW, f"exit {status}, stderr shows {raw[0]}: {text[-200:]}")
    if "run with --traceback" in text and not crash:
        return Outcome(RAW, f"exit {status}, a failure while running, not a usage error: {text[-220:]}")
    if status == 0:
        return Outcome(SILENT, f"exit 0: {text[-160:] or out[-160:]}")
    missing = [w for w in words if w.lower() not in text.lower()]
    if status != rc or "mixprec: error:" not in text or missing:
        return Outcome(UNCLEAR, f"exit {status} (want {rc}), lacks {missing}: {text[-200:]}")
    return Outcome(CLEAR, f"exit {status}: {text[-160:]}")


_DIR = _TMP / "adir"
_DIR.mkdir()
_FILE = _TMP / "afile"
_FILE.write_text("x")

# (argv, words the error must hold). Issue 26's CLI items and their neighbours. A bug in the user's own
# workload, found while it runs, is reported as a failure (lab/failure.py): those cases are in CRASHES.
COMPARE = [
    (["compare", "--threads", "9999"], ["--threads", "cores"]),
    (["compare", "--threads", "0"], ["--threads"]),
    (["compare", "--threads", "-1"], ["--threads"]),
    (["compare", "--threads", "two"], ["--threads"]),
    (["compare", "--steps", "99999999999999999999"], ["steps"]),
    (["compare", "--steps", "0"], ["steps"]),
    (["compare", "--steps", "-5"], ["steps"]),
    (["compare", "--steps", "1.5"], ["--steps"]),
    (["compare", "--eval-every", "0"], ["eval-every"]),
    (["compare", "--seed", "-1"], ["seed"]),
    (["compare", "--seed", str(2**70), "--steps", "1", "--recipes", "fp32"], ["seed"]),
    (["compare", "--device", "bogus"], ["bogus"]),
    (["compare", "--device", "cuda"], ["cuda"]),
    (["compare", "--device", "cuda:7"], ["cuda"]),
    (["compare", "--device", ""], ["device"]),
    (["compare", "--workload", "nope"], ["nope"]),
    (["compare", "--workload", "no_such_module:fn"], ["no_such_module"]),
    (["compare", "--workload", "probe_workloads:"], ["package.module:function"]),
    (["compare", "--workload", "probe_workloads:nothing_here"], ["nothing_here"]),
    (["compare", "--workload", "probe_workloads:not_a_function"], ["not a function"]),
    (["compare", "--workload", "probe_workloads:needs_args"], ["no arguments"]),
    (["compare", "--workload", "probe_workloads:returns_none"], ["None"]),
    (["compare", "--workload", "probe_workloads:missing_keys"], ["lacks"]),
    (["compare", "--workload", "probe_workloads:model_is_int"], ["'model'"]),
    (["compare", "--workload", "probe_workloads:optimizer_is_word"], ["'optimizer'"]),
    (["compare", "--workload", "probe_workloads:optimizer_built"], ["already built"]),
    (["compare", "--workload", "probe_workloads:data_is_tuple"], ["Split"]),
    (["compare", "--workload", "probe_workloads:frozen"], ["trainable"]),
    (["compare", "--workload", "probe_workloads:batch_size_zero"], ["batch_size"]),
    (["compare", "--workload", "probe_workloads:typo_key"], ["optimiser", "optimizer"]),
    (["compare", "--benchmark", "nope"], ["nope"]),
    (["compare", "--recipes", "fp17"], ["fp17"]),
    (["compare", "--recipes", ""], ["recipes"]),
    (["compare", "--recipes", "fp16,scale=static:1e-50"], ["2**-24"]),
    (["compare", "--recipes", "tf32"], ["tf32"]),
    (["compare", "--recipes", "bf16,modules=nomatch:fp32"], ["nomatch"]),
    (["compare", "--recipes", "fp16-pure,fp32_modules=LayerNrom"], ["LayerNrom"]),
    (["compare", "--recipes", "fp32,fp8,fp8=current(skip=nomatch)"], ["nomatch"]),
    (["compare", "--json", str(_DIR)], ["directory"]),
    (["compare", "--json", str(_TMP / "missing" / "x.json")], ["does not exist"]),
    (["compare", "--out", str(_FILE)], ["is a file"]),
    (["compare", "--nproc", "0"], ["nproc"]),
    (["compare", "--nproc", "-1"], ["nproc"]),
    (["compare", "--parallel", "fsdp"], ["--nproc"]),
    (["compare", "--batch-size", "4"], ["--batch-size"]),
]
for argv, words in COMPARE:
    add("cli", "mixprec " + " ".join(argv), lambda a=argv, w=words: cli(a, *w))

OTHERS = [
    (["doctor", "--recipe", "fp17"], ["fp17"]),
    (["doctor", "--steps", "0"], ["steps"]),
    (["doctor", "--modules", "nope"], ["nope"]),
    (["doctor", "--threads", "0"], ["--threads"]),
    (["doctor", "--workload", "nope"], ["nope"]),
    (["doctor", "--device", "bogus"], ["bogus"]),
    (["doctor", "--out", str(_FILE)], ["is a file"]),
    (["doctor", "--recipe", "fp16,scale=static:1e-50"], ["2**-24"]),
    (["doctor", "--seed", "-1"], ["seed"]),
    (["doctor", "--recipe", "fp16-pure,fp32_modules=LayerNrom"], ["LayerNrom"]),
    (["inspect", "--recipes", "fp17"], ["fp17"]),
    (["inspect", "--batch-size", "0"], ["batch"]),
    (["inspect", "--batch-size", "-1"], ["batch"]),
    (["inspect", "--benchmark", "nope"], ["nope"]),
    (["inspect", "--json", str(_DIR)], ["directory"]),
    (["inspect", "--workload", "nope"], ["nope"]),
    (["doctor", "--recipe", "fp8,fp8=current(skip=nomatch)"], ["nomatch"]),
    (["doctor", "--seed", str(2**70)], ["seed"]),
    (["inspect", "--workload", "probe_workloads:wrong_width", "--recipes", "fp32"], ["Linear"]),
    (["inspect", "--recipes", "fp16-pure,fp32_modules=LayerNrom"], ["LayerNrom"]),
    (["trace", "--recipe", "fp16-pure,fp32_modules=LayerNrom"], ["LayerNrom"]),
    (["trace", "--recipe", "fp8,fp8=current(skip=nomatch)"], ["nomatch"]),
    (["trace", "--seed", str(2**70)], ["seed"]),
    (["trace", "--recipe", "fp17"], ["fp17"]),
    (["trace", "--batch-size", "0"], ["batch"]),
    (["trace", "--workload", "nope"], ["nope"]),
    (["trace", "--json", str(_DIR)], ["directory"]),
    ([], ["command"]),
    (["frobnicate"], ["frobnicate"]),
]
for argv, words in OTHERS:
    add("cli", "mixprec " + " ".join(argv), lambda a=argv, w=words: cli(a, *w))


CRASHES = [
    (["compare", "--workload", "probe_workloads:wrong_width", "--steps", "2", "--recipes", "fp32"],
     ["module Linear", "F.linear"]),
    (["compare", "--workload", "probe_workloads:integer_inputs", "--steps", "2", "--recipes", "fp32"],
     ["Long"]),
    (["compare", "--workload", "probe_workloads:loss_returns_vector", "--steps", "2", "--recipes", "fp32"],
     ["the loss must be a single number"]),
    (["compare", "--workload", "probe_broken_import:tiny"], ["no_such_module_anywhere"]),
    (["trace", "--workload", "probe_workloads:wrong_width"], ["module Linear"]),
    (["doctor", "--workload", "probe_workloads:wrong_width", "--steps", "1"], ["module Linear"]),
]
for argv, words in CRASHES:
    add("cli", "mixprec " + " ".join(argv), lambda a=argv, w=words: cli(a, *w, crash=True))


def _report_file(name: str, text: str | bytes) -> Path:
    path = _TMP / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


REPORTS = [
    ("missing file", lambda: str(_TMP / "nope.json"), ["cannot read"]),
    ("not JSON", lambda: str(_report_file("notjson.json", "hello")), ["JSON"]),
    ("binary", lambda: str(_report_file("bin.json", b"\xff\xfe\x00")), ["UTF-8"]),
    ("a doctor report", lambda: str(_report_file("doc.json", json.dumps({"kind": "doctor"}))), ["doctor"]),
    ("an empty object", lambda: str(_report_file("empty.json", "{}")), ["report"]),
    ("a list", lambda: str(_report_file("list.json", "[]")), ["report"]),
    ("a compare report without runs", lambda: str(_report_file("kind.json", json.dumps({"kind": "compare"}))),
     ["report"]),
    ("a folder", lambda: str(_DIR), ["cannot read"]),
]
for what, make, words in REPORTS:
    add("cli", f"mixprec report <{what}>", lambda m=make, w=words: cli(["report", m()], *w))


@case("cli", "mixprec report R.json --out R.json")
def _report_onto_itself() -> Outcome:
    path = _report_file("self.json", "{}")
    return cli(["report", str(path), "--out", str(path)], "the report itself")


def _good_checkpoint() -> Path:
    path = _TMP / "good.ckpt"
    if not path.exists():
        mp = engine("fp16-pure")
        train(mp, 2)
        save_checkpoint(path, mp)
    return path


CKPTS = [
    ("missing", lambda: str(_TMP / "nope.ckpt"), ["no such"]),
    ("garbage", lambda: str(_report_file("garbage.ckpt", b"\x00" * 100)), ["not a mixprec checkpoint"]),
    ("truncated", lambda: str(_report_file("cut.ckpt", _good_checkpoint().read_bytes()[:-50])), ["truncated"]),
    ("a folder", lambda: str(_DIR), ["directory"]),
    ("a torch.save file", lambda: (torch.save({}, _TMP / "ts.pt"), str(_TMP / "ts.pt"))[1],
     ["not a mixprec checkpoint"]),
]
for what, make, words in CKPTS:
    add("cli", f"mixprec ckpt show <{what}>", lambda m=make, w=words: cli(["ckpt", "show", m()], *w))
add("cli", "mixprec ckpt (no action)", lambda: cli(["ckpt"], "action"))


@case("cli", "mixprec ckpt show --json <good> prints JSON")
def _ckpt_json() -> Outcome:
    path = _good_checkpoint()
    with captured() as (out, err):
        status = main(["ckpt", "show", str(path), "--json"])
    try:
        data = json.loads(out.getvalue())
    except ValueError:
        data = {}
    return Outcome(CORRECT if status == 0 and data.get("steps") == 2 else SILENT,
                   f"exit {status}, steps {data.get('steps')} (want 0 and 2)")


@case("cli", "compare --workload <every step NaN> --recipes fp16,fp32 exits 1")
def _nan_compare() -> Outcome:
    return cli(["compare", "--workload", "probe_workloads:nan_model", "--recipes", "fp16,fp32", "--steps", "2",
                "--device", "cpu", "--threads", "1"], "every recipe failed", rc=1)


@case("cli", "compare <gpt2 on the CPU> says it will be slow before it starts")
def _slow_note() -> Outcome:
    from mixprec.lab.compare.cli import slow_run_note
    from mixprec.lab.compare.run import plan_compare
    note = slow_run_note(plan_compare("gpt2", ["bf16"], steps=1, device="cpu"))
    return Outcome(CORRECT if note and "minutes" in note else SILENT, f"note: {note!r}")


@case("cli", "trace --help does not promise compare's --batch-size")
def _trace_help() -> Outcome:
    with captured() as (out, err):
        main(["trace", "--help"])
    text = out.getvalue()
    return Outcome(CORRECT if "as in compare" not in text else SILENT, "trace's help names its own flags")


# ----------------------------------------------------------------------------- real processes
_MIXPREC = Path(sys.executable).with_name("mixprec")


def process(argv: list[str], *words: str, rc: int = 2) -> Outcome:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run([str(_MIXPREC), *argv], cwd=_TMP, env=env, capture_output=True, text=True,
                          timeout=120)
    return judge(done.returncode, done.stdout, done.stderr, words, rc)


add("cli", "process: mixprec compare --threads 0",
    lambda: process(["compare", "--threads", "0"], "--threads"))
add("cli", "process: mixprec compare <every step NaN> exits 1",
    lambda: process(["compare", "--workload", "probe_workloads:nan_model", "--recipes", "fp16,fp32",
                     "--steps", "2", "--device", "cpu", "--threads", "1"], "every recipe failed", rc=1))
add("cli", "process: mixprec ckpt show <garbage>",
    lambda: process(["ckpt", "show", str(_report_file("garbage2.ckpt", b"x" * 10))], "not a mixprec"))
