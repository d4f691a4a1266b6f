"""Expert parallelism: the 'expert' mesh axis, its config checks, and the all-to-all dispatch.

The fast tests run in this (one-device) process. The slow ones run tests/expert_checks.py once
in a subprocess with 8 simulated CPU devices and check its JSON: the sharded dispatch + experts
+ combine against a per-token reference (forward and gradients, dropless and capacity, E4M3
dispatch within its bound), and train steps with the expert axis against one device.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from fp8jax import errors, models, spec
from fp8jax.parallel import comm, sharding
from fp8jax.trainer import loop as train_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_sharding import (  # noqa: E402
    EXACT_RTOL,
    FP8_GRAD_NORM_RTOL,
    FP8_UPDATE_RTOL,
    LOSS_RTOL,
)


def moe_config(**mesh):
    c = train_lib.load_config("moe_tiny")
    c.mesh.update(mesh)
    return c


# ---------------------------------------------------------------------------- mesh and specs


def test_mesh_splits_tokens_over_the_expert_axis_too():
    run = spec.parse(moe_config(data=2, expert=4))
    mesh = sharding.make_mesh(run.mesh, devices=[object()] * 8)
    assert dict(mesh.shape) == {"data": 2, "expert": 4, "fsdp": 1, "tensor": 1}
    assert sharding.dp_size(mesh) == 8  # every device a data-parallel replica
    assert sharding.batch_sharding(mesh).spec == P(("data", "expert", "fsdp"))
    with pytest.raises(ValueError, match="needs 8 devices"):
        sharding.make_mesh(run.mesh, devices=[object()] * 4)


def test_rules_split_the_experts_over_the_expert_axis():
    model = models.build_model(spec.parse(moe_config()).model)
    specs = sharding.param_specs(model, AbstractMesh((1, 2, 2, 1), sharding.MESH_AXES))
    mlp = specs["blocks"]["mlp"]
    # [layers, expert, embed, 2, mlp] and [layers, expert, mlp, embed]: experts over 'expert',
    # ZeRO-3 over 'embed' as for the dense MLP; the router stays whole on every shard.
    assert mlp["experts_wi"]["kernel"] == P(None, "expert", "fsdp")
    assert mlp["experts_wo"]["kernel"] == P(None, "expert", None, "fsdp")
    assert mlp["router"]["kernel"] == P(None, "fsdp")
    wi, router = mlp["experts_wi"]["kernel"], mlp["router"]["kernel"]
    # Per-device replicas (O1, no tensor axis): each device keeps its own experts, whole along
    # fsdp, and their gradients have data x fsdp replicas; the router comes whole.
    plan = comm.Plan(
        AbstractMesh((1, 2, 2, 1), sharding.MESH_AXES), comm.CommConfig(), 1, *[None] * 3
    )
    assert plan.local_spec(wi) == P(None, "expert")
    assert plan.replica_spec(wi) == P(comm.EXPERT_REPLICA_AXES, None, "expert")
    assert plan.replica_axes(wi) == ("data",)
    assert plan.local_spec(router) == P()
    assert plan.replica_spec(router) == P(sharding.DP_AXES, None, None)
    # Tensor parallelism (replicas vmapped under XLA's partitioner): a replica's full gradient
    # is laid out over the replicas, whole along expert and fsdp.
    plan = comm.Plan(
        AbstractMesh((1, 2, 2, 2), sharding.MESH_AXES), comm.CommConfig(), 1, *[None] * 3
    )
    assert plan.replica_spec(wi) == P(sharding.DP_AXES, None, None, None)


def test_expert_count_the_axis_does_not_divide_is_refused():
    with pytest.raises(errors.ConfigError, match=r"mesh.expert=3 does not divide") as info:
        spec.parse(moe_config(expert=3))
    assert "\n" not in str(info.value) and "model.moe.num_experts=8" in str(info.value)
    assert spec.parse(moe_config(expert=2)).mesh.expert == 2


def test_train_py_refuses_an_undivided_expert_count_with_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FP8JAX_DEBUG"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    workdir = tmp_path / "work"
    flags = ["--config", "moe_tiny", f"--workdir={workdir}", "--config.mesh.expert=3"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "mesh.expert=3" in lines[0], lines[-5:]
    assert not workdir.exists()


# ------------------------------------------------------------------ 8 simulated devices


@pytest.fixture(scope="module")
def checks():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "expert_checks.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_dispatch_matches_the_per_token_reference(checks):
    cases = checks["dispatch"]
    meshes = ("ep2", "ep4", "ep8", "data2 x ep4", "data2 x ep2 x fsdp2")
    assert set(cases) == {f"{m} {mode}" for m in meshes for mode in ("dropless", "capacity")}
    for name, c in cases.items():
        # The same products and sums as one device, in f32: equal within f32 reassociation.
        for key in ("fwd", "grad_x", "grad_p", "grad_w1", "grad_w2"):
            assert c[key] <= EXACT_RTOL, (name, key, c)
        assert c["w1_grad_sharded"], name  # each shard holds its experts' weights and grads
        assert c["row_scatters"] == [], (name, c["row_scatters"])  # gathers both ways
        if name.endswith("capacity"):  # the capacity bites: pairs dropped, output changed
            assert c["dropped"] > 0 and c["capacity_changes_output"], (name, c)
        else:
            assert c["dropped"] == 0, (name, c)


@pytest.mark.slow
def test_fp8_dispatch_within_the_e4m3_bound(checks):
    c = checks["fp8_dispatch"]
    assert c["within_bound"], c
    assert c["fp8_err"] > 0.0, c  # the tokens did travel as E4M3
    assert c["exact_err"] <= EXACT_RTOL, c
    assert c["grad_x"] <= EXACT_RTOL, c  # gradients return unquantized


def _assert_step_matches_one_device(name: str, c: dict) -> None:
    """test_sharding's criteria for a step whose gradients are reduced in FP8."""
    assert c["scales_identical_across_devices"], name
    # Step 0: the forward is the one-device forward, so are its amaxes (merged over every
    # replica, the expert axis's included) and scales.
    assert c["fp8_state_step0_fwd_rel"] <= EXACT_RTOL, (name, c)
    assert c["fp8_state_step0_rel"] <= EXACT_RTOL, (name, c)
    assert c["loss_rel"][0] <= LOSS_RTOL, (name, c)
    loss1_bound = 2 * c["loss1_first_order"] + LOSS_RTOL * c["loss1_scale"]
    assert c["loss1_diff"] <= loss1_bound, (name, c)
    assert max(c["grad_norm_rel"]) <= FP8_GRAD_NORM_RTOL, (name, c)
    assert c["update_rel_l2"] <= FP8_UPDATE_RTOL, (name, c)


