"""lm-evaluation-harness tasks built from the shipped novels (no download): their YAML files and
the module that builds their documents (``novels``); ``fp8jax.lm_eval`` includes this folder."""
