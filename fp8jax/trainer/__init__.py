"""The trainer: run spec, loop, train step, checkpoints, data, tokenizer and metrics."""
