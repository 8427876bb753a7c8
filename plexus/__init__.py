"""Plexus: 3D-parallel full-graph GCN training (Ranjan et al., SC'25, arXiv 2505.04083).

``fit`` trains on any graph (a :class:`plexus.data.Graph`, a PyG ``Data`` or any
:class:`plexus.data.ShardSource`); the command line is ``python -m plexus.train``.

Layout of the package (README.md, "Layout", names every module):
    data/       everything up to a rank's shard (graphs, datasets, preparation, sources)
    layout.py   which grid axis plays which role in each layer; padding (pure)
    sparse.py   BlockSparse adjacency blocks and the SpMM's dispatch (csr.py one block and
                the kernel loader, slicing.py cache blocking, kernels.py numba, transpose.py A^T)
    model.py    the 3D-parallel GCN: the layer's equations and its collectives; how each
                layer runs (layer_plan.py) is decided once, before the model is built
    loss.py     cross-entropy and accuracy with the class axis sharded
    config.py   ModelConfig, OptimConfig, RunConfig; gcn_workload (the planner's view)
    build.py    a rank's shard, model and optimizer
    trainer.py  Trainer (set-up, resume, train_step, evaluate) and run(), the loop; fit,
                train_gcn, predictions
    checkpoint.py  grid-independent checkpoints
    train.py    python -m plexus.train (arguments; report.py prints)
    prepare.py  python -m plexus.prepare (the writer: plexus.data.writer)
"""


def fit(*args, **kwargs):
    """See :func:`plexus.trainer.fit` (imported lazily so ``import plexus`` stays light)."""
    from plexus.trainer import fit as _fit

    return _fit(*args, **kwargs)


__all__ = ["fit"]
