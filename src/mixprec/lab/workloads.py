"""Workloads: a model, its data, its loss, its optimizer and how to score it, as one frozen value.

A workload is everything the trainer needs to train one model the same way under every recipe. Data is
loaded when asked for (never at import) and cached for the process; the train/test split is fixed, so
metrics compare across seeds and recipes. Three kinds, one lookup::

    >>> w = get_workload("mlp")
    >>> data = w.load_data()
    >>> tuple(data.x_train.shape), tuple(data.x_test.shape)
    ((1437, 64), (360, 64))
    >>> get_workload("resnet")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: unknown workload 'resnet' (did you mean 'resnet50'?); built-in: mlp, cnn, gpt, beam; benchmarks (...): resnet50, gpt2; ...

- ``WORKLOADS``, real data that trains in seconds on a CPU: ``mlp`` (a 2-layer MLP, 64-256-10, on scikit-learn's
  8x8 digits), ``cnn`` (a small ResNet with BatchNorm on the same digits), ``gpt`` (a character-level
  nanoGPT on the Python documentation that ships with CPython, ``pydoc_data.topics``: no download),
  ``beam`` (cantilever deflection curves in metres, computed from the beam equation: a regression
  where fp16 without loss scaling loses accuracy because its gradients underflow).
- ``BENCHMARKS``, synthetic data at realistic sizes, for speed and memory on a GPU: ``resnet50``
  (ResNet-50, 224x224 images, batch 256, like MXNet's float16 ``train_imagenet.py --benchmark 1``) and ``gpt2`` (GPT-2 small,
  124M parameters, 1024 tokens, batch 12). Their metric is the loss on a random batch: it says nothing
  about accuracy, only that the numbers stayed finite.
- Your own, named ``package.module:function``: see ``user_workloads.load_user_workload``. The function takes no
  arguments and returns either a ``Workload`` or, simpler, a dict::

      # my_workloads.py; then: mixprec compare --workload my_workloads:tiny
      import torch, torch.nn.functional as F
      from mixprec.lab.workloads import Split

      def tiny():
          g = torch.Generator().manual_seed(0)
          x = torch.randn(600, 16, generator=g)
          y = (x @ torch.randn(16, 3, generator=g)).argmax(dim=1)   # 3 classes by a fixed linear rule
          return {
              "model": torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)),
              "data": Split(x[:500], y[:500], x[500:], y[500:]),   # train inputs, targets; test ones
              "loss": F.cross_entropy,                               # loss(outputs, targets) -> scalar
              "optimizer": lambda params: torch.optim.AdamW(params, lr=1e-3),
              # optional: "metric" (default accuracy), "metric_name", "higher_is_better", "batch_size"
              # (64), "steps" (500), "tokens_per_sample" (0), "summary"
          }
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .models import GPT, GPTConfig, ResNet50, SmallResNet
from .user_workloads import load_user_workload
from .workload import Split, Workload, accuracy, cross_entropy, mean_cross_entropy

__all__ = ["Split", "Workload", "WORKLOADS", "BENCHMARKS", "get_workload",
           "accuracy", "r2_score", "cross_entropy", "mean_cross_entropy", "pydoc_text", "char_vocab", "text_windows",
           "synthetic_split"]


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=1e-4)


# ------------------------------------------------------------------------------- mlp and cnn
# A 2-layer MLP (the classic first loss-scaling example trains one on MNIST), on the 8x8 digits that ship with
# scikit-learn: 1797 real handwritten digits, no download.

_DIGITS_FEATURES = 64      # 8x8 pixels
_DIGITS_CLASSES = 10
_DIGITS_MAX_PIXEL = 16.0   # pixel values are integers 0..16
_MLP_HIDDEN = 256
_SPLIT_SEED = 0            # fixed: the test set is the same whatever --seed says


@functools.cache
def _digits() -> Split:
    # Imported here: scikit-learn is slow to import and only this loader needs it.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / _DIGITS_MAX_PIXEL).astype(np.float32)   # [0, 1]: exact in fp16 and bf16 (k/16)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=_SPLIT_SEED)
    return Split(torch.from_numpy(x_train), torch.from_numpy(y_train),
                 torch.from_numpy(x_test), torch.from_numpy(y_test))


@functools.cache
def _digit_images() -> Split:
    d = _digits()   # the same rows, as (N, 1, 8, 8) one-channel images
    return Split(d.x_train.view(-1, 1, 8, 8), d.y_train, d.x_test.view(-1, 1, 8, 8), d.y_test)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(_DIGITS_FEATURES, _MLP_HIDDEN), nn.ReLU(),
                         nn.Linear(_MLP_HIDDEN, _DIGITS_CLASSES))


MLP = Workload(
    name="mlp",
    summary=f"2-layer MLP ({_DIGITS_FEATURES}-{_MLP_HIDDEN}-{_DIGITS_CLASSES}, ReLU) on scikit-learn's "
            "8x8 handwritten digits (1437 train / 360 test)",
    build_model=_mlp, load_data=_digits, loss_fn=F.cross_entropy, make_optimizer=_adamw,
    metric=accuracy, metric_name="accuracy", batch_size=64, default_steps=500,
)

CNN = Workload(
    name="cnn",
    summary="small ResNet (3 residual blocks, 8 BatchNorms, 38k parameters) on the same 8x8 digits as "
            "(N, 1, 8, 8) images; pure recipes keep its BatchNorms fp32",
    build_model=SmallResNet, load_data=_digit_images, loss_fn=F.cross_entropy, make_optimizer=_adamw,
    metric=accuracy, metric_name="accuracy", batch_size=64, default_steps=500,
)


# ----------------------------------------------------------------------------------------- gpt
# Character-level language modelling on CPython's pydoc topics: ~465k characters of real English and
# Python, ~100 distinct characters (the exact text and vocabulary follow the Python version).

_GPT_BLOCK = 64              # T: characters of context
_GPT_TRAIN_STRIDE = 16       # overlapping train windows: each character is seen at 4 positions of a
                             # window, much as random offsets would give, at 1/16 the memory of all
_GPT_TRAIN_FRACTION = 0.9    # the first 90% of the text trains, the last 10% validates


def pydoc_text() -> str:
    """CPython's pydoc topics (what ``help("if")`` prints), in sorted-key order, one blank line apart."""
    from pydoc_data.topics import topics   # ships with every CPython; imported only when asked for
    return "\n".join(topics[key] for key in sorted(topics))


