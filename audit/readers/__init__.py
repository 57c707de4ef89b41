"""Reading a model a user hands over without running its code: an exported program
(``torch.export``, a ``.pt2`` archive) read as plain data (:mod:`.exported`,
:mod:`.exported_schema`), its graph run node by node (:mod:`.exported_graph`) through an
allow-list of operators (:mod:`.exported_ops`) within a compute and memory budget
(:mod:`.exported_compute`, :mod:`.exported_budget`)."""
