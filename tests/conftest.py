import os

# In-process engine (one process, closures in collective_rpc); must be set before vLLM builds an engine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
