"""What a run keeps on disk and must not lose: the privacy ledger (:mod:`.ledger`), the
checkpoint pair and its commit record (:mod:`.checkpoint`), the private run state
(:mod:`.run_state`, :mod:`.canary_state`), one writer per run folder (:mod:`.run_lock`),
atomic writes (:mod:`.atomic`) and strict JSON (:mod:`.jsonsafe`). Imports no torch on its
own."""
