"""The distributed roles of a run on Ray: inference engines, sandbox actors and the learner.

``bpo train`` with ``cluster.address`` set connects to Ray (or starts it on this machine with
``"local"``), reserves one placement group whose bundles are the learner's resources (when
``cluster.learner_resources`` is given), one bundle per inference engine and one per sandbox
actor, placed by the group's strategy (``cluster.placement``), and starts each role in its
bundle:

* the **learner**: the whole trainer (rollout loop, learner, checkpoints, evaluation) runs in a
  Ray actor in bundle 0, e.g. on the node with the GPU (:func:`run_trainer`);
* **inference engines**: actors that each hold a copy of the policy (transformers or vLLM, as
  ``policy.backend`` says) and serve the sampling calls, routed by prefix
  (:mod:`bpo.cluster.routing`), their weights set by the learner between batches
  (:class:`EngineGroup`);
* **sandbox actors**: the hosts of the training rollouts' sandboxes
  (:class:`bpo.sandbox.pool.SandboxPool`).

Ray does what it is for here: placement, actor lifetimes, the object store that carries the
weights; nothing is written by hand that Ray provides. The run directory must be on a
filesystem every node sees (the trainer actor writes it; engines read nothing from it).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bpo.config import ClusterConfig, Config, ConfigError
from bpo.policy.protocol import PolicyStats, SamplingParams, TurnSample

__all__ = ["EngineGroup", "Placement", "connect", "run_trainer"]

_RAY_KEYS = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


def connect(cfg: ClusterConfig) -> bool:
    """Connect to (or start) Ray as ``cfg.address`` says; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # actors share the cores (MACHINE.md)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        if cfg.address == "local":
            # "local", not None: a new Ray even when another one runs on this machine (None
            # would join it, and refuse object_store_memory)
            ray.init(address="local", object_store_memory=cfg.object_store_mb * 2**20,
                     include_dashboard=False, log_to_driver=True)  # fmt: skip
        else:
            ray.init(address=cfg.address, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConfigError(
            f"cluster.address={cfg.address!r}: cannot connect to Ray ({e}); start the cluster "
            "first (ray start --head on one node, ray start --address=HEAD:6379 on the "
            "others) or use cluster.address=local"
        ) from None
    return True


def actor_options(bundle: dict[str, float]) -> dict[str, Any]:
    """Ray ``.options(...)`` that ask for a placement-group bundle's resources."""
    opts: dict[str, Any] = {"num_cpus": 0}
    custom = {}
    for key, amount in bundle.items():
        if key in _RAY_KEYS:
            opts[_RAY_KEYS[key]] = int(amount) if key == "memory" else amount
        else:
            custom[key] = amount
    if custom:
        opts["resources"] = custom
    return opts


@dataclass
class Placement:
    """One placement group for a run's roles: bundle 0 the learner (when it has resources),
    then the engines, then the sandbox actors. Picklable: the trainer actor receives it."""

    cfg: ClusterConfig
    group: Any = None
    learner: int | None = None
    engines: list[int] = field(default_factory=list)
    sandboxes: list[int] = field(default_factory=list)

    @classmethod
    def reserve(cls, cfg: ClusterConfig) -> Placement:
        """Reserve the bundles; fails, naming what is missing, when the cluster cannot hold
        them within ``cfg.placement_timeout_s``."""
        import ray
        from ray.util.placement_group import placement_group

        bundles: list[dict[str, float]] = []
        p = cls(cfg)
        if cfg.learner_resources:
            p.learner = len(bundles)
            bundles.append(dict(cfg.learner_resources))
        for _ in range(cfg.inference_engines):
            p.engines.append(len(bundles))
            bundles.append(dict(cfg.engine_resources))
        for _ in range(cfg.sandbox_actors):
            p.sandboxes.append(len(bundles))
            bundles.append(dict(cfg.sandbox_resources))
        if not bundles:
            return p
        # a bundle may not be empty: an actor with no resources still takes a tiny CPU share
        bundles = [b if any(v > 0 for v in b.values()) else {"CPU": 0.01} for b in bundles]
        p.group = placement_group(bundles, strategy=cfg.placement, name="")
        timeout_s = cfg.placement_timeout_s
        ready, _ = ray.wait([p.group.ready()], timeout=timeout_s)
        if not ready:
            have = ray.cluster_resources()
            ray.util.remove_placement_group(p.group)
            raise ConfigError(
                f"the Ray cluster cannot hold this run's roles within {timeout_s:.0f} s: it asks "
                f"for bundles {bundles} ({cfg.placement}); the cluster has "
                f"{ {k: v for k, v in have.items() if not k.startswith('node:')} }; lower "
                "cluster.inference_engines / cluster.sandbox_actors or their *_resources, or "
                "add nodes"
            )
        return p

    def options(self, index: int) -> dict[str, Any]:
        """Ray options that start an actor in bundle ``index``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.group.bundle_specs[index]
        return {
            **actor_options(bundle),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=index
            ),
        }

    def release(self) -> None:
        if self.group is not None:
            import ray

            ray.util.remove_placement_group(self.group)
            self.group = None


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class _InferenceEngine:
    """An actor holding one copy of the policy with its prefix cache: the transformers model
    itself (``backend="hf"``), or a vLLM engine in the actor's process (``"vllm"``, see
    :func:`_vllm_policy`)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, seed: int, cache_tokens: int,
                 backend: str = "hf", stop_token_ids: Sequence[int] | None = None,
                 max_model_len: int | None = None) -> None:  # fmt: skip
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.version = -1
        self.backend = backend
        if backend == "vllm":
            # the names the engine's model has: the learner's state also holds the value head
            self.names = set(model.state_dict())
            # and the tied ones it lacks (lm_head.weight of a model that ties its embeddings):
            # vLLM's reload needs every checkpoint tensor, or the logits are wrong (1.4 nats)
            first = {id(p): n for n, p in model.named_parameters()}
            self.tied = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
                         if first[id(p)] != n}  # fmt: skip
            self.policy: Any = _vllm_policy(model, tokenizer, seed, stop_token_ids, max_model_len)
            return
        from bpo.policy.hf import HFPolicy

        # the GPU Ray gave this actor (engine_resources with GPU), else the CPU
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = model.to(device).eval().requires_grad_(False)
        self.policy = HFPolicy(model, tokenizer, seed=seed, cache_budget_tokens=cache_tokens)

    def set_weights(self, version: int, state: dict[str, torch.Tensor]) -> int:
        if self.backend == "vllm":  # in place, in memory; drops the prefix cache
            weights = {k: v for k, v in state.items() if k in self.names}
            weights.update({k: weights[v] for k, v in self.tied.items() if v in weights})
            self.policy.update_weights(weights)
        else:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in state.items():
                    if name in params:  # the value head (PPO) lives on the learner's model only
                        params[name].copy_(value)
            self.policy.clear_cache()
        self.version = version
        return version

    def sample(
        self, contexts: list[list[int]], n: list[int], params: SamplingParams | None
    ) -> list[list[TurnSample]]:
        return self.policy.sample(contexts, n, params)

    def release(self, contexts: list[list[int]]) -> None:
        self.policy.release(contexts)

    def clear_cache(self) -> None:
        self.policy.clear_cache()

    def stats(self) -> PolicyStats:
        return self.policy.stats()

    def where(self) -> dict[str, Any]:
        return {"node": node_id(), "pid": os.getpid(), "threads": torch.get_num_threads()}


