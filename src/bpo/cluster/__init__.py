"""Running a training job across machines: Ray roles (:mod:`bpo.cluster.roles`) and prefix-aware
routing of sampling calls over inference engines (:mod:`bpo.cluster.routing`). The rest of
the scale-out is elsewhere: data-parallel learners in :mod:`bpo.data_parallel`, asynchronous
rollouts in :mod:`bpo.rollout.asynchronous`, sandbox actors in :mod:`bpo.sandbox.pool`."""
