"""mesh_hicache: a hierarchical prefix cache for hybrid models on a pp x cp x tp DeviceMesh."""

from mesh_hicache.consensus import Consensus
from mesh_hicache.topology import MeshAxis, MeshTopology

__all__ = ["Consensus", "MeshAxis", "MeshTopology"]
__version__ = "0.1.0"
