"""The listed kernel's ``round_maxima``: each row's max rounded to the embeddings' dtype
(nearest-even), as the hosts' half-precision einsum rounds every similarity -- checked
against torch's own rounding of exact products, on the GPU where there is one, else under
the interpreter (``TRITON_INTERPRET=1``).

Tokens with one non-zero feature make every similarity one product of two 16-bit numbers,
exact in fp32, so the expected value is torch's cast of that product: ties at half a step
(round to even), values that round past the largest finite one (to inf), tiny ones, NaN."""
from __future__ import annotations

import pytest
import torch

DIM = 16

# runs everywhere (the interpreter without CUDA); the marker puts it in run_gpu.sh's CUDA run too
pytestmark = pytest.mark.gpu


def _device():
    if torch.cuda.is_available():
        return torch.device("cuda")
    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    return torch.device("cpu")


def _tokens(values, dtype, device):
    """One single-token ``[1, DIM]`` tensor per value: the value in feature 0, zeros elsewhere."""
    out = torch.zeros(len(values), DIM, dtype=dtype)
    out[:, 0] = values.to(dtype)
    return [t.clone().to(device) for t in out.split(1)]


def _special(dtype):
    """(query values, candidate values) whose products probe the rounding's edges."""
    if dtype == torch.bfloat16:
        # 1.03125 * 1.9375 = 1.998046875: finite in fp32, past bf16's largest (1.9921875) * 2^127
        return ([1 + 2 ** -7, 1.5, -3.0, 1.03125 * 2.0 ** 127, float("nan"), 0.0],
                [1.5, 1 + 2 ** -6, 2 ** -100, 1.9375, 1.3359375, 1.0])
    return ([1 + 2 ** -10, 1.5, 2047 / 8, -3.0, float("nan"), 0.0],
            [1.5, 1 + 2 ** -9, 256.25, 2 ** -20, 256.0, 1.0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_maxima_is_torchs_rounding_of_each_similarity(dtype):
    from lik_plugins.kernels.triton.listed import candidate_table, score_table

    device = _device()
    g = torch.Generator().manual_seed(3)
    q_special, c_special = _special(dtype)
    # random 16-bit values: about one product in 2^8 (bf16) / 2^11 (fp16) lies exactly
    # half a step between two neighbours
    a = torch.cat([torch.tensor(q_special), torch.randn(34, generator=g) * 4]).to(dtype)
    b = torch.cat([torch.tensor(c_special), torch.randn(144, generator=g) * 4]).to(dtype)
    queries, cands = _tokens(a, dtype, device), _tokens(b, dtype, device)
    table = candidate_table(cands, dtype, DIM, device, extra=[1] * len(queries))
    assert not isinstance(table, str), table
    with torch.no_grad():
        rounded = score_table(queries, table.extra, table, None, None, round_maxima=True).cpu()
        plain = score_table(queries, table.extra, table, None, None).cpu()
    exact = a.float()[:, None] * b.float()[None, :]          # exact: 16-bit times 16-bit in fp32
    # a max of -inf in fp32 (a product past fp32's range) marks an empty row in this kernel,
    # which adds 0: not a rounding case
    kept = exact != float("-inf")
    torch.testing.assert_close(rounded[kept], exact.to(dtype).float()[kept], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(plain[kept], exact[kept], rtol=0, atol=0, equal_nan=True)
    # the edges were reached: exact ties, a finite product past the largest 16-bit value
    half = (exact - exact.to(dtype).float()).abs()
    step = (exact.to(dtype).float().abs() * torch.finfo(dtype).eps)
    assert bool(((half == step / 2) & (half > 0)).any())
    assert bool((torch.isfinite(exact) & torch.isinf(rounded)).any())
