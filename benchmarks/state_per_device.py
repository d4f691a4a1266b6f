"""Train-state bytes per device at O2 (data parallel) vs O3 (fsdp): the issue-8 memory check.

    PYTHONPATH=. python benchmarks/state_per_device.py --config gpt_1b3 --devices 2

Builds the real train state abstractly (``jax.eval_shape``: nothing is allocated) with the
shardings ``train.setup`` gives it, on ``--devices`` simulated CPU devices, and sums each
leaf's shard. O2 replicates the FP16 masters and FP8/FP16 Adam state on every device; O3 shards
them over ``fsdp`` and all-gathers the kernels as E4M3 (1 byte/param) for the GEMMs. The
check: O3's state per device <= O2's state / N + the gathered FP8 kernels. Same numbers on any
backend: shardings, not a GPU, decide them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def shard_bytes(leaf, sharding) -> int:
    """Bytes of one device's shard of ``leaf``."""
    shape = sharding.shard_shape(leaf.shape) if hasattr(sharding, "shard_shape") else leaf.shape
    return math.prod(shape) * leaf.dtype.itemsize


def measure(config_name: str, level: str, mesh: tuple[int, int, int]) -> dict:
    """Per-device bytes of params, optimizer state and FP8 scale state."""
    import jax

    from fp8jax.optim.master import is_matmul_weight, is_scaled
    from fp8jax.trainer import loop as train_lib

    c = train_lib.load_config(config_name)
    c.fp8.level = level
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
    c.model.attention_impl = "xla"  # no GPU needed: attention does not touch the state
    env = train_lib.setup(c)
    abstract = jax.eval_shape(env["init"], jax.random.PRNGKey(0))
    sh = env["state_shardings"]
    out = {"run": f"{config_name} {level} mesh={mesh}"}
    for part in ("params", "opt_state", "fp8"):
        leaves = jax.tree.leaves(getattr(abstract, part))
        shards = jax.tree.leaves(getattr(sh, part))
        out[part] = sum(shard_bytes(x, s) for x, s in zip(leaves, shards, strict=True))
    out["state"] = out["params"] + out["opt_state"] + out["fp8"]
    flat = jax.tree_util.tree_flatten_with_path(abstract.params, is_leaf=is_scaled)[0]
    out["matmul_params"] = sum(math.prod(x.shape) for p, x in flat if is_matmul_weight(p, x))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="gpt_1b3")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = p.parse_args()
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    n = a.devices
    o2 = measure(a.config, "O2", (n, 1, 1))
    o3 = measure(a.config, "O3", (1, n, 1))
    fp8_kernels = o3["matmul_params"]  # gathered E4M3 copies: 1 byte per matmul weight
    bound = o2["state"] / n + fp8_kernels
    gib = 2.0**30
    print(f"{'run':34s} {'params':>8s} {'opt':>8s} {'fp8':>8s} {'state GiB/device':>17s}")
    for r in (o2, o3):
        print(
            f"{r['run']:34s} {r['params'] / gib:8.3f} {r['opt_state'] / gib:8.3f} "
            f"{r['fp8'] / gib:8.4f} {r['state'] / gib:17.3f}"
        )
    print(
        f"O3 state + gathered FP8 kernels {(o3['state'] + fp8_kernels) / gib:.3f} GiB; "
        f"bound O2/N + FP8 kernels {bound / gib:.3f} GiB; O3 state alone {o3['state'] / gib:.3f}"
        f" <= O2/N {o2['state'] / n / gib:.3f} x 1.01: {o3['state'] <= 1.01 * o2['state'] / n}"
    )
    result = {"O2": o2, "O3": o3, "devices": n, "bound_bytes": bound}
    with open(os.path.join(a.out, "state_per_device.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main() is None)
