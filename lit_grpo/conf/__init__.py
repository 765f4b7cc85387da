"""Hydra's config tree. A package, so that Hydra finds it as `pkg://lit_grpo.conf` when `lit-grpo` runs."""
