"""Workloads: lookup, the gpt text windows, model sizes counted by hand, short runs that learn, and the
user-workload protocol with every violation's message."""

import dataclasses
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec.lab import workloads as W
from mixprec.lab.models import GPT, GPTConfig, ResNet50, SmallResNet
from mixprec.lab.trainer import train
from mixprec.lab.user_workloads import load_user_workload
from mixprec.lab.workloads import (BENCHMARKS, WORKLOADS, Split, Workload, char_vocab, get_workload,
                                   pydoc_text, synthetic_split, text_windows)

TESTS = Path(__file__).parent


# ------------------------------------------------------------------------------------------ lookup
def test_names_are_unique_and_each_kind_is_found():
    assert set(WORKLOADS) == {"mlp", "cnn", "gpt", "beam"} and set(BENCHMARKS) == {"resnet50", "gpt2"}
    for name, w in {**WORKLOADS, **BENCHMARKS}.items():
        assert get_workload(name) is w and w.name == name
        assert w.synthetic == (name in BENCHMARKS)
    assert get_workload(" CNN ") is WORKLOADS["cnn"]


def test_unknown_name_lists_every_kind():
    with pytest.raises(ValueError, match=r"unknown workload 'resnet' \(did you mean 'resnet50'\?\); built-in: mlp, cnn, gpt, beam; benchmarks "
                                         r".*: resnet50, gpt2; or your own as package.module:function"):
        get_workload("resnet")
    with pytest.raises(TypeError, match="workload must be a name"):
        get_workload(3)


def test_mlp_is_the_seeds_as_before():
    w = get_workload("mlp")
    assert (w.batch_size, w.default_steps, w.metric_name, w.higher_is_better) == \
        (64, 500, "accuracy", True)
    linears = [m for m in w.build_model() if isinstance(m, nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == [(256, 64), (10, 256)]
    data = w.load_data()
    assert tuple(data.x_train.shape) == (1437, 64) and tuple(data.x_test.shape) == (360, 64)


def test_split_refuses_misaligned_rows():
    x, y = torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"x_test and y_test must hold the same number of rows"
                                         r".*\(4, 2\) and \(3,\)"):
        Split(x, y, x, y[:3])
    with pytest.raises(TypeError, match=r"Split.y_train must be a torch.Tensor, got list.*torch.as_tensor"):
        Split(x, [0, 1, 2, 3], x, y)


# --------------------------------------------------------------------------------------- cnn
def test_cnn_data_is_the_digits_as_images():
    flat, images = get_workload("mlp").load_data(), get_workload("cnn").load_data()
    assert tuple(images.x_train.shape) == (1437, 1, 8, 8)
    assert tuple(images.x_test.shape) == (360, 1, 8, 8)
    assert torch.equal(images.x_train.flatten(1), flat.x_train)
    assert torch.equal(images.y_test, flat.y_test)


def test_small_resnet_shape_and_size():
    model = SmallResNet()
    # stem 9*16 + BN 32; blocks: 16->16 (2*9*16*16 + 2*32), 16->32 (9*16*32 + 9*32*32 + 2*64 + 1x1 16*32
    # + 64), 32->32 (2*9*32*32 + 2*64); head 32*10 + 10
    assert sum(p.numel() for p in model.parameters()) == \
        (144 + 32) + (4608 + 64) + (4608 + 9216 + 128 + 512 + 64) + (18432 + 128) + 330 == 38266
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 8
    assert tuple(model(torch.zeros(5, 1, 8, 8)).shape) == (5, 10)


def test_cnn_keeps_batchnorm_fp32_under_fp16_pure_and_trains():
    w = get_workload("cnn")
    torch.manual_seed(0)
    model = w.build_model()
    mp = mixprec.MixedPrecision(model, w.make_optimizer(model.parameters()), "fp16-pure")
    for m in model.modules():
        tensors = list(m.parameters(recurse=False))
        tensors += [b for b in m.buffers(recurse=False) if b.is_floating_point()]
        if isinstance(m, nn.BatchNorm2d):     # weight, bias, running mean and variance
            assert len(tensors) == 4 and all(t.dtype == torch.float32 for t in tensors)
        elif isinstance(m, (nn.Conv2d, nn.Linear)):
            assert all(t.dtype == torch.float16 for t in tensors)
    data = w.load_data()
    losses = []
    for step in range(4):
        idx = torch.arange(step * 64, (step + 1) * 64)
        with mp.autocast():
            out = model(data.x_train[idx])
            loss = w.loss_fn(out, data.y_train[idx])
        assert out.dtype == torch.float32        # outputs come back fp32 for the loss
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses)


