"""The LM head's per-chunk softmax work (rl.model.lean.lm_head_logprobs) as one Triton kernel on CUDA: the target's
log-softmax and, when a gradient will be needed, softmax - onehot(target) written over the logits.

The torch chain per 1,024-row chunk at M3's vocab (200,064) casts the bf16 logits to fp32, runs log_softmax, gathers,
exponentiates, scatters the -1 and casts back: six passes over 0.8 GB fp32 tensors. At 4 x 16K tokens they took
about 140 ms of a 2.6 s step beside the head's two GEMMs (results/gpu/run105 time split: log_softmax 52, casts 61,
exp 25 ms). The kernel reads the bf16 logits three times (max, sum, write) and writes them once, in place: 36.6 ms
of that step, the head 607.5 -> 521.5 ms (run118). An online max-and-sum pass would save one read (~9 ms) but sum
exp(x - running max) rescaled, not torch's exp(x - max).

Same formula and rounding points as torch's CUDA ops: the row max, the sum of expf(x - max) in fp32, logp =
(x - max) - logf(sum) (LogSoftMaxForwardEpilogue's order), softmax = expf(logp), minus 1.0 at the target, one
rounding to the logits' dtype. Only the sum's order differs (tests/rl/model/test_lm_head_triton.py).
"""

import torch

from rl.model.swiglu_triton import EXPF as LIBDEVICE  # CUDA's expf / logf there; the CPU interpreter has no libdevice

try:  # CPU installs run without Triton; the torch chain is the path there
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from rl.model.swiglu_triton import round_bf16
except ImportError:  # pragma: no cover
    triton = None

BLOCK = 4096  # vocab columns per step of a row's loops


def usable(logits: torch.Tensor) -> bool:
    return triton is not None and logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float32)


def logprobs_(logits: torch.Tensor, targets: torch.Tensor, jacobian: bool, block: int = BLOCK) -> torch.Tensor:
    """fp32 log_softmax(fp32(logits))[row, targets[row]] for logits [rows, vocab] (contiguous); with `jacobian`,
    logits is overwritten with softmax - onehot(targets) in its own dtype (-d logp / d logits). A target outside
    [0, vocab) gives NaN (the callers' finiteness checks then name it), not a read out of bounds."""
    rows, vocab = logits.shape
    if not logits.is_contiguous() or targets.shape != (rows,):
        raise ValueError(f"logprobs_: contiguous logits [rows, vocab] and targets [rows]; got {tuple(logits.shape)} "
                         f"(contiguous: {logits.is_contiguous()}) and {tuple(targets.shape)}")
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _logprobs[(rows,)](logits, targets.contiguous(), out, vocab, JAC=jacobian,
                           TO_BF16=logits.dtype == torch.bfloat16, LIBDEVICE=LIBDEVICE, BLOCK=block, num_warps=8)
    return out


if triton is not None:
    @triton.jit
    def _exp(x, LIBDEVICE: tl.constexpr):
        return libdevice.exp(x) if LIBDEVICE else tl.exp(x)

    @triton.jit
    def _logprobs(x_ptr, t_ptr, out_ptr, vocab, JAC: tl.constexpr, TO_BF16: tl.constexpr, LIBDEVICE: tl.constexpr,
                  BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * vocab
        c = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for v0 in range(0, vocab, BLOCK):
            x = tl.load(base + v0 + c, mask=v0 + c < vocab, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, x)
        mx = tl.max(m, 0)  # a NaN logit may be dropped here, but it makes the sum below NaN
        s = tl.zeros([BLOCK], tl.float32)
        for v0 in range(0, vocab, BLOCK):
            x = tl.load(base + v0 + c, mask=v0 + c < vocab, other=float("-inf")).to(tl.float32)
            s += _exp(x - mx, LIBDEVICE)
        total = tl.sum(s, 0)
        logsum = libdevice.log(total) if LIBDEVICE else tl.log(total)
        t = tl.load(t_ptr + row)
        inside = (t >= 0) & (t < vocab)
        xt = tl.load(base + t, mask=inside, other=float("nan")).to(tl.float32)  # before the pass below overwrites it
        tl.store(out_ptr + row, (xt - mx) - logsum)
        if JAC:
            for v0 in range(0, vocab, BLOCK):
                col = v0 + c
                x = tl.load(base + col, mask=col < vocab, other=0.0).to(tl.float32)
                d = _exp((x - mx) - logsum, LIBDEVICE) - tl.where(col == t, 1.0, 0.0)
                if TO_BF16:
                    d = round_bf16(d)
                tl.store(base + col, d.to(x_ptr.dtype.element_ty), mask=col < vocab)
