"""What an audit hands a person: typed results (:mod:`.results`), the readable report
(:mod:`.privacy_report`, :mod:`.score_report`), its files and figures (:mod:`.report_files`)
written through a folder the audit holds open (:mod:`.report_folder`), and ``audit
--dry-run`` (:mod:`.dry_run`)."""
