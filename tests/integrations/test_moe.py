"""A mixture of experts under fp8 (HF Mixtral, whose experts are 3-D Parameters multiplied in
MixtralExperts.forward): per-tensor fp8 runs the experts as grouped fp8 GEMMs, named in the report;
the routing around them equals HF's own experts forward; the model trains (eager and compiled alike)
and its fp8 state round-trips; blocked scalings leave the experts out and say why."""

import copy

import pytest
import torch
from optional_deps import need

need("transformers")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

import mixprec  # noqa: E402
from mixprec.fp8 import Fp8Reason  # noqa: E402
from mixprec.fp8.grouped import Fp8GroupedLinear  # noqa: E402

CFG = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=2)
IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def _mixtral(seed: int = 0, **over) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**{**CFG, **over}))


def _train(model, recipe: str, steps: int, compiled: bool = False) -> tuple[list[float], mixprec.MixedPrecision]:
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe)
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    losses = []
    for _ in range(steps):
        with mp.autocast():
            loss = run(input_ids=IDS, labels=IDS).loss
        mp.backward(loss)
        assert not mp.step().skipped
        mp.zero_grad()
        losses.append(loss.item())
    return losses, mp


def test_mixtral_experts_become_grouped_fp8_gemms_and_the_report_names_them():
    model = _mixtral()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "fp8")
    report = mp.fp8_report
    assert len(report.swapped) == 13                     # q, k, v, o per layer, lm_head, 2 projections per layer
    experts = {d.name: d for d in report.layers if d.groups > 1}
    assert sorted(experts) == [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")]
    gate_up = experts["model.layers.0.mlp.experts.gate_up_proj"]
    assert (gate_up.groups, gate_up.out_features, gate_up.in_features) == (4, 256, 64) and gate_up.swapped
    assert isinstance(model.model.layers[0].mlp.experts.down_proj_fp8, Fp8GroupedLinear)
    # Only the embedding and the routers stay out (and the 1-D norm scales, which multiply elementwise).
    assert sorted(u.name for u in report.uncovered) == [
        "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    one_d = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert report.fp8_fraction == pytest.approx(1 - (64 * 64 + 2 * 4 * 64 + one_d) / report.parameters)
    text = str(report)
    assert "13 of 13 linear layers and grouped expert GEMMs swapped" in text and "4 x (256, 64)" in text
    # The model's own parameters and state_dict keys are unchanged: the fp8 layers hold state only.
    assert sorted(model.state_dict()) == sorted(_mixtral().state_dict())


def test_a_blocked_scaling_or_a_skip_leaves_the_experts_out_and_says_why():
    model = _mixtral()
    report = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "fp8-rowwise").fp8_report
    reasons = {d.name: d.reason for d in report.layers if d.groups > 1}
    assert len(reasons) == 4 and set(reasons.values()) == {Fp8Reason.SCALING}
    assert not hasattr(model.model.layers[0].mlp.experts, "down_proj_fp8")
    model = _mixtral()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()),
                                "fp8", fp8_filter=lambda name, m: "layers.1.mlp.experts" not in name)
    swapped = set(mp.fp8_report.swapped)
    assert "model.layers.0.mlp.experts.down_proj" in swapped and "model.layers.1.mlp.experts.down_proj" not in swapped
    model = _mixtral()
    with pytest.raises(ValueError, match="did you mean 'model.layers.0.mlp.experts.down_proj'"):
        mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()),
                               "compute=bf16,fp8=current(skip=model.layers.0.mlp.experts.down_prj)")


