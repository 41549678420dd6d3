"""fdlora plan: predict step time, memory and switch costs of each LoRA serving strategy (merged, dynamic,
merged-weight cache, per-prompt grouped, quantized base) for a model, adapters, GPU and traffic, from config
files only. Imports diffusers/transformers only when a plan is made."""

from .api import PlanResult, plan

__all__ = ["PlanResult", "plan"]
