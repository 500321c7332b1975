"""One representative call of each Triton kernel, for ``compute-sanitizer --tool memcheck``.

Odd sizes on purpose (d=96, Lq=33, Ld=70, masks with holes) so every masked load/store
edge is exercised."""
import torch

import lik_plugins as lik


torch.manual_seed(0)
dev = "cuda"
for kd in (False, True):
    for normalize in (False, True):
        for backward in ("lowmem", "unified"):
            Q = torch.randn(5, 33, 96, device=dev, dtype=torch.bfloat16, requires_grad=True)
            shape = (5, 3, 70, 96) if kd else (6, 70, 96)
            D = torch.randn(*shape, device=dev, dtype=torch.bfloat16, requires_grad=True)
            qm = torch.rand(5, 33, device=dev) > 0.3
            dm = torch.rand(*shape[:-1], device=dev) > 0.3
            out = lik.maxsim(Q, D, qm, dm, normalize=normalize, backward=backward, mask_mode="zero")
            out.sum().backward()
# Enough queries that the grad_Q gather rides in the grad_D launch (fused lowmem paths):
# pairs and candidates (zero-filled grad_D + winners kernel), cross (one-hot doc kernel).
for layout in ("pairs", "kd", "cross"):
    for normalize in (False, True):
        Q = torch.randn(70, 33, 96, device=dev, dtype=torch.bfloat16, requires_grad=True)
        shape = {"pairs": (70, 50, 96), "kd": (70, 2, 50, 96), "cross": (3, 50, 96)}[layout]
        D = torch.randn(*shape, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dm = torch.rand(*shape[:-1], device=dev) > 0.3
        fn = lik.maxsim_pairs if layout == "pairs" else lik.maxsim
        fn(Q, D, None, dm, normalize=normalize, backward="lowmem").sum().backward()
Q = torch.randn(2, 300, 768, device=dev, dtype=torch.float32, requires_grad=True)   # K-loop + row chunks
D = torch.randn(3, 40, 768, device=dev, dtype=torch.float32, requires_grad=True)
lik.maxsim(Q, D, normalize=True).sum().backward()
torch.cuda.synchronize()
print("sanitize calls done", lik.routing_counts())
