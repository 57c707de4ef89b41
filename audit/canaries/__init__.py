"""Canaries and their scores: gradient canaries in an Opacus or plain DP-SGD run
(:mod:`.gradient_canaries`, :mod:`.opacus_canaries`, :mod:`.canary_block`,
:mod:`.canary_steps`, :mod:`.canary_dataset`, :mod:`.gradient_canary_scores`,
:mod:`.gradient_canary_audit`), black-box record canaries (:mod:`.record_canaries`), canary
clients (:mod:`.canary_clients`, Andrew et al. 2024), a run's own canaries
(:mod:`.canary_audit`) and scores from any framework (:mod:`.score_audit`,
:mod:`.score_file`)."""
