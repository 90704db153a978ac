"""A Hugging Face model as a ``mixprec compare --workload hf_workload:gpt2_tiny`` workload.

The model returns a ``CausalLMOutputWithPast``; mixprec hands its ``logits`` to the loss and the metric.
"""

import torch

from mixprec.lab.workloads import Split, cross_entropy, mean_cross_entropy


def gpt2_tiny() -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel
    g = torch.Generator().manual_seed(0)
    # A learnable toy language: token t+1 = (token t + 1) mod 32, from a random start.
    starts = torch.randint(0, 32, (96, 1), generator=g)
    ids = (starts + torch.arange(17)) % 32                        # (96, 17)
    x, y = ids[:, :-1], ids[:, 1:]
    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    return {
        "model": lambda: GPT2LMHeadModel(cfg),
        "data": Split(x[:64], y[:64], x[64:], y[64:]),
        "loss": cross_entropy,                      # gets the logits (B, T, V) and targets (B, T)
        "optimizer": lambda params: torch.optim.AdamW(params, lr=3e-3),
        "metric": mean_cross_entropy, "higher_is_better": False, "batch_size": 16,
        "tokens_per_sample": 16,
    }
