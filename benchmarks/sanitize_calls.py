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
Q = torch.randn(2, 300, 768, device=dev, dtype=torch.float32, requires_grad=True)   # K-loop + row chunks
D = torch.randn(3, 40, 768, device=dev, dtype=torch.float32, requires_grad=True)
lik.maxsim(Q, D, normalize=True).sum().backward()
torch.cuda.synchronize()
print("sanitize calls done", lik.routing_counts())
