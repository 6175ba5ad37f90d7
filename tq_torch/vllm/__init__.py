"""tq_torch inside vLLM 0.33: an attention backend for ``--kv-cache-dtype turboquant_*``.

vLLM 0.33 ships a TurboQuant backend whose cache bytes are this project's
format. `register` replaces it (``AttentionBackendEnum.TURBOQUANT``) with
`tq_torch.vllm.backend.TQTorchAttentionBackend`, which keeps vLLM's cache
spec, page size and layout (caches stay interchangeable with the stock
backend) and runs `tq_torch.store_kv` / `tq_torch.paged_attention`, adding what
the stock backend lacks: sliding windows, attention sinks, logits soft cap,
and a prefill whose answer does not depend on how it was chunked (every key
and value is read from the cache).

`register` is the ``vllm.general_plugins`` entry point declared in
pyproject.toml, so vLLM calls it in every process that loads plugins (front
end, engine core, every tensor/pipeline-parallel worker). It is idempotent.
Nothing is registered when ``TQ_VLLM_DISABLE=1`` (compare with the stock
backend), or when the installed vLLM is not 0.33 (the backend builds on
0.33's internal classes). ``VLLM_PLUGINS`` (vLLM's own allow-list of plugin
names) can exclude the plugin too; its entry point name is ``tq_torch``.

This module does not import vLLM or the backend until `register` runs.
"""

from __future__ import annotations

import logging
import os

__all__ = ["BACKEND_CLASS_PATH", "DISABLE_ENV", "PLUGIN_NAME", "SUPPORTED_VLLM", "disabled", "register"]

#: The environment variable that turns the override off (``1``, ``true``, ``yes``, ``on``).
DISABLE_ENV = "TQ_VLLM_DISABLE"
#: The entry point's name in the ``vllm.general_plugins`` group (what ``VLLM_PLUGINS`` lists).
PLUGIN_NAME = "tq_torch"
#: The vLLM release series the backend is written against.
SUPPORTED_VLLM = "0.33"
#: What ``AttentionBackendEnum.TURBOQUANT`` resolves to once registered.
BACKEND_CLASS_PATH = "tq_torch.vllm.backend.TQTorchAttentionBackend"

# A child of vLLM's "vllm" logger, so these lines appear in vLLM's log with its format and level.
logger = logging.getLogger("vllm.tq_torch")


def disabled() -> bool:
    """True when ``TQ_VLLM_DISABLE`` asks for vLLM's stock TurboQuant backend."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> bool:
    """Makes ``AttentionBackendEnum.TURBOQUANT`` resolve to the tq_torch backend.

    Returns True when the override is in place after the call, False when it
    was skipped (off switch, or a vLLM other than 0.33). Safe to call any
    number of times, in any process.
    """
    if disabled():
        logger.info("tq_torch.vllm: %s is set; vLLM's stock TurboQuant backend stays in use", DISABLE_ENV)
        return False
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    version = str(getattr(vllm, "__version__", ""))
    if version.split("+")[0].split(".")[:2] != SUPPORTED_VLLM.split("."):
        logger.warning("tq_torch.vllm: written for vLLM %s.x, found %s; not registering (the stock "
                       "TurboQuant backend stays in use)", SUPPORTED_VLLM, version or "an unknown version")
        return False
    register_backend(AttentionBackendEnum.TURBOQUANT, BACKEND_CLASS_PATH)
    logger.info("tq_torch.vllm: --kv-cache-dtype turboquant_* now runs %s (set %s=1 to turn it off)",
                BACKEND_CLASS_PATH, DISABLE_ENV)
    return True
