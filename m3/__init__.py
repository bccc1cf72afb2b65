"""The MiniMax-M3 model definition both sides share, with no vLLM and no trainer inside: the config schema and its
validation (config.py), checkpoint tensor names and layouts (weights.py), the math both must compute identically
(ops.py), and the deterministic tiny-model builder for tests and the embedded default (tiny.py)."""
