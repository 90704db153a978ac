"""``mixprec compare``: one workload trained under several recipes from the same weights and data order.

``run.py`` plans and runs (``multiproc.py`` for ``--nproc``), ``report.py`` is the report and its JSON,
``render.py`` the console table, ``html.py`` the page, ``cli.py`` the ``compare`` and ``report`` commands.
"""

from .report import CompareReport
from .run import DEFAULT_RECIPES, ComparePlan, plan_compare, run_compare

__all__ = ["CompareReport", "ComparePlan", "DEFAULT_RECIPES", "plan_compare", "run_compare"]
