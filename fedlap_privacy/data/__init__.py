"""The records a run trains and is evaluated on: the built-in datasets and their files
(:mod:`.datasets`, :mod:`.dataset_files`, :mod:`.npz_reader`), a user's own data
(:mod:`.user_data`), the clients' split (:mod:`.client_splits`) and
per-record features (:mod:`.record_features`). Imports no torch on its own."""
