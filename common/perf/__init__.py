"""Performance model: predicted time and memory per rank of every grid, for both engines.

Pure Python (no torch): :mod:`common.perf.machine` (machine profiles, alpha-beta collectives,
placement), :mod:`common.perf.model` (collectives, predictions, plans), :mod:`common.perf.gcn`
(a Plexus GCN epoch), :mod:`common.perf.gpt` (a 4D GPT step) and :mod:`common.perf.paper` (the
check against the Plexus paper). :mod:`common.perf.calibrate` measures a machine and is the one
module that imports torch. The planning command is ``python -m common.plan``::

    from common.perf import GCNWorkload, load_profile, plan_gcn
    plan = plan_gcn(GCNWorkload(num_nodes=2_449_029, nnz=126_167_053, num_features=100,
                                num_classes=47), 64, load_profile("perlmutter-a100"))
    print(plan.table(top=10))
"""

from common.perf.gcn import GCNWorkload, plan_gcn, predict_gcn
from common.perf.gpt import GPTWorkload, plan_gpt, predict_gpt
from common.perf.machine import MachineProfile, available_profiles, load_profile
from common.perf.model import Collective, Plan, Prediction, factorizations, spearman

__all__ = ["Collective", "GCNWorkload", "GPTWorkload", "MachineProfile", "Plan", "Prediction",
           "available_profiles", "factorizations", "load_profile", "plan_gcn", "plan_gpt",
           "predict_gcn", "predict_gpt", "spearman"]
