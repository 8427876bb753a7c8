"""Plexus: 3D-parallel full-graph GCN training (Ranjan et al., SC'25, arXiv 2505.04083).

``fit`` trains on any graph (a :class:`plexus.graph.Graph` or a PyG ``Data``); the command line
is ``python -m plexus.train``.
"""


def fit(*args, **kwargs):
    """See :func:`plexus.trainer.fit` (imported lazily so ``import plexus`` stays light)."""
    from plexus.trainer import fit as _fit

    return _fit(*args, **kwargs)


__all__ = ["fit"]
