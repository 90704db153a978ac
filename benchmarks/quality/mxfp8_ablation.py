"""Why does mxfp8 train differently from fp8-rowwise? One factor at a time, in lockstep (issue 35).

Every variant below runs ``lockstep.train_lockstep`` (one init and one batch order per seed) with the
blocked fp8 layers emulated, and changes one thing of how the six operand quantizations of a linear
layer are done. The six sites (``blocked_linear.BlockedLinearFn``)::

    fwd_x  x along K (forward)          fwd_w  W along K (forward)
    gx_g   g along N (grad_x GEMM)      gx_w   W along N (grad_x GEMM)
    gw_g   g along M (grad_W GEMM)      gw_x   x along M (grad_W GEMM)

Each site is quantized ``row`` (rowwise: e4m3, one power-of-two scale per row of the operand along that
axis), ``mx`` (e4m3 in 32-blocks, e8m0 scale rounded up: mxfp8), ``mxfloor`` (the OCP reference's e8m0
scale ``2**(floor(log2 amax) - 8)``, which saturates a block's top values), ``mx_e5m2`` (e5m2 elements in
32-blocks), ``bf16`` (just rounded to bf16) or ``once`` (W's forward quantization reused by grad_x: the
weight quantized once). A variant is a name and a dict of sites; sites not named are ``row``.

    python benchmarks/quality/mxfp8_ablation.py --variants row,mx,mx_fwd,mx_gx,mx_gw --seeds 0,1,2 --iters 800 \\
        --device cuda --workers 12 --json out.jsonl

It prints one line per (variant, seed) with the validation loss at each evaluation, and a table of the
final loss minus ``row``'s at the same seed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lockstep import run_jobs  # noqa: E402

SITES = ("fwd_x", "fwd_w", "gx_g", "gx_w", "gw_g", "gw_x")
_ROLE_AXIS = {("input", 1): "fwd_x", ("weight", 1): "fwd_w", ("grad_output", 1): "gx_g",
              ("weight", 0): "gx_w", ("grad_output", 0): "gw_g", ("input", 0): "gw_x"}

MX = {s: "mx" for s in SITES}
VARIANTS: dict[str, dict[str, str]] = {
    "row": {},                                            # rowwise, through this ablation's hooks
    "mx": dict(MX),                                       # mxfp8, through the hooks
    "mx_fwd": {"fwd_x": "mx", "fwd_w": "mx"},             # mx in the forward GEMM only
    "mx_gx": {"gx_g": "mx", "gx_w": "mx"},                # mx in the grad_x GEMM only
    "mx_gw": {"gw_g": "mx", "gw_x": "mx"},                # mx in the grad_W GEMM only
    "mx_w_once": {**MX, "gx_w": "once"},                  # mxfp8, W quantized once (forward's blocks)
    "row_w_once": {"gx_w": "once"},                       # rowwise, W quantized once
    "mxfloor": {s: "mxfloor" for s in SITES},             # OCP floor scales instead of RCEIL
    "mx_g_e5m2": {**MX, "gx_g": "mx_e5m2", "gw_g": "mx_e5m2"},   # e5m2 gradients in 32-blocks
    "mx_g_bf16": {**MX, "gx_g": "bf16", "gw_g": "bf16"},  # gradients not quantized at all
    "bf16_all": {s: "bf16" for s in SITES},               # nothing quantized beyond bf16
}


def _spec(kind: str):
    from mixprec.formats import FP8_E4M3, FP8_E5M2
    from mixprec.fp8.blockscale import BlockScaling
    return {"row": BlockScaling(FP8_E4M3, 0, scale="pow2"), "mx": BlockScaling(FP8_E4M3, 32, scale="e8m0"),
            "mxfloor": BlockScaling(FP8_E4M3, 32, scale="e8m0"),
            "mx_e5m2": BlockScaling(FP8_E5M2, 32, scale="e8m0")}[kind]


def install(sites: dict[str, str]) -> None:
    """Patch blocked_linear's quantize/dequantize so each site quantizes as ``sites`` says (this process)."""
    from mixprec.fp8 import blocked_linear as bl
    from mixprec.fp8 import blockscale as bs
    q0, dq0 = bs.quantize_blocked, bs.dequantize_blocked
    roles: dict[int, str] = {}

    def site(how, axis: int) -> str:
        return _ROLE_AXIS[(roles[id(how)], axis % 2)]

    def quantize(x, how, axis, *, noise=None, dtype=torch.float32):
        name = site(how, axis)
        kind = sites.get(name, "row")
        if kind == "bf16":
            q = x.to(torch.bfloat16).to(torch.float32)
            return q, torch.ones(_decode_shape(q.shape, _spec("row"), axis), device=x.device)
        if kind == "once":                    # the weight as the forward quantized it (along K)
            fwd = sites.get("fwd_w", "row")
            q = bs.fake_quantize_blocked(x, _spec(fwd), 1) if fwd != "bf16" else x.to(torch.bfloat16).float()
            return q, torch.ones(_decode_shape(q.shape, _spec("row"), axis), device=x.device)
        if kind == "mxfloor":
            return _quantize_floor(x, axis)
        return q0(x, _spec(kind), axis, noise=noise, dtype=dtype)

    def dequantize(q, d, how, axis):
        kind = sites.get(site(how, axis), "row")
        if kind in ("bf16", "once"):
            return q.to(torch.float32)
        return dq0(q, d, _spec("mx" if kind == "mxfloor" else kind), axis)

    def recipe():
        # Three distinct objects, so the hooks know the role of the ``how`` they are handed.
        from mixprec.fp8.blocked_linear import BlockedRecipe
        r = BlockedRecipe(_spec("row"), _spec("row"), _spec("row"))
        for role in ("input", "weight", "grad_output"):
            roles[id(r.role(role))] = role
        return r

    bl.quantize_blocked, bl.dequantize_blocked = quantize, dequantize
    install.recipe = recipe                   # type: ignore[attr-defined]