def test_the_fp8_experts_forward_routes_as_hf_does_when_the_casts_are_exact():
    # With every cast replaced by the identity, what remains is mixprec's routing (sort by expert,
    # grouped GEMMs, gate, routing weights, back to token order): it must equal HF's eager loop.
    model = _mixtral(3)
    hf_experts = copy.deepcopy(model.model.layers[0].mlp.experts)
    mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), "fp8")
    experts = model.model.layers[0].mlp.experts
    for layer in (experts.gate_up_proj_fp8, experts.down_proj_fp8):
        layer._cast = lambda role, x, record: (x.float(), torch.tensor(1.0), x.abs().max().float(), None)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(12, 64, generator=g)
    index = torch.randint(0, 4, (12, 2), generator=g)
    index[:, 1] = (index[:, 0] + 1) % 4                   # two distinct experts per token, as top-k gives
    weights = torch.rand(12, 2, generator=g)
    got = experts(hidden, index, weights)
    want = hf_experts(hidden, index, weights)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_mixtral_trains_in_fp8_and_resumes_bit_for_bit(tmp_path):
    fp8, mp = _train(_mixtral(), "fp8-delayed", 4)
    bf16, _ = _train(_mixtral(), "bf16", 4)
    assert fp8[-1] < fp8[0] - 0.2
    assert abs(fp8[-1] - bf16[-1]) < 0.02                # fp8 experts and attention track bf16
    state = mp.state_dict()["fp8"]
    layer = state["model.layers.1.mlp.experts.gate_up_proj_fp8"]
    assert layer["input_history"][:4].gt(0).all()        # every step entered its amax
    # Resume from a checkpoint: a fresh model and engine step exactly as the original.
    path = mixprec.save_checkpoint(tmp_path / "moe.pt", mp)
    model2 = _mixtral(1)
    mp2 = mixprec.MixedPrecision(model2, torch.optim.AdamW(model2.parameters(), lr=1e-3), "fp8-delayed")
    mixprec.load_checkpoint(path, mp2)
    losses = []
    for engine in (mp, mp2):
        with engine.autocast():
            loss = engine.model(input_ids=IDS, labels=IDS).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    assert all(torch.equal(a, b) for a, b in zip(mp.model.parameters(), model2.parameters()))


@pytest.mark.slow
def test_mixtral_fp8_experts_compile_fullgraph_to_the_eager_losses():
    eager, _ = _train(_mixtral(), "fp8", 3)
    torch._dynamo.reset()
    compiled, _ = _train(_mixtral(), "fp8", 3, compiled=True)
    assert compiled == eager


def _plan(floor_db: float):
    import dataclasses

    import torch.nn.functional as F

    from mixprec.diagnostics.speed_model import TARGETS
    from mixprec.lab.plan import plan_model

    free = dataclasses.replace(TARGETS["h100"], name="free-h100", hbm_tb_s=1e9)   # fp8 pays at any size
    ids = torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(1))
    return plan_model(_mixtral, lambda params: torch.optim.AdamW(params, lr=1e-3), ids[:, :-1], ids[:, 1:],
                      lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()), target=free,
                      batch_size=8, steps=8, floor_db=floor_db)


EXPERTS = tuple(f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj"))


def _expert_reasons(recipe: str) -> dict:
    model = _mixtral()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), recipe)
    return {d.name: d.reason for d in mp.fp8_report.layers if d.groups > 1}


def test_a_plan_measures_the_experts_as_one_grouped_layer_each_and_spells_them_in_its_recipe():
    # At a 10 dB floor every layer passes per-tensor fp8: the experts measured at the module (~21 dB,
    # gradient SNR 5-7), costed as two grouped GEMMs over 4 experts, and swapped by the recipe.
    report = _plan(10)
    experts = [lay for lay in report.layers if lay.groups > 1]
    assert [lay.name for lay in experts] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for lay in experts:
        assert lay.groups == 4 and (lay.out_features, lay.in_features) == (256, 64) and lay.rows == 8 * 16 * 2
        assert lay.candidates == ("bf16", "current") and lay.excluded["rowwise"].startswith("grouped expert GEMMs")
        assert 10 < lay.evidence["current"].sqnr_db < 40 and lay.evidence["current"].grad_snr > 2
        assert lay.format == "current"
    assert report.accepted and _expert_reasons(report.recipe) == dict.fromkeys(EXPERTS, Fp8Reason.SWAPPED)
    # Above their SQNR the experts stay bf16: both projections skipped (else the per-tensor lead swaps them).
    report = _plan(21.5)
    assert all(lay.format == "bf16" for lay in report.layers if lay.groups > 1)
    assert any(lay.format == "current" for lay in report.layers)
    assert _expert_reasons(report.recipe) == dict.fromkeys(EXPERTS, Fp8Reason.SKIP)


