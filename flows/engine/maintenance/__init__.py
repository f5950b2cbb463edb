"""Commands over a store, run from the orchestrating process: `pt2flow audit`, `check-compat`
(each checks in supervised worker processes) and `repro`.

May import common/, environment/, orchestrator/ (the supervisor) and storage.
"""
