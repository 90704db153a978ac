"""``mixprec trace``: which op ran in which dtype, per module, for one forward and backward.

``run.py`` plans and runs, ``report.py`` is the report and its JSON, ``render.py`` the table, ``cli.py``
the ``trace`` command.
"""

from .report import TraceReport
from .run import TracePlan, plan_trace, run_trace

__all__ = ["TraceReport", "TracePlan", "plan_trace", "run_trace"]