def _decode_shape(shape, how, axis):
    from mixprec.fp8.blockscale import _geometry
    t0, t1, n0, n1 = _geometry(shape, how, axis % 2)
    return (n0, n1)


def _quantize_floor(x: torch.Tensor, axis: int):
    """OCP MX reference scaling: d = 2**(floor(log2 amax) - 8) per 32-block (e4m3's emax is 8), saturating."""
    from mixprec.fp8.blockscale import _tiles, _untile, _amax_tiles, _geometry
    how = _spec("mx")
    geo = _geometry(x.shape, how, axis % 2)
    xt = _tiles(x.to(torch.float32), *geo)
    amax = _amax_tiles(xt)
    d = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(amax)) - 8), 1.0)
    y = (xt / d[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32)
    return _untile(y, x.shape), d


def configure_variant(name: str):
    """The ``configure`` hook for ``train_lockstep``: every fp8 layer runs variant ``name``'s sites."""
    install(VARIANTS[name])

    def configure(model: torch.nn.Module) -> None:
        from mixprec.fp8.linear import Fp8Linear
        for m in model.modules():
            if isinstance(m, Fp8Linear):
                m.blocked = install.recipe()      # type: ignore[attr-defined]
                m.backend = "emulate"
    return configure


def table(results: list[dict], base: str = "row") -> str:
    """Final validation loss per variant (mean over seeds) and minus ``base``'s at the same seed."""
    final = {(r["label"], r["seed"]): r["curve"][-1][1] for r in results}
    labels = list(dict.fromkeys(r["label"] for r in results))
    seeds = sorted({r["seed"] for r in results})
    lines = ["| variant | final val loss, mean (min-max) | minus " + base + ", per seed | mean |", "|---|---|---|---|"]
    for lab in labels:
        v = [final[(lab, s)] for s in seeds if (lab, s) in final]
        d = [final[(lab, s)] - final[(base, s)] for s in seeds if (lab, s) in final and (base, s) in final]
        lines.append(f"| {lab} | {statistics.fmean(v):.4f} ({min(v):.4f}-{max(v):.4f}) | "
                     + " / ".join(f"{x:+.3f}" for x in d) + f" | {statistics.fmean(d) if d else 0:+.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--recipes", default="", help="';'-separated named recipes to run beside the variants")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--iters", type=int, default=800)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [("variant", v, "bf16,fp8=rowwise(backend=emulate)", s, args.iters, args.eval_every, args.device)
            for v in filter(None, args.variants.split(",")) for s in seeds]
    jobs += [("recipe", r, r, s, args.iters, args.eval_every, args.device)
             for r in filter(None, args.recipes.split(";")) for s in seeds]
    print(f"torch {torch.__version__}, {args.device}, {len(jobs)} runs, {args.workers} workers")
    results = run_jobs(jobs, args.workers, args.json)
    print(table(results))


if __name__ == "__main__":
    main()
