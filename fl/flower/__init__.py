"""The Flower driver, split by job (package-internal; the public names are re-exported by
:mod:`fedlap_privacy.fl.engine.flower_app`).

* :mod:`.codec` — method states and weights as Flower records, and back;
* :mod:`.run_config` — the run config (TOML values) <-> :class:`TrainConfig`, the App files;
* :mod:`.policy` — the node's privacy policy and its persistent ledger
  (docs/threat-model.md, "Cross-silo deployment");
* :mod:`.client_app` — the ClientApp: validates every instruction, then trains;
* :mod:`.server_app` — the ServerApp: :func:`simulation.train` with Flower messages;
* :mod:`.processes`, :mod:`.deployment` — a local deployment of Flower's own commands
  (``flower-superlink``, ``flower-supernode``, ``flwr run``) and ``train --engine flower``
  (:mod:`.runner`, :mod:`.timings`);
* :mod:`.simulation_engine` — ``train --engine flower-simulation`` on Flower's public
  ``flwr.simulation.run_simulation``.

Only Flower's public API is imported (``flwr.app``, ``flwr.clientapp``, ``flwr.serverapp``,
``flwr.simulation``); nothing of Flower is replaced.
"""
