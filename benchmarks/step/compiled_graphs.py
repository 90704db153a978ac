"""How many graphs ``torch.compile(model)`` makes of a vision model under each recipe, against torch.amp.

Dynamo hands every graph it captures to the backend; a counting backend (which then runs the graph
eagerly) records how many and their call nodes (functions, methods, modules). Two training steps per
recipe, so a recompile in the second step shows as an extra graph. ``amp`` is the hand-written
``torch.autocast(bf16)`` loop: the count to match (issue 27: the casts belong in the model's graph).

    python benchmarks/step/compiled_graphs.py [--models resnet18,vit,convnext] [--recipes amp,bf16,bf16-pure]

Needs torchvision (resnet18) and timm (vit, convnext).
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F

import mixprec


def _resnet18():
    import torchvision
    return torchvision.models.resnet18(num_classes=10)


def _vit():
    import timm
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10)


def _convnext():
    import timm
    return timm.create_model("convnext_atto", num_classes=10)


MODELS = {"resnet18": _resnet18, "vit": _vit, "convnext": _convnext}


def count_graphs(build, recipe: str, steps: int = 2) -> list[int]:
    """Call nodes of each graph Dynamo captured over ``steps`` training steps of ``build()``."""
    graphs: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    compiled = torch.compile(model, backend=backend)
    if recipe == "amp":
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(compiled(x), y)
            loss.backward()
        return graphs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe)
    for _ in range(steps):
        with mp.autocast():
            loss = F.cross_entropy(compiled(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return graphs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18,vit,convnext")
    p.add_argument("--recipes", default="amp,bf16,fp16,bf16-pure,fp16-pure")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}; per model and recipe: graphs [call nodes of each]")
    for name in args.models.split(","):
        for recipe in args.recipes.split(","):
            graphs = count_graphs(MODELS[name], recipe)
            print(f"  {name:9s} {recipe:10s} {len(graphs)} {graphs}", flush=True)


if __name__ == "__main__":
    main()
