"""A mixture of experts under fp8: the report names the expert weights fp8 does not cover (HF Mixtral,
whose experts are 3-D Parameters multiplied in MixtralExperts.forward), and the model still trains."""

import torch
from optional_deps import need

need("transformers")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

import mixprec  # noqa: E402


def test_mixtral_expert_weights_are_named_in_the_fp8_report():
    cfg = MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4,
                        num_experts_per_tok=2)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "fp8")
    report = mp.fp8_report
    assert len(report.swapped) == 9                      # q, k, v, o per layer, and lm_head
    uncovered = {u.name: u for u in report.uncovered}
    for i in range(2):
        gate_up = uncovered[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        assert gate_up.shape == (4, 256, 64) and gate_up.reason.startswith("3-D, multiplied in MixtralExperts")
        assert uncovered[f"model.layers.{i}.mlp.experts.down_proj"].shape == (4, 64, 128)
        assert "MixtralTopKRouter" in uncovered[f"model.layers.{i}.mlp.gate.weight"].reason
    assert uncovered["model.embed_tokens.weight"].reason.startswith("an embedding")
    assert len(uncovered) == 7
    # The experts hold most of the model: 2 x 4 x (256 x 64 + 64 x 128) = 196608 of its parameters.
    experts = sum(u.numel for n, u in uncovered.items() if ".experts." in n)
    assert experts == 196608 and experts / report.parameters > 0.6
    assert report.fp8_fraction < 0.2
    assert "(4, 256, 64)" in str(report) and "not covered: 7 weights" in str(report)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with mp.autocast():
        loss = model(input_ids=ids, labels=ids).loss
    mp.backward(loss)
    assert not mp.step().skipped
