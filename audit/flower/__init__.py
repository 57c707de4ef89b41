"""Canary clients inside any Flower strategy (:mod:`.flower_audit`, :mod:`.flower_canaries`,
:mod:`.flower_strategies`) and an in-process rehearsal of a strategy's rounds
(:mod:`.flower_rehearsal`). Needs the ``flower`` extra."""
