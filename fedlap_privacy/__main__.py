"""``python -m fedlap_privacy``: the ``fedlap-privacy`` command of :mod:`fedlap_privacy.cli.main`.

``python -m fedlap_privacy plan --eps 10 --delta 1e-5`` is ``fedlap-privacy plan --eps 10
--delta 1e-5``.
"""

from fedlap_privacy.cli.main import app

if __name__ == "__main__":
    app(prog_name="fedlap-privacy")
