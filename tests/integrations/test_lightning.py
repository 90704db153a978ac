"""mixprec's Lightning Precision plugin inside Lightning's own loops: the same numbers as the engine
driven by hand, clipping of unscaled gradients, checkpoints that resume the engine's state."""

import pytest
import torch
import torch.nn.functional as F
from optional_deps import need
from torch import nn

need("lightning")
import lightning as L  # noqa: E402

from mixprec import MixedPrecision  # noqa: E402
from mixprec.integrations.lightning import MixedPrecisionPlugin  # noqa: E402
from mixprec.integrations.logging import MetricsLogger  # noqa: E402

STEPS = 15


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * 8, 16, generator=g)
    return x, (x @ torch.randn(16, 4, generator=g)).argmax(1)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4))


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _net()

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _loader(batches=STEPS):
    x, y = _data()
    x, y = x[:batches * 8], y[:batches * 8]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


def _fit(plugin, tmp_path, steps=STEPS, ckpt_path=None, batches=STEPS, accumulate=1):
    trainer = L.Trainer(max_steps=steps, plugins=[plugin], gradient_clip_val=1.0, accelerator="cpu",
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    module = Module()
    trainer.fit(module, _loader(batches), ckpt_path=ckpt_path)
    return trainer, module


def _by_hand(recipe, steps=STEPS, accumulate=1):
    net = _net()
    holder = nn.Module()
    holder.net = net                       # the same parameter names as the LightningModule
    mp = MixedPrecision(holder, torch.optim.SGD(holder.parameters(), lr=0.5), recipe, clip_grad_norm=1.0)
    x, y = _data()
    for i in range(steps * accumulate):
        with mp.autocast():
            loss = F.cross_entropy(net(x[i * 8:(i + 1) * 8]), y[i * 8:(i + 1) * 8])
        mp.backward(loss / accumulate if accumulate > 1 else loss)   # Lightning divides by k, k > 1
        if (i + 1) % accumulate == 0:
            mp.step()
            mp.zero_grad()
    return holder, mp


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16"])
def test_lightning_loop_equals_the_engine_by_hand_bit_for_bit(recipe, tmp_path):
    seen = []
    plugin = MixedPrecisionPlugin(recipe, metrics=MetricsLogger(lambda m, step: seen.append((step, m))))
    _, module = _fit(plugin, tmp_path)
    holder, mp = _by_hand(recipe)
    for (name, p), q in zip(module.named_parameters(), holder.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
    assert plugin.engine.scale == mp.scale
    assert [s for s, _ in seen] == list(range(STEPS))
    norms = [m["mixprec/grad_norm"] for _, m in seen]
    assert max(norms) > 1.0                                # clipping engaged, on the unscaled norm
    assert all(n < 100 for n in norms)                     # not S-scaled norms (S = 65536 for fp16)


@pytest.mark.parametrize("accumulate", [1, 2, 4])
@pytest.mark.parametrize("recipe", ["fp16", "fp16-pure", "bf16-pure", "fp8"])
def test_gradient_accumulation_equals_the_engine_by_hand_from_the_first_micro_batch(recipe, accumulate,
                                                                                   tmp_path):
    # The engine must exist before the first micro-batch: built at the first optimizer step, the k - 1
    # micro-batches before it ran without the loss scale (fp16: their gradients then divided by 65536),
    # in fp32 weights (pure) or in plain linears (fp8).
    steps = 3
    plugin = MixedPrecisionPlugin(recipe)
    _, module = _fit(plugin, tmp_path, steps=steps, batches=steps * accumulate, accumulate=accumulate)
    holder, mp = _by_hand(recipe, steps=steps, accumulate=accumulate)
    for (name, p), q in zip(module.named_parameters(), holder.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
    assert plugin.engine.scale == mp.scale
    if mp.master is not None:
        for m, n in zip(plugin.engine.master.masters, mp.master.masters):
            assert torch.equal(m, n)
    if recipe == "fp8":
        assert plugin.engine.fp8_report.swapped == mp.fp8_report.swapped == ("net.0",)
        assert torch.equal(module.net[0].input_scale, holder.net[0].input_scale)


def test_the_engine_exists_before_the_first_forward(tmp_path):
    seen = []

    class Probe(Module):
        def training_step(self, batch, i):
            seen.append((self.trainer.precision_plugin.engine is not None, self.net[0].weight.dtype))
            return super().training_step(batch, i)

    trainer = L.Trainer(max_steps=1, plugins=[MixedPrecisionPlugin("fp16-pure")], accelerator="cpu",
                        accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Probe(), _loader(2))
    assert seen == [(True, torch.float16), (True, torch.float16)]


def test_checkpoint_holds_the_engine_state_and_resumes_it(tmp_path, monkeypatch):
    half_trainer, _ = _fit(MixedPrecisionPlugin("fp16-pure"), tmp_path / "a", steps=5)
    path = str(tmp_path / "half.ckpt")
    half_trainer.save_checkpoint(path)
    assert "masters" in torch.load(path, weights_only=False)["MixedPrecisionPlugin"]["master"]
    # Lightning decides which batches a resumed run sees; record them and replay them by hand.
    fed = []
    step = Module.training_step
    monkeypatch.setattr(Module, "training_step",
                        lambda self, batch, i: (fed.append(batch), step(self, batch, i))[1])
    resumed_trainer, resumed = _fit(MixedPrecisionPlugin("fp16-pure"), tmp_path / "b", steps=10, ckpt_path=path)
    assert len(fed) == 5
    holder, mp = _by_hand("fp16-pure", steps=5)          # the run the checkpoint came from
    for x, y in fed:
        with mp.autocast():
            loss = F.cross_entropy(holder.net(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    for (name, p), q in zip(resumed.named_parameters(), holder.parameters()):
        assert torch.equal(p, q), name
    for m, n in zip(resumed_trainer.precision_plugin.engine.master.masters, mp.master.masters):
        assert torch.equal(m, n)


def test_clipping_by_value_is_refused(tmp_path):
    trainer = L.Trainer(max_steps=1, plugins=[MixedPrecisionPlugin("fp16")], gradient_clip_val=1.0,
                        gradient_clip_algorithm="value", accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match="norm"):
        trainer.fit(Module(), _loader())


def test_validation_alone_builds_no_engine_and_runs_in_the_recipes_autocast(tmp_path):
    dtypes = []

    class Validated(Module):
        def validation_step(self, batch, _):
            dtypes.append(self.net(batch[0]).dtype)

    plugin = MixedPrecisionPlugin("bf16")
    trainer = L.Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.validate(Validated(), _loader(2))
    assert plugin.engine is None and dtypes == [torch.bfloat16, torch.bfloat16]