def _vllm_policy(
    model: torch.nn.Module,
    tokenizer: Any,
    seed: int,
    stop_token_ids: Sequence[int] | None,
    max_model_len: int | None,
) -> Any:
    """A :class:`bpo.policy.vllm.VLLMPolicy` over ``model`` (received through the object
    store). vLLM builds its engine from a model directory only, so the model is written to a
    temporary directory on the actor's node and removed once the engine has read it: weight
    updates then arrive in memory (``update_weights``), nothing is read from the run directory,
    and a killed engine leaves no files behind. Full weights only: the learner's state must
    hold every parameter (LoRA runs are refused by the config check)."""
    import tempfile

    from bpo.policy.vllm import VLLMPolicy

    if hasattr(model, "peft_config"):
        raise ValueError("vLLM inference engines take full weights, not LoRA adapters")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory(prefix="bpo-vllm-engine-") as path:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return VLLMPolicy(path, tokenizer, dtype=dtype, seed=seed, stop_token_ids=stop_token_ids,
                          max_model_len=max_model_len)  # fmt: skip


def _ray_call(calls: list[tuple[Any, str, tuple]]) -> list[Any]:
    """Submit every ``actor.method(*args)`` at once, then wait for all of them."""
    import ray

    return ray.get([getattr(actor, method).remote(*args) for actor, method, args in calls])