def test_cnn_learns_in_a_short_run():
    result = train(get_workload("cnn"), "fp32", steps=60)
    assert abs(result.losses[0] - math.log(10)) < 0.3      # untrained: about uniform over 10 classes
    assert result.final_loss < 0.5 and result.test_metric > 0.85


# --------------------------------------------------------------------------------------- gpt
def test_text_windows_by_hand():
    x, y = text_windows(torch.arange(10), block_size=3, stride=2)
    # N = (10 - 3 - 1) // 2 + 1 = 4 windows, starting at 0, 2, 4, 6
    assert x.tolist() == [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8]]
    assert y.tolist() == [[1, 2, 3], [3, 4, 5], [5, 6, 7], [7, 8, 9]]


def test_gpt_vocabulary_and_windows_come_from_the_text():
    text = pydoc_text()
    vocab = char_vocab(text)
    assert list(vocab) == sorted(set(text)) and len(text) > 100_000 and "\n" in vocab and "a" in vocab
    data = get_workload("gpt").load_data()
    T, stride = 64, 16
    n_train = int(len(text) * 0.9)
    assert tuple(data.x_train.shape) == tuple(data.y_train.shape) == ((n_train - T - 1) // stride + 1, T)
    assert tuple(data.x_test.shape) == ((len(text) - n_train - T - 1) // T + 1, T)
    assert data.x_train.dtype == data.y_train.dtype == torch.int64

    def decode(ids: torch.Tensor) -> str:
        return "".join(vocab[i] for i in ids.tolist())

    last = len(data.x_train) - 1
    for k in (0, 1, last):
        assert decode(data.x_train[k]) == text[k * stride:k * stride + T]
        assert decode(data.y_train[k]) == text[k * stride + 1:k * stride + T + 1]
    assert torch.equal(data.x_train[:, 1:], data.y_train[:, :-1])          # y is x shifted by one
    # Validation starts where training ends; its targets tile the held-out text once.
    assert decode(data.x_test[0]) == text[n_train:n_train + T]
    assert decode(data.y_test.flatten()) == text[n_train + 1:n_train + 1 + data.y_test.numel()]
    again = W._pydoc_windows.__wrapped__()                                  # not the cached one
    assert all(torch.equal(a, b) for a, b in zip(dataclasses.astuple(again), dataclasses.astuple(data)))


def test_gpt_model_shape():
    w = get_workload("gpt")
    model = w.build_model()
    V = len(char_vocab(pydoc_text()))
    assert model.lm_head.weight is model.wte.weight                          # tied
    assert tuple(model(torch.zeros(2, 64, dtype=torch.int64)).shape) == (2, 64, V)
    assert (w.tokens_per_sample, w.higher_is_better, w.metric_name) == (64, False, "loss")
    with pytest.raises(ValueError, match="sequence length 65 exceeds block_size 64"):
        model(torch.zeros(1, 65, dtype=torch.int64))


def test_gpt_learns_in_a_short_run():
    w = get_workload("gpt")
    ln_vocab = math.log(len(char_vocab(pydoc_text())))
    result = train(w, "fp32", steps=100)
    assert abs(result.losses[0] - ln_vocab) < 0.1      # N(0, 0.02) weights: logits near 0, uniform
    assert result.final_loss < ln_vocab - 1.5 and result.test_metric < ln_vocab - 1.5


# --------------------------------------------------------------------------------- benchmarks
def test_resnet50_has_torchvisions_parameter_count_and_runs_a_step():
    torch.manual_seed(0)
    model = ResNet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032     # torchvision.models.resnet50()
    mp = mixprec.MixedPrecision(model, BENCHMARKS["resnet50"].make_optimizer(model.parameters()), "fp32")
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([3, 999])
    with mp.autocast():
        logits = model(x)
        loss = BENCHMARKS["resnet50"].loss_fn(logits, y)
    assert tuple(logits.shape) == (2, 1000)
    mp.backward(loss)
    result = mp.step()
    assert not result.skipped and math.isfinite(result.grad_norm)


def test_gpt2_small_is_124m_counted_on_meta():
    with torch.device("meta"):                      # shapes only: no memory, no init cost
        model = BENCHMARKS["gpt2"].build_model()
        gpt2_vocab = GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768))
    # wte 50304*768 = 38,633,472; wpe 1024*768 = 786,432; per block: two LayerNorms 2*2*768 = 3,072,
    # c_attn 768*2304 + 2304 = 1,771,776, attn c_proj 768*768 + 768 = 590,592, c_fc 768*3072 + 3072 =
    # 2,362,368, mlp c_proj 3072*768 + 768 = 2,360,064: 7,087,872, times 12 = 85,054,464; ln_f 1,536;
    # lm_head tied to wte: 0.
    assert sum(p.numel() for p in model.parameters()) == \
        38_633_472 + 786_432 + 12 * 7_087_872 + 1_536 == 124_475_904
    # GPT-2's published 124,439,808 has the unpadded 50257 rows: 47 * 768 = 36,096 fewer.
    assert sum(p.numel() for p in gpt2_vocab.parameters()) == 124_475_904 - 47 * 768 == 124_439_808
    assert model.wte.weight.shape[0] % 64 == 0 and model.lm_head.weight is model.wte.weight


