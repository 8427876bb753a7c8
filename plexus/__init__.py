"""Plexus: 3D-parallel full-graph GCN training (Ranjan et al., SC'25, arXiv 2505.04083)."""
