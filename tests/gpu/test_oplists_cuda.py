"""CUDA-only checks of op lists: torch's CUDA lists as probed, edits on CUDA, the trace on a GPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.casting.oplists import OpListMode, OpPolicy, autocast_op_lists, op_list_mode

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")]


def test_probed_cuda_lists_match_torchs_registrations():
    lists = autocast_op_lists("cuda", torch.float16)
    # torch's autocast_mode.cpp, CUDA: lower_precision_fp, fp32 (incl. fp32_set_opt_dtype), promote.
    assert {"mm", "bmm", "linear", "matmul", "conv2d", "addmm", "baddbmm"} <= lists.low
    assert {"softmax", "log_softmax", "layer_norm", "exp", "sum", "cumsum", "nll_loss", "pow"} <= lists.fp32
    # cat and stack have no AutocastCUDA kernel (they promote by themselves): they follow, on no list.
    assert {"index_put", "addcmul"} <= lists.follow and lists.policy("cat") is OpPolicy.FOLLOW
    # The lists read on fake tensors are what real CUDA tensors do under autocast, op by op.
    x = torch.randn(4, 8, device="cuda").half()
    with torch.autocast("cuda", dtype=torch.float16):
        for name, out in {"softmax": torch.softmax(x, -1), "log_softmax": torch.log_softmax(x, -1),
                          "sum": x.sum(), "prod": x.prod(), "cumsum": x.cumsum(0), "cumprod": x.cumprod(0),
                          "linalg_vector_norm": torch.linalg.vector_norm(x)}.items():
            assert (name in lists.fp32) == (out.dtype == torch.float32), name
        assert torch.mm(x.float(), x.float().t()).dtype == torch.float16


def test_edits_on_cuda_are_bitwise_manual_casts_and_defaults_install_nothing():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 32, device="cuda", generator=g)
    w = torch.randn(8, 32, device="cuda", generator=g)
    edits = {"softmax": OpPolicy.LOW, "linear": OpPolicy.FP32}
    with torch.autocast("cuda", dtype=torch.float16), OpListMode(edits, "cuda"):
        soft, lin, gelu = torch.softmax(x, -1), F.linear(x, w), F.gelu(x)
    with torch.autocast("cuda", dtype=torch.float16):
        gelu_plain = F.gelu(x)
    assert soft.dtype == torch.float16 and torch.equal(soft, torch.softmax(x.half(), -1))
    assert lin.dtype == torch.float32 and torch.equal(lin, F.linear(x, w))
    assert torch.equal(gelu, gelu_plain)
    # softmax and layer_norm are fp32 on CUDA already: nothing differs, nothing is installed.
    assert op_list_mode({"softmax": OpPolicy.FP32, "layer_norm": OpPolicy.FP32}, "cuda") is None


def test_trace_and_module_regions_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10)).cuda()
    x, y = torch.randn(8, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    trace = mixprec.diagnostics.trace_ops(model, "fp16,modules=2:fp32", lambda m: F.cross_entropy(m(x), y))
    assert trace.select(module="0", phase="forward", op="addmm")[0].output == "fp16"
    assert trace.select(module="2", phase="forward", op="addmm")[0].output == "fp32"
    assert trace.select(module="0", phase="backward", op="mm")[0].output == "fp16"