def test_benchmark_settings():
    r, g = BENCHMARKS["resnet50"], BENCHMARKS["gpt2"]
    assert (r.batch_size, r.tokens_per_sample, r.higher_is_better) == (256, 0, False)
    assert (g.batch_size, g.tokens_per_sample, g.higher_is_better) == (12, 1024, False)


def test_synthetic_split_is_seeded_and_shaped():
    images = synthetic_split((6, 3, 4, 4), 2, classes=1000)
    assert tuple(images.x_train.shape) == (6, 3, 4, 4) and tuple(images.y_test.shape) == (2,)
    assert images.x_train.dtype == torch.float32
    assert 0 <= int(images.y_train.min()) <= int(images.y_train.max()) < 1000
    again = synthetic_split((6, 3, 4, 4), 2, classes=1000)
    assert torch.equal(images.x_train, again.x_train) and torch.equal(images.y_test, again.y_test)
    tokens = synthetic_split((5, 8), 3, classes=50257, tokens=True)
    assert tuple(tokens.x_train.shape) == tuple(tokens.y_train.shape) == (5, 8)
    assert tuple(tokens.x_test.shape) == (3, 8)
    assert tokens.x_train.dtype == torch.int64 and int(tokens.x_train.max()) < 50257
    assert torch.equal(tokens.x_train[:, 1:], tokens.y_train[:, :-1])


def test_gpt2_optimizer_steps_a_tiny_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    mp = mixprec.MixedPrecision(model, BENCHMARKS["gpt2"].make_optimizer(model.parameters()), "fp32")
    ids = torch.randint(0, 64, (2, 17))
    with mp.autocast():
        loss = BENCHMARKS["gpt2"].loss_fn(model(ids[:, :-1]), ids[:, 1:])
    mp.backward(loss)
    assert not mp.step().skipped


