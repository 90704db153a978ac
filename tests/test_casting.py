"""Preparing a model: what is cast, what stays fp32, which dtypes flow in and out."""

import io

import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision, parse_recipe
from mixprec.casting.model import cast_floating, low_precision_params


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.head(self.ln(self.fc(x.flatten(1))))


def test_pure_recipe_casts_weights_keeps_norms_fp32_and_routes_dtypes():
    torch.manual_seed(0)
    model = Net()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16-pure")
    assert {model.conv.weight.dtype, model.fc.weight.dtype, model.head.bias.dtype} == {torch.float16}
    assert {model.bn.weight.dtype, model.bn.running_var.dtype, model.ln.weight.dtype} == {torch.float32}
    seen, computed = {}, {}

    def record(module, args, out):
        seen[module] = out.dtype     # returns None: observes, changes nothing
    for name in ("bn", "ln", "head"):
        getattr(model, name).register_forward_hook(record)

    class Spy(torch.overrides.TorchFunctionMode):   # the dtype each norm kernel is handed
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (F.batch_norm, F.layer_norm, F.linear):
                computed.setdefault(func.__name__, []).append(args[0].dtype)
            return func(*args, **(kwargs or {}))
    with mp.autocast(), Spy():
        out = model(torch.randn(2, 1, 8, 8))                   # fp32 input from the data pipeline
    # Norms compute on fp32 inputs (their weights are fp32, so they compute in fp32) and hand fp16 on.
    assert computed["batch_norm"] == computed["layer_norm"] == [torch.float32]
    assert seen[model.bn] == seen[model.ln] == torch.float16
    assert computed["linear"] == [torch.float16, torch.float16]  # fc and head get fp16 activations
    assert out.dtype == torch.float32                           # logits leave in fp32 for the loss
    # The master copy holds exactly the low-precision parameters, as fp32 clones of the initial values.
    assert len(mp.master.masters) == 6 and all(m.dtype == torch.float32 for m in mp.master.masters)


def test_autocast_recipe_keeps_weights_and_hands_on_what_autocast_makes():
    model = Net()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16")
    assert all(p.dtype == torch.float32 for p in model.parameters()) and mp.master is None
    x = torch.randn(2, 1, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    with mp.autocast():
        out = model(x)
    # torch.amp's logits, dtype and bits: a drop-in changes nothing the caller's loss sees.
    assert out.dtype == expected.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_prepared_model_still_serialises():
    model = Net()
    MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    clone = torch.load(buffer, weights_only=False)
    x = torch.randn(2, 1, 8, 8)
    assert torch.equal(clone(x), model(x))


def test_fp32_modules_option_and_tied_weights():
    model = Net()
    recipe = parse_recipe("params=bf16,compute=bf16,master=fp32,fp32_modules=Linear+Norm")
    params = low_precision_params(model, recipe)
    assert [p.shape for p in params] == [model.conv.weight.shape, model.conv.bias.shape]
    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    assert len(low_precision_params(tied, parse_recipe("bf16-pure"))) == 1   # one tensor, counted once


def test_cast_floating_walks_nests_and_leaves_integers():
    value = {"a": [torch.ones(2), torch.arange(3)], "b": (torch.ones(1, dtype=torch.float64), "text")}
    cast = cast_floating(value, torch.float16)
    assert cast["a"][0].dtype == torch.float16 and cast["a"][1].dtype == torch.int64
    assert cast["b"][0].dtype == torch.float16 and cast["b"][1] == "text" and isinstance(cast["b"], tuple)


class LossInside(nn.Module):
    """A Hugging Face-style model: computes its own loss and returns it with the logits."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 6)

    def forward(self, x, labels=None):
        logits = self.head(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


def test_outputs_are_cast_where_the_loss_needs_it_not_copied_wholesale():
    from mixprec.casting.model import autocast_softmax_is_fp32
    assert not autocast_softmax_is_fp32("cpu", torch.bfloat16)   # CPU autocast: log_softmax stays bf16
    model = LossInside()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16")
    x, labels = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    with mp.autocast():
        with_loss, bare = model(x, labels), model(x)
    # The model computed its loss: the loss comes out fp32 and the logits are not copied to fp32.
    assert with_loss["loss"].dtype == torch.float32 and with_loss["logits"].dtype == torch.bfloat16
    # No loss inside: the logits are autocast's (its F.cross_entropy runs in fp32 from them).
    assert bare["logits"].dtype == torch.bfloat16
    # A pure recipe has no fp32 weights to give fp32 logits: on CPU, where autocast would run
    # log_softmax in bf16, its logits are cast for the caller's loss.
    model = LossInside()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure")
    with mp.autocast():
        with_loss, bare = model(x, labels), model(x)
    assert with_loss["loss"].dtype == torch.float32 and with_loss["logits"].dtype == torch.bfloat16
    assert bare["logits"].dtype == torch.float32
    assert torch.equal(bare["logits"], with_loss["logits"].float())


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 10)

    def forward(self, x, scale: float = 1.0):
        return self.fc(self.bn(self.conv(x)).mean((2, 3))) * scale


def _dynamo_graphs(recipe):
    """The graphs Dynamo hands a backend for one compiled forward of ``_ConvNet`` under ``recipe``
    (None: the hand-written torch.autocast loop), as call counts."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ConvNet()
    x = torch.randn(2, 3, 8, 8)
    compiled = torch.compile(model, backend=backend)
    if recipe is None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
    else:
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
        with mp.autocast():
            out = compiled(x)
    return graphs, out


def test_a_compiled_model_traces_the_edge_casts_into_its_one_graph():
    # As forward hooks the input cast and the logits cast were compiled as one-node graphs of their
    # own (3 graphs: [1, 9, 1]); wrapped into forward they are part of the model's graph.
    amp, _ = _dynamo_graphs(None)
    assert len(amp) == 1
    for recipe in ("bf16", "bf16-pure", "fp16-pure"):
        graphs, out = _dynamo_graphs(recipe)
        assert len(graphs) == 1, (recipe, graphs)
        # bf16 hands on autocast's logits; a pure recipe's are lifted to fp32 on a CPU: the cast still runs.
        assert out.dtype == (torch.bfloat16 if recipe == "bf16" else torch.float32)


def test_the_edge_casts_keep_the_forward_signature_and_come_off_with_close():
    import inspect
    model = _ConvNet()
    before = inspect.signature(model.forward)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure")
    assert inspect.signature(model.forward) == before      # the HF Trainer picks dataset columns by it
    assert model(torch.randn(2, 3, 8, 8), scale=2.0).dtype == torch.float32
    for handle in mp._hooks:
        handle.remove()
    assert "forward" not in model.__dict__
