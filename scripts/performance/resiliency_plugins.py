"""The resiliency plugins of the performance scripts: the same classes as ``megatron.bridge.recipes.run_plugins``.

Megatron-Bridge's performance scripts import ``FaultTolerancePlugin`` from this path; here it is the package's own
plugin (``run.Script`` and ``run.Partial`` tasks, any executor, section timeouts delivered to ft_launcher), so the
two never drift apart. ``PreemptionPlugin`` and both script-argument dataclasses are here too.

    from resiliency_plugins import FaultTolerancePlugin  # with scripts/performance on sys.path
"""

from megatron.bridge.recipes.run_plugins import (
    FaultTolerancePlugin,
    FaultTolerancePluginScriptArgs,
    PreemptionPlugin,
    PreemptionPluginScriptArgs,
)

__all__ = ["FaultTolerancePlugin", "FaultTolerancePluginScriptArgs", "PreemptionPlugin", "PreemptionPluginScriptArgs"]