def char_vocab(text: str) -> str:
    """The distinct characters of ``text``, sorted: token id ``i`` stands for ``vocab[i]``."""
    return "".join(sorted(set(text)))


def text_windows(ids: torch.Tensor, block_size: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut ``(L,)`` token ids into inputs and next-token targets, ``(N, T)`` each.

    ``x[i] = ids[i*stride : i*stride + T]`` and ``y[i] = ids[i*stride + 1 : i*stride + T + 1]``, for
    every window that fits: ``N = (L - T - 1) // stride + 1``. With ``stride == T`` the targets tile
    the text once.
    """
    windows = ids.unfold(0, block_size + 1, stride)    # (N, T + 1), a view
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


@functools.cache
def _pydoc_chars() -> tuple[str, str]:
    text = pydoc_text()
    return text, char_vocab(text)


@functools.cache
def _pydoc_windows() -> Split:
    text, vocab = _pydoc_chars()
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([index[ch] for ch in text], dtype=torch.int64)    # (L,)
    n_train = int(len(ids) * _GPT_TRAIN_FRACTION)
    x_train, y_train = text_windows(ids[:n_train], _GPT_BLOCK, _GPT_TRAIN_STRIDE)
    x_val, y_val = text_windows(ids[n_train:], _GPT_BLOCK, _GPT_BLOCK)  # each val character scored once
    return Split(x_train, y_train, x_val, y_val)


def _char_gpt() -> nn.Module:
    vocab_size = len(_pydoc_chars()[1])
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=_GPT_BLOCK, n_layer=2, n_head=4, n_embd=64))


def _gpt_adamw(params: Iterable[nn.Parameter], lr: float = 3e-3) -> torch.optim.Optimizer:
    # nanoGPT's grouping: weight decay on matrices (linears, embeddings), none on biases and norms.
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))


GPT_CHAR = Workload(
    name="gpt",
    summary=f"character-level nanoGPT (2 pre-LN blocks, 4 heads, width 64, context {_GPT_BLOCK}) on "
            "CPython's pydoc topics (first 90% trains, last 10% validates); metric: validation loss, "
            "nats per character",
    build_model=_char_gpt, load_data=_pydoc_windows, loss_fn=cross_entropy, make_optimizer=_gpt_adamw,
    metric=mean_cross_entropy, metric_name="loss", higher_is_better=False, batch_size=32,
    default_steps=600, tokens_per_sample=_GPT_BLOCK,
)

# ---------------------------------------------------------------------------------------- beam
# A regression in physical units where fp16 without loss scaling really fails (mixprec doctor predicts
# it): the deflection curve of a steel cantilever under a tip load F, w(x) = F x^2 (3L - x) / (6 E I),
# at 64 points along its length L, in metres (0.67 mm on average). The four inputs are standardised as
# usual; the targets stay in metres. The MSE (m^2) is averaged over 64 points x 256 curves, so each
# output's gradient is 2 (f - y) / 16384: once the fit is within ~0.25 mm (2**-12 m) it is below
# fp16's smallest subnormal, 2**-24, and flushes to zero. fp32 keeps learning: with its output layer
# zero-initialised (a common choice for regression heads) SGD's progress on the fit does not depend on
# the units, and lr 3 was tuned in fp32 for this mean-reduced loss. No multiplier anywhere.

_BEAM_POINTS = 64
_BEAM_CURVES, _BEAM_TRAIN = 2000, 1600
_BEAM_SEED = 0                   # fixed: the data set is the same whatever --seed says


@functools.cache
def _beam_curves() -> Split:
    g = torch.Generator().manual_seed(_BEAM_SEED)
    n = _BEAM_CURVES
    load = torch.empty(n, dtype=torch.float64).uniform_(1e3, 5e3, generator=g)        # F, newtons
    length = torch.empty(n, dtype=torch.float64).uniform_(0.8, 1.2, generator=g)      # L, metres
    modulus = torch.empty(n, dtype=torch.float64).uniform_(190e9, 210e9, generator=g)  # E, Pa (steel)
    inertia = torch.empty(n, dtype=torch.float64).uniform_(2e-6, 4e-6, generator=g)   # I, m^4
    x = torch.linspace(0, 1, _BEAM_POINTS, dtype=torch.float64)[None, :] * length[:, None]   # (N, 64)
    deflection = (load[:, None] * x**2 * (3 * length[:, None] - x)
                  / (6 * modulus[:, None] * inertia[:, None]))                          # (N, 64) metres
    inputs = torch.stack([load, length, modulus, inertia], dim=1)
    inputs = (inputs - inputs.mean(0)) / inputs.std(0)                                  # standardised
    x32, y32 = inputs.float(), deflection.float()
    t = _BEAM_TRAIN
    return Split(x32[:t], y32[:t], x32[t:], y32[t:])


def _beam_mlp() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 256), nn.GELU(), nn.Linear(256, _BEAM_POINTS))
    nn.init.zeros_(model[2].weight)      # the regression head starts at zero (and so at 0 m)
    nn.init.zeros_(model[2].bias)
    return model


def r2_score(pred: torch.Tensor, target: torch.Tensor) -> float:
    """Coefficient of determination over all outputs: 1 - SSE / SST (1 is perfect). Syncs with the host."""
    pred, target = pred.double(), target.double()
    return float(1 - ((pred - target) ** 2).sum() / ((target - target.mean(0)) ** 2).sum())


BEAM = Workload(
    name="beam",
    summary=f"deflection curves of steel cantilevers ({_BEAM_POINTS} points, metres) from load, length, "
            "modulus and inertia; 2-layer MLP, SGD; the MSE in m^2 is tiny: fp16 needs a loss scale",
    build_model=_beam_mlp, load_data=_beam_curves, loss_fn=F.mse_loss,
    make_optimizer=lambda params: torch.optim.SGD(params, lr=3.0, momentum=0.9), metric=r2_score,
    metric_name="r2", batch_size=256, default_steps=400,
)

WORKLOADS: dict[str, Workload] = {w.name: w for w in (MLP, CNN, GPT_CHAR, BEAM)}


# ---------------------------------------------------------------------------------- benchmarks
# Random data at the sizes people train at, for speed and memory on a GPU. The train set is a few
# batches (the trainer indexes rows, so any step reads real-sized batches), from a fixed generator.

_BENCH_SEED = 0
_RESNET50_BATCH = 256        # MXNet's float16 ResNet-50: train_imagenet.py --benchmark 1 --batch-size 256
_IMAGE_SIZE = 224
_IMAGENET_CLASSES = 1000
_GPT2_BATCH = 12             # nanoGPT's GPT-2 batch per step (before gradient accumulation)
_GPT2_BLOCK = 1024
_GPT2_VOCAB = 50257          # GPT-2's BPE vocabulary: the ids that occur in the data
# A tensor-core lesson: 50257 is odd, so the (B*T, C) x (C, V) LM-head matmul, the largest in the
# model, breaks the rule that 16-bit tensor-core GEMMs want every dimension a multiple of 8 (16 for
# fp8), and its last tile runs partly empty. nanoGPT pads the embedding and head to 50304 = 786 * 64
# rows; the 47 extra rows are never a target, so their logits just learn to stay low.
_GPT2_VOCAB_PADDED = 50304
_BENCH_BATCHES = 2           # the synthetic train set holds this many batches; the test set is smaller
_BENCH_STEPS = 100           # the trainer times the last 90: the first 10 allocate and pick kernels


def synthetic_split(x_train_shape: tuple[int, ...], n_test: int, *, classes: int,
                    tokens: bool = False, seed: int = _BENCH_SEED) -> Split:
    """Random data from a fixed generator: images with a random class each, or random token sequences.

    Images: ``x`` is N(0, 1) float32 (as normalised pixels are), ``y`` a class in ``[0, classes)``.
    Tokens (``tokens=True``, ``x_train_shape = (N, T)``): a random sequence of T + 1 ids per row, ``x``
    its first T and ``y`` its last T, as a language model would see it.
    """
    g = torch.Generator().manual_seed(seed)
    n_train, sample_shape = x_train_shape[0], x_train_shape[1:]
    if tokens:
        (T,) = sample_shape
        seqs = torch.randint(0, classes, (n_train + n_test, T + 1), generator=g)   # (N, T + 1)
        x, y = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
    else:
        x = torch.randn(n_train + n_test, *sample_shape, generator=g)              # (N, ...)
        y = torch.randint(0, classes, (n_train + n_test,), generator=g)
    return Split(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def _resnet50_data() -> Split:
    return synthetic_split((_BENCH_BATCHES * _RESNET50_BATCH, 3, _IMAGE_SIZE, _IMAGE_SIZE), 64,
                           classes=_IMAGENET_CLASSES)   # 0.35 GB of fp32 pixels


def _gpt2_data() -> Split:
    # 4 test rows: the trainer scores them in one forward, (4, 1024, 50304) fp32 logits = 0.8 GB.
    return synthetic_split((_BENCH_BATCHES * _GPT2_BATCH, _GPT2_BLOCK), 4, classes=_GPT2_VOCAB, tokens=True)


def _gpt2_small() -> nn.Module:
    return GPT(GPTConfig(vocab_size=_GPT2_VOCAB_PADDED, block_size=_GPT2_BLOCK, n_layer=12, n_head=12,
                         n_embd=768))


def _sgd_fused(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    # Fused: the engine hands the loss scale and overflow flag to the kernel, no host sync per step.
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4, fused=True)


def _adamw_fused(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


RESNET50 = Workload(
    name="resnet50",
    summary=f"ResNet-50 (25.6M parameters) on random {_IMAGE_SIZE}x{_IMAGE_SIZE} images, batch "
            f"{_RESNET50_BATCH}: speed and memory (metric: loss on a random batch)",
    build_model=ResNet50, load_data=functools.cache(_resnet50_data), loss_fn=F.cross_entropy,
    make_optimizer=_sgd_fused, metric=mean_cross_entropy, metric_name="loss", higher_is_better=False,
    batch_size=_RESNET50_BATCH, default_steps=_BENCH_STEPS, synthetic=True,
)

GPT2 = Workload(
    name="gpt2",
    summary=f"GPT-2 small (124M parameters, vocabulary padded to {_GPT2_VOCAB_PADDED}) on random token "
            f"ids, {_GPT2_BLOCK} tokens x batch {_GPT2_BATCH}: speed and memory (metric: loss on a "
            "random batch)",
    build_model=_gpt2_small, load_data=functools.cache(_gpt2_data), loss_fn=cross_entropy,
    make_optimizer=_adamw_fused, metric=mean_cross_entropy, metric_name="loss", higher_is_better=False,
    batch_size=_GPT2_BATCH, default_steps=_BENCH_STEPS, tokens_per_sample=_GPT2_BLOCK, synthetic=True,
)

BENCHMARKS: dict[str, Workload] = {w.name: w for w in (RESNET50, GPT2)}


def get_workload(name: str) -> Workload:
    """The workload ``name`` names: built-in, benchmark, or ``package.module:function`` (the user's own).

    Built-in and benchmark names are distinct, so one word picks either; an unknown one lists them all.
    """
    if not isinstance(name, str):
        raise TypeError(f"workload must be a name such as 'mlp', got {type(name).__name__}")
    if ":" in name:
        return load_user_workload(name)
    key = name.strip().lower()
    if key in WORKLOADS:
        return WORKLOADS[key]
    if key in BENCHMARKS:
        return BENCHMARKS[key]
    close = difflib.get_close_matches(key, [*WORKLOADS, *BENCHMARKS], n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    raise ValueError(f"unknown workload {name!r}{hint}; built-in: {', '.join(WORKLOADS)}; benchmarks (synthetic "
                     f"data, for GPUs): {', '.join(BENCHMARKS)}; or your own as package.module:function")
