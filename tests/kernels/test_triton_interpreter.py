"""The real Triton kernels, run on CPU tensors by the Triton interpreter
(``TRITON_INTERPRET=1``, ``LIK_BACKEND=triton``), against the float64 reference.

Interpreter cost is about (programs x tiles), so every shape here is tiny; each test
still covers what the kernels branch on: layouts (3-D cross product, 4-D per-query
candidates, pairs), both mask modes, fused normalisation, both backward strategies,
long queries split into row chunks (Lq > 128), the K-loop (d > 256), d not a power of
two, several document tiles (Ld > 64), Lq = 1, Ld = 1, and the lowmem compaction that
needs several rounds when many query rows pick tokens of one tile.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lik_plugins as lik
from lik_plugins._config import triton_interpret
from lik_plugins.kernels import dispatch, reference
from support.maxsim_testlib import (
    LAYOUTS, MASK_MODES, check_against_reference, check_exact_ties, check_nan_query_poisons_only_its_scores,
    check_nonfinite_masked_tokens_are_ignored, check_property_case, expected_argmax, force_forward_block_n, generator,
    make_inputs, op, property_cases, rel_err, noncontiguous_inputs, tied_inputs,
)

pytestmark = pytest.mark.skipif(
    not (dispatch.triton_available() and triton_interpret()),
    reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py on CPU-only machines)",
)

# (nq, nj, lq, ld, d) per layout: tiny, ragged, d not a power of two, Ld > BLOCK_N (64)
# for the cross product so the tile loop and the cross-tile argmax run.
SHAPES = {
    "cross": (3, 4, 7, 70, 48),
    "kd": (2, 3, 9, 33, 48),
    "pairs": (4, 1, 6, 29, 48),
}


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("LIK_BACKEND", "triton")


@pytest.fixture(params=["compact", "compact-gather-after", "dense"])
def lowmem_rows(request, monkeypatch):
    """The ways the cross product's lowmem grad_D finds its rows: each tile lists the rows
    that picked one of its tokens first (``backward_launch.COMPACT_MIN_WORK`` lowered so
    every size does, with a scan step of 16 winners so the tiny shapes take several), with
    grad_Q's gather in the same launch or in its own after the lists are freed; or every
    query row against every tile (dense: the threshold out of reach)."""
    from lik_plugins.kernels.triton import backward_launch, launch

    dense = request.param == "dense"
    monkeypatch.setattr(backward_launch, "COMPACT_MIN_WORK", 1 << 62 if dense else 0)
    monkeypatch.setattr(backward_launch, "COMPACT_SCAN", 16)
    if request.param == "compact-gather-after":
        monkeypatch.setattr(backward_launch, "GATHER_ALONE_MIN_WAVES", 0)
    launch.clear_plans()  # a cached lowmem plan holds the route it was made with
    yield request.param
    launch.clear_plans()


def _inputs(gen, layout, dtype=torch.float32, shape=None, **kw):
    nq, nj, lq, ld, d = shape or SHAPES[layout]
    return make_inputs(gen, layout, nq, nj, lq, ld, d, dtype, **kw)


def test_calls_are_served_by_triton(gen):
    lik.reset_routing_counts()
    Q, D, qm, dm = _inputs(gen, "pairs", shape=(2, 1, 3, 5, 16))
    lik.maxsim_pairs(Q, D, qm, dm)
    lik.maxsim(Q, D, qm, dm)
    counts = lik.routing_counts()
    assert counts["maxsim_pairs"] == {"triton": 1}
    assert counts["maxsim"] == {"triton": 1}


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("mask_mode", MASK_MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_lowmem_matches_reference(gen, layout, mask_mode, normalize, lowmem_rows):
    Q, D, qm, dm = _inputs(gen, layout)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, normalize=normalize, mask_mode=mask_mode,
                            backward="lowmem")


@pytest.mark.parametrize(
    "layout,mask_mode,normalize",
    [("cross", "exclude", True), ("cross", "zero", False), ("kd", "zero", True), ("pairs", "exclude", False)],
)
def test_fp32_unified_matches_reference(gen, layout, mask_mode, normalize):
    Q, D, qm, dm = _inputs(gen, layout)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, normalize=normalize, mask_mode=mask_mode,
                            backward="unified")


def test_unmasked_auto_backward(gen):
    """No masks at all (colpali-engine's call), backward="auto"."""
    Q, D, _, _ = _inputs(gen, "cross", shape=(2, 3, 5, 20, 32))
    check_against_reference("cross", Q, D, None, None, gen=gen, backward="auto")


@pytest.mark.parametrize("backward", ["lowmem", "unified"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_matches_reference(gen, layout, backward, lowmem_rows):
    """bf16 inputs: fp32 accumulation (scores tight), gradients written in bf16 (tolerance)."""
    shape = {"cross": (2, 3, 5, 37, 40), "kd": (2, 2, 6, 21, 40), "pairs": (3, 1, 5, 19, 40)}[layout]
    Q, D, qm, dm = _inputs(gen, layout, torch.bfloat16, shape=shape)
    mode = "zero" if layout != "kd" else "exclude"
    check_against_reference(layout, Q, D, qm, dm, gen=gen, mask_mode=mode, normalize=layout == "kd",
                            backward=backward)


def test_fp16_matches_reference(gen):
    Q, D, qm, dm = _inputs(gen, "cross", torch.float16, shape=(2, 2, 5, 17, 24))
    check_against_reference("cross", Q, D, qm, dm, gen=gen, mask_mode="zero", backward="lowmem")


def test_long_query_is_split_into_row_chunks(gen):
    """Lq = 130 > 128: the forward splits each query into row chunks (partial sums)."""
    Q, D, qm, dm = make_inputs(gen, "cross", 1, 2, 130, 8, 16)
    check_against_reference("cross", Q, D, qm, dm, gen=gen, mask_mode="zero", normalize=True, backward="lowmem")


@pytest.fixture
def split_gather(monkeypatch):
    """Let the gather backward split tiny document sets over programs (it needs many steps
    per program to pay on a GPU), and check that the shape given does split."""
    from lik_plugins.kernels.triton import blocking, launch

    monkeypatch.setattr(blocking, "GATHER_SPLIT_MIN_STEPS", 1)

    def splits(nq, nj, lq, d):
        n_split = blocking.gather_blocking(nq, nj, lq, max(16, blocking.next_pow2(d)), 132)[3]
        assert n_split > 1, "the shape no longer splits the gather: the test would not cover the partials"

    launch.clear_plans()
    yield splits
    launch.clear_plans()


@pytest.mark.parametrize("backward", ["lowmem", "unified"])
def test_wide_embedding_uses_k_loop(gen, backward, split_gather):
    """d = 300 > 256: the forward loops over K tiles; the gather backward splits the
    documents over programs (fp32 partials, then the normalisation Jacobian)."""
    split_gather(2, 4, 5, 300)
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 4, 5, 9, 300)
    check_against_reference("cross", Q, D, qm, dm, gen=gen, normalize=True, backward=backward)


def test_wide_embedding_candidates(gen):
    Q, D, qm, dm = make_inputs(gen, "kd", 1, 2, 4, 6, 512)
    check_against_reference("kd", Q, D, qm, dm, gen=gen, mask_mode="zero", backward="lowmem")


def test_few_queries_many_documents_split_gather(gen, split_gather):
    """One query, many documents: the gather backward splits the documents (partials)."""
    split_gather(1, 20, 33, 64)
    Q, D, qm, dm = make_inputs(gen, "cross", 1, 20, 33, 5, 64)
    check_against_reference("cross", Q, D, qm, dm, gen=gen, backward="lowmem")


@pytest.mark.parametrize("d,layout", [(96, "cross"), (120, "kd"), (120, "pairs")])
def test_d_not_power_of_two(gen, d, layout):
    Q, D, qm, dm = make_inputs(gen, layout, 2, 2, 5, 11, d)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, normalize=layout != "cross", backward="lowmem")


@pytest.mark.parametrize(
    "layout,lq,ld",
    [("cross", 1, 9), ("cross", 6, 1), ("cross", 1, 1), ("kd", 1, 1), ("pairs", 1, 1), ("pairs", 1, 7)],
)
@pytest.mark.parametrize("backward", ["lowmem", "unified"])
def test_single_token_sequences(gen, layout, lq, ld, backward):
    Q, D, qm, dm = make_inputs(gen, layout, 3, 2, lq, ld, 16)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, mask_mode="zero", backward=backward)
    check_against_reference(layout, Q, D, None, None, gen=gen, backward=backward)


