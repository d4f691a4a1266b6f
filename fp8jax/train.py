"""The training loop: ``train_and_evaluate(config, workdir)``.

Called by ``train.py``, the notebooks and the tests. The step itself (pure, jitted once with
explicit shardings and donation) lives in ``fp8jax.step``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from fp8jax import data as data_lib
from fp8jax import metrics as metrics_lib
from fp8jax import models
from fp8jax import sharding as sharding_lib
from fp8jax import step as step_lib
from fp8jax.checkpoint import Checkpointer, abstract_like
from fp8jax.errors import NonFiniteLossError


class _Preempted:
    """SIGTERM flag: the loop checkpoints and returns at the next step boundary."""

    def __init__(self):
        self.flag = False
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread (e.g. some notebook kernels): no handler
            self._old = None
        return self

    def _handle(self, signum, frame):
        del signum, frame
        self.flag = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def setup(config: ml_collections.ConfigDict, workdir: str):
    """Build model, optimizer, mesh, data and the jitted steps (shared with inspect/benchmarks)."""
    models.check_config(config)
    mesh = sharding_lib.make_mesh(config.mesh)
    model = models.build_model(config)
    tx = step_lib.make_optimizer(config)
    init_fn = functools.partial(step_lib.init_state, model, tx, config)
    abstract = jax.eval_shape(init_fn, jax.random.PRNGKey(config.seed))
    state_sh = sharding_lib.state_shardings(model, config, abstract, mesh)
    batch_sh = sharding_lib.batch_sharding(mesh)
    train_step = jax.jit(
        step_lib.make_train_step(model, tx, config),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, sharding_lib.replicated(mesh)),
        donate_argnums=0,
    )
    eval_step = jax.jit(step_lib.make_eval_step(model), in_shardings=(state_sh, batch_sh))
    return dict(
        mesh=mesh,
        model=model,
        tx=tx,
        init=jax.jit(init_fn, out_shardings=state_sh),
        abstract=abstract,
        state_shardings=state_sh,
        batch_sharding=batch_sh,
        train_step=train_step,
        eval_step=eval_step,
        stats_step=jax.jit(step_lib.make_stats_step(model)),
    )


def abstract_batch(config, batch_size=None):
    """ShapeDtypeStructs of one training batch."""
    shape = (batch_size or config.batch_size, config.seq_len)
    spec = jax.ShapeDtypeStruct(shape, jnp.int32)
    return {"inputs": spec, "targets": spec}


def evaluate(eval_step, state, batches, sharding) -> dict:
    """Mean validation loss and perplexity over fixed batches."""
    losses = [eval_step(state, jax.device_put(b, sharding)) for b in batches]
    loss = float(np.mean(jax.device_get(losses)))
    return {"val_loss": loss, "val_perplexity": float(np.exp(min(loss, 50.0)))}


def sample(model, state, tokenizer, prompt: str, num_tokens: int, max_len: int, seed=0) -> str:
    """Sample ``num_tokens`` tokens after ``prompt`` (temperature 0.8, fixed-length buffer)."""
    from fp8jax import optim

    ids = tokenizer.encode(prompt)[-(max_len - num_tokens) :] or [0]
    n0 = len(ids)
    buf = np.zeros((1, max_len), np.int32)
    buf[0, :n0] = ids
    params = optim.materialize(state.params)

    @jax.jit
    def next_token(tokens_1xL, pos, key):
        logits = model.apply({"params": params, "fp8_state": state.fp8}, tokens_1xL)
        return jax.random.categorical(key, logits[0, pos - 1] / 0.8)

    key = jax.random.PRNGKey(seed)
    for pos in range(n0, min(max_len, n0 + num_tokens)):
        key, sub = jax.random.split(key)
        buf[0, pos] = int(next_token(jnp.asarray(buf), pos, sub))
    return tokenizer.decode(buf[0, :pos + 1].tolist())


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Train ``config`` in ``workdir`` (resuming if a checkpoint is there); return final metrics."""
    os.makedirs(workdir, exist_ok=True)
    metrics_lib.quiet_library_logs()
    if config.get("distributed", False):
        jax.distributed.initialize()
    logging.info("fp8jax: level %s, devices %s", config.fp8.level, jax.devices())
    dataset = data_lib.build(config, workdir)
    env = setup(config, workdir)
    ckpt = Checkpointer(workdir, keep=config.keep_checkpoints, every=config.checkpoint_every_steps)
    train_iter = dataset.train_iter()
    start = ckpt.latest_step()
    if start is not None:
        target = abstract_like(env["abstract"], env["state_shardings"])
        state, data_state = ckpt.restore(target, start)
        train_iter.set_state(data_state)
        logging.info("resuming from checkpoint at step %d in %s", start, ckpt.directory)
    else:
        start = 0
        state = env["init"](jax.random.PRNGKey(config.seed))
    compiled = env["train_step"].lower(state, abstract_batch(config)).compile()
    metrics_lib.log_memory(compiled)
    eval_batches = dataset.eval_batches(config.eval_batches)
    writer = metrics_lib.Writer(workdir, enabled=jax.process_index() == 0)
    tokens_per_step = config.batch_size * config.seq_len
    summary, pending = {}, None
    step = start
    bar = tqdm(total=config.num_train_steps, initial=start, desc="train", unit="step",
               disable=jax.process_index() != 0)  # fmt: skip
    t_last, steps_since = time.perf_counter(), 0
    with _Preempted() as preempt:
        while step < config.num_train_steps:
            batch = jax.device_put(next(train_iter), env["batch_sharding"])
            state, metrics = compiled(state, batch)
            step += 1
            steps_since += 1
            # Pull the previous step's metrics only now, so this step is already dispatched.
            done, pending = pending, (step, metrics)
            if done is not None:
                _check_finite(done, config, ckpt, state, train_iter)
            bar.update(1)
            if step % config.log_every_steps == 0 or step == config.num_train_steps:
                m = jax.device_get(metrics)
                _check_finite((step, metrics), config, ckpt, state, train_iter)
                dt = time.perf_counter() - t_last
                m["tokens_per_s"] = steps_since * tokens_per_step / max(dt, 1e-9)
                t_last, steps_since = time.perf_counter(), 0
                writer.scalars(step, {f"train/{k}": v for k, v in m.items()})
                bar.set_postfix(loss=f"{float(m['loss']):.3f}", tok_s=f"{m['tokens_per_s']:.0f}")
                logging.info("step %d: %s", step, metrics_lib.fmt(m))
                summary.update({f"train_{k}": float(v) for k, v in m.items()})
            if step % config.eval_every_steps == 0 or step == config.num_train_steps:
                ev = evaluate(env["eval_step"], state, eval_batches, env["batch_sharding"])
                writer.scalars(step, {f"eval/{k}": v for k, v in ev.items()})
                logging.info("step %d: %s", step, metrics_lib.fmt(ev))
                summary.update(ev)
            if config.fp8.level != "O0" and step % config.fp8_stats_every_steps == 0:
                health = metrics_lib.fp8_health(state, env["stats_step"](state, batch))
                writer.scalars(step, health)
            ckpt.save(step, state, train_iter.get_state())
            if preempt.flag:
                ckpt.save(step, state, train_iter.get_state(), force=True)
                logging.warning("SIGTERM: checkpointed step %d in %s; exiting", step, workdir)
                summary["preempted_at"] = step
                break
    bar.close()
    if pending is not None:
        _check_finite(pending, config, ckpt, state, train_iter)
    ckpt.save(step, state, train_iter.get_state(), force=True)
    ckpt.close()
    if config.sample_tokens > 0 and not summary.get("preempted_at"):
        text = sample(env["model"], state, dataset.tokenizer, "The ", config.sample_tokens,
                      config.seq_len)  # fmt: skip
        logging.info("sample: %s", text)
        summary["sample"] = text
    summary["step"] = step
    writer.close()
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def _check_finite(done, config, ckpt, state, train_iter):
    """Stop with a clear message (and a checkpoint of the last good state) on repeated NaN/Inf."""
    step, metrics = done
    bad = int(jax.device_get(metrics["bad_steps"]))
    if bad == 0:
        return
    loss = float(jax.device_get(metrics["loss"]))
    logging.warning("step %d: non-finite loss/gradients (loss=%s); update skipped", step, loss)
    if bad >= config.max_bad_steps:
        # Skipped steps leave the state untouched, so this is the last good state.
        ckpt.save(step, state, train_iter.get_state(), force=True)
        raise NonFiniteLossError(
            f"{bad} consecutive non-finite steps up to step {step} (loss={loss}); the last good "
            f"state is checkpointed in {ckpt.directory}. Lower the learning rate, check the data, "
            f"or raise config.max_bad_steps"
        )
