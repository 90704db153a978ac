"""Every script in examples/ runs, on a tiny configuration, and trains: each is loaded from its file
and its ``main(argv)`` called in this process (a few seconds each)."""

import importlib.util
import math
import pathlib

import torch
from optional_deps import need

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_has_a_test():
    tested = {"nanogpt_train", "hf_trainer", "lightning_accumulate", "accelerate_train"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


TINY_GPT = ["--iters", "24", "--batch", "8", "--block", "32", "--n-layer", "1", "--n-embd", "32",
            "--eval-interval", "24", "--eval-iters", "2", "--warmup", "4", "--device", "cpu"]


def test_nanogpt_trains_alike_under_fp32_bf16_and_fp16(capsys):
    example = load("nanogpt_train")
    runs = {recipe: example.main(TINY_GPT + ["--recipe", recipe]) for recipe in ("fp32", "bf16", "fp16")}
    # Untrained, the loss is about ln(vocabulary size) nats per character (uniform guesses).
    first = float(capsys.readouterr().out.split("train ", 1)[1].split(",")[0])
    assert abs(first - math.log(len(set(example.load_text())))) < 0.15
    for recipe, run in runs.items():
        assert run["val"] < first - 0.8, recipe          # learned: the character frequencies at least
        assert abs(run["val"] - runs["fp32"]["val"]) < 0.05, recipe
    assert runs["fp16"]["skipped_steps"] <= 1              # at most the first step at 65536 overflows


def test_hf_trainer_example_trains_with_the_fused_optimizer():
    need("transformers")
    from transformers import LlamaForCausalLM
    from mixprec.step.optimizer import fused_step_ok
    trainer = load("hf_trainer").main(["--steps", "8", "--batch", "4", "--accumulate", "2", "--block", "32",
                                       "--hidden", "32", "--layers", "1"])
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < losses[0]
    assert all("loss_scale" in log for log in trainer.state.log_history if "loss" in log)
    assert fused_step_ok(trainer.mixprec)               # through Accelerate's wrapper: no host sync
    saved = LlamaForCausalLM.from_pretrained(trainer.args.output_dir + "/final")
    assert saved.model.layers[0].mlp.up_proj.weight.dtype == torch.float32


def test_lightning_example_accumulates_under_the_recipe_from_the_first_micro_batch():
    need("lightning")
    module, plugin, logged = load("lightning_accumulate").main(["--steps", "12", "--accumulate", "4"])
    assert len(module.losses) == 48 and len(logged) == 12
    assert sum(module.losses[-8:]) < 0.8 * sum(module.losses[:8])
    assert logged[0]["mixprec/loss_scale"] == 65536.0 and plugin.engine.skipped_steps == 0
    assert all(m["mixprec/grad_norm"] < 100 for m in logged)    # unscaled norms


def test_accelerate_example_keeps_the_fused_path():
    need("accelerate")
    from mixprec.step.optimizer import fused_step_ok
    mp, losses, logged = load("accelerate_train").main(["--steps", "30"])
    assert fused_step_ok(mp) and type(mp.optimizer).__name__ == "AcceleratedOptimizer"
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    assert len(logged) == 3 and logged[0]["mixprec/loss_scale"] == 65536.0
