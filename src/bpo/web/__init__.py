"""A local web shop in the style of WebShop (Yao et al. 2022) for training web agents.

* :mod:`bpo.web.catalog`: a seeded product catalogue (any size) in SQLite with an FTS5 index,
  searched with BM25;
* :mod:`bpo.web.goals`: instructions drawn from target products, WebShop's reward, train and
  test splits, and an expert that buys a reward-1 product through the site;
* :mod:`bpo.web.app`: the site (Starlette, Jinja2): plain HTML pages under ``/s/{sid}/`` per
  session, state export/import and the expert as JSON;
* :mod:`bpo.web.serve`: ``bpo serve-shop`` (uvicorn) and ``start_server()`` for tests and pools.

The agent's side (HTML to text, WebShop's ``search[...]``/``click[...]`` actions, snapshots) is
:mod:`bpo.sandbox.envs.web`.
"""
