"""FSDP learner (``learner.parallel=fsdp``): two gloo processes, each training its shard of an
FSDP2-sharded copy of the model, take the same update as one process on the whole batch, write
it back into the whole model (the one that samples), and save and load the optimizer state in
the single-process layout.

The scenarios, comparisons and tolerances are the data-parallel test's (test_ddp.py): FSDP
reduce-scatters, as a SUM, the same per-rank partial gradients that the DDP path all-reduces, so
the same fp32 round-off bounds hold. In ``empty_shard`` rank 1 has no tree in the second
minibatch and runs an idle forward/backward to stay in lockstep with rank 0's row chunk.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_ddp import (
    PARAM_ATOL,
    SCENARIOS,
    assert_single_process_update,
    join_ranks,
    run_scenarios,
    spawn_ranks,
)

from bpo.data_parallel import DataParallel
from bpo.learner import Learner, LearnerConfig
from bpo.testing import random_tree, tiny_causal_lm

OPTIM_ATOL, OPTIM_RTOL = 1e-7, 1e-5


def resume_run(dp: DataParallel | None) -> dict:
    """A run that resumes, under FSDP, from a single-process checkpoint: one process updates
    on batch A; its weights and optimizer state are loaded into a new FSDP learner (the
    checkpoint path of ``bpo train --resume``); both update on batch B. With ``dp=None``
    ``parallel=fsdp`` is ignored (one process)."""
    rng = np.random.default_rng(11)
    batch_a = [random_tree(rng, prefix=int(rng.integers(4, 16))) for _ in range(3)]
    batch_b = [random_tree(rng, prefix=int(rng.integers(4, 16))) for _ in range(3)]
    cfg = LearnerConfig(lr=1e-3, parallel="fsdp", max_grad_norm=0.01)
    one = Learner(tiny_causal_lm(), cfg)
    fresh = Learner(tiny_causal_lm(), cfg, data_parallel=dp)  # iteration 0's checkpoint
    fresh.load_optimizer_state(one.optimizer_state())
    one.update(batch_a)
    weights = {k: v.clone() for k, v in one.model.state_dict().items()}
    optim = copy.deepcopy(one.optimizer_state())
    two = Learner(tiny_causal_lm(seed=1), cfg, data_parallel=dp)
    two.full_model.load_state_dict(weights)
    two.load_optimizer_state(optim)
    two.updates = one.updates  # as Trainer.load restores it
    back = two.optimizer_state()
    one.update(batch_b)
    two.update(batch_b)
    return {
        "saved": optim, "loaded_back": back, "updates": two.updates,
        "fresh_state": len(fresh.optimizer.state),
        "one": [p.detach().clone() for p in one.model.parameters()],
        "two": [p.detach().clone() for p in two.full_model.parameters()],
    }  # fmt: skip


def _worker(rank: int, port: int, path: str) -> None:
    dp = join_ranks(rank, port)
    try:
        out = run_scenarios(dp, "fsdp")
        out["resume"] = resume_run(dp)
        torch.save(out, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_scenarios(None, "fsdp"), spawn_ranks(_worker, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fsdp_ranks_take_the_single_process_update(runs, name):
    single, ranks = runs
    assert_single_process_update(single[name], ranks, name)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fsdp_optimizer_state_is_whole_on_rank_0_in_the_single_process_layout(runs, name):
    single, ranks = runs
    ref, got = single[name]["optim"], ranks[0][name]["optim"]
    assert ranks[1][name]["optim"] == {}  # rank 0 alone writes checkpoints
    assert got["param_groups"] == ref["param_groups"]
    assert sorted(got["state"]) == sorted(ref["state"])
    for i, st in ref["state"].items():
        assert sorted(got["state"][i]) == sorted(st)
        for key, value in st.items():
            assert got["state"][i][key].device.type == "cpu"
            torch.testing.assert_close(
                got["state"][i][key], value, atol=OPTIM_ATOL, rtol=OPTIM_RTOL
            )


def test_fsdp_resumes_a_single_process_checkpoint(runs):
    for r, ranks in enumerate(runs[1]):
        res = ranks["resume"]
        assert res["updates"] == 2
        assert res["fresh_state"] == 0  # an empty state loads empty (no step counted)
        if r == 0:  # loaded, then saved again: the same state
            saved, back = res["saved"], res["loaded_back"]
            assert back["param_groups"] == saved["param_groups"]
            for i, st in saved["state"].items():
                for key, value in st.items():
                    assert torch.equal(back["state"][i][key], value), (i, key)
        moved = max(float((a - b).abs().max()) for a, b in zip(res["one"], res["two"], strict=True))
        assert moved < PARAM_ATOL, f"rank {r}: resumed parameters differ by {moved:.2e}"


def test_parallel_is_validated():
    with pytest.raises(ValueError, match="valid: ddp, fsdp"):
        LearnerConfig(parallel="zero3")