class EngineGroup:
    """``cluster.inference_engines`` engine actors behind one :class:`RoutedPolicy`; a
    :class:`bpo.rollout.asynchronous.WeightSync` (the engines hold weights of their own).

    An engine that dies (killed, out of memory, its node lost) is started again in its bundle
    with the current weights, and the call that met the death is made again, once (a sampling
    call re-samples the turn's whole batch; a second failure reaches the rollout engine, which
    retries the batch itself). Restarts are counted in :attr:`restarts`.

    ``backend`` is the engines' (``policy.backend``): "hf" samples with the transformers model
    (``cache_tokens`` of prefix cache), "vllm" with a vLLM engine per actor (contexts up to
    ``max_model_len`` tokens); both take the learner's weights in memory."""

    needs_state = True

    def __init__(self, placement: Placement, model: torch.nn.Module, tokenizer: Any,
                 stop_token_ids: Sequence[int], seed: int, cache_tokens: int,
                 routing: str, backend: str = "hf",
                 max_model_len: int | None = None) -> None:  # fmt: skip
        import ray

        from bpo.cluster.routing import RoutedPolicy

        if next(model.parameters()).device.type != "cpu":  # engines place their own copy
            model = copy.deepcopy(model).to("cpu")
        self._remote = ray.remote(_InferenceEngine)
        self._model = ray.put(model)  # once in the object store, fetched by each engine's node
        self._placement, self._tokenizer = placement, tokenizer
        self._seed, self._cache_tokens = seed, cache_tokens
        self._backend = (backend, tuple(stop_token_ids), max_model_len)
        self._weights: Any = None
        self.restarts = 0
        self.actors = [self._start(i) for i in range(len(placement.engines))]
        self.policy = RoutedPolicy(self.actors, tokenizer, stop_token_ids, self._call, routing)
        self.version = -1
        self.sync_seconds = 0.0

    def _start(self, i: int) -> Any:
        """Engine ``i`` in its bundle (a restarted one samples with a stream of its own)."""
        opts = self._placement.options(self._placement.engines[i])
        seed = self._seed + 1 + i + 1000 * self.restarts
        return self._remote.options(**opts).remote(self._model, self._tokenizer, seed,
                                                   self._cache_tokens, *self._backend)  # fmt: skip

    def _call(self, calls: list[tuple[Any, str, tuple]]) -> list[Any]:
        from ray.exceptions import RayActorError

        try:
            return _ray_call(calls)
        except RayActorError:  # every call (sample, stats, ...) is safe to make again
            fresh = self._restart_dead()
            return _ray_call([(fresh.get(id(a), a), m, args) for a, m, args in calls])

    def _restart_dead(self) -> dict[int, Any]:
        """Start the dead engines again; returns ``{id(dead handle): new handle}``."""
        import ray
        from ray.exceptions import RayActorError

        fresh: dict[int, Any] = {}
        for i, actor in enumerate(self.actors):
            try:
                ray.get(actor.where.remote(), timeout=60)
                continue
            except RayActorError:
                pass
            except ray.exceptions.GetTimeoutError:
                ray.kill(actor)  # hung: no better than dead
            self.restarts += 1
            new = self._start(i)
            if self._weights is not None:
                ray.get(new.set_weights.remote(self.version, self._weights))
            self.actors[i] = self.policy.engines[i] = fresh[id(actor)] = new
        return fresh

    def load(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Every engine takes the learner's weights (one copy in the object store)."""
        import ray
        from ray.exceptions import RayActorError

        t0 = time.perf_counter()
        ref = ray.put({k: v.detach().cpu() for k, v in state.items()})
        self._weights, self.version = ref, version  # kept for engines that restart
        try:
            ray.get([a.set_weights.remote(version, ref) for a in self.actors])
        except RayActorError:
            self._restart_dead()  # they start with these weights
        self.policy.router.reset()
        self.sync_seconds = time.perf_counter() - t0

    def where(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([a.where.remote() for a in self.actors])

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []


def sandbox_pool(placement: Placement, cfg: Config) -> Any:
    """The sandbox actors of the training rollouts, one per sandbox bundle."""
    from bpo.sandbox.pool import SandboxPool

    s = cfg.sandbox
    return SandboxPool(
        s.name, len(placement.sandboxes), env_options=dict(s.options), backend=s.backend,
        actor_options=[placement.options(b) for b in placement.sandboxes],
    )  # fmt: skip


class _TrainerActor:
    """The learner's role: a whole :class:`bpo.train.Trainer` in a Ray actor."""

    def run(self, cfg: Config, run_dir: str, resume: bool, placement: Placement) -> dict:
        from bpo.train import Trainer

        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        trainer = Trainer(cfg, run_dir, resume=resume, placement=placement)
        return trainer.run()


def run_trainer(cfg: Config, run_dir: str, resume: bool,
                local: Callable[[Placement | None], dict]) -> dict:  # fmt: skip
    """Run a training job as ``cfg.cluster`` says: in this process when it names no Ray
    address (``local(None)``); else connect to Ray, reserve the roles' placement group, and
    run the trainer in this process (``local(placement)``) or, with
    ``cluster.learner_resources``, in an actor placed with them. Ray is shut down afterwards
    if this call started it."""
    c = cfg.cluster
    if not c.address:
        return local(None)
    import ray

    started = connect(c)
    placement = None
    try:
        placement = Placement.reserve(c)
        if placement.learner is None:
            return local(placement)
        actor = ray.remote(_TrainerActor).options(**placement.options(placement.learner))
        handle = actor.remote()
        try:
            return ray.get(handle.run.remote(cfg, run_dir, resume, placement))
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
        finally:
            ray.kill(handle)
    finally:
        if placement is not None:
            placement.release()
        if started:
            ray.shutdown()