# ----------------------------------------------------------------------------- user workloads
def test_user_example_loads_and_trains(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    w = get_workload("user_workload_example:tiny")       # ':' routes to load_user_workload
    assert isinstance(w, Workload) and w.name == "user_workload_example:tiny"
    assert (w.batch_size, w.default_steps, w.metric_name) == (64, 500, "accuracy")
    first, second = w.build_model(), w.build_model()
    assert first is not second
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    result = train(w, "fp32", steps=60)
    assert result.test_metric > 0.8
    # Training worked on a copy: the next run starts from the same weights again.
    assert all(torch.equal(a, b) for a, b in zip(w.build_model().state_dict().values(),
                                                 first.state_dict().values()))


def test_user_example_with_a_model_function_and_options(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    w = load_user_workload("user_workload_example:tiny_seeded")
    assert (w.batch_size, w.default_steps) == (32, 200)
    assert w.summary == "a LayerNorm MLP on three linear blobs"
    assert train(w, "bf16", steps=30).losses[-1] < train(w, "bf16", steps=1).losses[0]


_BAD = '''
import torch, torch.nn.functional as F
from torch import nn
from mixprec.lab.workloads import Split, get_workload

def _good():
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    return {"model": nn.Linear(4, 2), "data": Split(x, y, x, y), "loss": F.cross_entropy,
            "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}

def as_workload(): return get_workload("mlp")
def returns_list(): return [1, 2]
def needs_args(n_hidden): return _good()
def missing_loss(): d = _good(); del d["loss"]; return d
def misspelt(): d = _good(); d["optimiser"] = d.pop("optimizer"); return d
def tuple_data(): d = _good(); d["data"] = tuple(d["data"].__dict__.values()); return d
def string_model(): return {**_good(), "model": "resnet"}
def model_fn_returns_dict(): return {**_good(), "model": lambda: {}}
def optimizer_instance(): return {**_good(), "optimizer": torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1)}
def optimizer_returns_none(): return {**_good(), "optimizer": lambda p: None}
def loss_is_a_number(): return {**_good(), "loss": 0.0}
def zero_batch(): return {**_good(), "batch_size": 0}
def bool_better(): return {**_good(), "higher_is_better": "no"}
NOT_A_FUNCTION = 3
'''


@pytest.fixture
def bad_module(tmp_path, monkeypatch):
    (tmp_path / "mixprec_bad_workloads.py").write_text(textwrap.dedent(_BAD))
    (tmp_path / "mixprec_broken_import.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("mixprec_bad_workloads", "mixprec_broken_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return "mixprec_bad_workloads"


def test_user_function_may_return_a_workload(bad_module):
    assert load_user_workload(f"{bad_module}:as_workload") is WORKLOADS["mlp"]


_PROTOCOL = r"return a mixprec.lab.workloads.Workload, or a dict"


@pytest.mark.parametrize("fn, error, message", [
    ("returns_list", TypeError, rf"returns_list\(\) returned a list; {_PROTOCOL}"),
    ("needs_args", TypeError, r"needs_args\(\) must take no arguments, it requires \['n_hidden'\]"),
    ("missing_loss", ValueError, rf"the dict lacks \['loss'\]; {_PROTOCOL}"),
    ("misspelt", ValueError, r"unknown keys 'optimiser' \(did you mean 'optimizer'\?\)"),
    ("tuple_data", TypeError,
     r"'data' is a tuple; give mixprec.lab.workloads.Split\(x_train, y_train, x_test, y_test\)"),
    ("string_model", TypeError, r"'model' is a str; give a torch.nn.Module or a function that builds one"),
    ("model_fn_returns_dict", TypeError,
     r"'model' is a function that returned a dict; it must return a torch.nn.Module"),
    ("optimizer_instance", TypeError,
     r"'optimizer' is an optimizer already built; .* lambda params: torch.optim.SGD\(params"),
    ("optimizer_returns_none", TypeError,
     r"'optimizer'\(params\) returned None; it must return a torch.optim.Optimizer"),
    ("loss_is_a_number", TypeError, r"'loss' is a float, not a function"),
    ("zero_batch", ValueError, r"'batch_size' must be an integer >= 1, got 0"),
    ("bool_better", TypeError, r"'higher_is_better' must be a bool, got a str"),
    ("NOT_A_FUNCTION", TypeError, r"'NOT_A_FUNCTION' is an int, not a function"),
])
def test_user_protocol_violations_name_the_spec_and_the_fix(bad_module, fn, error, message):
    spec = f"{bad_module}:{fn}"
    with pytest.raises(error, match=rf"^workload '{spec}': ") as info:
        load_user_workload(spec)
    assert info.match(message)


def test_user_module_or_function_not_found(bad_module):
    with pytest.raises(ValueError, match=r"workload 'no_such_module_xyz:fn': no module named "
                                         r"'no_such_module_xyz' in .* or on sys.path; run from the "
                                         r"directory that holds it, set PYTHONPATH"):
        load_user_workload("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match=rf"module '{bad_module}' has no 'nope'; its functions: "
                                         r"as_workload, bool_better, loss_is_a_number"):
        load_user_workload(f"{bad_module}:nope")
    for spec in (f"{bad_module}:", ":fn", f"{bad_module}:a:b", f"{bad_module}:not-a-name"):
        with pytest.raises(ValueError, match=r"expected package.module:function, e.g. my_workloads:tiny"):
            load_user_workload(spec)


def test_a_failing_import_inside_the_user_module_keeps_its_own_error(bad_module):
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_not_installed"):
        load_user_workload("mixprec_broken_import:fn")


def test_user_module_is_found_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "mixprec_cwd_workload.py").write_text(
        "from mixprec.lab.workloads import get_workload\ndef mlp(): return get_workload('mlp')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "mixprec_cwd_workload", raising=False)
    path_before = list(sys.path)
    assert load_user_workload("mixprec_cwd_workload:mlp") is WORKLOADS["mlp"]
    assert sys.path == path_before                       # the directory was on the path for the import only


@pytest.mark.parametrize("name, hint", [("mlpp", "'mlp'"), ("gtp", "'gpt'"), ("resnet5", "'resnet50'")])
def test_a_misspelled_workload_says_did_you_mean(name, hint):
    with pytest.raises(ValueError, match="did you mean") as e:
        get_workload(name)
    assert hint in str(e.value) and "built-in: mlp" in str(e.value)
