"""The pure step's norm read from 16-bit gradients: hand-worked values, bits that depend on the values
alone (not on alignment or chunking), one cast per gradient per step, and clipping as torch clips."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from conftest import OPTIMIZERS, assert_same_state, batches, master_state, tiny_model

import mixprec.update.transients as transients_module
from mixprec import MixedPrecision
from mixprec.step.grad_norm import GradNorm, _fits_one_block, global_norm_f32


class count_ops(TorchDispatchMode):
    """The aten ops run inside, by name (a list)."""

    def __enter__(self):
        super().__enter__()
        self.names = []
        return self.names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_hand_worked_norms_over_mixed_dtypes():
    norm = GradNorm(block=16)
    # 3-4-5 in three dtypes: every value and square is exact in each, so is the sum 9 + 16 = 25.
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert norm([torch.tensor([3.0, 4.0], dtype=dtype)]).item() == 5.0
    # 40 twos in blocks of 16, 16 and 8 (fp16), 9 ones (bf16), one 6 (fp32): 160 + 9 + 36 = 205.
    grads = [torch.full((5, 8), 2.0, dtype=torch.float16), torch.ones(9, dtype=torch.bfloat16),
             torch.tensor([6.0])]
    assert norm(grads).item() == pytest.approx(math.sqrt(205), rel=2**-23)
    assert norm(grads).dtype == torch.float32
    # fp16's largest value squared (4.29e9) is far inside fp32: no overflow from the squares.
    assert norm([torch.tensor([65504.0], dtype=torch.float16)]).item() == 65504.0


def test_a_nonfinite_gradient_makes_the_norm_nonfinite():
    norm = GradNorm(block=16)
    for bad in (math.inf, -math.inf, math.nan):
        g = torch.zeros(50, dtype=torch.float16)
        g[37] = bad                                  # in the third block
        out = norm([torch.ones(3, dtype=torch.bfloat16), g])
        assert not torch.isfinite(out)


# (dtype, elements, offset in elements) where MKL's dot of these values at that misalignment was
# measured to differ in the last bit from the dot at a 64-byte aligned address (torch 2.13, MKL 2024.2,
# one thread; the split over threads changes which cases differ).
MISALIGNED_DOTS_DIFFER = [(torch.bfloat16, 2**20, 1), (torch.float16, 37, 2), (torch.float16, 2**20 - 3, 2)]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def misaligned_copy(t, offset):
    out = torch.empty(t.numel() + offset, dtype=t.dtype)[offset:]
    out.copy_(t)
    assert out.data_ptr() % 64 != 0
    return out


@pytest.mark.parametrize("dtype,n,offset", MISALIGNED_DOTS_DIFFER)
def test_the_bits_depend_on_the_values_alone(dtype, n, offset, one_thread):
    # A tensor's sum of squares is a function of its values (and dtype and size), not of its address:
    # an fp32 gradient aligned (dotted in place) or misaligned (through the aligned scratch), and a
    # 16-bit gradient aligned or not, compiled or through the scratch, give the same bits each.
    g16 = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3).to(dtype)
    g32 = g16.float()
    assert g32.data_ptr() % 64 == 0
    norm, scratch_only = GradNorm(), GradNorm(compiled=False)
    f32 = [norm._block_squares(g) for g in (g32, misaligned_copy(g32, offset))]
    assert all(torch.equal(x, y) for x, y in zip(*f32))
    # Through the scratch a 16-bit gradient is the fp32 one, block for block.
    s16 = [scratch_only._block_squares(g) for g in (g16, misaligned_copy(g16, offset))]
    assert all(torch.equal(x, y) for pair in ((s16[0], s16[1]), (s16[0], f32[0])) for x, y in zip(*pair))
    c16 = [norm._block_squares(g) for g in (g16, misaligned_copy(g16, offset))]
    assert all(torch.equal(x, y) for x, y in zip(*c16))
    # ... and each is the norm: within fp32 rounding of the fp64 value (a dot of n products rounds n
    # times, at most n * 2**-24 relative in the worst case; measured ~1e-5 for n = 2**20).
    exact = g32.double().square().sum().sqrt().item()
    for g, how in ((g32, norm), (g16, norm), (g16, scratch_only)):
        assert how([g]).item() == pytest.approx(exact, rel=1e-4)


def test_large_16bit_gradients_go_through_the_compiled_loop():
    g = torch.full((2**20,), 3.0, dtype=torch.bfloat16)
    norm = GradNorm()
    assert norm([g]).item() == 3072.0                 # sqrt(2**20 * 9) = 1024 * 3, exactly
    assert norm.scratch_bytes == 0                    # no fp32 block was made for it
    assert GradNorm(compiled=False)([g]).item() == 3072.0


def test_gradients_longer_than_a_block_are_summed_blockwise():
    # 2.5 blocks of 16 fp16 twos, misaligned in fp32 or not: 40 * 4 = 160, exactly.
    g = torch.full((40,), 2.0, dtype=torch.float16)
    norm = GradNorm(block=16)
    assert [b.item() for b in norm._block_squares(g)] == [64.0, 64.0, 32.0]
    assert norm([g]).item() == pytest.approx(math.sqrt(160), rel=2**-24)
    assert norm.scratch_bytes == 16 * 4        # one block of fp32, freed at the end of the call


def test_small_gradients_are_read_in_three_ops_with_the_bits_of_the_multi_tensor_norm(one_thread):
    # A small model's gradients (at most one block together, every one dense) are read by one
    # _foreach_norm and the norm of the norms: global_norm_f32's bits exactly, whatever their dtype,
    # size, address or layout (a transposed fp32 gradient), and no scratch is made.
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(5, 8, generator=g) * 1e-2).half(),
             misaligned_copy((torch.randn(9, generator=g) * 1e3).bfloat16(), 3),
             torch.randn(37, 3, generator=g).t(),
             (torch.randn(300, generator=g) * 1e-4).bfloat16()]
    norm = GradNorm()
    with count_ops() as ops:
        got = norm(grads)
    assert torch.equal(got, global_norm_f32(grads)) and norm.scratch_bytes == 0
    assert ops == ["_foreach_norm", "stack", "linalg_vector_norm"]
    # Within fp32 rounding of the fp64 value, and of the block-by-block dots.
    exact = math.sqrt(sum(t.double().square().sum().item() for t in grads))
    assert got.item() == pytest.approx(exact, rel=1e-6)
    assert got.item() == pytest.approx(GradNorm(block=16)(grads).item(), rel=1e-6)
    # Other shapes are looked at again (not read through the last call's answer): too large for one
    # block together goes block by block; sparse gradients are read by their values.
    other = [torch.full((3, 3), 2.0, dtype=torch.float16), torch.tensor([6.0])]
    assert norm(other).item() == torch.tensor(72.0).sqrt().item()     # sqrt(9 * 4 + 36), in fp32
    assert _fits_one_block(other, 16) and not _fits_one_block([torch.ones(10), torch.ones(10)], 16)
    sparse = [torch.tensor([0.0, 3.0, 0.0, 4.0]).to_sparse(), torch.tensor([12.0])]
    assert _fits_one_block(sparse, 16) and norm(sparse).item() == 13.0     # its values, as dense
    twenty = GradNorm(block=16)
    assert twenty([torch.full((10,), 2.0), torch.full((10,), 2.0)]).item() == torch.tensor(80.0).sqrt().item()
    assert twenty.scratch_bytes == 0      # fp32, aligned: dotted in place


def test_bad_block_size_names_the_fix():
    with pytest.raises(ValueError, match="multiple of 16"):
        GradNorm(block=100)


def test_on_fp32_gradients_it_agrees_with_the_whole_tensor_dot_within_rounding():
    grads = [torch.randn(300, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    assert GradNorm(block=64)(grads).item() == pytest.approx(global_norm_f32(grads).item(), rel=1e-6)


def train(recipe, opt_name, *, chunk_bytes=None, block=None, clip=None, plant_at=None, hidden=17, steps=4):
    model = tiny_model(hidden=hidden)
    mp = MixedPrecision(model, OPTIMIZERS[opt_name](model.parameters()), recipe, clip_grad_norm=clip, seed=3)
    if chunk_bytes is not None:
        mp.master.chunk_bytes = chunk_bytes
    if block is not None:
        mp._grad_norm = GradNorm(block=block)
    skipped = []
    for step, (x, y) in enumerate(batches(steps)):
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        if step == plant_at:
            model[3].weight.grad.view(-1)[7] = math.inf      # a later chunk: seen before any update
        skipped.append(mp.step().skipped)
        mp.zero_grad()
    return mp, skipped


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure"])
@pytest.mark.parametrize("opt_name", ["adamw-fused", "sgd-momentum"])
def test_chunked_is_one_call_bitwise_across_blocks_and_the_kept_workspace(recipe, opt_name, monkeypatch):
    # The hard case for the bits: 16-element blocks (each gradient spans several), odd sizes (17), and
    # every chunk cast into the CPU workspace, where gradients sit at offsets rounded to 64 bytes. The
    # one-call step dots its casts there in place; the chunked one (100 B: a chunk per tensor) does
    # that for its first chunk and reads the others' 16-bit gradients through the scratch.
    monkeypatch.setattr(transients_module, "_WORKSPACE_MIN", 0)
    one, _ = train(recipe, opt_name, block=16, clip=0.5, plant_at=1)
    assert one.master.workspace_bytes > 0
    many, skipped = train(recipe, opt_name, chunk_bytes=100, block=16, clip=0.5, plant_at=1)
    assert skipped == [False, True, False, False]
    assert_same_state(master_state(one), master_state(many))


@pytest.mark.parametrize("chunk_bytes", [None, 100])
def test_each_gradient_is_cast_once_per_step(chunk_bytes):
    # One cast per gradient: the norm reads the 16-bit gradients themselves, and the step casts each
    # chunk once, one chunk at a time.
    mp, _ = train("bf16-pure", "adamw-fused", chunk_bytes=chunk_bytes, steps=1)
    calls = []
    real = mp.master._pull      # what pull_grads and each chunk of step() cast through

    def counting(which, *args, **kw):
        calls.append(list(which))
        return real(which, *args, **kw)

    mp.master._pull = counting
    with mp.autocast():
        loss = F.cross_entropy(mp.model(batches(1)[0][0]), batches(1)[0][1])
    mp.backward(loss)
    mp.step()
    cast = [i for which in calls for i in which]
    assert sorted(cast) == list(range(len(mp.master.masters)))      # each copy exactly once
    # 100 B chunks: [w0 17x8], [b0 17 + the LayerNorm's fp32 tensors (no copies)], [w1 4x17], [b1 4].
    assert calls == ([[0, 1, 2, 3]] if chunk_bytes is None else [[0], [1], [2], [3]])


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure"])
@pytest.mark.parametrize("chunk_bytes", [None, 100])
def test_clipping_matches_torch_clip_grad_norm_on_fp32_copies(recipe, chunk_bytes):
    # One SGD step (lr 1, no momentum) on the fp32 masters: w - clip_coef * grad / S. The reference
    # gives fp32 copies of the unscaled 16-bit gradients to torch.nn.utils.clip_grad_norm_.
    model = tiny_model(hidden=17)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1.0), recipe, clip_grad_norm=0.05)
    if chunk_bytes is not None:
        mp.master.chunk_bytes = chunk_bytes
    x, y = batches(1)[0]
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    mp.backward(loss)
    scale = mp.loss_scale.value.item()
    opt_params = [p for g in mp.optimizer.param_groups for p in g["params"]]
    own = {id(m): p for p, m in zip(mp.master.model_params, mp.master.masters)}
    before = [t.detach().clone() for t in opt_params]
    twins = [torch.zeros_like(t, requires_grad=True) for t in opt_params]
    for twin, t in zip(twins, opt_params):
        twin.grad = own.get(id(t), t).grad.float() / scale      # exact: S is a power of two
    total = torch.nn.utils.clip_grad_norm_(twins, 0.05)         # clips the twins' gradients in place
    result = mp.step()
    assert 0.05 / total.item() < 0.5                            # the clip is active
    # The norms are fp32 sums of the same squares in other orders: a sum of n <= 136 products is
    # within n * 2**-24 of exact (relative, Higham's gamma_n) on either side, so they agree to 1e-5.
    assert result.grad_norm == pytest.approx(total.item(), rel=1e-5)
    for t, b, twin in zip(opt_params, before, twins):
        # w - coef * g: the coefficients differ by <= 1e-5 relative (the norms) plus a rounding or
        # two (torch multiplies by coef / 1, we by 1 / (S / coef)), and each side rounds the
        # difference once (2**-24 of |w|).
        step = twin.grad
        tol = 2**-23 * b.abs().max().item() + 2e-5 * step.abs().max().item()
        torch.testing.assert_close(t.detach(), b - step, rtol=0, atol=tol)


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure"])
def test_chunked_is_one_call_bitwise_through_the_compiled_loop(recipe):
    # hidden 2**17: w0 (2**17 x 8 = 2**20 elements) goes through the compiled 16-bit loop, the rest
    # through the scratch; 1 MiB chunks cut the step into several.
    one, _ = train(recipe, "adamw-fused", hidden=2**17, clip=0.5, plant_at=1, steps=3)
    many, skipped = train(recipe, "adamw-fused", hidden=2**17, chunk_bytes=2**20, clip=0.5, plant_at=1,
                          steps=3)
    assert skipped == [False, True, False]
    assert len(many.master._plan(many.optimizer)) > 1
    assert_same_state(master_state(one), master_state(many))


@pytest.mark.parametrize("fused", [False, True], ids=["generic-sgd", "fused-adamw"])
def test_finite_gradients_whose_norm_overflows_fp32_skip_the_step_as_docs_step_md_says(fused):
    """Issue 37: docs/step.md said the norm is inf/NaN exactly when a gradient is; a finite gradient above
    sqrt(fp32 max) = 1.8447e19 overflows the fp32 sum of squares (as in torch's clip_grad_norm_). The page
    now states that limit; this pins the engine to it on both step paths."""
    import pathlib
    import mixprec
    limit = math.sqrt(torch.finfo(torch.float32).max)             # 1.8446744e19
    assert "1.8e19" in (pathlib.Path(__file__).parents[1] / "docs" / "step.md").read_text()
    for g, skipped in [(0.99 * limit, False), (1.01 * limit, True), (math.inf, True)]:
        model = torch.nn.Linear(2, 1, bias=False)
        opt = (torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if fused
               else torch.optim.SGD(model.parameters(), lr=1e-19))   # moves w by about 1.8
        mp = mixprec.MixedPrecision(model, opt, "fp32")
        w0 = model.weight.detach().clone()
        with mp.autocast():
            loss = model(torch.ones(1, 2)).sum()
        mp.backward(loss)
        model.weight.grad = torch.tensor([[g, 0.0]])                 # one finite (or inf) gradient
        result = mp.step()
        assert result.skipped is skipped, g
        assert math.isinf(result.grad_norm) is skipped
        assert torch.equal(model.weight.detach(), w0) is skipped      # a skip leaves the weights alone
