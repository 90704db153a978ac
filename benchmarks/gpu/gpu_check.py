"""The GPU check: what matters most about mixprec on a GPU, in one call of at most 8 minutes.

Five parts, in order of importance, each a subprocess with its own share of one time budget; a part
whose time would run out is cut at its share (what it wrote so far is kept) and a part that cannot
start in the time left is skipped with a line saying so:

  a. tests    the CUDA tests (tests/gpu and the gpu-marked tests elsewhere), one pytest process, each
              file stopped at its first failure (benchmarks/gpu/gpu_check_plugin.py);
  b. parity   the default bf16/fp16 loop against torch.amp's (benchmarks/step/bench_parity.py), interleaved,
              weights compared: a GPU-bound transformer (lm-gpu) and a host-bound one (lm), eager and
              ``torch.compile``d;
  c. fp8      fp8 per-tensor and rowwise against torch.amp bf16 and torchao float8 (tensorwise and
              rowwise), compiled, on a 340M-parameter Llama (benchmarks/step/bench_e2e.py --layers 4);
  d. host     the host-bound step (a 64-wide MLP, batch 8) eager and captured (``torch.compile`` +
              ``mp.compile_step(mode="reduce-overhead")``: CUDA graphs) against torch.amp eager and
              compiled (benchmarks/step/bench_step.py);
  e. doctor   the doctor's cost on the GPU (benchmarks/doctor/bench_doctor.py) and the memory prediction
              against the allocator's peak (``mixprec inspect --benchmark gpt2``).

Writes into the output folder (``$OUT``, else ./gpu-out): ``gpu_check.md`` (a header with the device,
torch version, date and commit, then one markdown table per part, rewritten after every part, ready
to paste into benchmarks/HISTORY.md, its headline figures into RESULTS.md) and ``gpu_check.log``
(every part's raw output).

``--dry-run`` runs every part's code path on the CPU at tiny sizes, compiled rows through the
``aot_eager`` backend, so the check cannot rot without a GPU (tests/test_gpu_check.py runs it).

    bash benchmarks/gpu/gpu_check.sh                 # on the GPU machine: python3 with a CUDA torch
    bash benchmarks/gpu/gpu_check.sh --dry-run       # anywhere
    bash benchmarks/gpu/gpu_check.sh --budget 300 --parts tests,host
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Part:
    name: str
    title: str
    share: float          # seconds of the budget this part may use on a GPU
    minimum: float        # seconds below which it is not started
    commands: list        # (label, argv, markdown file or None) run in order


# The CUDA test files (under tests/), in this order: those no GPU run has reached yet (FSDP2 fp8, the
# Hopper block kernel: the H200 check of 2026-11-28 stopped at its 117 s before them), those that
# failed or changed there, the rest, and the compile tests (minutes of Inductor) last; a file not
# named here runs before the compile tests.
_TEST_ORDER = ("gpu/test_fp8_fsdp_cuda", "test_fp8_blocked", "gpu/test_memory_cuda", "gpu/test_diagnostics_gpu",
               "gpu/test_grad_norm_cuda", "gpu/test_usage_checks_cuda", "gpu/test_fp8_cuda", "gpu/test_cuda",
               "gpu/test_doctor_cuda", "gpu/test_issue16_cuda", "gpu/test_oplists_cuda",
               "gpu/test_lab_reports_cuda", "gpu/test_nccl")
_LAST = ("gpu/test_compile_cuda",)


def _gpu_tests() -> list[str]:
    """Every file in tests/gpu, and the one outside it that holds a gpu-marked test (the Hopper block
    kernel), in _TEST_ORDER's order, the unnamed ones next, _LAST last."""
    files = {f"gpu/{p.stem}": p for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    files["test_fp8_blocked"] = ROOT / "tests" / "test_fp8_blocked.py"
    first = [files.pop(name) for name in _TEST_ORDER if name in files]
    last = [files.pop(name) for name in _LAST if name in files]
    return [str(p.relative_to(ROOT)) for p in first + sorted(files.values()) + last]


def parts(dry: bool, tmp: Path, py: str) -> list[Part]:
    b = "benchmarks/"
    if dry:
        dev, backend = ["--device", "cpu"], ["--backend", "aot_eager"]
        parity_sizes, parity_pairs = ["--quick"], ["--pairs", "1", "--warmup", "1"]
        e2e = ["--cpu-smoke", "--steps", "1", "--warmup", "1"]
        host = ["--reps", "2"]
        doctor = ["--reps", "1", "--workloads", "mlp", "--threads", "1"]
        inspect = ["--workload", "mlp", "--recipes", "bf16", "fp8"]
    else:
        dev, backend = ["--device", "cuda"], []
        parity_sizes, parity_pairs = [], ["--pairs", "10", "--warmup", "3"]
        e2e = ["--layers", "4", "--steps", "10", "--warmup", "3"]
        host = ["--reps", "100"]
        doctor = ["--reps", "10", "--workloads", "gpt"]
        inspect = ["--benchmark", "gpt2", "--recipes", "bf16", "fp16-pure", "fp8"]
    md = lambda name: str(tmp / f"{name}.md")
    return [
        Part("tests", "a. CUDA tests", 130, 20, [
            ("pytest", [py, "-m", "pytest", "-q", "-rs", "-p", "gpu_check_plugin", "-p", "no:cacheprovider",
                        *_gpu_tests(), "-m", "gpu"], None)]),
        Part("parity", "b. The default loop against torch.amp's (ratio < 1: mixprec faster)", 120, 30, [
            ("eager", [py, b + "step/bench_parity.py", *dev, *parity_sizes, *parity_pairs, "--models", "lm-gpu,lm",
                       "--recipes", "bf16,fp16", "--modes", "eager", "--optimizers", "fused",
                       "--markdown", md("parity-eager")], md("parity-eager")),
            ("compiled", [py, b + "step/bench_parity.py", *dev, *parity_sizes, *parity_pairs, *backend,
                          "--models", "lm-gpu,lm", "--recipes", "bf16,fp16", "--modes", "compiled",
                          "--optimizers", "fused", "--markdown", md("parity-compiled")], md("parity-compiled"))]),
        Part("fp8", "c. fp8 against torch.amp bf16 and torchao float8, compiled", 150, 60, [
            ("e2e", [py, b + "step/bench_e2e.py", *dev, *e2e, *backend, "--modes", "compiled", "--variants",
                     "amp-bf16,fp8,torchao-fp8,fp8-rowwise,torchao-fp8-rowwise", "--markdown", md("fp8")],
             md("fp8"))]),
        Part("host", "d. The host-bound step, eager and captured", 40, 15, [
            ("step", [py, b + "step/bench_step.py", *dev, *host, *backend, "--width", "64", "--depth", "3",
                      "--batch", "8", "--recipes", "bf16,fp16", "--opt-widths", "", "--markdown", md("host")],
             md("host"))]),
        Part("doctor", "e. The doctor's cost and the memory prediction", 50, 15, [
            ("doctor", [py, b + "doctor/bench_doctor.py", *dev, *doctor, "--recipes", "bf16",
                        "--markdown", md("doctor")], md("doctor")),
            ("memory", [py, "-m", "mixprec.lab.cli", "inspect", *dev, *inspect,
                        "--json", str(tmp / "inspect.json")], None)]),
    ]


def tests_table(results: Path) -> str:
    """One row per test file from the plugin's records (benchmarks/gpu/gpu_check_plugin.py): passed,
    failed, skipped, seconds, first failure. A run cut off at its time limit shows what it reached."""
    if not results.exists():
        return "(no test finished: pytest was stopped before its first result, or collected nothing)"
    files: dict[str, list] = {}
    for line in results.read_text().splitlines():
        r = json.loads(line)
        row = files.setdefault(r["file"], [0, 0, 0, 0.0, ""])
        row[3] += r["seconds"]
        if r["outcome"] == "failed":
            row[1] += 1
            row[4] = row[4] or f"{r['test']}: {r['message']}"
        else:
            row[0 if r["outcome"] == "passed" else 2] += 1
    lines = ["| file | passed | failed | skipped | s | first failure |", "|---|---|---|---|---|---|"]
    lines += [f"| {f} | {p} | {x} | {s} | {t:.1f} | {msg.replace('|', '/')} |"
              for f, (p, x, s, t, msg) in files.items()]
    return "\n".join(lines)


def memory_table(json_path: Path) -> str:
    """Predicted peak against the allocator's, per recipe, from the inspect report."""
    if not json_path.exists():
        return "(inspect wrote no report)"
    rep = json.loads(json_path.read_text())
    mib = lambda v: "-" if v is None else f"{v / 2**20:.1f}"
    lines = [f"`mixprec inspect` on {rep['workload']}, batch {rep['batch_size']}, {rep['device']}",
             "", "| recipe | predicted peak MiB | measured peak MiB | measured / predicted |", "|---|---|---|---|"]
    for m in rep["memory"]:
        pred, meas = m["predicted"]["peak"], (m.get("measured") or {}).get("peak")
        ratio = f"{meas / pred:.3f}" if meas and pred else "-"
        lines.append(f"| {m['label']} | {mib(pred)} | {mib(meas)} | {ratio} |")
    return "\n".join(lines)


def header(py: str, dry: bool) -> str:
    probe = ("import torch; print(torch.__version__, torch.version.cuda or '-', "
             "torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')")
    info = subprocess.run([py, "-c", probe], capture_output=True, text=True, cwd=ROOT).stdout.split()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown (no git)"
    torch_v, cuda_v, device = (info[0], info[1], " ".join(info[2:])) if len(info) >= 3 else ("?", "?", "?")
    mode = "DRY RUN on the CPU (tiny sizes, aot_eager): checks the code paths, measures nothing" if dry else ""
    return (f"# GPU check, {datetime.date.today().isoformat()}\n\n{device}; torch {torch_v} (CUDA {cuda_v}); "
            f"Python {sys.version.split()[0]}; mixprec commit {commit}. {mode}\n")


def _run_part(part: Part, w: str, allowed: float | None, log_path: Path, env: dict, tmp: Path, start: float,
              append: bool = False) -> str:
    """Run one part's commands in order, their output into ``log_path``; return its report section.
    ``allowed``: the part's seconds (None: no limit, the dry run)."""
    body = []
    t0 = time.monotonic()
    with log_path.open("a" if append else "w") as logf:
        for label, cmd, md in part.commands:
            remaining = None if allowed is None else allowed - (time.monotonic() - t0)
            if remaining is not None and remaining < 5:
                body.append(f"{label}: skipped, the part's {allowed:.0f} s were spent")
                continue
            logf.write(f"\n### {w}/{label}: {' '.join(cmd)}\n")
            logf.flush()
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                    timeout=None if remaining is None else max(remaining, 1)).returncode
                status = f"exit {rc}"
            except subprocess.TimeoutExpired:
                status = f"stopped at the part's time limit ({allowed:.0f} s)"
            logf.write(f"### {w}/{label}: {status}\n")
            logf.flush()
            body.append(f"{label} ({status}):\n")
            if md and Path(md).exists():
                body.append(Path(md).read_text())
            elif w == "tests":
                body.append(tests_table(tmp / "tests.jsonl"))
            elif label == "memory":
                body.append(memory_table(tmp / "inspect.json"))
            else:
                body.append("(no table: see gpu_check.log)")
    body.append(f"\n({time.monotonic() - t0:.0f} s)")
    print(f"gpu_check: {w} done at {time.monotonic() - start:.0f} s", flush=True)
    return f"## {part.title}\n\n" + "\n".join(body) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every part's code path on the CPU at tiny sizes")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all parts together (default 450)")
    ap.add_argument("--parts", default="tests,parity,fp8,host,doctor", help="comma list, run in this order")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-out", help="folder for the results")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    known = {p.name: p for p in parts(args.dry_run, tmp, py)}
    wanted = [w for w in args.parts.split(",") if w]
    if not wanted or not set(wanted) <= set(known):
        ap.error(f"--parts takes a comma list of {', '.join(known)}; got {args.parts!r}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "benchmarks" / "gpu")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env["GPU_CHECK_RESULTS"] = str(tmp / "tests.jsonl")
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""          # the CPU paths even on a machine with a GPU
    report, log = out / "gpu_check.md", out / "gpu_check.log"
    sections = [header(py, args.dry_run)]
    start = time.monotonic()
    total_share = sum(known[w].share for w in wanted)
    if args.dry_run:
        # Nothing is measured on the CPU: the parts run side by side, one per core, each into a log of its
        # own; the report and the log are put together in the parts' order.
        logs = {w: tmp / f"{w}.log" for w in wanted}
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
            futures = {w: pool.submit(_run_part, known[w], w, None, logs[w], env, tmp, start) for w in wanted}
            with log.open("w") as logf:
                for w in wanted:
                    sections.append(futures[w].result())
                    logf.write(logs[w].read_text())
                    report.write_text("\n".join(sections))
    else:
        for w in wanted:
            part = known[w]
            left = args.budget - (time.monotonic() - start)
            # A part may use its share of the budget, and what earlier parts left unused of theirs.
            scale = args.budget / total_share
            later = sum(known[x].share * scale for x in wanted[wanted.index(w) + 1:])
            allowed = min(left, max(part.share * scale, left - later))
            if left < part.minimum * scale:
                sections.append(f"## {part.title}\n\nskipped: {max(left, 0):.0f} s of the budget left, the part "
                                f"needs at least {part.minimum * scale:.0f} s\n")
            else:
                sections.append(_run_part(part, w, allowed, log, env, tmp, start, append=True))
            report.write_text("\n".join(sections))     # after every part: a cut-off run keeps what it has
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