@pytest.mark.slow
def test_expert_axis_as_data_parallelism_matches_one_device(checks):
    """A dense model on data2 x expert4: the expert axis splits the batch like data."""
    _assert_step_matches_one_device("dense data2 x ep4", checks["step"])
    assert checks["step"]["mesh"] == {"data": 2, "expert": 4, "fsdp": 1, "tensor": 1}


@pytest.mark.slow
def test_expert_parallel_moe_steps_match_one_device(checks):
    steps = checks["moe_steps"]
    assert set(steps) == {
        "data2 x ep4",
        "ep4 x fsdp2 O3",
        "ep4 x fsdp2 O3 upfront",
        "data2 x ep4 capacity",
    }
    for name, c in steps.items():
        _assert_step_matches_one_device(name, c)
        assert "s32" in c["all_to_all_dtypes"], (name, c)  # expert ids: the dispatch ran
        assert "'expert'" in c["experts_sharded"], (name, c)  # stored split over the axis
        # Each device's layers hold its own experts only (8 over the mesh's expert axis), so
        # their weights, gradients and optimizer inputs are that share, not all 8 experts.
        assert c["kernel_experts_seen"] == [8 // 4], (name, c["kernel_experts_seen"])
    # Per-layer gathers (O3's default) on the expert mesh: a block's routed experts reduce over
    # the devices holding them ('data' x fsdp), everything else over every replica.
    layers = steps["ep4 x fsdp2 O3"]["layer_replica_axes"]
    assert layers["blocks/mlp/experts_wi/kernel"] == ["data"], layers
    assert layers["blocks/mlp/router/kernel"] == ["data", "expert"], layers
    assert not steps["ep4 x fsdp2 O3 upfront"]["layer_replica_axes"]


@pytest.mark.slow
def test_split_expert_stack_keeps_one_scale(checks):
    """A weight stack split over 'expert' quantizes with the whole stack's scale (its amax
    merged over the shards): the outputs equal one device's on the whole stack."""
    c = checks["split_stack"]
    assert len(set(c["amax_shards"])) == 4, c  # the shards' own amaxes differ
    assert c["amax_recorded"] == [c["amax_whole"]] * 4, c
    assert c["max_rel"] <= EXACT_RTOL, c


@pytest.mark.slow
def test_block_scaled_expert_gemms_run_inside_the_expert_axis(checks):
    """The block recipe's grouped GEMM on its padded layout, its stack split over 'expert':
    y, dx and dw equal one device's on the whole stack (each expert's tiles are its own)."""
    c = checks["block_split_stack"]
    assert c["padded"], c
    assert max(c["y"], c["dx"], c["dw"]) <= EXACT_RTOL, c


@pytest.mark.slow
def test_sharded_steps_keep_the_router_in_f32(checks):
    """fsdp-sharded bf16 steps (O3's per-layer and upfront gathers, O2's) hand the router and
    the shared gate their f32 kernels (f32 logits from f32 weights) and the other layers bf16
    ones; the per-layer gathers move the router in f32 and reduce its gradient in f32."""
    assert set(checks["gathers"]) == {"O3 layer", "O3 upfront", "O2"}
    for name, c in checks["gathers"].items():
        k = c["kernels"]
        assert k["Router router"] == k["Dense shared_gate"] == ["float32"], (name, k)
        for other in ("GroupedLinear experts_wi", "DenseGeneral q", "Dense head"):
            assert k[other] == ["bfloat16"], (name, other, k)
    leaves = checks["gathers"]["O3 layer"]["leaves"]
    for name in ("mlp/router/kernel", "mlp/shared_gate/kernel"):
        li = leaves[name]
        assert li["fsdp"] is not None and not li["cast"] and not li["fp8_grad"], (name, li)
    assert leaves["mlp/experts_wi/kernel"]["fp8_grad"], leaves  # the others do reduce in FP8