def _magnet_inputs(gen, layout, nq, nj, lq, ld, d, token):
    """Every query token's winner is ``token`` of every document: many query rows
    hit the same document tile, so lowmem's compaction needs several rounds."""
    Q = torch.randn(nq, lq, d, generator=gen)
    Q[..., 0] = Q[..., 0].abs() + 1.0
    shape = (nj, ld, d) if layout == "cross" else (nq, nj, ld, d)
    D = torch.randn(*shape, generator=gen)
    D[..., token, 0] = 40.0
    return Q, D


@pytest.mark.parametrize(
    "layout,shape",
    [("cross", (3, 2, 24, 8, 16)), ("kd", (1, 2, 40, 300, 16))],
    ids=["cross-72-rows-one-tile", "kd-40-rows-one-tile-of-300"],
)
def test_lowmem_many_winners_in_one_tile(gen, layout, shape, lowmem_rows):
    nq, nj, lq, ld, d = shape
    Q, D = _magnet_inputs(gen, layout, nq, nj, lq, ld, d, token=min(5, ld - 1))
    _, _, gd = check_against_reference(layout, Q, D, None, None, gen=gen, backward="lowmem")
    # every gradient row of D lands on the magnet token
    assert gd.reshape(-1, ld, d).abs().sum(-1).nonzero()[:, 1].unique().tolist() == [min(5, ld - 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_lowmem_is_bitwise_deterministic(gen, layout, dtype, lowmem_rows):
    Q, D, qm, dm = make_inputs(gen, layout, 3, 3, 6, 20, 32, dtype)
    Q.requires_grad_()
    D.requires_grad_()
    grad_out = None
    results = []
    for _ in range(2):
        out = op(layout)(Q, D, qm, dm, normalize=True, backward="lowmem")
        if grad_out is None:
            grad_out = torch.randn(out.shape, generator=gen)
        results.append((out.detach(), *torch.autograd.grad(out, (Q, D), grad_out)))
    for first, second in zip(*results):
        assert torch.equal(first, second)


@pytest.mark.parametrize("mask_mode", MASK_MODES)
@pytest.mark.parametrize("backward", ["lowmem", "unified"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
def test_fully_masked_rows_get_exact_zero_gradients(gen, backward, mask_mode, normalize, lowmem_rows):
    Q, D, qm, dm = make_inputs(gen, "cross", 3, 3, 5, 9, 16)
    qm[1] = False  # a fully masked query
    dm[2] = False  # a fully masked document
    Q.requires_grad_()
    D.requires_grad_()
    out = lik.maxsim(Q, D, qm, dm, mask_mode=mask_mode, normalize=normalize, backward=backward)
    assert torch.equal(out[1], torch.zeros(3))
    assert torch.equal(out[:, 2], torch.zeros(3))
    gq, gd = torch.autograd.grad(out, (Q, D), torch.randn(out.shape, generator=gen))
    assert torch.equal(gq[1], torch.zeros_like(gq[1]))
    assert torch.equal(gd[2], torch.zeros_like(gd[2]))
    assert torch.equal(gq[~qm], torch.zeros_like(gq[~qm]))
    assert torch.equal(gd[~dm], torch.zeros_like(gd[~dm]))
    assert gq[qm].abs().sum() > 0 and gd[dm].abs().sum() > 0


settings_small = settings(max_examples=8, deadline=None, derandomize=False,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings_small
@given(case=property_cases(max_n=3, max_lq=9, max_ld=20, dims=[3, 16, 40, 64]),
       backward=st.sampled_from(["lowmem", "unified"]))
def test_property_matches_reference(case, backward):
    check_property_case(case, backward=backward)


@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_noncontiguous_inputs_and_masks(gen, layout):
    """Transposed views everywhere: Q [Lq, Nq, d].transpose, D with a strided embedding
    dim, masks transposed.  Normalisation on (its norms follow the input strides)."""
    nq, nj, lq, ld, d = 2, 3, 5, 11, 24
    Q, D, qm, dm = noncontiguous_inputs(gen, layout, nq, nj, lq, ld, d)
    for backward in ("lowmem", "unified"):
        check_against_reference(layout, Q, D, qm, dm, gen=gen, normalize=True, mask_mode="zero", backward=backward)


def test_no_argmax_under_no_grad(gen, monkeypatch):
    from lik_plugins.kernels.triton import launch

    seen = []
    real = launch.forward

    def spy(*args, **kwargs):
        scores, argmax = real(*args, **kwargs)
        seen.append((kwargs["save_argmax"], argmax))
        return scores, argmax

    monkeypatch.setattr(launch, "forward", spy)
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 2, 4, 7, 16)
    Q.requires_grad_()
    with torch.no_grad():
        out = lik.maxsim(Q, D, qm, dm)
    assert out.grad_fn is None and not out.requires_grad
    assert seen == [(False, None)]
    seen.clear()
    out = lik.maxsim(Q, D, qm, dm)
    assert out.grad_fn is not None
    assert seen[0][0] is True and seen[0][1] is not None
    assert seen[0][1].shape == (2, 2, 4)


@pytest.mark.parametrize("mask_mode", MASK_MODES)
@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_saved_argmax_and_sentinel(gen, layout, mask_mode):
    """The launcher's argmax: the winner for rows with a valid winner, -1 otherwise
    (masked query token, fully masked document, masked 0 winning in zero mode)."""
    from lik_plugins.kernels.triton import launch

    Q, D, qm, dm = make_inputs(gen, layout, 2, 3, 6, 70, 16)
    scores, arg = launch.forward(Q, D, qm, dm, cross=layout == "cross", normalize=False,
                                 zero_mode=mask_mode == "zero", save_argmax=True)
    assert arg.shape == (2, 3, 6)
    assert not arg.dtype.is_floating_point
    _, no_arg = launch.forward(Q, D, qm, dm, cross=layout == "cross", normalize=False,
                               zero_mode=mask_mode == "zero", save_argmax=False)
    assert no_arg is None
    expected = expected_argmax(Q, D, qm, dm, layout, mask_mode)
    assert torch.equal(arg.long(), expected)
    assert rel_err(scores, reference.maxsim(Q.double(), D.double(), qm, dm, mask_mode=mask_mode)) < 2e-5


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_in_query_propagates_without_crash(gen):
    check_nan_query_poisons_only_its_scores(gen)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nonfinite_masked_tokens_are_ignored(gen):
    check_nonfinite_masked_tokens_are_ignored(gen)


def test_float64_is_refused_with_a_reason(gen):
    Q, D, _, _ = make_inputs(gen, "cross", 1, 1, 2, 3, 8, torch.float64, masks=False)
    with pytest.raises(RuntimeError, match=r"LIK_BACKEND=triton, but the Triton kernels take fp16/bf16/fp32"):
        lik.maxsim(Q, D)


@pytest.mark.parametrize("backward", ["lowmem", "unified"])
@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_exact_ties_go_to_the_lowest_index(gen, layout, backward, lowmem_rows):
    from lik_plugins.kernels.triton import launch

    check_exact_ties(gen, layout, launch.forward, backward=backward)


def test_nan_in_masked_query_tokens_never_reaches_a_gradient(gen, lowmem_rows):
    """A masked query token holding NaN has no winner: every gradient stays finite."""
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 3, 6, 40, 16, special_rows=False)
    qm[1, 3] = False
    Q[1, 3] = float("nan")
    Q.requires_grad_()
    D.requires_grad_()
    out = lik.maxsim(Q, D, qm, dm, backward="lowmem")
    gq, gd = torch.autograd.grad(out, (Q, D), torch.randn(out.shape, generator=gen))
    assert torch.isfinite(gd).all()
    assert torch.isfinite(gq[qm]).all()


@pytest.mark.parametrize("docs_per_program", [2, 4])
@pytest.mark.parametrize("mask_mode", MASK_MODES)
@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_several_documents_per_forward_program(gen, layout, mask_mode, docs_per_program, monkeypatch):
    """A forward program that scores several documents with one query block
    (``blocking.docs_per_program``; here forced, argmax included) returns every document's
    scores, winners and gradients; a count it does not divide runs one per program."""
    from lik_plugins.kernels.triton import blocking, launch

    monkeypatch.setattr(blocking, "docs_per_program",
                        lambda nj, *_: docs_per_program if nj % docs_per_program == 0 else 1)
    launch.clear_plans()
    try:
        for nj in (4, 5):
            Q, D, qm, dm = make_inputs(gen, layout, 3, nj, 6, 70, 16)
            scores, arg = launch.forward(Q, D, qm, dm, cross=layout == "cross", normalize=False,
                                         zero_mode=mask_mode == "zero", save_argmax=True)
            assert torch.equal(arg.long(), expected_argmax(Q, D, qm, dm, layout, mask_mode))
            assert rel_err(scores, reference.maxsim(Q.double(), D.double(), qm, dm, mask_mode=mask_mode)) < 2e-5
        check_against_reference(layout, Q, D, qm, dm, gen=gen, mask_mode=mask_mode, backward="lowmem")
    finally:
        launch.clear_plans()


@pytest.mark.parametrize("backward", ["lowmem", "unified"])
def test_gather_walks_many_documents_per_step(gen, backward, monkeypatch):
    """grad_Q's gather with 8 documents per step over 11 documents (the last step ragged)
    and 2 query tokens per program."""
    from lik_plugins.kernels.triton import blocking, launch

    monkeypatch.setattr(blocking, "GATHER_MAX_BLOCK_S", 2)
    monkeypatch.setattr(blocking, "GATHER_STEP_ELEMS", 2 * 8 * 16)
    launch.clear_plans()
    Q, D, qm, dm = _inputs(gen, "cross", shape=(2, 11, 5, 9, 16))
    try:
        check_against_reference("cross", Q, D, qm, dm, gen=gen, backward=backward)
    finally:
        launch.clear_plans()


def test_documents_per_forward_program_rule():
    """Several documents per program only where the sweep found it faster: 16-bit
    inference, big launches (twice as big for documents longer than 256 tokens)."""
    from lik_plugins.kernels.triton import blocking

    n = blocking.FORWARD_DOCS_PER_PROGRAM
    big = blocking.FORWARD_MULTI_DOC_MIN_PROGRAMS
    assert n > 1
    assert blocking.docs_per_program(4096, 256, 4 * big, False, 2) == n       # search
    assert blocking.docs_per_program(4096, 256, 4 * big, True, 2) == 1        # training: argmax
    assert blocking.docs_per_program(4096, 256, 4 * big, False, 4) == 1       # fp32
    assert blocking.docs_per_program(4096, 256, 4 * big, False, 1) == 1       # fp8
    assert blocking.docs_per_program(4097, 256, 4 * big, False, 2) == 1       # does not divide
    assert blocking.docs_per_program(4096, 256, big - 1, False, 2) == 1       # small launch
    assert blocking.docs_per_program(1000, 1030, big, False, 2) == 1          # long documents ...
    assert blocking.docs_per_program(1000, 1030, 2 * big, False, 2) == n      # ... on a big launch
    assert blocking.docs_per_program(4096, 256, 4 * big, False, 2, 32) == 1   # a 32-row block (rerank)


def test_fp8_short_queries_take_128_row_programs_of_several_documents():
    """fp8 with Lq <= 32: 128-row programs of FORWARD_DOCS_PER_PROGRAM documents where the
    launch is big enough, 256 x 1 elsewhere; blocks under 128 rows (one short query) score one
    document per program in every dtype (as measured)."""
    from lik_plugins.kernels.triton import blocking as rules

    n = rules.FORWARD_DOCS_PER_PROGRAM

    def blocking(nq, lq, nj, ld, elem=1, cross=True):
        return rules.forward_blocking(nq, lq, nj, ld, cross=cross, elem=elem, d_pad=128, save_argmax=False)

    assert blocking(64, 32, 4096, 256) == (32, 4, 1, n)            # search: 128 rows x 4 documents
    assert blocking(256, 32, 256, 256) == (32, 4, 1, n)            # in-batch 256
    assert blocking(16, 32, 1000, 1030) == (32, 8, 1, 1)           # ColPali 16x1000: too few programs
    assert blocking(64, 128, 4096, 256) == (128, 2, 1, 1)          # Lq 128 keeps 256 x 1
    assert blocking(1, 32, 100_000, 300) == (32, 1, 1, 1)          # one query: no taller block to split
    assert blocking(64, 32, 4096, 256, cross=False) == (32, 1, 1, 1)
    assert blocking(64, 32, 4096, 256, elem=2) == (32, 8, 1, n)    # bf16: 256 rows x 4 documents
    assert blocking(1, 32, 100_000, 300, elem=2) == (32, 1, 1, 1)  # bf16 rerank: a 32-row block, 1 document
    assert blocking(64, 128, 4096, 256, elem=2) == (128, 2, 1, n)  # bf16 search Lq 128
    assert rules.forward_blocking(64, 32, 4096, 256, cross=True, elem=1, d_pad=128, save_argmax=True)[3] == 1


@pytest.fixture(params=["tail-tiles", "masked-tile"])
def tail_tiles(request, monkeypatch):
    """Both ways the forward covers a document's last ``Ld % BLOCK_N`` tokens: narrower tail
    tiles (``blocking.tail_tile``, here for the tiny shapes' 16-row programs and short
    documents too) or one whole tile with the rest masked (no document long enough)."""
    from lik_plugins.kernels.triton import blocking, launch

    tails = request.param == "tail-tiles"
    monkeypatch.setattr(blocking, "TAIL_MIN_BLOCK_ROWS", 0)
    monkeypatch.setattr(blocking, "TAIL_MIN_LD", 0 if tails else 1 << 62)
    launch.clear_plans()  # a cached forward plan holds the tail width it was made with
    yield request.param
    launch.clear_plans()


@pytest.mark.parametrize("block_n", [32, 64, 128])
@pytest.mark.parametrize("mask_mode", MASK_MODES)
def test_document_tails_at_every_tile_width(gen, block_n, mask_mode, tail_tiles, monkeypatch):
    """Scores and winners for documents whose length leaves every kind of tail after the
    whole tiles (none, shorter than one tail tile, one, two at BLOCK_N 128, no whole tile at
    all), at each BLOCK_N the autotuner may pick; exact ties between the first token and
    the last (inside the tail) go to the first."""
    from lik_plugins.kernels.triton import launch

    force_forward_block_n(monkeypatch, block_n)
    for ld in (5, 20, 64, 70, 100, 130, 200):
        Q, D, qm, dm = make_inputs(gen, "cross", 2, 3, 5, ld, 16)
        scores, arg = launch.forward(Q, D, qm, dm, cross=True, normalize=False, zero_mode=mask_mode == "zero",
                                     save_argmax=True)
        assert torch.equal(arg.long(), expected_argmax(Q, D, qm, dm, "cross", mask_mode)), ld
        ref = reference.maxsim(Q.double(), D.double(), qm, dm, mask_mode=mask_mode)
        assert rel_err(scores, ref) < 2e-5, ld
        Qt, Dt = tied_inputs(gen, "cross", 2, 2, 3, ld, 16, copies=(0, ld - 1))
        _, arg = launch.forward(Qt, Dt, None, None, cross=True, normalize=False, zero_mode=False, save_argmax=True)
        assert (arg[:, 0] == 0).all(), (ld, arg[:, 0])
        assert torch.equal(arg.long(), expected_argmax(Qt, Dt, None, None, "cross", "exclude")), ld
    launch.clear_plans()


def test_tail_tile_rule(monkeypatch):
    """Tail tiles at least 16 wide (the MMA's minimum), no wider than a power of two above
    ``Ld % 64``, none where every BLOCK_N divides the length, none below TAIL_MIN_LD."""
    from lik_plugins.kernels.triton import blocking

    assert blocking.tail_tile(1030) == 16     # ColPali pages: 1024 + 6
    assert blocking.tail_tile(1030, 32) == 0  # one short query per program: memory-bound, masked tile
    assert blocking.tail_tile(1030, 128) == 16 and blocking.tail_tile(1030, 256) == 16
    assert blocking.tail_tile(600) == 32 and blocking.tail_tile(1024) == 0
    assert blocking.tail_tile(300) == 0 and blocking.tail_tile(180) == 0   # ColBERT lengths: no tail variants
    monkeypatch.setattr(blocking, "TAIL_MIN_LD", 0)
    assert blocking.tail_tile(300) == 64      # 256 + 44
    assert blocking.tail_tile(180) == 64      # 128 + 52
    assert blocking.tail_tile(200) == 16      # 192 + 8 (BLOCK_N 128: 128 + 72 in five tiles of 16)
    assert blocking.tail_tile(20) == 32       # shorter than any whole tile
    assert blocking.tail_tile(320) == 64      # only BLOCK_N 128 leaves a tail
    assert blocking.tail_tile(256) == 0
    for ld in range(1, 600):
        width = blocking.tail_tile(ld)
        if ld % 128:
            assert width >= 16 and width & (width - 1) == 0
            # one tile of this width covers what BLOCK_N 64 leaves (when it leaves anything)
            assert ld % 64 <= width


def test_autotuning_size_classes():
    """The forward's autotuner keys on a launch size class: a rerank of 1000 documents
    (latency-bound) and one of 100k (HBM-bound) are tuned apart; one training batch size
    stays in one class; classes grow by factors of 8 in programs."""
    from lik_plugins.kernels.triton import tuning

    assert tuning.size_class(1000) != tuning.size_class(100_000)
    assert tuning.size_class(8192) == tuning.size_class(8192 + 4096)
    classes = [tuning.size_class(1 << p) for p in range(8, 24)]
    assert classes == sorted(classes) and classes[0] == 0
    assert all(classes.count(c) == 3 for c in set(classes) - {0, classes[-1]})  # 8x programs a class


def test_a_hard_max_step_imports_only_its_own_kernels():
    """A fresh process's hard-max forward and backward on the Triton path imports neither the
    smooth-max nor the quantised and residual kernel modules (Triton parses each ``@jit``
    source at import: milliseconds of a user's first step); a smooth call then imports its
    module, which replaces its stand-in in the implementation handed out."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch, lik_plugins as lik\n"
        "from lik_plugins.kernels import dispatch\n"
        "Q = torch.randn(2, 5, 16, requires_grad=True); D = torch.randn(3, 9, 16, requires_grad=True)\n"
        "lik.maxsim(Q, D).sum().backward()\n"
        "names = ('lik_plugins.kernels.triton.smoothmax', 'lik_plugins.kernels.triton_ops',\n"
        "         'lik_plugins.kernels.triton.quantize', 'lik_plugins.kernels.triton.approx')\n"
        "print('hard', lik.routing_counts(), [n for n in names if n in sys.modules])\n"
        "lik.smooth_maxsim(Q, D, tau=0.1).sum().backward()\n"
        "impl = dispatch.serve(Q, 'smooth')\n"
        "print('smooth', lik.routing_counts()['smooth_maxsim'], impl.smooth is sys.modules[names[0]],\n"
        "      type(impl.quantized).__name__)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", LIK_BACKEND="triton")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    hard, smooth = done.stdout.strip().splitlines()[-2:]
    assert hard == "hard {'maxsim': {'triton': 1}} []"
    assert smooth == "smooth {'triton': 1} True _ImportedOnUse"
