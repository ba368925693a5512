"""Integrations of cascadeinfer's kernels into other inference engines (optional extras)."""
