"""Definitions in, Triton modules out: plan, render, write."""
from kdsl.codegen.output import Difference, compare, write
from kdsl.codegen.plan import PlanError, PlannedKernel, plan_kernels
from kdsl.codegen.render import render_all

__all__ = ["Difference", "compare", "write", "PlanError", "PlannedKernel", "plan_kernels", "render_all"]
