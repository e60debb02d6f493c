"""vLLM's way in: the `vllm.general_plugins` entry point (pyproject.toml) calls `register` in
every vLLM process: the front end's (where `EngineArgs` is made, before any engine starts), the
engine core's and each worker's, before a model is built."""

import functools
import logging
import sys

import vllm
from vllm import ModelRegistry
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from kvcalib_vllm import checks

log = logging.getLogger(__name__)

# the contexts in which vLLM's own commands make the engine config: the OpenAI server (`vllm
# serve`, `python -m vllm.entrypoints.openai.api_server`), the batch runner, the demo server
COMMANDS = (
    UsageContext.OPENAI_API_SERVER,
    UsageContext.OPENAI_BATCH_RUNNER,
    UsageContext.API_SERVER,
)


def register() -> None:
    """Register the model classes that read a folder's side-car (`model`), the checks at the
    engine config (`check_at_config`), and, in a vLLM the plugin serves, the attention backend
    that stores it (`attention`, over CPU_ATTN). In another vLLM only the model classes and
    the checks are registered: a converted folder is refused in one line and every other model
    is left as vLLM builds it."""
    for arch in checks.ARCHITECTURES:
        ModelRegistry.register_model(arch, f"kvcalib_vllm.model:Kvcalib{arch}")
    check_at_config()
    try:
        checks.check_version(vllm.__version__)
    except checks.KvcalibVllmError as e:
        log.warning("%s", e)
        return
    register_backend(AttentionBackendEnum.CPU_ATTN, "kvcalib_vllm.attention.KvcalibBackend")


def check_at_config() -> None:
    """Run the plugin's checks (`checks.check_folder`) as vLLM's front end makes the engine
    config (`EngineArgs.create_engine_config`, which `LLM(...)`, `AsyncLLM` and the servers
    call before the engine-core process starts), not only in the worker that builds the model,
    whose refusal the user read below vLLM's "Engine core initialization failed" traceback.
    `LLM(...)` then raises KvcalibVllmError with its one line; a vLLM command (COMMANDS) prints
    the line alone on stderr and exits 2. Wrapped once per process."""
    create = EngineArgs.create_engine_config
    if getattr(create, "kvcalib_checks", False):
        return

    @functools.wraps(create)
    def create_engine_config(self, usage_context=None, *args, **kwargs):
        config = create(self, usage_context, *args, **kwargs)
        try:
            checks.check_folder(config, vllm.__version__, current_platform.is_cpu())
        except checks.KvcalibVllmError as e:
            if usage_context in COMMANDS:
                print(e, file=sys.stderr)
                raise SystemExit(2) from None
            raise
        return config

    create_engine_config.kvcalib_checks = True
    EngineArgs.create_engine_config = create_engine_config
