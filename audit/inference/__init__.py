"""Membership inference on a trained model: member / non-member sets (:mod:`.membership`),
per-record features (:mod:`.features`), attacks (:mod:`.attacks`), reference-model scores
(:mod:`.reference_attacks`, :mod:`.reference_audit`: offline LiRA and RMIA), the audit of a
checkpoint end to end (:mod:`.report`) and of a model trained elsewhere (:mod:`.external`)."""
