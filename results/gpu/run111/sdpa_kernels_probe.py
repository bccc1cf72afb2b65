import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
from torch.nn.attention.varlen import varlen_attn
q=torch.randn(1,64,2048,128,device='cuda',dtype=torch.bfloat16,requires_grad=True)
k=torch.randn(1,4,2048,128,device='cuda',dtype=torch.bfloat16,requires_grad=True)
v=torch.randn(1,4,2048,128,device='cuda',dtype=torch.bfloat16,requires_grad=True)
for _ in range(2): F.scaled_dot_product_attention(q,k,v,is_causal=True,enable_gqa=True).sum().backward()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    F.scaled_dot_product_attention(q,k,v,is_causal=True,enable_gqa=True).sum().backward(); torch.cuda.synchronize()
print("SDPA", [e.key[:80] for e in p.key_averages() if e.device_type.name=='CUDA'][:8])
cu=torch.tensor([0,2048],dtype=torch.int32,device='cuda')
q2,k2,v2=(x.detach()[0].transpose(0,1).contiguous().requires_grad_() for x in (q,k,v))
for _ in range(2): varlen_attn(q2,k2,v2,cu,cu,2048,2048,window_size=(-1,0)).sum().backward()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    varlen_attn(q2,k2,v2,cu,cu,2048,2048,window_size=(-1,0)).sum().backward(); torch.cuda.synchronize()
print("VARLEN", [e.key[:80] for e in p.key_averages() if e.device_type.name=='CUDA'][:8])
