"""``mixprec inspect``: memory per recipe and the matmuls that miss tensor cores, without training.

``run.py`` plans and runs, ``report.py`` is the report and its JSON, ``render.py`` the tables, ``cli.py``
the ``inspect`` command.
"""

from .report import InspectReport
from .run import InspectPlan, plan_inspect, run_inspect

__all__ = ["InspectReport", "InspectPlan", "plan_inspect", "run_inspect"]
