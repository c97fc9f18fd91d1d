"""Exact verification of the advantage estimators on tabular MDPs (``bpo verify``).

* :mod:`~bpo.analysis.mdp`: tabular MDPs, exact J / V / Q / dJ/dlogits, prefix variance shares;
* :mod:`~bpo.analysis.families`: the MDP families (random, agent, chain, trap, budget_trap);
* :mod:`~bpo.analysis.sampling`: rollout trees grown like ``bpo.rollout.engine`` grows them;
* :mod:`~bpo.analysis.forest`: vectorised estimators (checked against ``bpo.estimators``) and
  per-batch policy gradients;
* :mod:`~bpo.analysis.metrics`: bias z-tests, trace of covariance, cosine, norm variance;
* :mod:`~bpo.analysis.study`: the matched-budget Monte-Carlo study;
* :mod:`~bpo.analysis.bridge`: a tabular policy that drives the real ``bpo.rollout.engine`` on
  the ``mdp`` sandbox;
* :mod:`~bpo.analysis.checks` and :mod:`~bpo.analysis.regimes`: biased constructions and the
  regime sweep; :mod:`~bpo.analysis.tables` and :mod:`~bpo.analysis.verify`: output and CLI.
"""
