"""Diagnostics: FP8 coverage of a jitted function, memory accounting, the inspect command."""
