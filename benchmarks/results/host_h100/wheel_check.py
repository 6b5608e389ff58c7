# Run from a folder outside the checkout with only the installed wheel on the path (plus its dependencies).
import torch, kdsl
from kdsl.runtime.manifest import shipped_dir
print("kdsl from", kdsl.__file__, "| kernels from", shipped_dir())
x, w = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16), torch.randn(2112, 7168, device="cuda", dtype=torch.bfloat16)
q, s = kdsl.ops.act_quant(x); wq, ws = kdsl.ops.weight_quant(w)
y = kdsl.ops.fp8_gemm(q, s, wq, ws)
ref = x.float() @ w.float().T
print("fp8_gemm via", kdsl.registry.dispatch("fp8_gemm", kdsl.BlockFP8().name, x.device).name,
      "rel err vs bf16 inputs", ((y.float() - ref).norm() / ref.norm()).item())