def test_the_end_to_end_gradient_snr_of_an_experts_module_covers_both_projections_in_fp8():
    # One experts module's gradient (both projections, end to end) against fp32: with its projections
    # in fp8 its own quantization counts (SNR 11.4 here); with only the head in fp8 it does not (35.8).
    from mixprec.lab.doctor.grad_snr import gradient_snr
    state = _mixtral().state_dict()
    snr = {}
    for fp8 in (EXPERTS[:2], ("lm_head",)):
        out = gradient_snr(_mixtral, state, lambda m: m(input_ids=IDS, labels=IDS).loss, ["bf16,fp8=current"],
                           layers=["model.layers.0.mlp.experts"], fp8_layers=fp8)
        snr[fp8] = out["model.layers.0.mlp.experts"]["bf16,fp8=current"].snr
    assert 2 < snr[EXPERTS[:2]] < 20 < snr[("lm_head",)]


def test_experts_in_per_tensor_fp8_under_a_blocked_lead_get_a_rule_for_the_module_and_its_projections():
    from mixprec.lab.plan.choose import Pick, recipe_for
    picks = {"model.layers.0.self_attn.q_proj": Pick("rowwise", ""), "lm_head": Pick("rowwise", ""),
             "model.layers.0.mlp.experts": Pick("current", ""), "model.layers.1.mlp.experts": Pick("bf16", "")}
    experts = {f"model.layers.{i}.mlp.experts": EXPERTS[2 * i:2 * i + 2] for i in (0, 1)}
    recipe = str(recipe_for(picks, experts=experts))
    assert "layers=model.layers.0.mlp.experts*:current" in recipe
    reasons = _expert_reasons(recipe)
    # An experts module no counted forward called is not planned: named, and kept bf16 by skip=.
    from mixprec.lab.plan.candidates import unplanned_experts
    assert unplanned_experts(_mixtral(), {"model.layers.0.mlp.experts": 256}) == EXPERTS[2:]
    assert _expert_reasons(str(recipe_for({"lm_head": Pick("current", "")}, keep=EXPERTS[2:]))) == {
        **dict.fromkeys(EXPERTS[:2], Fp8Reason.SWAPPED), **dict.fromkeys(EXPERTS[2:], Fp8Reason.SKIP)}
    # Layer 1's experts stay bf16 (the swap names the rowwise lead before their skip= as the reason).
    assert reasons == {**dict.fromkeys(EXPERTS[:2], Fp8Reason.SWAPPED), **dict.fromkeys(EXPERTS[2:], Fp8Reason.SCALING)}


@pytest.mark.parametrize("router_logits", [False, True], ids=["no-aux-loss", "aux-loss"])
def test_per_layer_scale_takes_mixtral_with_its_router_at_the_global_scale(router_logits):
    # The router (MixtralTopKRouter) returns its logits and the top-k weights made from them, so it is
    # kept at S (a factor there would scale part of its logits' gradient twice); every other layer keeps
    # a factor. In fp32 powers of two are exact: any factors give the gradients of factors 1 bit for bit.
    # Against scale=dynamic they agree to fp32 rounding only: the layers' input views change the order
    # in which autograd sums a tensor's several uses (q, k and v read one input).
    grads = {}
    for run, (scale, factors) in {"dynamic": ("dynamic", None), "ones": ("per-layer", None),
                                  "factors": ("per-layer", "pow2")}.items():
        model = _mixtral(output_router_logits=router_logits, router_aux_loss_coef=0.1)
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                    f"params=fp32,compute=fp32,scale={scale}")
        if factors:
            n = len(mp.loss_scale.layers)
            mp.loss_scale.factors.copy_(2.0 ** torch.arange(n).remainder(15).float())
            torch.reciprocal(mp.loss_scale.factors, out=mp.loss_scale.inverses)
        with mp.autocast():
            loss = model(input_ids=IDS, labels=IDS).loss
        if scale == "per-layer":
            with pytest.warns(UserWarning, match=r"keeps layer 'model\.layers\.0\.mlp\.gate' at the global"):
                mp.backward(loss)
            assert sorted(mp.loss_scale.pinned) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
        else:
            mp.backward(loss)
        mp.step()                               # unscales the fp32 gradients in place
        grads[run] = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    assert grads["dynamic"].keys() == grads["ones"].keys() == grads["factors"].keys()
    assert [k for k in grads["ones"] if not torch.equal(grads["ones"][k], grads["factors"][k])] == []
    for k, g in grads["dynamic"].items():
        torch.testing.assert_close(grads["factors"][k], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()))
