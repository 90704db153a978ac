"""A Hugging Face ``Trainer`` run under a mixprec recipe: a small Llama learns CPython's pydoc text.

``MixedPrecisionTrainer`` is ``Trainer`` with the recipe in charge of the precision: leave
``TrainingArguments(fp16=..., bf16=...)`` off. Gradient accumulation, ``max_grad_norm`` (of the
unscaled gradients), checkpoints that resume bit for bit and an fp32 ``save_model`` come with it::

    python examples/hf_trainer.py                         # bf16-pure, 40 optimizer steps
    python examples/hf_trainer.py --recipe fp16 --steps 200 --accumulate 4

Each log line carries the loss scale and the skipped steps beside Trainer's loss and grad_norm.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from mixprec.integrations.hf import MixedPrecisionTrainer


def char_windows(block: int, count: int, seed: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """``count`` random windows of ``block`` characters as token ids (labels = inputs: the model
    shifts them), and the vocabulary size."""
    from pydoc_data.topics import topics
    text = "\n".join(topics[key] for key in sorted(topics))
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    starts = torch.randint(len(ids) - block, (count,), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids[s:s + block], "labels": ids[s:s + block]} for s in starts.tolist()], len(index)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="bf16-pure", help="a mixprec recipe: bf16, fp16, bf16-pure, fp8, ...")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--output-dir", default=None, help="checkpoints and the final fp32 model (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> MixedPrecisionTrainer:
    """Train and save; returns the trainer (``trainer.state.log_history``, ``trainer.mixprec``)."""
    args = parse_args(argv)
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="mixprec-hf-")
    data, vocab_size = char_windows(args.block, args.steps * args.batch * args.accumulate, args.seed)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=args.hidden // 2, max_position_embeddings=args.block))
    training_args = TrainingArguments(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate, learning_rate=args.lr, max_grad_norm=1.0,
        optim="adamw_torch_fused",     # the fused kernel unscales, clips and skips: no host sync
        logging_steps=max(1, args.steps // 10), save_strategy="no", report_to=[], seed=args.seed,
        use_cpu=not torch.cuda.is_available())
    trainer = MixedPrecisionTrainer(model=model, args=training_args, train_dataset=data, recipe=args.recipe)
    trainer.train()                    # logs loss, grad_norm (unscaled), loss_scale, skipped_steps
    trainer.save_model(out_dir + "/final")          # fp32 weights: the master copies under pure recipes
    return trainer


if __name__ == "__main__":
    main()
