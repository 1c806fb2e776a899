"""GPU figures: a sampler interface (sampler.py), NVML for NVIDIA (nvml.py), amdgpu's sysfs and
the DRM fdinfo for AMD and Intel (drm.py), which cards the GPU child uses (placement.py), the
monitor that samples and keeps the figures (monitor.py), and the chart's history
(history.py)."""

from .monitor import GpuMonitor
from .sampler import MIB, GpuSample, Sampler, Unavailable

__all__ = ["MIB", "GpuMonitor", "GpuSample", "Sampler", "Unavailable"]
