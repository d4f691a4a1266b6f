"""Train a decoder-only LM with FP8 mixed precision (from a checkout; installed: fp8jax-train).

    python train.py --config configs/tiny.py --workdir /tmp/fp8jax_tiny
    python train.py --config configs/tiny.py --config.fp8.level=O0 --config.num_train_steps=50

The command is ``fp8jax.train`` (``python -m fp8jax.train``, ``fp8jax-train``): ``--config``
takes a config file or a shipped config's name; bad flags, config, data or checkpoints exit 2
with one line on stderr (FP8JAX_DEBUG=1 shows the traceback instead).
"""

from fp8jax.train import run

if __name__ == "__main__":
    run()
