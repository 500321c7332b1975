"""GPU suite: the kernel binaries shipped with the package (``LIK_SHIPPED_BINARIES=1``).

Every binary of this GPU's architecture loads with the parameters its manifest declares;
the hosts' calls (shapes from ``lik_plugins.precompile``'s grid, forward and backward) run
on the shipped binaries with no JIT launch of a shipped variant, and give what the JIT's
binaries give and what the fp64 reference gives.  Skipped without CUDA or without binaries
for this GPU."""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference
from lik_plugins.kernels.triton import binaries_loader, direct

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@pytest.fixture(scope="module")
def manifest():
    path = binaries_loader.BINARIES_DIR / _arch() / "manifest.json"
    if not path.is_file():
        pytest.skip(f"no shipped binaries for {_arch()}")
    return binaries_loader.read_manifest(_arch())


def _mode(monkeypatch, shipped: bool) -> None:
    monkeypatch.setenv("LIK_SHIPPED_BINARIES", "1" if shipped else "0")
    monkeypatch.setenv("LIK_BACKEND", "triton")
    direct.clear()
    binaries_loader.reset()


def test_every_shipped_binary_loads_with_its_declared_parameters(manifest, monkeypatch):
    _mode(monkeypatch, True)
    device = binaries_loader._open_device(torch.cuda.current_device())
    assert not isinstance(device, str), device                  # the driver opened and the self-check passed
    for key, entry in manifest["variants"].items():
        shipped = device.kernel(key)
        assert shipped.name == entry["function"] and shipped.layout.codes == entry["params"]


def _rel(x, y) -> float:
    return ((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-12)).item()


# (name, score function, Q shape, D shape, masks) -- the hosts' calls at sizes of the precompile grid
def _cases():
    def pylate(Q, D, dm, qm):
        return lik.maxsim(Q, D, None, dm, mask_mode="zero")

    def st(Q, D, dm, qm):
        return lik.maxsim(Q, D, qm, dm)

    def ops(Q, D, dm, qm):
        return lik.maxsim(Q, D, None, dm)

    def colpali(Q, D, dm, qm):
        return lik.maxsim(Q, D)

    def smooth(layout):
        return lambda Q, D, dm, qm: lik.smooth_maxsim(Q, D, tau=0.1, layout=layout)

    return [
        ("pylate-contrastive", pylate, (32, 32), (64, 180)),
        ("pylate-kd", pylate, (16, 32), (16, 32, 180)),
        ("st", st, (16, 32), (16, 128)),
        ("ops", ops, (32, 16), (32, 300)),
        ("colpali-inbatch", colpali, (8, 16), (8, 1030)),
        ("colpali-hardneg", colpali, (8, 16), (8, 2, 1030)),
        ("colpali-smooth-cross", smooth("cross"), (8, 16), (8, 1030)),
        ("colpali-smooth-pairs", smooth("pairs"), (8, 16), (8, 1030)),
    ]


def _reference(name, Q, D, dm, qm):
    Q64, D64 = Q.double(), D.double()
    if name.startswith("colpali-smooth"):
        return reference.smooth_maxsim(Q64, D64, tau=0.1, layout=name.rsplit("-", 1)[1])
    if name.startswith("colpali"):
        return reference.maxsim(Q64, D64)
    if name.startswith("pylate"):
        return reference.maxsim(Q64, D64, None, dm, mask_mode="zero")
    return reference.maxsim(Q64, D64, qm if name == "st" else None, dm)


def _run(fn, Q0, D0, dm, qm, grad_seed=1):
    Q, D = Q0.detach().requires_grad_(), D0.detach().requires_grad_()
    out = fn(Q, D, dm, qm)
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(grad_seed))
    out.backward(g.to(out.dtype))
    return out.detach(), Q.grad, D.grad, g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", _cases(), ids=[c[0] for c in _cases()])
def test_host_calls_run_on_shipped_binaries_as_on_the_jit(case, dtype, manifest, monkeypatch):
    name, fn, q_shape, d_shape = case
    g = torch.Generator(device="cuda").manual_seed(0)
    dim = 128
    Q0 = torch.nn.functional.normalize(torch.randn(*q_shape, dim, device="cuda", generator=g), dim=-1).to(dtype)
    D0 = torch.nn.functional.normalize(torch.randn(*d_shape, dim, device="cuda", generator=g), dim=-1).to(dtype)
    dm = torch.rand(d_shape, device="cuda", generator=g) > 0.2
    qm = torch.rand(q_shape, device="cuda", generator=g) > 0.1

    _mode(monkeypatch, True)
    direct.reset_variants()
    shipped = _run(fn, Q0, D0, dm, qm)
    launched = set(direct._VARIANTS)
    report = binaries_loader.diagnostics()
    device = report["devices"][torch.cuda.current_device()]
    assert isinstance(device, dict), device
    assert report["kernels"] == {}, report["kernels"]            # no kernel edited since the build
    served = {binaries_loader.variant_key(k) for k in launched} & set(manifest["variants"])
    assert served, "the call reached no shipped variant"
    assert served <= set(binaries_loader._devices[torch.cuda.current_device()].loaded)
    _mode(monkeypatch, False)
    jit = _run(fn, Q0, D0, dm, qm)

    out_ref = _reference(name, Q0, D0, dm, qm)
    Qr, Dr = Q0.double().requires_grad_(), D0.double().requires_grad_()
    _reference(name, Qr, Dr, dm, qm).backward(shipped[3].double())
    tol = TOL[dtype]
    for got, want, ref in ((shipped[0], jit[0], out_ref), (shipped[1], jit[1], Qr.grad), (shipped[2], jit[2], Dr.grad)):
        assert _rel(got, ref) < tol and _rel(want, ref) < tol
        # the same kernel source compiled by two Triton releases: within rounding of each other
        assert _rel(got, want) < tol
