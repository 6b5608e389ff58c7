"""Definitions in, Triton modules out: plan, render, write."""
from kdsl.codegen.output import Difference, OutputError, compare, write
from kdsl.codegen.plan import PlanError, PlannedKernel, plan_kernels
from kdsl.codegen.render import RenderError, render_all

__all__ = ["Difference", "OutputError", "compare", "write", "PlanError", "PlannedKernel", "plan_kernels", "RenderError",
           "render_all"]
