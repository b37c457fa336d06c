"""jabasray: adaptive-batch, auto-scaling and packed training of PyTorch models on
heterogeneous GPU clusters with Ray. See README.md and DESIGN notes in the docs."""
from .config import JobConfig, RunConfig
from .types import ClusterSpec, NodeSpec, Plan, WorkerConfig

__version__ = "0.1.0"
__all__ = ["JobConfig", "RunConfig", "ClusterSpec", "NodeSpec", "Plan", "WorkerConfig", "__version__"]
