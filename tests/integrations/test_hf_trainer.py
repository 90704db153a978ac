"""mixprec inside Hugging Face's Trainer: accumulation, clipping of unscaled gradients, logging,
checkpoints that resume bit for bit, fp32 export under pure recipes."""

import os

import pytest
import torch
from optional_deps import need

need("transformers")
need("accelerate")
import hf_tiny  # noqa: E402
from transformers import LlamaForCausalLM, TrainingArguments  # noqa: E402

from mixprec.integrations.hf import ENGINE_STATE_NAME, MixedPrecisionTrainer  # noqa: E402

_IDS = torch.randint(0, hf_tiny.VOCAB, (32, 16), generator=torch.Generator().manual_seed(0))
DATA = [{"input_ids": row, "labels": row} for row in _IDS]


def _trainer(out_dir, recipe, *, steps=6, optim="adamw_torch", lr=1e-3, resume=None, chunked_loss=True, **extra):
    args = TrainingArguments(output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=lr, optim=optim, logging_steps=1,
                             save_steps=3, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             max_grad_norm=1.0, **extra)
    model, _, _ = hf_tiny.llama()
    trainer = MixedPrecisionTrainer(model=model, args=args, train_dataset=DATA, recipe=recipe,
                                    chunked_loss=chunked_loss)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _logs(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # One fp32 and one fp16-pure run with plain SGD, where clipping changes the update directly: had
    # the scaled gradients been clipped (norm ~S * 1.3 > 1.0), fp16-pure would barely move.
    return {recipe: _trainer(tmp_path_factory.mktemp(recipe), recipe, optim="sgd", lr=0.5)
            for recipe in ("fp32", "fp16-pure")}


def test_grad_norm_logged_is_the_unscaled_one_and_clipping_acts_on_it(runs):
    ref, pure = runs["fp32"], runs["fp16-pure"]
    norms_ref, norms = _logs(ref, "grad_norm"), _logs(pure, "grad_norm")
    assert len(norms) == 6 and norms[0] > 1.0                           # clipping engaged (max 1.0)
    assert norms == pytest.approx(norms_ref, rel=2e-2)                 # not S times larger
    assert _logs(pure, "loss_scale")[-1] == 65536.0 and _logs(pure, "skipped_steps")[-1] == 0
    assert _logs(pure, "loss") == pytest.approx(_logs(ref, "loss"), rel=5e-3)
    start, _, _ = hf_tiny.llama()
    masters = {id(p): m for p, m in zip(pure.mixprec.master.model_params, pure.mixprec.master.masters)}
    for (name, p_ref), p_start, p in zip(ref.model.named_parameters(), start.parameters(),
                                         pure.model.parameters()):
        moved = (p_ref.detach() - p_start).norm()
        p_pure = masters.get(id(p), p).detach().float()
        # fp16-pure moved as fp32 did, to within fp16 rounding of the update.
        assert (p_pure - p_ref.detach()).norm() <= 0.05 * moved + 1e-6, name


def test_the_chunked_loss_trains_bit_for_bit_like_the_models_own(tmp_path):
    # Under gradient accumulation (2 micro-batches) Trainer passes num_items_in_batch: the sum form.
    from mixprec.integrations.hf import causal_lm_loss
    chunked = _trainer(tmp_path / "chunked", "bf16")
    own = _trainer(tmp_path / "own", "bf16", chunked_loss=False)
    assert chunked.chunked_loss and chunked.model.loss_function is causal_lm_loss
    assert not own.chunked_loss and own.model.loss_function.__name__ == "ForCausalLMLoss"
    assert _logs(chunked, "loss") == pytest.approx(_logs(own, "loss"), rel=1e-6)
    for a, b in zip(chunked.model.parameters(), own.model.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_resumes_bit_for_bit_and_exports_fp32(tmp_path):
    straight = _trainer(tmp_path / "a", "fp16-pure")
    resumed = _trainer(tmp_path / "a", "fp16-pure", resume=str(tmp_path / "a" / "checkpoint-3"))
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    for m, n in zip(straight.mixprec.master.masters, resumed.mixprec.master.masters):
        assert torch.equal(m, n)
    assert _logs(resumed, "loss")[-1] == _logs(straight, "loss")[-1]
    ckpt = tmp_path / "a" / "checkpoint-6"
    assert os.path.exists(ckpt / ENGINE_STATE_NAME)
    # save_pretrained wrote the fp32 masters, not the fp16 weights the model holds.
    loaded = LlamaForCausalLM.from_pretrained(str(ckpt))
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    low = {id(p): m for p, m in zip(straight.mixprec.master.model_params, straight.mixprec.master.masters)}
    for (name, p), q in zip(straight.model.named_parameters(), loaded.parameters()):
        if id(p) in low:
            assert p.dtype == torch.float16 and torch.equal(q, low[id(p)]), name


def test_accelerates_own_fp16_flag_is_refused(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, bf16=True)
    model, _, _ = hf_tiny.llama()
    with pytest.raises(ValueError, match="Leave both off"):
        MixedPrecisionTrainer(model=model, args=args, train_dataset=DATA, recipe="bf16")
