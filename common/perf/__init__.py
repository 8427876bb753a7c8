"""Performance model: predicted time and memory per rank of every grid, for both engines.

Pure Python (no torch): :mod:`common.perf.machine` (machine profiles, alpha-beta collectives,
placement), :mod:`common.perf.model` (collectives, predictions, plans), :mod:`common.perf.gcn`
(a Plexus GCN epoch), :mod:`common.perf.gpt` (a 4D GPT step), :mod:`common.perf.choose`
(one :func:`plan`, one :func:`auto_grid` and one ``--grid``: :func:`parse_grid`,
:func:`choose_grid`, for both workloads), :mod:`common.perf.cli` (the
planning command ``python -m common.perf``) and :mod:`common.perf.paper` (the check
against the Plexus paper). :mod:`common.perf.calibrate` measures a machine and is the one
module that imports torch::

    from common.perf import GCNWorkload, auto_grid, plan
    work = GCNWorkload(num_nodes=2_449_029, nnz=126_167_053, num_features=100, num_classes=47)
    print(plan(work, 64, machine="perlmutter-a100").table(top=10))
    grid, _ = auto_grid(work, 64, machine="perlmutter-a100")

"""

from common.perf.choose import GridSpec, auto_grid, choose_grid, default_grid, parse_grid, plan
from common.perf.gcn import GCNWorkload, plan_gcn, predict_gcn
from common.perf.gpt import GPTWorkload, plan_gpt, predict_gpt
from common.perf.machine import MachineProfile, available_profiles, load_profile
from common.perf.model import Collective, Plan, Prediction, factorizations, spearman

__all__ = ["Collective", "GCNWorkload", "GPTWorkload", "GridSpec", "MachineProfile", "Plan",
           "Prediction", "auto_grid", "available_profiles", "choose_grid", "default_grid",
           "factorizations", "load_profile", "parse_grid", "plan", "plan_gcn", "plan_gpt",
           "predict_gcn", "predict_gpt", "spearman"]
