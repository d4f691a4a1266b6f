"""Errors the command line reports as one line: bad config, data, checkpoint, non-finite run."""


class CheckpointMismatchError(ValueError):
    """The checkpoint in the work dir does not fit this config's model (or is corrupt)."""


class NonFiniteLossError(RuntimeError):
    """Raised after ``max_bad_steps`` consecutive non-finite steps."""


# ValueError/TypeError/FileNotFoundError are what config, format, recipe, shape and data checks
# raise with a message naming the fix. Set FP8JAX_DEBUG=1 to see full tracebacks instead.
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NonFiniteLossError)
