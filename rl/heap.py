"""The Python heap out of the cyclic collector's reach (rl.train's loop, an engine rebuild, scripts/train_step_m3.py).
Needs only the standard library: the GPU slice benchmark imports it on a machine without Hydra/OmegaConf.
"""

import gc


def freeze_heap() -> None:
    """Everything alive now (imports, model, engine: ~10^5-10^6 objects, all living to the end) out of the cyclic
    collector's reach: its full passes scan them, ~0.2-0.4 s each at steps nobody picks (results/gpu/run120: 0.41 s
    of a 2.9 s step). vLLM's engine core freezes its startup heap the same way."""
    gc.collect()
    gc.freeze()
