"""The vLLM worker extension our engines run with: `worker_extension_cls="rollout.worker_extension.M3Worker"`."""

from rollout.adapter_sync import AdapterSyncExtension
from rollout.capture import CaptureExtension


class M3Worker(AdapterSyncExtension, CaptureExtension):
    """In-memory adapter sync with checksum + routing / MSA block capture, callable through `collective_rpc`."""
