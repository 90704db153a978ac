"""``mixprec doctor``: per-layer numeric ranges of one recipe on one workload, and the loss-scale window.

``run.py`` plans and runs, ``report.py`` is the report and its JSON, ``render.py`` the table and findings
(``render_fp8.py`` their fp8 part), ``html.py`` the page, ``cli.py`` the ``doctor`` command.
"""

from .report import DoctorReport
from .run import DoctorPlan, plan_doctor, run_doctor

__all__ = ["DoctorReport", "DoctorPlan", "plan_doctor", "run_doctor"]
