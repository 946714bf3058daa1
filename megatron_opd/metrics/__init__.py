"""Training-health metrics (health.py) and the length-inflation collapse detector (collapse.py)."""

from megatron_opd.metrics.collapse import CollapseConfig, CollapseDetector, CollapseVerdict
from megatron_opd.metrics.health import HealthConfig, rollout_health

__all__ = ["CollapseConfig", "CollapseDetector", "CollapseVerdict", "HealthConfig", "rollout_health"]
