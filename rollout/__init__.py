"""The rollout side: the colocated vLLM engine client (`engine.py`), in-memory adapter sync and routing/MSA capture
(worker extensions), rollout-only serving (`serve.py`), and our vLLM plugin (`plugin/`). Never imports `rl`: it runs
inside vLLM's processes."""
