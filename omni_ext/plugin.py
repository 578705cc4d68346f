"""The one place where omni-ext plugs into vLLM and vLLM-Omni (all entry points point here).

Entry points (see ``pyproject.toml``):

- ``vllm_omni.platform_plugins``: :func:`cpu_platform` returns the CPU OmniPlatform on a host with
  no accelerator, else None so vLLM-Omni's own CUDA/NPU platform wins.
- ``vllm.general_plugins``: :func:`register_vllm`. Runs in the API process while the CLI parser is
  built (before config resolution), and again in every process that loads vLLM-Omni's plugins.
- ``vllm_omni.general_plugins``: :func:`register_omni`. Runs in the API process before stages
  start, in stage processes and in every diffusion worker.

Both register functions do the same cheap, idempotent activation and log one line per process
naming the features that are active there, so an operator can see from the log that the plugin
reached the API server and each worker.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from omni_ext import __version__, environment

logger = logging.getLogger("omni_ext")

_ACTIVE: dict[str, object] | None = None


def _ensure_log_handler() -> None:
    # vLLM configures its own loggers; ours would otherwise be silent at INFO.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [omni-ext] %(message)s", "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(environment.value("OMNI_EXT_LOG_LEVEL").upper())


def _activate(side: str) -> dict[str, object]:
    """Activate omni-ext in this process (idempotent); log once, and again only if something changed.

    Called from both entry-point groups: in the API process the first call can come before
    vLLM-Omni's HTTP module is imported, so API-side patches are picked up on the later call. In a
    TunedExecutor worker the call comes after the worker marked itself (``ROLE.tuned_worker``), so
    the ``tuned-worker`` patches apply there (:func:`omni_ext.patches.process_roles`).
    """
    global _ACTIVE
    from omni_ext.patches import apply_patches
    from omni_ext.platform.detect import cpu_platform_qualname
    from omni_ext.platform.threads import remember_user_omp

    if _ACTIVE is None:
        _ensure_log_handler()
        remember_user_omp()
        _register_preset_pipelines()
    if multiprocessing.current_process().name == "MainProcess":
        _ensure_progress_dir()
    outcome = apply_patches()
    state: dict[str, object] = {
        "cpu_platform": cpu_platform_qualname() is not None,
        "patches": sorted(n for n, r in outcome.items() if r == "applied"),
        "skipped": sorted(n for n, r in outcome.items() if r != "applied"),
    }
    if _ACTIVE is None or {k: v for k, v in _ACTIVE.items() if k != "side"} != state:
        logger.info(
            "omni-ext %s loaded in %s (pid %d, via %s): cpu-platform=%s patches=%s%s",
            __version__,
            multiprocessing.current_process().name,
            os.getpid(),
            side,
            "on" if state["cpu_platform"] else "off",
            ",".join(state["patches"]) or "none",  # type: ignore[arg-type]
            f" skipped={','.join(state['skipped'])}" if state["skipped"] else "",  # type: ignore[arg-type]
        )
    _ACTIVE = {"side": side, **state}
    return _ACTIVE


def _register_preset_pipelines() -> None:
    """Pipeline topologies the presets name (``pipeline: omni_ext_qwen_image`` in a deploy YAML).

    Must exist before ``vllm-omni serve`` resolves its config, hence here; a failure is logged and
    only the presets that name these topologies are affected.
    """
    try:
        from omni_ext.presets.pipelines import register_preset_pipelines

        register_preset_pipelines()
    except Exception:
        logger.warning("omni-ext: could not register the preset pipeline topologies", exc_info=True)


def _ensure_progress_dir() -> None:
    """The API process picks the step-progress directory before any worker starts (they inherit it)."""
    import atexit
    import shutil

    from omni_ext.progress import ENV, ensure_progress_dir

    if os.environ.get(ENV):
        return
    path = ensure_progress_dir()
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))


def register_vllm() -> None:
    """``vllm.general_plugins`` entry point (in ``vllm-omni serve`` it runs before arguments are parsed)."""
    _activate("vllm.general_plugins")
    _check_serve_command()


def _check_serve_command() -> None:
    """Fail fast, with one clear line, on a ``vllm-omni serve`` model that cannot be loaded or
    omni-ext options that are wrong."""
    import sys

    from omni_ext.startup import check_model, check_serve_options, serve_model_arg

    if multiprocessing.current_process().name != "MainProcess":
        return
    model = serve_model_arg(sys.argv)
    problem = (check_model(model) if model else None) or check_serve_options(sys.argv)
    if problem:
        logger.error("omni-ext: cannot start vllm-omni serve: %s", problem)
        raise SystemExit(2)


def register_omni() -> None:
    """``vllm_omni.general_plugins`` entry point."""
    _activate("vllm_omni.general_plugins")


def cpu_platform() -> str | None:
    """``vllm_omni.platform_plugins`` entry point."""
    from omni_ext.platform.detect import cpu_platform_qualname

    return cpu_platform_qualname()
