"""GPU figures: a sampler interface (sampler.py), NVML as one sampler (nvml.py), the monitor
that samples and keeps the figures (monitor.py), and the chart's history (history.py)."""

from .monitor import GpuMonitor
from .sampler import MIB, GpuSample, Sampler, Unavailable

__all__ = ["MIB", "GpuMonitor", "GpuSample", "Sampler", "Unavailable"]
