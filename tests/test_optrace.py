"""The op trace: which op ran in which dtype, per module, forward and backward; and ``mixprec trace``."""

import json

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.diagnostics import OpTrace, trace_ops
from mixprec.lab.cli import main


class Attn(nn.Module):
    """Explicit attention, so softmax and the two batched matmuls are separate torch calls."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ln = nn.LayerNorm(8)
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 3)

    def forward(self, x):                                   # (B, T, 8)
        q, k, v = self.qkv(self.ln(x)).split(8, dim=-1)
        att = torch.softmax(q @ k.transpose(1, 2), dim=-1)  # (B, T, T)
        return self.head((att @ v).mean(1))                 # (B, 3)


X, Y = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 2])


def _loss(model):
    return F.cross_entropy(model(X), Y)


def _outputs(trace, phase):
    """(module, op) -> output dtypes, leaving out the casts themselves."""
    out = {}
    for r in trace.select(phase=phase):
        if r.op != "_to_copy":
            out.setdefault((r.module, r.op), set()).add(r.output)
    return out


def test_trace_counts_the_ops_of_a_bf16_step_by_module():
    trace = trace_ops(Attn(), "bf16", _loss)
    assert trace.recipe == "params=fp32,compute=bf16,master=none,scale=none" and trace.device == "cpu"
    [qkv] = trace.select(module="qkv", phase="forward", op="addmm")
    assert qkv.inputs == ("bf16", "bf16", "bf16") and qkv.output == "bf16" and qkv.count == 1
    [ln] = trace.select(module="ln", phase="forward", op="native_layer_norm")
    assert ln.output == "fp32"                           # CPU autocast leaves layer_norm alone: fp32 in
    # Two batched matmuls (q k^T and att v) and the softmax between them, in the Attn module itself.
    assert sum(r.count for r in trace.select(module="", phase="forward", op="bmm")) == 2
    [soft] = trace.select(module="", phase="forward", op="_softmax")
    assert soft.output == "bf16"
    assert trace.select(module="qkv", phase="backward", op="mm")[0].output == "bf16"
    assert OpTrace.from_json(trace.to_json()) == trace


def test_an_edit_changes_exactly_the_targeted_op_in_forward_and_backward():
    plain = trace_ops(Attn(), "bf16", _loss)
    edited = trace_ops(Attn(), "bf16,fp32_ops=softmax", _loss)
    for phase, op in (("forward", "_softmax"), ("backward", "_softmax_backward_data")):
        before, after = _outputs(plain, phase), _outputs(edited, phase)
        assert before[("", op)] == {"bf16"} and after[("", op)] == {"fp32"}
        assert {k: v for k, v in before.items() if k != ("", op)} == \
               {k: v for k, v in after.items() if k != ("", op)}


def test_tracing_a_pure_recipe_leaves_the_callers_model_alone():
    model = Attn()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trace = trace_ops(model, "bf16-pure,modules=head:fp32", _loss)
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert trace.select(module="qkv", phase="forward", op="addmm")[0].output == "bf16"
    assert trace.select(module="head", phase="forward", op="addmm")[0].inputs == ("fp32",) * 3


def test_cli_trace_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert main(["trace", "--workload", "mlp", "--recipe", "bf16,follow_ops=linear", "--device", "cpu",
                 "--batch-size", "4", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "addmm" in out and "op-list edits applied: linear->follow" in out
    trace = OpTrace.from_json(path.read_text())
    # linear moved to follow: fp32 inputs and weights, so the first layer runs in fp32 now.
    assert trace.select(module="0", phase="forward", op="addmm")[0].output == "fp32"
    assert json.loads(path.read_text())["recipe"].endswith("follow_ops=linear")


def test_cli_trace_mistakes_are_one_line_with_the_fix(capsys, tmp_path):
    cases = [(["--recipe", "bf16,fp32_ops=softmx"], "did you mean softmax"),
             (["--workload", "gpt", "--recipe", "bf16,modules=lm_haed:fp32"], "did you mean lm_head"),
             (["--recipe", "bf16", "--batch-size", "0"], "--batch-size must be at least 1"),
             (["--recipe", "bf16", "--json", str(tmp_path)], "is a directory")]
    for args, words in cases:
        assert main(["trace", "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mixprec: error: ") and words in err and err.count("\n") == 1, err
