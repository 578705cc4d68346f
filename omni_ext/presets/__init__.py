"""Launch presets for ``vllm-omni serve``: a catalog, a renderer, validation, a planner and a doctor.

The catalog is data (``catalog/*.yaml``, one file per deployment); the cost table behind the planner
is data too (``costs.yaml``, every number with its source). See ``omni-ext presets --help``.
"""

from omni_ext.presets.catalog import Preset, PresetError, get_preset, load_catalog
from omni_ext.presets.costs import Topology, load_cost_table

__all__ = ["Preset", "PresetError", "Topology", "get_preset", "load_catalog", "load_cost_table"]
