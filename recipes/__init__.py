"""Hydra config groups for `miles-train`, shipped inside the installed package (searched as pkg://recipes)."""
