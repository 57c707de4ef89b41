"""The statistics of an audit, torch-free: the claim tested (:mod:`.claim`), the one-run
bounds (:mod:`.one_run`, Steinke, Nasr, Jagielski 2023; :mod:`.fdp`, Mahloujifar, Melis,
Chaudhuri 2025), the claimed mechanism's own curve (:mod:`.claim_curve`), the noise test of
the releases (:mod:`.noise_check`), the attack metrics (:mod:`.metrics`), a Gaussian-DP
estimate (:mod:`.gdp_estimate`) and the one rule that turns them into verdicts
(:mod:`.canary_verdicts`)."""
