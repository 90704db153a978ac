"""``mixprec plan``: from per-layer evidence to the fastest recipe that still trains like fp32, verified.

``candidates.py`` (which formats each linear may take on the target, and their predicted costs),
``evidence.py`` (lockstep runs, fp32's band, the what-if), ``choose.py`` (the greedy choice and the
recipe), ``run.py`` (plan and run; ``plan_model`` for your own model), ``report.py`` (the report and
its JSON), ``render.py`` (the table), ``html.py`` (the page with the curves), ``cli.py`` (the command).
"""

from .report import PlanReport
from .run import PlanSetup, plan_model, plan_setup, run_plan

__all__ = ["PlanReport", "PlanSetup", "plan_setup", "run_plan", "plan_model"]
