"""vLLM inference engines as Ray actors (``policy.backend=vllm`` with
``cluster.inference_engines``): an :class:`bpo.cluster.roles.EngineGroup` of one vLLM engine
actor, on a Ray started on this machine, samples through its :class:`RoutedPolicy` with the
log-probs of the weights it was given, takes the learner's new weights in memory (the samples
then score under the new weights, not the old), and comes back with the current weights after
its process is killed.

Runs where vLLM and Ray are installed (``make test-vllm``); skipped with the reason elsewhere,
failed with ``BPO_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

missing = [m for m in ("vllm", "ray") if importlib.util.find_spec(m) is None]
if missing:
    if os.environ.get("BPO_REQUIRE_VLLM") == "1":
        pytest.fail(f"BPO_REQUIRE_VLLM=1 but {missing} not installed (make setup-vllm)",
                    pytrace=False)  # fmt: skip
    pytest.skip(f"{missing} not installed (make setup-vllm)", allow_module_level=True)

from bpo.config import ClusterConfig  # noqa: E402
from bpo.policy.models import init_model  # noqa: E402
from bpo.policy.protocol import SamplingParams  # noqa: E402
from bpo.policy.sampling import teacher_forced_logprobs  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

TOL = 1e-4  # float32 engine vs float32 transformers (tests/unit/test_policy_vllm.py)
P = SamplingParams(max_new_tokens=10, temperature=0.8, seed=7)


def max_error(model: torch.nn.Module, ctx: list[int], action: tuple[int, ...],
              logprobs: tuple[float, ...]) -> float:  # fmt: skip
    with torch.no_grad():
        ref = teacher_forced_logprobs(model, ctx, action, P.temperature)
    return (ref - torch.tensor(logprobs)).abs().max().item()


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory):
    """One vLLM engine actor (a tiny float32 Qwen2; head_dim 64 for vLLM's CPU attention)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bpo.cluster.roles import EngineGroup, Placement, connect

    path = init_model(tmp_path_factory.mktemp("m") / "qwen2", arch="qwen2", hidden=128,
                      layers=2, heads=2)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "disabled")  # as tests/integration/test_cluster.py
    cfg = ClusterConfig(address="local", inference_engines=1, engine_resources={"CPU": 1},
                        object_store_mb=200)  # fmt: skip
    started = connect(cfg)
    placement = Placement.reserve(cfg)
    g = None
    try:
        g = EngineGroup(placement, model, tok, [tok.eos_token_id], seed=0, cache_tokens=4096,
                        routing="prefix", backend="vllm", max_model_len=256)  # fmt: skip
        yield g, model, tok
    finally:
        if g is not None:
            g.close()
        placement.release()
        if started:
            import ray

            ray.shutdown()
        mp.undo()


def test_the_engine_actor_samples_with_its_weights(group) -> None:
    g, model, tok = group
    (where,) = g.where()
    assert where["pid"] != os.getpid()  # sampled in the actor, not here
    ctxs = [tok.encode("You are in a kitchen."), tok.encode("A long hallway. " * 10)]
    out = g.policy.sample(ctxs, n=[2, 1], params=P)
    assert [len(s) for s in out] == [2, 1]
    for ctx, samples in zip(ctxs, out, strict=True):
        for s in samples:
            assert len(s.action_ids) == len(s.logprobs) >= 1
            assert max_error(model, ctx, s.action_ids, s.logprobs) < TOL
    # a later turn extends its tree's context: the engine's prefix cache serves the context
    # (whole 32-token blocks of it)
    assert len(ctxs[1]) >= 32
    before = g.policy.stats()
    g.policy.sample([ctxs[1] + list(out[1][0].action_ids)], n=1, params=P)
    assert g.policy.stats().cache_hit_tokens - before.cache_hit_tokens >= 32


def test_new_weights_reach_the_engine_and_survive_a_restart(group) -> None:
    import copy

    g, model, tok = group
    ctx = tok.encode("You see a locked chest.")
    old = g.policy.sample([ctx], n=2, params=P)[0]
    new_model = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # what the trainer publishes: trainable parameters (no tied lm_head), plus a PPO value head
    state = {n: p.detach() for n, p in new_model.named_parameters()}
    g.load(1, {**state, "value_head.weight": torch.zeros(1, 128)})
    assert g.sync_seconds > 0
    new = g.policy.sample([ctx], n=2, params=P)[0]
    for s in new:
        assert max_error(new_model, ctx, s.action_ids, s.logprobs) < TOL
    for s in old:  # the sync was not a no-op: the old samples score differently now
        assert max_error(new_model, ctx, s.action_ids, s.logprobs) > 1e-2
    assert [s.action_ids for s in new] != [s.action_ids for s in old]
    # a killed engine is started again in its bundle, with the weights of version 1
    os.kill(g.where()[0]["pid"], signal.SIGKILL)
    time.sleep(1)
    again = g.policy.sample([ctx], n=2, params=P)[0]
    assert g.restarts == 1
    for s in again:
        assert max_error(new_model, ctx, s.action_ids, s.logprobs) < TOL
